"""The gathered path: a decode step (T == 1) of a policy that `gathers` (Quest) reads only the
slots of the `Gather` its `select(view, q_rot, None)` answers, before any key is rotated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from kvpolicies import offload
from kvpolicies.base import View
from kvpolicies.slots import take_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Gather:
    """A decode step's sparse read, as data (`select`'s answer when `attend` asks with k_rot=None):
    per kv head, n blocks of `size` consecutive view slots, block i covering slots
    [start_i, start_i + size) (Quest: its pages). M = n x size is static; a block with ok False is
    not read (a missing candidate, a page past the cache), nor are its slots past the view's end;
    the blocks must not overlap. Blocks are gathered whole (contiguous size x D copies)."""

    start: Int[Array, "B K n"]
    ok: Bool[Array, "B K n"]
    size: int = dataclasses.field(default=1, metadata=dict(static=True))


def gathered_view(view: View, g: Gather) -> View:
    """The view's S stored slots restricted to the Gather's M = n x size slots (keys and values
    moved from a host tier if they live there), then its appended new tokens (`View.append`) as
    they are; unread slots get position -1, so causality masks them."""
    s, size = view.k.shape[2], g.size
    if size > s:  # blocks longer than the stored slots: gather slot by slot
        return gathered_view(view, slotwise(g, s))
    start = jnp.clip(g.start, 0, s - size)  # [B, K, n] a block past the end is read from s - size
    slots = start[..., None] + jnp.arange(size)  # [B, K, n, size]
    ok = g.ok[..., None] & (slots >= g.start[..., None])  # [B, K, n, size]: only the block's own slots
    b, k, n = start.shape
    slots, ok = slots.reshape(b, k, n * size), ok.reshape(b, k, n * size)  # [B, K, M]
    k_, v_ = offload.fetch((view.k, view.v), start, size)  # [B, K, M, D] each

    def per_slot(x, fill=None):  # [B, Kp, S(+T)] -> [B, K, M(+T)]: the gathered slots, then the appended ones
        got = take_slots(x[..., :s], slots)
        if fill is not None:
            got = jnp.where(ok, got, fill)
        if view.append is None:
            return got
        new = x[..., s:]
        return jnp.concatenate([got, jnp.broadcast_to(new, new.shape[:1] + got.shape[1:2] + new.shape[2:])], axis=-1)

    rp = view.rope
    rope = type(rp)(q=rp.q, k=per_slot(rp.k), seg=None if rp.seg is None else per_slot(rp.seg))
    mask = None if view.mask is None else per_slot(view.mask[:, :, 0])[:, :, None]  # [B, K, 1, M(+T)]
    bias = None if view.bias is None else per_slot(view.bias)  # [B, K, M(+T)]
    return View(k=k_, v=v_, pos=per_slot(view.pos, -1), rope=rope, mask=mask, bias=bias, carry=view.carry,
                append=view.append, basis=view.basis)


def slotwise(g: Gather, s: int) -> Gather:
    """The same read as blocks of one slot (slots past the view's end not read)."""
    slots = g.start[..., None] + jnp.arange(g.size)  # [B, K, n, size]
    ok = g.ok[..., None] & (slots < s)
    b, k, n, size = slots.shape
    return Gather(jnp.minimum(slots, s - 1).reshape(b, k, n * size), ok.reshape(b, k, n * size), 1)
