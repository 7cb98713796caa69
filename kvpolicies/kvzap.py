"""`kvzap`: KVzap (Jegou et al., "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning",
arXiv 2601.07891; kvpress `KVzapPress` + `DMSPress`) — a small per-layer surrogate (linear, or a
2-layer MLP) reads the layer's input hidden states and predicts KVzip's per-(token, kv head)
score (log scale); tokens are scored as they are prefilled, with no reconstruction pass, and
pruned by a threshold (DMS-style) or to a token budget, a short local window always kept.

Shapes: B batch, T new tokens, d model width, H surrogate hidden width, K kv heads, M = max_len
(the prompt phase's slots), S = budget + max_new slots per kv head on average, L layers.

The surrogate's weights are ours: trained with optax on the registered `kvzip` policy's own
reconstruction scores over the Paul Graham essays (`python -m evals.train_kvzap`), saved as
`kvpolicies/kvzap_weights/<model>_<kind>.npz` (`surrogate`); `surrogate="auto"` picks the file of
`kind` whose (d, K, L) match the model.

Protocol (a prompt compressor whose scorer reads hidden states):
  1. prompt phase (`ZapPhase`): the context is held densely, as kvzip's; each layer's step reads
     its normalised input hidden states (`models.llama.block` asks a policy that `reads_hidden`,
     the surrogate weights riding with the layer's weights, `hidden_weights`) and writes the
     predicted log-scores of the step's tokens into `extra["zap"]` [B, K, M];
  2. `after_prompt`: each kv head keeps its last `window` tokens and, with `rule="threshold"`,
     every older token whose predicted score is >= `threshold` (DMS: per-head and per-layer counts
     follow the content), or, with `rule="budget"`, the layer's K x budget best-scored tokens of
     all heads together (kvzip's head-wise rule); stored as Ada-KV's head pool
     (`kvpolicies.adakv`), the heads holding different numbers of tokens.
Decoding and streams are kvzip's (`KVzip.compact`): a kept slot's mass is exp(predicted log-score),
KVzip's probability scale, and later queries' attention raises it.

Defaults: window 128 (kvpress `DMSPress.sliding_window_size`), the linear surrogate.
Deviations, named: (1) the head pool has a static capacity, K x (budget + max_new) slots per
layer, so a threshold can only keep fewer tokens than `budget` per head on average (when more
pass it, the best-scored are kept): the stored bytes are the pool's, and a threshold's achieved
ratio (`kept_counts`) is what it kept of it, unless the engine stores each layer at what it kept
(`Fits`: `models.engine.Engine.fitted`, `fit=n`); (2) the surrogate's targets are our kvzip's scores
(max over query heads and repeat queries of the reconstruction softmax), not KVzip+'s
output-norm-weighted scores; (3) decoding adds no surrogate scores (kvzip's attention mass).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.adakv import HeadPool, as_rows, fit_pool, head_of, pack_by_head, pool_view, prompt_pool
from kvpolicies.base import EMPTY, Policy, View, empty_slots
from kvpolicies.budgets import Budgeted, Fits
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.kvzip import KVzip
from kvpolicies.prompt import PromptCompressor, PromptPhase, PromptState
from kvpolicies.scored import top_mask

WEIGHTS_DIR = Path(__file__).resolve().parent / "kvzap_weights"
KINDS = ("linear", "mlp")
LOWEST = jnp.finfo(jnp.float32).min


def surrogate(params: dict[str, Array], h: Float[Array, "B T d"]) -> Float[Array, "B T K"]:
    """The surrogate's forward pass for one layer: linear (`w` [d, K], `b` [K]) or a 2-layer MLP
    (`w1` [d, H], `b1` [H], GELU (erf), `w2` [H, K], `b2` [K]), in float32."""
    x = h.astype(jnp.float32)
    if "w" in params:
        return x @ params["w"] + params["b"]  # [B, T, K]
    z = jax.nn.gelu(x @ params["w1"] + params["b1"], approximate=False)  # [B, T, H]
    return z @ params["w2"] + params["b2"]  # [B, T, K]


def weight_file(name: str) -> Path:
    return WEIGHTS_DIR / f"{name}.npz"


PARAM_NAMES = {"linear": ("w", "b"), "mlp": ("w1", "b1", "w2", "b2")}
MLP_WIDTH = 64  # the MLP surrogate's hidden width (ours; small enough for a CPU-trained, committed file)


def random_surrogate(kind: str, d_model: int, kv_heads: int, n_layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random surrogate weights (the training's initialisation, also surrogate="random")."""
    rng = np.random.default_rng(seed)
    n = lambda *s: (rng.standard_normal((n_layers,) + s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    if kind == "linear":
        return {"w": n(d_model, kv_heads), "b": np.zeros((n_layers, kv_heads), np.float32)}
    return {"w1": n(d_model, MLP_WIDTH), "b1": np.zeros((n_layers, MLP_WIDTH), np.float32),
            "w2": n(MLP_WIDTH, kv_heads), "b2": np.zeros((n_layers, kv_heads), np.float32)}


@functools.lru_cache(maxsize=16)
def load_surrogate(name: str) -> dict[str, np.ndarray]:
    """A saved surrogate (`evals.train_kvzap`): per-layer arrays stacked on L, plus its dims."""
    path = Path(name) if name.endswith(".npz") else weight_file(name)
    if not path.is_file():
        raise ValueError(f"kvzap.surrogate={name!r}: no weight file {path}; train one with "
                         f"`python -m evals.train_kvzap model=<name> kind=<linear|mlp>`")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def find_surrogate(kind: str, d_model: int, kv_heads: int, n_layers: int) -> str:
    """The saved surrogate of `kind` whose dims match the model (surrogate="auto")."""
    for path in sorted(WEIGHTS_DIR.glob(f"*_{kind}.npz")):
        s = load_surrogate(path.stem)
        if (int(s["d_model"]), int(s["kv_heads"]), int(s["n_layers"])) == (d_model, kv_heads, n_layers):
            return path.stem
    raise ValueError(f"kvzap: no {kind} surrogate in {WEIGHTS_DIR} for a model with d_model={d_model}, "
                     f"{kv_heads} kv heads, {n_layers} layers; train one with `python -m evals.train_kvzap`")


@dataclasses.dataclass(frozen=True)
class KVzap(Budgeted, Fits, PromptCompressor, Policy):
    """Keep each kv head's last `window` tokens and the tokens a learned surrogate of KVzip scores
    highly (above `threshold`, or the layer's K x budget best)."""

    observes = ("logits",)
    per_token = True
    budget_field = "budget"

    budget: int = 1024  # tokens per kv head on average (pool capacity; window included)
    max_new: int = 256  # free slots per kv head on average for the question and the answer
    rule: str = "budget"  # "budget": the K x budget best; "threshold": score >= threshold (DMS)
    threshold: float = -6.0  # log-score threshold (rule="threshold")
    window: int = 128  # the newest tokens every head keeps (DMS's sliding window)
    kind: str = "linear"  # the surrogate: "linear" or "mlp"
    surrogate: str = "auto"  # a file stem under kvpolicies/kvzap_weights, a .npz path, "auto" (match the model), "random"
    prefill: str = "dense"  # "sparse" (rule="threshold"): evict while the prompt is prefilled (DMS's sparse prefill)
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("kvzap", "window", self.window, 1)
        check_int("kvzap", "budget", self.budget, self.window)
        check_int("kvzap", "max_new", self.max_new, 0)
        check_choice("kvzap", "rule", self.rule, ("budget", "threshold"))
        check_choice("kvzap", "kind", self.kind, KINDS)
        check_choice("kvzap", "prefill", self.prefill, ("dense", "sparse"))
        if self.prefill == "sparse" and self.rule != "threshold":
            raise ValueError("kvzap.prefill='sparse' evicts by the threshold as the prompt streams in: it needs "
                             "rule='threshold'")
        if not isinstance(self.threshold, (int, float)) or not np.isfinite(self.threshold):
            raise ValueError(f"kvzap.threshold={self.threshold!r}: must be a finite number (a log-score)")

    def capacity(self, max_len):
        """Slots per kv head on average (the pool holds kv_heads x this many)."""
        return min(self.budget + self.max_new, max_len)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), kv_heads)  # [B, K, S, D]
        return HeadPool(st.k, st.v, st.pos, mass=jnp.zeros(st.pos.shape, jnp.float32))

    def fit(self, tokens_per_head: int) -> "KVzap":
        """The same rule with room for `tokens_per_head` kept tokens per kv head on average (at
        least `window`): on a prompt whose layer kept at most K x that many, it keeps the same
        tokens (`Engine.fitted` stores each layer at its own size)."""
        return dataclasses.replace(self, budget=min(max(int(tokens_per_head), self.window), self.budget))

    def fit_state(self, state: HeadPool, max_len: int) -> HeadPool:
        """A compressed pool cut to this (fitted) policy's slots per row (`fit_pool`)."""
        return fit_pool(state, min(self.capacity(max_len), state.pos.shape[2]))

    # -- the surrogate ---------------------------------------------------------------------------
    def surrogate_params(self, d_model: int, kv_heads: int, n_layers: int) -> dict[str, np.ndarray]:
        """The surrogate's weights for a model of these dims, stacked on L: the saved file, or
        (surrogate="random") seeded random weights of `kind` (tests; a scorer that knows nothing)."""
        if self.surrogate == "random":
            return random_surrogate(self.kind, d_model, kv_heads, n_layers)
        name = self.surrogate if self.surrogate != "auto" else find_surrogate(self.kind, d_model, kv_heads, n_layers)
        s = load_surrogate(name)
        dims = (int(s["d_model"]), int(s["kv_heads"]), int(s["n_layers"]))
        if dims != (d_model, kv_heads, n_layers):
            raise ValueError(f"kvzap.surrogate={name!r} is for (d_model, kv_heads, layers) = {dims}, the model has "
                             f"{(d_model, kv_heads, n_layers)}")
        if str(s["kind"]) != self.kind:
            raise ValueError(f"kvzap.surrogate={name!r} is a {s['kind']} surrogate, kind={self.kind!r}")
        return s

    # -- the head-wise choice ----------------------------------------------------------------------
    def keep(self, score: Float[Array, "B K V"], pos: Int[Array, "B K V"], s: int,
             threshold: float | None = None) -> Bool[Array, "B K V"]:
        """Per kv head (pos = -1 where a slot is not the head's): the tokens of the last `window`
        positions, then (threshold None) the layer's best-scored tokens of all heads together,
        K x min(budget, s) in all, or (threshold) every token scoring >= threshold, at most that
        many (the best of them; ties to the newer token)."""
        b, kh, v = pos.shape
        filled = pos >= 0
        recent = filled & (pos > pos.max(axis=(1, 2), keepdims=True) - self.window)  # [B, K, V]
        chosen = filled if threshold is None else recent | (filled & (score >= threshold))
        prio = jnp.where(recent, jnp.inf, jnp.where(chosen, score, -jnp.inf))
        n = kh * min(self.budget, s)
        return top_mask(prio.reshape(b, kh * v), pos.reshape(b, kh * v), n).reshape(b, kh, v) & chosen

    # -- decoding and streams: kvzip's ---------------------------------------------------------------
    def extend(self, state, k, v, pos):
        return pool_view(self.codec, state, k, v, pos)

    stream_keep = keep  # KVzip.compact's cut of a full pool
    compact = KVzip.compact

    # -- the method's protocol ---------------------------------------------------------------------
    def prompt_policy(self):
        if self.prefill == "sparse":
            return ZapSparse(codec=self.codec, of=self, kind=self.kind, surrogate=self.surrogate)
        return ZapPhase(codec=self.codec, of=self, obs_window=0, kind=self.kind, surrogate=self.surrogate)

    def after_prompt(self, state: PromptState) -> HeadPool:
        if isinstance(state, ZapPool):  # the sparse prefill's pool: already what the threshold kept
            filled = state.pos >= 0
            pool = HeadPool(state.k, state.v, state.pos, mass=jnp.where(filled, jnp.exp(state.mass), 0.0))
            return fit_pool(pool, min(self.capacity(state.zap.shape[-1]), state.pos.shape[2]))  # a fitted policy
        if "zap" not in state.extra:
            raise ValueError("kvzap: the prompt has no surrogate scores (its prompt phase runs in models.llama)")
        m = state.slots
        s = self.capacity(m)
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        score = state.extra["zap"]  # [B, K, M] predicted log-scores
        filled = pos >= 0
        if self.rule == "threshold":
            kept = self.keep(score, pos, s, self.threshold)
        else:
            over = filled.sum(axis=-1, keepdims=True) > min(self.budget, s)  # [B, K, 1]
            kept = jnp.where(over, self.keep(score, pos, s), filled)
        return prompt_pool(state, kept, jnp.where(filled, jnp.exp(score), 0.0), kh * s)


