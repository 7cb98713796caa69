"""`cur`: CurDKV (Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition", arXiv:2509.15038; NVIDIA/kvpress `CURPress`) — keep per kv head the tokens with the
largest approximate leverage scores of their key and value, no attention read.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim, N = V padded to a
multiple of the local window, L = local_window.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt_scored import PromptScored, rank_by
from kvpolicies.scored import LAST_KEY
from kvpolicies.slots import inverse_order, take_slots

LEVERAGE = ("kv_product", "key", "value", "kv_avg")


@dataclasses.dataclass(frozen=True)
class CUR(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the largest leverage score, the
    first `n_sink` tokens always.

    kvpress's `CURPress` at its defaults (num_sinks 4, leverage_type "kv_product",
    use_local_approximation with local_window_size 16, no random projection): a token's key
    leverage is its squared L2 norm divided by the sum over its block of `local_window` tokens
    (blocks from position 0, the last one padded with zeros), its value leverage the same, and the
    score their product ("key", "value", "kv_avg": one of them or their mean; `local_window=0`:
    divided by the sum over all tokens instead). kvpress normalizes the scores to sum 1 and sets
    the sinks to 1.0; we rank the same order (sinks +inf). Norms of the stored (un-rotated) keys:
    RoPE keeps the norm (not its float32 rounding, so near ties can swap, as `knorm`'s). The paper
    derives the leverage scores from a CUR decomposition of the attention's value-weighted key
    matrix; this is kvpress's local approximation of it. kvpress's `use_random_leverage` (a
    Gaussian projection to 20 dimensions before the norms, torch's draw) is not reproduced.
    `budget` counts every kept token, sinks included.

    Stream extension (`PromptScored`: recompress on overflow): the blocks are cut from the held
    tokens in text order (the i-th held token in block i // local_window, gaps ignored); the sinks
    are the positions below `n_sink`.
    """

    label = "cur"

    budget: int = 1024
    max_new: int = 256
    n_sink: int = 4
    leverage: str = "kv_product"
    local_window: int = 16
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("cur", "n_sink", self.n_sink, 0)
        check_choice("cur", "leverage", self.leverage, LEVERAGE)
        check_int("cur", "local_window", self.local_window, 0)

    def rank(self, slots, keys, stats, seen):
        return self.score(keys, self.codec.decode(slots.v, jnp.float32), slots.pos)

    def score(self, keys: Float[Array, "B K V D"], values: Float[Array, "B K V D"], pos: Int[Array, "B K V"]
              ) -> tuple[Array, Array]:
        """(priority, tie) of every slot: the leverage product above, the sinks first."""
        filled = pos >= 0
        k2, v2 = (jnp.where(filled, jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1), 0.0) for x in (keys, values))
        k2, v2 = self.local(k2, pos), self.local(v2, pos)  # [B, K, V] each
        score = {"kv_product": lambda: k2 * v2, "key": lambda: k2, "value": lambda: v2,
                 "kv_avg": lambda: (k2 + v2) / 2}[self.leverage]()
        return rank_by(jnp.where(pos < self.n_sink, jnp.inf, score), pos)

    def local(self, x: Float[Array, "B K V"], pos: Int[Array, "B K V"]) -> Float[Array, "B K V"]:
        """x divided by its sum over each block of `local_window` held tokens in text order (0: over all)."""
        if not self.local_window:
            return x / jnp.maximum(x.sum(axis=-1, keepdims=True), 1e-30)
        w, v = self.local_window, pos.shape[-1]
        order = jnp.argsort(jnp.where(pos >= 0, pos, LAST_KEY), axis=-1)  # [B, K, V]: filled first, by position
        xs = take_slots(x, order)  # empty slots last, 0
        n = -(-v // w) * w
        blocks = jnp.pad(xs, ((0, 0), (0, 0), (0, n - v))).reshape(xs.shape[:2] + (n // w, w))  # [B, K, N / L, L]
        sums = jnp.repeat(blocks.sum(axis=-1), w, axis=-1)[..., :v]  # [B, K, V]: each slot's block sum
        return take_slots(xs / jnp.maximum(sums, 1e-30), inverse_order(order))  # back to view order
