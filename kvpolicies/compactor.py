"""`compactor`: Compactor (Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache
Compression with Approximate Leverage Scores", arXiv:2507.08143; NVIDIA/kvpress `CompactorPress`,
`NonCausalAttnPress`, `LeverageScorePress`) — rank the prompt's tokens by the approximate statistical
leverage of their keys blended with the attention they receive from every prompt query (non-causal,
chunk by chunk), no question needed.

Shapes: B batch, K kv heads, G query heads per kv head, S = budget + max_new slots, V view slots,
M prompt slots (slot j holds token j), D head dim, H = D / 2, R sketch dimension, C chunks of
`chunk_size` tokens, Z = chunk_size.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.expected import turn
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by
from kvpolicies.scored import LAST_KEY
from kvpolicies.slots import inverse_order, take_slots, write_rows


def sketch(seed: int, kv_heads: int, head_dim: int, dim: int) -> Float[Array, "K D R"]:
    """Our Gaussian sketch: N(0, 1 / dim) entries drawn by `jax.random.normal` from `seed`, one [D, R]
    matrix per kv head, the same in every layer and batch row (kvpress draws `torch.randn` per call)."""
    return jax.random.normal(jax.random.PRNGKey(seed), (kv_heads, head_dim, dim), jnp.float32) / math.sqrt(dim)


def leverage(keys: Float[Array, "B K V D"], use: Bool[Array, "B K V"], phi: Float[Array, "K D R"]
             ) -> Float[Array, "B K V"]:
    """Approximate leverage of the keys where `use` (0 elsewhere): centred over them, sketched on the
    right by `phi`, diag(X (X^T X + 0.01 I)^-1 X^T) (kvpress: Cholesky with jitter 1e-2, its first try)."""
    n = jnp.maximum(use.sum(axis=-1, keepdims=True), 1)[..., None]  # [B, K, 1, 1]
    x = jnp.where(use[..., None], keys, 0.0)
    x = jnp.where(use[..., None], x - x.sum(axis=2, keepdims=True) / n, 0.0)  # [B, K, V, D]
    y = jnp.einsum("BKVD,KDR->BKVR", x, phi)  # [B, K, V, R]
    g = jnp.einsum("BKVR,BKVQ->BKRQ", y, y)  # [B, K, R, R]
    g = 0.5 * (g + jnp.swapaxes(g, -1, -2)) + 1e-2 * jnp.eye(phi.shape[-1], dtype=g.dtype)
    chol = jnp.linalg.cholesky(g)
    z = jax.scipy.linalg.cho_solve((chol, True), jnp.swapaxes(y, -1, -2))  # [B, K, R, V]: G^-1 X^T
    return jnp.where(use, jnp.maximum(jnp.sum(y * jnp.swapaxes(z, -1, -2), axis=-1), 0.0), 0.0)


def zscore(x: Float[Array, "B K V"], use: Bool[Array, "B K V"]) -> Float[Array, "B K V"]:
    """(x - mean) / std over every head's used entries of a batch row (torch's unbiased std, >= 1e-6)."""
    n = use.sum(axis=(1, 2), keepdims=True)  # [B, 1, 1]
    mean = jnp.where(use, x, 0.0).sum(axis=(1, 2), keepdims=True) / jnp.maximum(n, 1)
    var = jnp.where(use, jnp.square(x - mean), 0.0).sum(axis=(1, 2), keepdims=True) / jnp.maximum(n - 1, 1)
    return (x - mean) / jnp.maximum(jnp.sqrt(var), 1e-6)


def pool3(x: Float[Array, "B K V"], pos: Int[Array, "B K V"], use: Bool[Array, "B K V"]) -> Float[Array, "B K V"]:
    """kvpress's avg_pool1d(kernel 3, padding 1): the mean of x over each used slot and its used
    neighbours in text order (absent neighbours count 0)."""
    order = jnp.argsort(jnp.where(use, pos, LAST_KEY), axis=-1)  # used first, by position
    xs = take_slots(jnp.where(use, x, 0.0), order)  # [B, K, V]
    pad = jnp.pad(xs, ((0, 0), (0, 0), (1, 1)))
    pooled = (pad[..., :-2] + pad[..., 1:-1] + pad[..., 2:]) / 3
    return take_slots(pooled, inverse_order(order))


@dataclasses.dataclass(frozen=True)
class QueryPhase(PromptPhase):
    """Compactor's prompt phase: dense storage plus every prompt query before RoPE,
    `extra["q"]` [B, K, M, G, D] (written at the first step, when G is known), and RoPE's frequencies
    `extra["inv_freq"]`: the non-causal attention reads each token's query with the keys after it."""

    @property
    def observes(self):
        return super().observes + ("q", "rope")

    def compact(self, view, seen):
        state = super().compact(view, seen)
        _, _, pos = view.carry
        q = jnp.swapaxes(seen.q, 2, 3)  # [B, K, T, G, D]
        buf = state.extra.get("q")
        if buf is None:
            buf = jnp.zeros(q.shape[:2] + (state.pos.shape[-1],) + q.shape[3:], jnp.float32)  # [B, K, M, G, D]
        extra = dict(state.extra, q=write_rows(buf, q, pos[:, 0]), inv_freq=jnp.asarray(seen.rope.inv_freq()))
        return dataclasses.replace(state, extra=extra)

    def head(self, state, n, lead=0):
        out = super().head(state, n, lead)
        if "q" in state.extra:
            out.extra["q"] = jax.lax.slice_in_dim(state.extra["q"], 0, n, axis=lead + 2)
        return out

    def with_head(self, state, head, lead=0):
        out = super().with_head(state, head, lead)
        if "q" in head.extra:
            full = state.extra.get("q")
            if full is None:  # the first step created the queries at the head's size
                m, h = state.pos.shape[-1], head.extra["q"]
                full = jnp.zeros(h.shape[:lead + 2] + (m,) + h.shape[lead + 3:], h.dtype)
            out.extra["q"] = jax.lax.dynamic_update_slice_in_dim(full, head.extra["q"], 0, axis=lead + 2)
        return out


