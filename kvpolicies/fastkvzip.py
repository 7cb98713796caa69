"""kvpress's `FastKVzipPress` (Kim et al. 2026, "Fast KVzip", arXiv:2601.17668; Janghyun1230/FastKVzip):
small per-layer gates, trained by the authors on KVzip's scores, read each layer's normalised input hidden
states and score every (token, kv head) during the prefill; no reconstruction pass. Reached through
`kvpolicies.compat.kvpress("FastKVzipPress", r, gates=<file>)` (kvpress's default, `layerwise=False`) or
with `layerwise=True`; not registered.

Shapes: B batch, T new tokens, d model width, K kv heads, G query heads per kv head, E = 16 the gate's
width, S = 16 its sink keys, M = max_len (the prompt phase's slots), L layers.

The gate of a layer (kvpress's `FastKVzipGate`): q = RMSNorm(h W_q + b_q) [K, G, E], k = RMSNorm(h W_k) [K, E]
(RMSNorm with a learned weight, eps 1e-6), logit = k.q / sqrt(E) + b [K, G], base_s = k_base[s].q / sqrt(E);
the score is 1 / (1 + sum_s exp(base_s - logit)), averaged over G. After the prompt (kvpress's
`compress_post`): the first n_sink tokens and the last max(1, int(n window_ratio)) score 1 (a context
under 32,000 tokens; window_size beyond), then
  - `layerwise=False` (kvpress's default): the int(L K n r) lowest-scored (layer, kv head, token) of ALL
    layers are removed, so each layer keeps a data-dependent number of pairs. The choice is kvzip's
    scope="model" (`kvpolicies.kvzip.model_scope_keep`), made by the engine between the prompt phase and
    `after_prompt` through the reconstructors' hook (`after_pass`): this policy is a `Reconstructor` whose
    pass feeds no repeat input (`repeat_chunk = 0`; the gates scored the prompt in the prefill);
  - `layerwise=True`: each layer drops its int(K n r) lowest-scored (token, kv head) pairs over all its heads.
The kept pairs are stored as Ada-KV's head pool (`kvpolicies.adakv`), the heads holding different numbers
of tokens (kvpress keeps every key and masks the dropped ones). Memory: `layerwise=True` stores
K x (n - int(n r) + 1 + max_new) slots per layer; `layerwise=False` lets a layer keep every token, so its
static pool is K x max_len slots per layer, and `Engine(..., fit=1)` (`Fits`: `Engine.fitted`) stores each
layer at what it kept plus max_new free slots per kv head: fewer bytes than kvpress's cache, which holds all
n keys and values of every head (docs/guide/kvpress.md, with the bytes).

Deviations, named: (1) the sinks are never removed (kvpress removes them too past ratio 1 - n_sink / n;
kvzip's `model_scope_keep`); (2) `layerwise=False` chooses over each batch row on its own (kvpress: over the
batch's pairs together); (3) ties remove the earlier (layer, head, token) first (kvpress: torch.topk's
order). The gates: the authors' are downloaded from `Jang-Hyun/Fast-KVzip` for a few checkpoints; ours are
trained by their recipe on our kvzip's scores, `python -m evals.train_fastkvzip model=<name>`
(`$KVP_DATA/fastkvzip/<model>.npz`, `GATE_NAMES`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.adakv import HeadPool, prompt_pool
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.kvzap import KVzap
from kvpolicies.kvzip import model_scope_keep
from kvpolicies.prompt import PromptPhase, PromptState, Reconstructor
from kvpolicies.scored import top_mask

GATE_NAMES = ("q_w", "q_b", "k_w", "q_norm", "k_norm", "k_base", "b")  # per layer, stacked on L


@functools.lru_cache(maxsize=8)
def load_gates(path: str) -> dict[str, np.ndarray]:
    """The gates of every layer, {name: [L, ...]} float32: q_w [L, d, K G E], q_b [L, K G E], k_w [L, d, K E],
    q_norm, k_norm [L, E], k_base [L, K, S, E], b [L, K, G] (an .npz file)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"fastkvzip.gates={path!r}: no such file; train gates with `python -m evals.train_fastkvzip "
                         "model=<name>` (kvpress downloads the authors')")
    with np.load(p) as z:
        missing = set(GATE_NAMES) - set(z.files)
        if missing:
            raise ValueError(f"fastkvzip.gates={path!r}: the file lacks {sorted(missing)}")
        return {n: np.asarray(z[n], np.float32) for n in GATE_NAMES}


