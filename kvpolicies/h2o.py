"""`h2o`: Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models") — keep the `recent` newest tokens plus the
`heavy` tokens with the largest accumulated attention, chosen per kv head.

Shapes: B batch, K kv heads, S = heavy + recent slots, T new tokens, V = S + T view slots,
D head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.base import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.scored import Scored, newest


@dataclasses.dataclass(frozen=True)
class H2O(Scored):
    """Keeps `heavy` heavy hitters + the `recent` newest tokens (S = heavy + recent slots).

    Every slot accumulates the attention it has received from every query since it entered
    the cache (summed over the G query heads of its kv head; the state's `mass`, [B, K, S] float32).
    A step with T new tokens works on the view of the S old slots plus the T new ones, every
    new query seeing all old slots and the new tokens up to itself. At the end of the step
    each slot's accumulated mass grows by the mass the step's T queries gave it; then, per kv
    head, the `recent` newest tokens are kept and the other slots compete: the `heavy` ones
    with the largest accumulated mass survive (ties keep the newer token).

    Decode (T = 1) is the paper's per-step eviction: once the cache is full, one token, the
    lowest-scoring non-recent one, leaves per step. Prefill with a chunk of T > 1 tokens
    accumulates the chunk's causal attention (column sums of its attention matrix, as the
    paper's prompt phase does) and then keeps the top tokens once, at the chunk's end; so a
    chunk that overflows the budget is not equal to feeding its tokens one by one (its later
    queries still see tokens that one-by-one feeding would have evicted). Chunks that fit in
    the budget are exactly equal to one by one.

    The state holds S tokens between steps; a query reads them and the new tokens up to
    itself (as in the paper, the new token joins before the eviction), so heavy=0 is a
    sliding window of recent + 1 tokens (tested); recent=0 is pure heavy-hitter eviction.
    """

    budget_field = "heavy"
    run_keys = {"heavy": "budget"}

    heavy: int = 256
    recent: int = 256
    codec: Codec = Identity()

    accumulates = True

    def __post_init__(self):
        check_int("h2o", "heavy", self.heavy, 0)
        check_int("h2o", "recent", self.recent, 0)
        if self.heavy + self.recent < 1:
            raise ValueError(f"h2o.heavy + h2o.recent = {self.heavy + self.recent}: must be >= 1")

    @classmethod
    def for_tokens(cls, n, **kw):
        """n tokens in all, split as the paper does: recent = n // 2, heavy = n - recent."""
        kw.setdefault("recent", n // 2)
        return cls(heavy=n - kw["recent"], **kw)

    def capacity(self, max_len):
        return min(self.heavy + self.recent, max_len)

    def priority(self, slots, scores):
        acc = slots.mass + scores.sum(axis=2)  # [B, K, V]: mass received so far
        filled = slots.pos >= 0  # [B, K, V]
        prio = jnp.where(newest(slots.pos, self.recent), jnp.inf, jnp.where(filled, acc, -jnp.inf))  # [B, K, V]
        return prio, dataclasses.replace(slots, mass=acc)