@dataclasses.dataclass(frozen=True)
class Compactor(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the highest blended score, the
    first `sink_start` and last `sink_end` prompt tokens always.

    kvpress's `CompactorPress` at its defaults (sink_size_start 8, sink_size_end 4, chunk_size 256,
    sketch_dimension 48, blending = the compression ratio): over the tokens between the sinks,
    score = blending z(leverage) + z(attention), z a z-score over every head of the layer. leverage:
    the keys before RoPE centred, sketched by a Gaussian [D, 48] matrix, diag(X (X^T X + 0.01 I)^-1
    X^T) (`leverage`). attention: the tokens cut into chunks of `chunk_size` from the first scored
    one, every query of a chunk attending to every key of it (no causal mask, logits unscaled as
    kvpress computes them), the attention each key receives summed over the chunk's queries and the
    kv head's query heads, times the value's norm, averaged over a window of 3 tokens. kvpress's
    padding of the last chunk is reproduced: pad keys enter its softmax at logit -1e-9 and pad
    queries spread ~1/chunk_size over it. `attention=False` is `LeverageScorePress` (leverage alone,
    no sinks); `blending=0` with no sinks is `NonCausalAttnPress`. `blending=None`: the ratio (kvpress's
    default), 0.35 without one (kvpress's fallback). `budget` counts every kept token.

    Our draw: the sketch is `sketch(seed, ...)`, not torch's (which cannot be reproduced), so with a
    leverage term the kept sets differ from kvpress's run to run there, not here. The z-scores are
    per batch row (kvpress: over the whole batch, which its pipeline runs one at a time).

    Cost: the prompt phase stores every prompt query before RoPE (`QueryPhase`: G times the keys'
    bytes, freed after the compression). Stream extension (`PromptScored`: recompress on overflow):
    queries after the prompt are not kept, so attention there is the mass each held token received
    since it entered (causal; the state's `mass`, as `observed`), the rest as above over the held
    tokens in text order (the sinks: the first `sink_start` and the last `sink_end` of them).
    """

    label = "compactor"
    observes = ("scores",)
    accumulates = True

    budget: int = 1024
    max_new: int = 256
    sink_start: int = 8
    sink_end: int = 4
    chunk_size: int = 256
    sketch_dim: int = 48
    blending: float | None = None
    attention: bool = True
    seed: int = 0
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        for name, lo in (("sink_start", 0), ("sink_end", 0), ("chunk_size", 1), ("sketch_dim", 1)):
            check_int("compactor", name, getattr(self, name), lo)
        check_int("compactor", "seed", self.seed, 0, 2**32 - 1)
        b = self.blending
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))):
            raise ValueError(f"compactor.blending={self.blending!r}: must be a number or None (the ratio)")
        if not isinstance(self.attention, bool):
            raise ValueError(f"compactor.attention={self.attention!r}: must be True or False")

    @property
    def weight(self) -> float:
        """The leverage term's weight (kvpress: blending, else the compression ratio)."""
        if self.blending is not None:
            return float(self.blending)
        return self.ratio if self.ratio else 0.35

    def shape_class(self, slots):
        return dataclasses.replace(super().shape_class(slots), blending=self.weight)  # the ratio's blending, kept

    def prompt_policy(self):
        return QueryPhase(codec=self.codec, of=self, obs_window=0)

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        return dataclasses.replace(slots, mass=slots.mass + seen.scores.sum(axis=2)), stats  # [B, K, V]

    def prompt_rank(self, state: PromptState, slots, keys, stats):
        pos = slots.pos  # [B, K, M]: slot j holds token j
        att = self.chunk_attention(state.extra["q"], keys, pos, state.extra["inv_freq"]) if self.attention else None
        return self.blend(att, keys, self.codec.decode(slots.v, jnp.float32), pos)

    def rank(self, slots, keys, stats, seen):
        return self.blend(slots.mass, keys, self.codec.decode(slots.v, jnp.float32), slots.pos)

    def scored(self, pos: Int[Array, "B K V"]) -> Bool[Array, "B K V"]:
        """The held tokens between the sinks (kvpress: min(sink_start, n) first, min(sink_end, rest) last)."""
        filled = pos >= 0
        order = jnp.argsort(jnp.where(filled, pos, LAST_KEY), axis=-1)
        rank = inverse_order(order)  # [B, K, V]: place in text order
        n = filled.sum(axis=-1, keepdims=True)  # [B, K, 1]
        left = jnp.minimum(self.sink_start, n)
        right = jnp.minimum(self.sink_end, n - left)
        return filled & (rank >= left) & (rank < n - right)

    def blend(self, att: Float[Array, "B K V"] | None, keys: Float[Array, "B K V D"], values: Float[Array, "B K V D"],
              pos: Int[Array, "B K V"]) -> tuple[Array, Array]:
        """(priority, tie): blending z(leverage) + z(pooled attention x value norm), the sinks first."""
        use = self.scored(pos)
        score = jnp.zeros(pos.shape, jnp.float32)
        if self.attention:
            vnorm = jnp.sqrt(jnp.sum(jnp.square(values), axis=-1))  # [B, K, V]
            score = zscore(pool3(att * vnorm, pos, use), use)
        w = 1.0 if not self.attention else self.weight
        if w:
            phi = sketch(self.seed, keys.shape[1], keys.shape[-1], self.sketch_dim)
            score = score + w * zscore(leverage(keys.astype(jnp.float32), use, phi), use)
        return rank_by(jnp.where(use, score, jnp.inf), pos)

    def chunk_attention(self, q: Float[Array, "B K M G D"], keys: Float[Array, "B K M D"], pos: Int[Array, "B K M"],
                        inv_freq: Float[Array, "H"]) -> Float[Array, "B K M"]:
        """kvpress's `non_causal_chunked_attn` column sums over the scored tokens (summed over G),
        every query and key rotated at its position; 0 outside them."""
        use = self.scored(pos)  # [B, K, M]
        n_use = use.sum(axis=-1)  # [B, K] scored tokens (one contiguous run)
        first = jnp.argmax(use, axis=-1)  # [B, K] its first slot
        m, z = pos.shape[-1], self.chunk_size
        c = -(-m // z)
        idx = jnp.clip(first[..., None] + jnp.arange(c * z), 0, m - 1)  # [B, K, C Z]: chunk-relative slots
        rel = jnp.arange(c * z)  # place in the scored run
        valid = rel < n_use[..., None]  # [B, K, C Z]
        ang = jnp.maximum(pos, 0).astype(jnp.float32)[..., None] * inv_freq  # [B, K, M, H]
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        k_rot = take_slots(turn(keys, cos, sin), idx)  # [B, K, C Z, D]
        q_rot = turn(q.astype(jnp.float32), cos[:, :, :, None], sin[:, :, :, None])  # [B, K, M, G, D]
        q_rot = jnp.take_along_axis(q_rot, idx[..., None, None], axis=2)  # [B, K, C Z, G, D]
        shape = pos.shape[:2] + (c, z)
        kc, qc = k_rot.reshape(shape + (-1,)), q_rot.reshape(shape + q_rot.shape[-2:])
        dots = jnp.einsum("BKCQGD,BKCJD->BKCGQJ", qc, kc)  # [B, K, C, G, Z, Z], unscaled
        vq = valid.reshape(shape)[:, :, :, None, :, None]  # [B, K, C, 1, Z, 1]
        vk = valid.reshape(shape)[:, :, :, None, None, :]  # [B, K, C, 1, 1, Z]
        dots = jnp.where(vq, dots, 0.0)  # kvpress: pad queries' logits 0, then pad keys' -1e-9
        dots = jnp.where(vk, dots, -1e-9)
        cols = jax.nn.softmax(dots, axis=-1).sum(axis=(3, 4))  # [B, K, C, Z]: over the chunk's queries and G
        live = (jnp.arange(c) * z)[None, None, :] < n_use[..., None]  # [B, K, C]: chunks holding scored tokens
        cols = jnp.where(live[..., None], cols, 0.0).reshape(pos.shape[:2] + (c * z,))  # [B, K, C Z]
        out = jnp.zeros(pos.shape, jnp.float32)
        out = jax.vmap(jax.vmap(lambda o, i, x, v: o.at[i].add(jnp.where(v, x, 0.0))))(out, idx, cols, valid)
        return jnp.where(use, out, 0.0)