def gate_scores(w: dict[str, Array], h: Float[Array, "B T d"]) -> Float[Array, "B K T"]:
    """kvpress's `FastKVzipGate.forward` for one layer on hidden states h, in float32."""
    kh, s, e = w["k_base"].shape
    g = w["b"].shape[-1]
    x = h.astype(jnp.float32)

    def norm(y, weight):  # Qwen3RMSNorm
        return weight * y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)

    q = norm((x @ w["q_w"] + w["q_b"]).reshape(x.shape[:2] + (kh, g, e)), w["q_norm"])  # [B, T, K, G, E]
    k = norm((x @ w["k_w"]).reshape(x.shape[:2] + (kh, e)), w["k_norm"])  # [B, T, K, E]
    logit = jnp.einsum("BTKE,BTKGE->BTKG", k, q) / np.sqrt(e) + w["b"]  # [B, T, K, G]
    base = jnp.einsum("KSE,BTKGE->BTKSG", w["k_base"], q) / np.sqrt(e)  # [B, T, K, S, G]
    score = 1.0 / (1.0 + jnp.exp(base - logit[:, :, :, None]).sum(axis=3))  # [B, T, K, G]
    return jnp.swapaxes(score.mean(axis=-1), 1, 2)  # [B, K, T]


@dataclasses.dataclass(frozen=True)
class FastKVzip(Reconstructor, KVzap):
    """kvpress's FastKVzipPress: the gates' scores (`gates`, a file), the n_sink first and the last
    max(1, int(n window_ratio)) tokens scored 1, then the int(L K n ratio) lowest (layer, kv head, token) of
    every layer removed (`layerwise=False`, kvpress's default) or each layer's int(K n ratio) lowest (token,
    kv head) pairs (`layerwise=True`). Decoding and streams: `kvzap`'s (a slot's mass is its score, kvzip's
    stream rule)."""

    # the engine's pass between the prompt phase and after_prompt (models.reconstruct) feeds no repeat input:
    # the gates scored the prompt in the prefill; only `after_pass`, the choice over all layers, runs
    repeat_chunk: ClassVar[int] = 0
    repeat_tail: ClassVar[int] = 0
    prompts: ClassVar[str] = "none"

    ratio: float = 0.5
    layerwise: bool = False  # kvpress's default: one choice over every layer's scores
    n_sink: int = 4
    window_ratio: float = 0.02
    window_size: int = 4096  # the window from 32,000 context tokens on
    gates: str = ""
    budget: int = 1 << 30  # unused with ratio (kvzap's field: the stream rule's)
    window: int = 1
    # tokens per kv head this layer is stored for (`fit`, set by `Engine.fitted`; 0: the static capacity)
    fitted: int = dataclasses.field(default=0, metadata={"engine": True})
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio < 1:
            raise ValueError(f"fastkvzip.ratio={self.ratio!r}: must be a number in (0, 1)")
        if not isinstance(self.window_ratio, (int, float)) or not 0 <= self.window_ratio < 1:
            raise ValueError(f"fastkvzip.window_ratio={self.window_ratio!r}: must be a number in [0, 1)")
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"fastkvzip.layerwise={self.layerwise!r}: must be True or False")
        check_int("fastkvzip", "fitted", self.fitted, 0)

    def kept_for(self, n: int) -> int:
        """Tokens per kv head on average after an n-token prompt (rounded up: a layer keeps K n - int(K n r);
        layerwise=False: the same fraction over the model, a layer's own count varies)."""
        return n - int(n * self.ratio) + 1

    def capacity(self, max_len):
        """Slots per kv head on average (the pool holds kv_heads x this many): once fitted, what the layer
        kept + max_new; layerwise=False, max_len (a layer may keep every token)."""
        if self.fitted:
            return min(self.fitted + self.max_new, max_len)
        if not self.layerwise:
            return max_len
        return min(self.kept_for(max_len) + self.max_new, max_len)

    # -- Fits: stored at what each layer kept (`Engine(..., fit=n)`) ----------------------------------
    def fit(self, tokens_per_head: int) -> "FastKVzip":
        return dataclasses.replace(self, fitted=max(int(tokens_per_head), 1))

    # -- the prompt phase and the engine's pass (no repeat input) --------------------------------------
    def prompt_policy(self):
        return GatePhase(codec=self.codec, of=self, obs_window=0, gates=self.gates)

    def reconstruction(self) -> "GatePhase":
        """The layer in the pass: its prompt phase (the pass feeds nothing, `repeat_chunk = 0`)."""
        return self.prompt_policy()

    def scores_in_pass(self, policy) -> bool:
        return isinstance(policy, GatePhase)

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """layerwise=False: one choice over every FastKVzip layer's scores (`model_scope_keep`, kvzip's
        scope="model"), stored as each layer's `extra["gate_kept"]` [B, K, M] for `after_prompt`."""
        if not all(isinstance(p, FastKVzip) for p in reconstructors):
            raise ValueError("fastkvzip: no other reconstructing policy (kvzip, kvcompose) in the same engine, got "
                             f"{sorted({type(p).__name__ for p in reconstructors})}")
        if all(p.layerwise for p in reconstructors):
            return states
        if len({(p.ratio, p.n_sink, p.window_ratio, p.window_size, p.layerwise) for p in reconstructors}) > 1:
            raise ValueError("fastkvzip layerwise=False: every fastkvzip layer must share ratio, n_sink, the window "
                             "and layerwise (one choice over all of them)")
        runs = [st for st, z in zip(states, scored) if z]
        score = jnp.concatenate([jax.vmap(self.scores)(st) for st in runs])  # [L, B, K, M]
        kept = model_scope_keep(score, jnp.concatenate([st.pos for st in runs]), self.ratio, self.n_sink)
        out, i = [], 0
        for st, z in zip(states, scored):
            if z:
                n = st.pos.shape[0]
                st = dataclasses.replace(st, extra={**st.extra, "gate_kept": kept[i:i + n]})
                i += n
            out.append(st)
        return tuple(out)

    def scores(self, state: PromptState) -> Float[Array, "B K M"]:
        """The gates' scores of a prompt state's tokens, the n_sink first and the window's scored 1 (0 past the
        prompt)."""
        if "gate" not in state.extra:
            raise ValueError("fastkvzip: the prompt has no gate scores (its prompt phase runs in models.llama)")
        kh, m = state.extra["gate"].shape[1:]
        pos = jnp.broadcast_to(state.pos, (state.pos.shape[0], kh, m))  # [B, K, M]
        n = (state.pos[:, :1] >= 0).sum(axis=-1, keepdims=True)  # [B, 1, 1] prompt tokens
        win = jnp.where(n < 32000, jnp.maximum(1, jnp.floor(n * self.window_ratio)), self.window_size)
        score = jnp.where((pos < self.n_sink) | (pos >= n - win), 1.0, state.extra["gate"])  # [B, K, M]
        return jnp.where(pos >= 0, score, 0.0)

    def after_prompt(self, state: PromptState) -> HeadPool:
        m = state.slots
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        filled = pos >= 0
        score = self.scores(state)  # [B, K, M]
        if not self.layerwise:
            if "gate_kept" not in state.extra:
                raise ValueError("fastkvzip layerwise=False: the prompt has no choice over all layers; run it "
                                 "through models.engine.Engine (compress makes it)")
            kept = state.extra["gate_kept"] & filled
        else:
            n = filled[:, 0].sum(axis=-1)  # [B] prompt tokens
            keep_n = kh * n - jnp.floor(kh * n * self.ratio).astype(jnp.int32)  # [B]
            prio = jnp.where(filled, score, -jnp.inf).reshape(b, kh * m)
            kept = top_mask(prio, pos.reshape(b, kh * m), keep_n[:, None]).reshape(b, kh, m) & filled
        return prompt_pool(state, kept, score, kh * self.capacity(m))