@dataclasses.dataclass(frozen=True)
class ZapPhase(PromptPhase):
    """KVzap's prompt phase: dense storage (a `PromptPhase` without rows) plus the surrogate's
    log-score of every prompt token per kv head, `extra["zap"]` [B, K, M], written as the layer
    reads its hidden states (`read_hidden`, called by `models.llama.block`)."""

    reads_hidden = True
    # the surrogate is part of what the phase stores (prompt sharing compares phases without `of`)
    kind: str = "linear"
    surrogate: str = "auto"

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return dataclasses.replace(st, extra={**st.extra, "zap": jnp.full((batch, kv_heads, max_len), LOWEST)})

    def hidden_weights(self, d_model: int, kv_heads: int, n_layers: int, a: int, b: int) -> dict[str, np.ndarray]:
        """The surrogate's weights of layers [a, b), each [b - a, ...], named "zap_<name>" (they
        travel with the layer's weights through the model's layer scan)."""
        s = KVzap(kind=self.kind, surrogate=self.surrogate).surrogate_params(d_model, kv_heads, n_layers)
        return {f"zap_{n}": np.asarray(s[n][a:b], np.float32) for n in PARAM_NAMES[self.kind]}

    def read_hidden(self, state: PromptState, h: Float[Array, "B T d"], pos: Int[Array, "B T"],
                    w: dict[str, Any]) -> PromptState:
        """The state with the step's tokens' predicted log-scores written at their positions
        (a prompt step's positions are contiguous from pos[:, 0])."""
        params = {k[4:]: v for k, v in w.items() if k.startswith("zap_")}
        score = jnp.swapaxes(surrogate(params, h), 1, 2)  # [B, K, T]
        zap = jax.vmap(lambda z, x, p: jax.lax.dynamic_update_slice_in_dim(z, x, p, axis=1))(
            state.extra["zap"], score, pos[:, 0])  # [B, K, M]
        return dataclasses.replace(state, extra={**state.extra, "zap": zap})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ZapPool(HeadPool):
    """The sparse prefill's state: a head pool of the policy's capacity (`mass`: each slot's
    predicted log-score) and the log-score of every prompt position per kv head, zap [B, K, M]."""

    zap: Float[Array, "B K M"]


