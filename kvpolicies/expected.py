"""`expected`: Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression
by Estimating Attention from Future Queries Distribution"; NVIDIA/kvpress
`ExpectedAttentionPress`) — keep the tokens future queries are expected to attend to most.

Shapes: B batch, K kv heads, G query heads per kv head (1 in the decode state's statistics,
see `Expected`), S = budget + max_new slots, V view slots, F = n_future_positions, D head dim.

The queries are modelled as Gaussian (mean mu, covariance C of the prompt's pre-RoPE queries,
the first n_sink excluded) and rotated by RoPE averaged over the next F positions,
R = mean_t R(L + t) (mu' = R mu, C' = R C R^T). For a post-RoPE key k, E[exp(q.k / sqrt(D))]
= exp(mu'.k / sqrt(D) + k^T C' k / (2 D)); its softmax over the non-sink keys, averaged over
the G query heads, times ||v|| (use_vnorm), is the score; the n_sink first tokens are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.base import SlotState
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import query_sums
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpectedState(SlotState):
    """Slots plus the running query statistics of the layer (not per slot).

    stats: {"q_sum": [B, K, 1, D], "q_sq": [B, K, 1, D, D], "q_n": [B]} float32: the sums of
           the pre-RoPE queries at positions >= n_sink (pooled over the G query heads of a kv
           head), of their outer products, and their number.
    """

    stats: dict[str, Any]


def turn(x: Float[Array, "*b D"], cos: Float[Array, "*c H"], sin: Float[Array, "*c H"]) -> Float[Array, "*b D"]:
    """x times the rotate-half matrix [[cos, -sin], [sin, cos]] (per channel pair i, i + D/2),
    cos and sin broadcasting against x's leading axes (RoPE's rotation, or its average)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def moments(stats: dict[str, Any]) -> tuple[Float[Array, "B K G D"], Float[Array, "B K G D D"]]:
    """Mean and (population) covariance of the queries summed in `stats`."""
    n = jnp.maximum(stats["q_n"], 1.0)[:, None, None, None]  # [B, 1, 1, 1]
    mu = stats["q_sum"] / n  # [B, K, G, D]
    cov = stats["q_sq"] / n[..., None] - jnp.einsum("BKGI,BKGJ->BKGIJ", mu, mu)  # [B, K, G, D, D]
    return mu, cov


