"""`full`: every token is kept; capacity is the maximum sequence length."""

from __future__ import annotations

import dataclasses

from kvpolicies.base import Policy, keys_rotated
from kvpolicies.codecs import Codec, Identity
from kvpolicies.limits import Bounded
from kvpolicies.slots import PrefixSlots, append_view, encode_new, write_at


@dataclasses.dataclass(frozen=True)
class Full(PrefixSlots, Bounded, Policy):
    """The dense baseline: slot i holds token i (`PrefixSlots`: a step at positions < n needs only
    slots [0, n)). New tokens are written in place (any T)."""

    codec: Codec = Identity()

    @property
    def rotated_keys(self):
        # RoPE sees text positions and only attention reads the keys: store them rotated (a decode
        # step then reads them as stored instead of rotating all S). A codec keeps them un-rotated
        # (it quantizes the same values whatever the policy around it) unless it encodes after RoPE.
        return keys_rotated(self.codec)

    def capacity(self, max_len):
        return max_len

    def extend(self, state, k, v, pos):
        # Chunks are contiguous, so the chunk starts at slot pos[:, 0]; attention reads the
        # stored slots in place and the new tokens after them.
        new = encode_new(self.codec, k, v, pos)
        return append_view(self.codec, state, new, pos, k.dtype, carry=(state, new, pos[:, 0]), start=pos[:, 0])

    def compact(self, view, seen):
        return write_at(*view.carry)
