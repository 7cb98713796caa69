"""`window`: sliding-window attention over a ring buffer of exactly `window` slots (memory O(W))."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvpolicies.base import Policy, check_choice, check_int, encode_new, ring_compact, ring_extend
from kvpolicies.codecs import Codec, Identity


@dataclasses.dataclass(frozen=True)
class Window(Policy):
    """Each query sees the newest `window` tokens, itself included (k_pos > q_pos - window).

    `positions` is accepted for symmetry with `sink`: the visible keys are contiguous, so
    rotating by rank in the cache gives the same relative distances as the text positions and
    both modes are exactly equal (tested).
    """

    budget_field = "window"
    run_keys = {"window": "window"}

    window: int = 4096
    positions: Literal["original", "cache"] = "original"
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("window", "window", self.window, 1)
        check_choice("window", "positions", self.positions, ("original", "cache"))

    def capacity(self, max_len):
        return min(self.window, max_len)

    def _slot(self, pos, capacity):
        return pos % capacity  # capacity < window only when max_len < window: then pos < capacity

    def extend(self, state, k, v, pos):
        return ring_extend(state, encode_new(self.codec, k, v, pos), self._slot(pos, state.slots))

    def visible(self, q_pos, k_pos):
        return k_pos[:, :, None, :] > q_pos[:, None, :, None] - self.window  # [B, Kp, T, S]

    def compact(self, view, scores=None):
        return ring_compact(view, self._slot, lambda pos: pos > pos[:, -1:] - self.window)
