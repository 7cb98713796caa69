"""Ring buffers (window, sink): new tokens go to slot `slot_of(pos)`; a slot is overwritten only
by a token at least `window` positions later, when the old one is no longer visible to it.

Shapes: B batch, T new tokens, K kv heads, D head dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int

from kvpolicies.base import SlotState, View
from kvpolicies.codecs import Codec
from kvpolicies.slots import Pending, append_view, encode_new, scatter


def ring_extend(codec: Codec, state: SlotState, k, v, pos: Int[Array, "B T"], slots: Int[Array, "B T"]) -> View:
    """The view of a ring step: the stored slots, then the new tokens (`append_view`). A decode
    step (T == 1) overwrites its slot (`Appended.start`); a chunk is folded back by
    `ring_compact`, so its early queries still see the slots its later tokens overwrite. The
    policy adds its mask / RoPE positions (`dataclasses.replace`)."""
    new = encode_new(codec, k, v, pos)
    start = slots[:, 0] if new.slots == 1 else None
    return append_view(codec, state, new, pos, k.dtype, Pending(state, new), start=start)


def ring_compact(carry: Pending, slot_of, keep_of) -> SlotState:
    """Fold the appended tokens of a ring step back into the ring (only surviving tokens).

    slot_of(pos [B, T], capacity) -> slots; keep_of(pos [B, T]) -> bool, True for the tokens
    that are the last writer of their slot.
    """
    old, new = carry
    pos = new.pos[:, 0]  # [B, T]
    slots = jnp.where(keep_of(pos), slot_of(pos, old.slots), old.slots)  # out of range = dropped
    return scatter(old, new, slots)
