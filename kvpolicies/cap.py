"""`cap`: CAPKV (kvpress `CapPress`, arXiv:2604.25975) — keep the tokens with the largest capacity
score: a token's query relevance w_i times its leverage in the relevance-weighted Gram matrix of
the values, s_i = w_i v_i^T (I + sum_j w_j v_j v_j^T)^-1 v_i.

Shapes: B batch, K kv heads, G query heads per kv head (1 in the decode state's statistics, see
`Cap`), S = budget + max_new slots, V view slots, F = n_future_positions, D head dim.

w_i = exp(tau cos(k_i, mu_q) - max): mu_q is the mean of the prompt's pre-RoPE queries (the first
n_sink excluded), rotated by RoPE averaged over the next F positions (as expected attention's);
k_i the key after RoPE. The scores of a kv head are averaged over its G query heads; the first
n_sink tokens are kept.
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
from kvpolicies.expected import turn
from kvpolicies.keydiff import rotated
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CapState(SlotState):
    """Slots plus the running query sums of the layer (not per slot).

    stats: {"q_sum": [B, K, 1, D], "q_n": [B]} float32: the sum of the pre-RoPE queries at positions
           >= n_sink (pooled over the G query heads of a kv head) and their number.
    """

    stats: dict[str, Any]


def unit(x: Float[Array, "*b D"]) -> Float[Array, "*b D"]:
    """x / max(||x||, 1e-12) (torch's F.normalize)."""
    return x / jnp.maximum(jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)), 1e-12)