@dataclasses.dataclass(frozen=True)
class Expected(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the largest expected attention.

    Defaults are kvpress's: n_future_positions=512, n_sink=4, use_covariance=True,
    use_vnorm=True, epsilon=0.0; `budget` counts every kept token, sinks included (kvpress
    gives the sinks the largest score). The prompt phase collects the query sums per query
    head, whatever the chunk (`PromptPhase(query_sink=n_sink)`); `after_prompt` scores the
    prompt's keys with the statistics of all its queries but the first n_sink and the RoPE
    average over positions L .. L + n_future_positions - 1.

    Stream extension (`PromptScored`: recompress on overflow; also generation beyond
    `max_new`): the state keeps running query sums (`ExpectedState`, D^2 + D + 1 floats per kv
    head, counted in its bytes) and a compression scores the view with the statistics of every
    query so far (position >= n_sink), averaged RoPE over the next n_future_positions. Its
    statistics are pooled over the G query heads of a kv head (one Gaussian per kv head),
    because a state's shape is fixed before the model's head count reaches the policy: a
    deviation of the extension only (the prompt protocol is per query head, as kvpress).
    """

    label = "expected"
    observes = ("q", "k_rot", "rope")

    budget: int = 1024
    max_new: int = 256
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("expected", "n_future_positions", self.n_future_positions, 1)
        check_int("expected", "n_sink", self.n_sink, 0)
        if not isinstance(self.epsilon, (int, float)) or self.epsilon < 0:
            raise ValueError(f"expected.epsilon={self.epsilon!r}: must be a number >= 0")

    @property
    def collects(self):
        return {"query_sink": self.n_sink}

    # -- state: slots + pooled query sums ---------------------------------------------------
    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        zeros = {"q_sum": jnp.zeros((batch, kv_heads, 1, head_dim), jnp.float32),
                 "q_sq": jnp.zeros((batch, kv_heads, 1, head_dim, head_dim), jnp.float32),
                 "q_n": jnp.zeros((batch,), jnp.float32)}
        return self.join(st, zeros)

    def split(self, state):
        return SlotState(state.k, state.v, state.pos), state.stats

    def join(self, slots, stats):
        return ExpectedState(slots.k, slots.v, slots.pos, stats=stats)

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        q = seen.q.reshape(seen.q.shape[:2] + (1, -1, seen.q.shape[-1]))  # [B, K, 1, G T, D]: pooled
        pos = jnp.tile(view.rope.q[..., 0], (1, seen.q.shape[2]))  # [B, G T]
        return slots, query_sums(q, pos, self.n_sink, stats)

    def from_prompt(self, state, pos):
        slots, _ = super().from_prompt(state, pos)
        ex = state.extra
        pooled = {"q_sum": ex["q_sum"].sum(axis=2, keepdims=True), "q_sq": ex["q_sq"].sum(axis=2, keepdims=True),
                  "q_n": ex["q_n"] * ex["q_sum"].shape[2]}  # the G heads' queries as one population
        return slots, pooled

    # -- the score ----------------------------------------------------------------------------
    def rank(self, slots, keys, stats, seen):
        start = slots.pos.max(axis=(1, 2)) + 1  # [B] the first future position
        inv = jnp.asarray(seen.rope.inv_freq())
        return self.score(seen.k_rot, slots.v, slots.pos, stats, inv, start)

    def prompt_rank(self, state, slots, keys, stats):
        ex = state.extra
        ang = slots.pos.astype(jnp.float32)[..., None] * ex["inv_freq"]  # [B, K, V, D/2]
        k_rot = turn(keys, jnp.cos(ang), jnp.sin(ang))  # [B, K, V, D]: RoPE at the text positions
        start = slots.pos.max(axis=(1, 2)) + 1
        return self.score(k_rot, slots.v, slots.pos, ex, ex["inv_freq"], start)  # per query head

    def score(self, k_rot: Float[Array, "B K V D"], v: Any, pos: Int[Array, "B K V"], stats: dict[str, Any],
              inv_freq: Float[Array, "H"], start: Int[Array, "B"]) -> tuple[Array, Array]:
        """(priority, tie): expected attention of the queries in `stats` at positions
        start .. start + n_future_positions - 1 to the keys `k_rot` (after RoPE), weighted by
        the norms of `v` (the slots' stored, codec-encoded values); the n_sink first tokens first."""
        d = k_rot.shape[-1]
        mu, cov = moments(stats)  # [B, K, G, D], [B, K, G, D, D]
        future = start[:, None] + jnp.arange(self.n_future_positions)  # [B, F]
        ang = future.astype(jnp.float32)[..., None] * inv_freq  # [B, F, D/2]
        c, s = (f(ang).mean(axis=1)[:, None, None] for f in (jnp.cos, jnp.sin))  # [B, 1, 1, D/2]: mean R
        mu = turn(mu, c, s)  # R mu
        k = k_rot.astype(jnp.float32)
        logit = jnp.einsum("BKVD,BKGD->BKGV", k, mu) / jnp.sqrt(d)  # [B, K, G, V]
        if self.use_covariance:
            c2, s2 = c[..., None, :], s[..., None, :]  # [B, 1, 1, 1, D/2]
            cov = turn(jnp.swapaxes(turn(cov, c2, s2), -1, -2), c2, s2)  # R C R^T
            logit = logit + jnp.einsum("BKVI,BKGIJ,BKVJ->BKGV", k, cov, k) / (2 * d)
        sink = pos < self.n_sink  # [B, K, V]
        scored = ((pos >= 0) & ~sink)[:, :, None]  # [B, K, 1, V]
        logit = jnp.where(scored, logit, -jnp.inf)
        top = jnp.max(logit, axis=-1, keepdims=True)
        e = jnp.where(scored, jnp.exp(logit - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        p = (e / jnp.maximum(e.sum(axis=-1, keepdims=True), 1e-30)).mean(axis=2)  # [B, K, V] softmax, mean over G
        if self.use_vnorm:
            vals = self.codec.decode(v, jnp.float32)  # [B, K, V, D]
            p = (p + self.epsilon) * jnp.sqrt(jnp.sum(jnp.square(vals), axis=-1))
        return rank_by(jnp.where(sink, jnp.inf, p), pos)