@dataclasses.dataclass(frozen=True)
class ZapSparse(Policy):
    """KVzap's sparse prefill (`prefill="sparse"`, ours, after DMS's sparse prefill; kvpress's
    DMSPress is the dense-prefill version): the prompt streams into the head pool and a token is
    evicted as soon as it leaves the `window` newest positions with a log-score below
    `threshold`. A query at position p sees the tokens j <= p with p - j <= window or a score >=
    threshold: exactly the tokens a token-by-token run holds when p arrives, whatever the chunk
    (the mask, `extend`). The state never holds the dense prompt: its bytes are the pool's (K x
    (budget + max_new) slots) plus one float32 score per position and kv head. Deviation: when
    more tokens pass than the pool holds, the best-scored are kept (then chunks can differ)."""

    reads_hidden = True
    codec: Codec = Identity()
    of: KVzap | None = None
    kind: str = "linear"
    surrogate: str = "auto"

    def capacity(self, max_len):
        return self.of.capacity(max_len)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = self.of.init(batch, kv_heads, head_dim, dtype, max_len)
        return ZapPool(st.k, st.v, st.pos, mass=st.mass, zap=jnp.full((batch, kv_heads, max_len), LOWEST))

    hidden_weights = ZapPhase.hidden_weights

    def read_hidden(self, state: ZapPool, h: Float[Array, "B T d"], pos: Int[Array, "B T"],
                    w: dict[str, Any]) -> ZapPool:
        """The state with the step's tokens' predicted log-scores written at their positions."""
        params = {k[4:]: v for k, v in w.items() if k.startswith("zap_")}
        score = jnp.swapaxes(surrogate(params, h), 1, 2)  # [B, K, T]
        zap = jax.vmap(lambda z, x, p: jax.lax.dynamic_update_slice_in_dim(z, x, p, axis=1))(state.zap, score, pos[:, 0])
        return dataclasses.replace(state, zap=zap)

    def extend(self, state: ZapPool, k, v, pos) -> View:
        pool = HeadPool(state.k, state.v, state.pos, mass=state.mass)
        view = pool_view(self.codec, pool, k, v, pos)
        slots, head, p = view.carry
        b, kh, m = state.zap.shape
        at = jnp.clip(head, 0, kh - 1) * m + jnp.clip(slots.pos, 0, m - 1)  # [B, 1, V]
        score = jnp.take_along_axis(state.zap.reshape(b, 1, kh * m), at, axis=-1)  # [B, 1, V] log-scores
        near = pos[:, :, None] - slots.pos <= self.of.window  # [B, T, V]: within the window of the query
        seen = (near | (score >= self.of.threshold))[:, None]  # [B, 1, T, V]
        slots = dataclasses.replace(slots, mass=score)
        v = slots.pos.shape[-1]  # positions per kv head (Kp = K), as the mask's: the blocked path pairs them
        return dataclasses.replace(view, pos=jnp.broadcast_to(view.pos, (b, kh, v)), mask=view.mask & seen,
                                   carry=(slots, head, p, state.zap))

    def compact(self, view: View, seen) -> ZapPool:
        """Each head's `window` newest tokens and every older one scoring >= threshold, packed by
        head into the pool (at most K x budget: the best-scored)."""
        slots, head, p, zap = view.carry
        kh = zap.shape[1]
        per_head = head == jnp.arange(kh)[None, :, None]  # [B, K, V]
        kept = self.of.keep(jnp.where(per_head, slots.mass, LOWEST), jnp.where(per_head, slots.pos, EMPTY), p // kh,
                            self.of.threshold).any(axis=1, keepdims=True)  # [B, 1, V]
        pool = as_rows(pack_by_head(slots, kept & (slots.pos >= 0), head, p), kh)
        return ZapPool(pool.k, pool.v, pool.pos, mass=pool.mass, zap=zap)


def kept_counts(pool: HeadPool) -> np.ndarray:
    """Tokens each kv head holds in a head-pool state, stacked or not (pos [..., B, K, S] ->
    counts [..., B, K]; the pool's rows are not heads: `kvpolicies.adakv.head_of`)."""
    pos = jnp.asarray(pool.pos)
    kh = pos.shape[-2]
    flat = pos.reshape(pos.shape[:-2] + (1, kh * pos.shape[-1]))  # [..., B, 1, P]
    head = head_of(flat, kh)  # [..., B, 1, P]
    return np.asarray((head == jnp.arange(kh)[:, None]).sum(axis=-1))  # [..., B, K]
