"""`window`: sliding-window attention over a ring buffer of exactly `window` slots (memory O(W))."""

from __future__ import annotations

import dataclasses

from kvpolicies.base import Policy, keys_rotated
from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.limits import Ring
from kvpolicies.ring import ring_compact, ring_extend


@dataclasses.dataclass(frozen=True)
class Window(Ring, Budgeted, Policy):
    """Each query sees the newest `window` tokens, itself included (k_pos > q_pos - window).

    RoPE sees text positions. The visible keys are contiguous, so rotating them by rank in the
    cache (StreamingLLM's choice for `sink`) would give the same relative distances: window
    has no position mode.
    """

    budget_field = "window"

    window: int = 4096
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("window", "window", self.window, 1)

    @property
    def rotated_keys(self):
        return keys_rotated(self.codec)  # as `full`: text positions, keys read only by attention

    def capacity(self, max_len):
        return min(self.window, max_len)

    def _slot(self, pos, capacity):
        return pos % capacity  # capacity < window only when max_len < window: then pos < capacity

    def extend(self, state, k, v, pos):
        view = ring_extend(self.codec, state, k, v, pos, self._slot(pos, state.slots))
        mask = view.pos[:, :, None, :] > pos[:, None, :, None] - self.window  # [B, Kp, T, S + T]
        return dataclasses.replace(view, mask=mask)

    def compact(self, view, seen):
        return ring_compact(view.carry, self._slot, lambda pos: pos > pos[:, -1:] - self.window)
