"""`full`: every token is kept; capacity is the maximum sequence length."""

from __future__ import annotations

import dataclasses

from kvpolicies.base import Policy, encode_new, view_of, write_at
from kvpolicies.codecs import Codec, Identity


@dataclasses.dataclass(frozen=True)
class Full(Policy):
    """The dense baseline: slot i holds token i. New tokens are written in place (any T)."""

    codec: Codec = Identity()

    def capacity(self, max_len):
        return max_len

    def extend(self, state, k, v, pos):
        # Chunks are contiguous, so the chunk starts at slot pos[:, 0].
        written = write_at(state, encode_new(self.codec, k, v, pos), pos[:, 0])
        return view_of(self.codec, written, pos, k.dtype, carry=written)

    def compact(self, view, seen):
        return view.carry