@dataclasses.dataclass(frozen=True)
class GatePhase(PromptPhase):
    """FastKVzip's prompt phase: dense storage plus the gates' score of every prompt token per kv head,
    `extra["gate"]` [B, K, M], written as the layer reads its hidden states (`models.llama.block`)."""

    reads_hidden = True
    gates: str = ""  # part of what the phase stores (prompt sharing compares phases without `of`)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return dataclasses.replace(st, extra={**st.extra, "gate": jnp.zeros((batch, kv_heads, max_len), jnp.float32)})

    def hidden_weights(self, d_model: int, kv_heads: int, n_layers: int, a: int, b: int) -> dict[str, np.ndarray]:
        """The gates of layers [a, b), named "fkz_<name>" (they ride with the layer's weights)."""
        g = load_gates(self.gates)
        if g["q_w"].shape[0] != n_layers or g["q_w"].shape[1] != d_model or g["k_base"].shape[1] != kv_heads:
            raise ValueError(f"fastkvzip.gates={self.gates!r}: gates of {g['q_w'].shape[0]} layers, width "
                             f"{g['q_w'].shape[1]}, {g['k_base'].shape[1]} kv heads; the model has {n_layers}, "
                             f"{d_model}, {kv_heads}")
        return {f"fkz_{n}": g[n][a:b] for n in GATE_NAMES}

    def read_hidden(self, state: PromptState, h: Float[Array, "B T d"], pos: Int[Array, "B T"],
                    w: dict[str, Any]) -> PromptState:
        score = gate_scores({k[4:]: v for k, v in w.items() if k.startswith("fkz_")}, h)  # [B, K, T]
        gate = jax.vmap(lambda z, x, p: jax.lax.dynamic_update_slice_in_dim(z, x, p, axis=1))(
            state.extra["gate"], score, pos[:, 0])  # [B, K, M]
        return dataclasses.replace(state, extra={**state.extra, "gate": gate})


def from_kvpress(r: float, max_new: int, fields: dict) -> FastKVzip:
    """`kvpolicies.compat.kvpress("FastKVzipPress", r, gates=<file>)`; kvpress's layerwise (default False: one
    choice over all layers), n_sink, window_size, window_ratio."""
    gates = fields.pop("gates", "")
    if not gates:
        raise ValueError("kvpress('FastKVzipPress'): give gates= (an .npz of per-layer gates: `python -m "
                         "evals.train_fastkvzip model=<name>` writes $KVP_DATA/fastkvzip/<model>.npz); kvpress "
                         "downloads the authors' from the Hugging Face hub")
    return FastKVzip(ratio=r, max_new=max_new, gates=str(gates), **{k: fields.pop(k) for k in list(fields) if k in (
        "layerwise", "n_sink", "window_size", "window_ratio")})
