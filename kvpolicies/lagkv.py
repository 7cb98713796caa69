"""`lagkv`: LagKV (Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which
Tokens Are Important", arXiv:2504.04704; authors' repo AI-Lab-China-Merchants-Bank/LagKV; NVIDIA/kvpress
`LagKVPress`) — score each token against the min-max range of the partition after it, no attention.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim, P partitions
of `lag_size` tokens, L = lag_size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.keydiff import rotated
from kvpolicies.prompt_scored import PromptScored, rank_by
from kvpolicies.scored import LAST_KEY
from kvpolicies.slots import inverse_order, take_slots


@dataclasses.dataclass(frozen=True)
class LagKV(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens LagKV ranks highest.

    kvpress's `LagKVPress` rule (defaults n_sink 4, lag_size 128, cross_scoring False): the n
    tokens after the first `n_sink` are cut into partitions of `lag_size`; a token of partition p
    is scored by the standard deviation over channels of its key (after RoPE) min-max normalised
    by the range of partition p + 1, softmaxed over partition p, the same for its value, the two
    averaged; without `cross_scoring` each partition's scores become their ranks / lag_size (every
    partition then offers the same values, so the budget is spread over the partitions). The sinks
    and the last full partition with the remainder score 1 (kept first). A prompt shorter than
    n_sink + 2 lag_size keeps its sinks and its newest tokens. `budget` counts every kept token.

    Ties: sinks and tail all score 1, as do equal ranks of different partitions; when the budget
    cuts through such a tie we keep the newer token, kvpress torch.topk's order. Our stream
    extension (`PromptScored`: recompress on overflow) applies the same rule to the view's tokens
    in text order (the i-th held token takes the i-th place, gaps ignored).

    Cost: as `keydiff`, the prompt phase's query statistics (`query_sink=4`) carry RoPE's
    frequencies; only those are read.
    """

    label = "lagkv"
    observes = ("k_rot",)
    collects = {"query_sink": 4}  # for RoPE's frequencies (see Cost)

    budget: int = 1024
    max_new: int = 256
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("lagkv", "n_sink", self.n_sink, 0)
        check_int("lagkv", "lag_size", self.lag_size, 1)
        if not isinstance(self.cross_scoring, bool):
            raise ValueError(f"lagkv.cross_scoring={self.cross_scoring!r}: must be True or False")

    def rank(self, slots, keys, stats, seen):
        return self.score(seen.k_rot, self.codec.decode(slots.v, jnp.float32), slots.pos)

    def prompt_rank(self, state, slots, keys, stats):
        k_rot = rotated(keys, slots.pos, state.extra["inv_freq"])
        return self.score(k_rot, self.codec.decode(slots.v, jnp.float32), slots.pos)

    def score(self, k_rot: Float[Array, "B K V D"], v: Float[Array, "B K V D"], pos: Int[Array, "B K V"]
              ) -> tuple[Array, Array]:
        """(priority, tie) of every slot: the rule above over the filled slots in text order."""
        order = jnp.argsort(jnp.where(pos >= 0, pos, LAST_KEY), axis=-1)  # [B, K, V]: filled first, by position
        ks, vs = (take_slots(x.astype(jnp.float32), order) for x in (k_rot, v))  # [B, K, V, D]
        n = (pos >= 0).sum(axis=-1, keepdims=True)  # [B, K, 1]
        ns, lag = self.n_sink, self.lag_size
        i = jnp.arange(pos.shape[-1])  # place in text order
        short = jnp.where(i < ns, 1.0, (i - ns) / jnp.maximum(n - ns, 1))  # [B, K, V]: no partition to score
        n_part = jnp.maximum(n - ns, 0) // lag  # [B, K, 1] full partitions
        p_max = max(pos.shape[-1] - ns, 0) // lag  # static
        if p_max >= 2:
            part = jnp.concatenate([self._partition_scores(x, p_max) for x in (ks, vs)], axis=0)
            part = (part[: ks.shape[0]] + part[ks.shape[0]:]) / 2  # [B, K, P, L]
            if not self.cross_scoring:
                part = inverse_order(jnp.argsort(part, axis=-1)) / lag
            tail = p_max * lag
            flat = jnp.pad(part.reshape(part.shape[:2] + (tail,)), ((0, 0), (0, 0), (ns, pos.shape[-1] - ns - tail)))
            scored = (i >= ns) & (i < ns + (n_part - 1) * lag)  # [B, K, V]: in a partition with one after it
            long = jnp.where(scored, flat, 1.0)
            prio = jnp.where(n >= ns + 2 * lag, long, short)
        else:
            prio = short
        prio = take_slots(prio, inverse_order(order))  # back to view order
        return rank_by(prio, pos)

    def _partition_scores(self, x: Float[Array, "B K V D"], p_max: int) -> Float[Array, "B K P L"]:
        """Per partition p < p_max - 1: the std over channels of its rows normalised by partition
        p + 1's per-channel min and max, softmaxed over the partition (the last row: unused)."""
        lag, ns = self.lag_size, self.n_sink
        parts = x[:, :, ns:ns + p_max * lag].reshape(x.shape[:2] + (p_max, lag, x.shape[-1]))  # [B, K, P, L, D]
        lo = jnp.roll(parts.min(axis=3, keepdims=True), -1, axis=2)  # [B, K, P, 1, D]: partition p + 1's
        hi = jnp.roll(parts.max(axis=3, keepdims=True), -1, axis=2)
        std = jnp.std((parts - lo) / (hi - lo), axis=-1, ddof=1)  # [B, K, P, L]
        return jax.nn.softmax(std, axis=-1)
