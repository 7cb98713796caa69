"""`observed`: ObservedAttention (kvpress's `ObservedAttentionPress`, its stand-in for H2O,
Zhang et al. 2023) — keep the tokens with the largest attention averaged over every query
that could see them.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by


@dataclasses.dataclass(frozen=True)
class Observed(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the largest mean attention.

    The score of token j (kvpress, eager attention over the whole prompt of n tokens): the
    attention it received summed over all queries and divided by the n - j queries that can
    see it, averaged over the G query heads of its kv head (we sum over G: the same ranking).
    `budget` counts every kept token, no window is protected. The prompt phase collects the
    column sums (`PromptPhase(columns=True)`), whatever the chunk; the state's `mass`
    ([B, K, S] float32) carries them into decoding, where every query adds its attention.

    Stream extension (`PromptScored`: recompress on overflow): a slot's score is its mass over
    the queries since it entered (last position - its position + 1), the same rule.
    """

    label = "observed"
    observes = ("scores",)
    collects = {"columns": True}
    accumulates = True

    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        return dataclasses.replace(slots, mass=slots.mass + seen.scores.sum(axis=2)), stats  # [B, K, V]: each query's

    def from_prompt(self, state, pos):
        slots, stats = super().from_prompt(state, pos)
        return dataclasses.replace(slots, mass=state.extra["mass"]), stats  # column sums over the prompt

    def rank(self, slots, keys, stats, seen):
        seen_by = slots.pos.max(axis=-1, keepdims=True) - slots.pos + 1  # [B, K, V] queries that saw it
        return rank_by(slots.mass / jnp.maximum(seen_by, 1), slots.pos)
