"""kvpress's `FastKVzipPress` (Kim et al. 2026, "Fast KVzip", arXiv:2601.17668; Janghyun1230/FastKVzip):
small per-layer gates, trained by the authors on KVzip's scores, read each layer's normalised input hidden
states and score every (token, kv head) during the prefill; no reconstruction pass. Reached through
`kvpolicies.compat.kvpress("FastKVzipPress", r, layerwise=True, gates=<file>)`; not registered.

Shapes: B batch, T new tokens, d model width, K kv heads, G query heads per kv head, E = 16 the gate's
width, S = 16 its sink keys, M = max_len (the prompt phase's slots), L layers.

The gate of a layer (kvpress's `FastKVzipGate`): q = RMSNorm(h W_q + b_q) [K, G, E], k = RMSNorm(h W_k) [K, E]
(RMSNorm with a learned weight, eps 1e-6), logit = k.q / sqrt(E) + b [K, G], base_s = k_base[s].q / sqrt(E);
the score is 1 / (1 + sum_s exp(base_s - logit)), averaged over G. After the prompt (kvpress's
`compress_post`): the first n_sink tokens and the last max(1, int(n window_ratio)) score 1 (a context
under 32,000 tokens; window_size beyond), and with `layerwise=True` each layer drops its int(K n r)
lowest-scored (token, kv head) pairs over all its heads; the kept pairs are stored as Ada-KV's head pool
(`kvpolicies.adakv`), the heads holding different numbers of tokens (kvpress masks them).

Not reproduced: kvpress's default `layerwise=False`, one choice over every layer's scores (the layers then
keep data-dependent counts; our kvzip does this through the engine's reconstruction hooks, which a
pass-free scorer does not run), refused by `compat`. The gates: the authors' are downloaded from
`Jang-Hyun/Fast-KVzip` for a few checkpoints; ours are trained by their recipe on our kvzip's scores,
`python -m evals.train_fastkvzip model=<name>` (`$KVP_DATA/fastkvzip/<model>.npz`, `GATE_NAMES`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.adakv import prompt_pool
from kvpolicies.codecs import Codec, Identity
from kvpolicies.kvzap import KVzap
from kvpolicies.prompt import PromptPhase, PromptState
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
class FastKVzip(KVzap):
    """kvpress's FastKVzipPress with `layerwise=True`: the gates' scores (`gates`, a file), the n_sink first
    and the last max(1, int(n window_ratio)) tokens scored 1, each layer's int(K n ratio) lowest (token, kv
    head) pairs dropped. Decoding and streams: `kvzap`'s (a slot's mass is its score, kvzip's stream rule)."""

    ratio: float = 0.5
    n_sink: int = 4
    window_ratio: float = 0.02
    window_size: int = 4096  # the window from 32,000 context tokens on
    gates: str = ""
    budget: int = 1 << 30  # unused with ratio (kvzap's field: the stream rule's)
    window: int = 1
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio < 1:
            raise ValueError(f"fastkvzip.ratio={self.ratio!r}: must be a number in (0, 1)")
        if not isinstance(self.window_ratio, (int, float)) or not 0 <= self.window_ratio < 1:
            raise ValueError(f"fastkvzip.window_ratio={self.window_ratio!r}: must be a number in [0, 1)")

    def kept_for(self, n: int) -> int:
        """Tokens per kv head on average after an n-token prompt (rounded up: a layer keeps K n - int(K n r))."""
        return n - int(n * self.ratio) + 1

    def capacity(self, max_len):
        return min(self.kept_for(max_len) + self.max_new, max_len)

    def prompt_policy(self):
        return GatePhase(codec=self.codec, of=self, obs_window=0, gates=self.gates)

    def after_prompt(self, state: PromptState) -> Any:
        if "gate" not in state.extra:
            raise ValueError("fastkvzip: the prompt has no gate scores (its prompt phase runs in models.llama)")
        m = state.slots
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        filled = pos >= 0
        n = filled[:, :1].sum(axis=-1, keepdims=True)  # [B, 1, 1] prompt tokens
        win = jnp.where(n < 32000, jnp.maximum(1, jnp.floor(n * self.window_ratio)), self.window_size)
        score = jnp.where((pos < self.n_sink) | (pos >= n - win), 1.0, state.extra["gate"])  # [B, K, M]
        keep_n = kh * n[:, 0, 0] - jnp.floor(kh * n[:, 0, 0] * self.ratio).astype(jnp.int32)  # [B]
        prio = jnp.where(filled, score, -jnp.inf).reshape(b, kh * m)
        kept = top_mask(prio, pos.reshape(b, kh * m), keep_n[:, None]).reshape(b, kh, m) & filled
        return prompt_pool(state, kept, jnp.where(filled, score, 0.0), kh * self.capacity(m))


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
    """`kvpolicies.compat.kvpress("FastKVzipPress", r, layerwise=True, gates=<file>)`; kvpress's n_sink,
    window_size, window_ratio. layerwise=False (kvpress's default, one choice over all layers) is refused."""
    if not fields.pop("layerwise", False):
        raise NotImplementedError("kvpolicies.compat.kvpress: FastKVzipPress(layerwise=False), one choice over every "
                                  "layer's gate scores (give layerwise=True: each layer drops int(K n r) pairs)")
    gates = fields.pop("gates", "")
    if not gates:
        raise ValueError("kvpress('FastKVzipPress'): give gates= (an .npz of per-layer gates: `python -m "
                         "evals.train_fastkvzip model=<name>` writes $KVP_DATA/fastkvzip/<model>.npz); kvpress "
                         "downloads the authors' from the Hugging Face hub")
    return FastKVzip(ratio=r, max_new=max_new, gates=str(gates), **{k: fields.pop(k) for k in list(fields) if k in (
        "n_sink", "window_size", "window_ratio")})
