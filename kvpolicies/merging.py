"""`Merging`: kvpress's `MergingPress` (merge on evict, after Token Merging, Bolya et al. ICLR 2023, and
D2O, Wan et al. 2024) — a prompt scorer chooses the kept tokens, then each evicted token's value is
folded into the kept token whose key is most cosine-similar. Not registered: reached through
`kvpolicies.compat.kvpress("MergingPress", r, press=...)`.

Shapes: B batch, K kv heads, S = budget + max_new slots, M prompt slots (slot j holds token j),
E evicted rows (= M), D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kvpolicies.codecs import Codec, Identity
from kvpolicies.cur import CUR
from kvpolicies.keydiff import KeyDiff, rotated
from kvpolicies.knorm import Knorm
from kvpolicies.lagkv import LagKV
from kvpolicies.prompt import PromptState
from kvpolicies.prompt_scored import PromptScored
from kvpolicies.random_keep import RandomKeep
from kvpolicies.scored import pack, top_mask

EPS = 1e-6  # kvpress's clamp of the key norms and of the weights' denominator


def merged_values(k_rot: Float[Array, "B K M D"], v: Float[Array, "B K M D"], kept: Bool[Array, "B K M"],
                  evicted: Bool[Array, "B K M"], threshold: float) -> Float[Array, "B K M D"]:
    """kvpress's `MergingPress.merge`: each evicted token whose best cosine similarity with a kept
    key is >= threshold adds its value, weighted by that similarity (clamped at 0) times
    |v_e| / (|v_e| + |v_target| + EPS), to its target; a kept value that received weight W and sum
    A becomes (v + A) / (1 + W). Keys and the other values unchanged."""
    unit = k_rot / jnp.maximum(jnp.linalg.norm(k_rot, axis=-1, keepdims=True), EPS)  # [B, K, M, D]
    sim = jnp.einsum("BKED,BKJD->BKEJ", unit, unit)  # [B, K, E, M]
    sim = jnp.where(kept[:, :, None, :], sim, -jnp.inf)
    target = jnp.argmax(sim, axis=-1)  # [B, K, E]
    best = jnp.max(sim, axis=-1)  # [B, K, E]
    norm = jnp.linalg.norm(v, axis=-1)  # [B, K, M]
    w = jnp.where(evicted & (best >= threshold), jnp.maximum(best, 0.0), 0.0)
    w = w * norm / (norm + jnp.take_along_axis(norm, target, axis=-1) + EPS)  # [B, K, E]
    add = jax.vmap(jax.vmap(lambda t, x: jnp.zeros_like(x).at[t].add(x)))  # scatter-add over E per (B, K)
    acc = add(target, w[..., None] * v)  # [B, K, M, D]
    wacc = add(target, w)  # [B, K, M]
    return jnp.where((kept & (wacc > 0))[..., None], (v + acc) / (1.0 + wacc[..., None]), v)


@dataclasses.dataclass(frozen=True)
class Merging(PromptScored):
    """After the prompt, `press` keeps its tokens (kvpress's n_kept), and every evicted token's value
    is merged into its most similar kept token (`merged_values`; keys after RoPE, as kvpress caches
    them): the merged tokens are the stored slots, no extra storage. `press` is a prompt scorer of
    the slots it is given (knorm, keydiff, lagkv, random, cur). kvpress's `merge_fraction` below 1
    (a quantile gate) is not reproduced (compat refuses it). The prompt phase also collects RoPE's
    frequencies (`query_sink`, as keydiff: D^2 + D floats per query head summed, discarded after).
    Streams (and generation past `max_new`): `press`'s own rule on overflow, without merging (ours)."""

    label = "merging"
    takes: ClassVar[tuple[type, ...]] = (Knorm, KeyDiff, LagKV, RandomKeep, CUR)

    press: PromptScored = None
    similarity_threshold: float = 0.0
    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if type(self.press) not in self.takes:
            raise ValueError(f"merging.press={self.press!r}: must be one of {[c.__name__ for c in self.takes]}")
        t = self.similarity_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
            raise ValueError(f"merging.similarity_threshold={t!r}: must be a number in [0, 1]")

    @property
    def observes(self):
        return self.press.observes

    @property
    def collects(self):
        return {**self.press.collects, "query_sink": self.press.collects.get("query_sink", 4)}  # RoPE's frequencies

    def rank(self, slots, keys, stats, seen):
        return self.press.rank(slots, keys, stats, seen)

    def prompt_rank(self, state, slots, keys, stats):
        return self.press.prompt_rank(state, slots, keys, stats)

    def after_prompt(self, state: PromptState, table=None):
        s = self.capacity(state.slots)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, M, D]
        pos = jnp.broadcast_to(state.pos, keys.shape[:3])  # [B, K, M]
        slots, stats = self.from_prompt(state, pos)
        filled = pos >= 0
        count = filled.sum(axis=-1)  # [B, K]
        n = self.n_kept(count, s, state.slots, table)  # [B, K, 1]
        prio, tie = self.prompt_rank(state, slots, keys, stats)
        kept = jnp.where(count[..., None] > n, top_mask(prio, tie, n) & filled, filled)
        v = self.codec.decode(state.v, jnp.float32)
        merged = merged_values(rotated(keys, pos, state.extra["inv_freq"]), v, kept, filled & ~kept,
                               self.similarity_threshold)
        dtype = jax.tree.leaves(state.v)[0].dtype if isinstance(self.codec, Identity) else jnp.float32
        slots = dataclasses.replace(slots, v=self.codec.encode(merged.astype(dtype)))
        return self.join(pack(slots, kept, s), stats)