@dataclasses.dataclass(frozen=True)
class Cap(PromptScored):
    """After the prompt, keep per kv head the first `n_sink` tokens and the best of the others by
    CAPKV's capacity score, `budget` in all (or kvpress's n_kept with `ratio`); decode appends.

    The score is kvpress 0.5.5's `CapPress` at its defaults (tau 5, n_future_positions 512, n_sink
    4, epsilon 1e-6): the query anchor and the keys L2-normalised before their dot product (the
    paper uses the raw dot product), the weights shifted by their per-head maximum, the anchor
    rotated by RoPE averaged over the next 512 positions (not in the paper; needed for RoPE
    models), the output direction u_i the raw value v_i, A = I + sum_j (w_j + epsilon) v_j v_j^T
    solved in float32, the score w_i v_i^T A^-1 v_i averaged over a kv head's query heads. kvpress
    gives the sinks max + 1 of the layer's scores (kept first); so do we (+inf).

    The prompt phase collects the query sums per query head (`PromptPhase(query_sink=n_sink)`, as
    expected attention's: D^2 + D floats per query head, the second moments unused and discarded).
    Stream extension (`PromptScored`: recompress on overflow; also generation beyond `max_new`):
    the state keeps the running pre-RoPE query sum pooled over a kv head's G query heads (`CapState`,
    D + 1 floats per kv head, counted in its bytes), and a compression scores the view with the
    anchor of every query so far (position >= n_sink), RoPE averaged over the next
    n_future_positions.
    """

    label = "cap"
    observes = ("q", "k_rot", "rope")

    budget: int = 1024
    max_new: int = 256
    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("cap", "n_future_positions", self.n_future_positions, 1)
        check_int("cap", "n_sink", self.n_sink, 0)
        for name in ("tau", "epsilon"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
                raise ValueError(f"cap.{name}={x!r}: must be a number >= 0")

    @property
    def collects(self):
        return {"query_sink": self.n_sink}

    # -- state: slots + pooled query sums ---------------------------------------------------
    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        zeros = {"q_sum": jnp.zeros((batch, kv_heads, 1, head_dim), jnp.float32), "q_n": jnp.zeros((batch,), jnp.float32)}
        return self.join(st, zeros)

    def split(self, state):
        return SlotState(state.k, state.v, state.pos), state.stats

    def join(self, slots, stats):
        return CapState(slots.k, slots.v, slots.pos, stats=stats)

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        g = seen.q.shape[2]
        pos = jnp.tile(view.rope.q[..., 0], (1, g))  # [B, G T]
        use = pos >= self.n_sink
        q = seen.q.reshape(seen.q.shape[:2] + (-1, seen.q.shape[-1])).astype(jnp.float32)  # [B, K, G T, D]
        q_sum = jnp.where(use[:, None, :, None], q, 0.0).sum(axis=2, keepdims=True)  # [B, K, 1, D]
        return slots, {"q_sum": stats["q_sum"] + q_sum, "q_n": stats["q_n"] + use.sum(axis=1).astype(jnp.float32)}

    def from_prompt(self, state, pos):
        slots, _ = super().from_prompt(state, pos)
        ex = state.extra
        return slots, {"q_sum": ex["q_sum"].sum(axis=2, keepdims=True), "q_n": ex["q_n"] * ex["q_sum"].shape[2]}

    # -- the score ----------------------------------------------------------------------------
    def rank(self, slots, keys, stats, seen):
        start = slots.pos.max(axis=(1, 2)) + 1  # [B] the first future position
        return self.score(seen.k_rot, slots.v, slots.pos, stats, jnp.asarray(seen.rope.inv_freq()), start)

    def prompt_rank(self, state, slots, keys, stats):
        ex = state.extra  # per query head (kvpress's anchor is per attention head)
        start = slots.pos.max(axis=(1, 2)) + 1
        return self.score(rotated(keys, slots.pos, ex["inv_freq"]), slots.v, slots.pos, ex, ex["inv_freq"], start)

    def score(self, k_rot: Float[Array, "B K V D"], v: Any, pos: Int[Array, "B K V"], stats: dict[str, Any],
              inv_freq: Float[Array, "H"], start: Int[Array, "B"]) -> tuple[Array, Array]:
        """(priority, tie): CAPKV's capacity score of each filled slot (keys `k_rot` after RoPE, the
        slots' stored values `v`), the anchor of the queries summed in `stats`; the n_sink first first."""
        d = k_rot.shape[-1]
        mu = stats["q_sum"] / jnp.maximum(stats["q_n"], 1.0)[:, None, None, None]  # [B, K, G, D]
        future = start[:, None] + jnp.arange(self.n_future_positions)  # [B, F]
        ang = future.astype(jnp.float32)[..., None] * inv_freq  # [B, F, D/2]
        c, s = (f(ang).mean(axis=1)[:, None, None] for f in (jnp.cos, jnp.sin))  # [B, 1, 1, D/2]: mean R
        anchor = unit(turn(mu, c, s))  # [B, K, G, D]
        stat = jnp.clip(jnp.einsum("BKGD,BKVD->BKGV", anchor, unit(k_rot.astype(jnp.float32))), -1.0, 1.0)
        sink = pos < self.n_sink  # [B, K, V]
        scored = ((pos >= 0) & ~sink)[:, :, None]  # [B, K, 1, V]
        logit = jnp.where(scored, self.tau * stat, -jnp.inf)
        top = jnp.max(logit, axis=-1, keepdims=True)
        w = jnp.where(scored, jnp.exp(logit - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)  # [B, K, G, V]
        vals = self.codec.decode(v, jnp.float32)  # [B, K, V, D]
        sv = vals[:, :, None] * jnp.where(scored, jnp.sqrt(w + self.epsilon), 0.0)[..., None]  # [B, K, G, V, D]
        gram = jnp.eye(d) + jnp.einsum("BKGVD,BKGVE->BKGDE", sv, sv)  # [B, K, G, D, D]
        vt = jnp.broadcast_to(jnp.swapaxes(vals, -1, -2)[:, :, None], gram.shape[:3] + (d, vals.shape[2]))
        lev = jnp.sum(vt * jnp.linalg.solve(gram, vt), axis=-2)  # [B, K, G, V]: v^T A^-1 v
        sc = (w * lev).mean(axis=2)  # [B, K, V]
        return rank_by(jnp.where(sink, jnp.inf, sc), pos)
