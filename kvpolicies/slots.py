"""Slot helpers: what a policy builds its steps from (writes, views, selections), and the
prefix-slot layout the engine can bucket (`PrefixSlots`).

Shapes: B batch, T new tokens, S slots, K kv heads, Kp = 1 or K position rows, H = K or Kp (a
field's head axis), D head dim. Encoded k/v leaves have layout [B, K, S, ...]; pos has
[B, Kp, S]; any extra field of a state is per slot, [B, K|Kp, S, ...].
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from kvpolicies.base import Appended, Deferred, EMPTY, RopePositions, SlotState, View
from kvpolicies.codecs import Codec


def encode_new(codec: Codec, k: Array, v: Array, pos: Int[Array, "B T"]) -> SlotState:
    """The T new tokens as a state of T slots."""
    return SlotState(k=codec.encode(k), v=codec.encode(v), pos=pos[:, None, :].astype(jnp.int32))


def view_of(codec: Codec, slots: SlotState, pos: Int[Array, "B T"], dtype: Any, carry: Any, **kw) -> View:
    """A view of `slots` decoded to `dtype`; RoPE at text positions unless `rope` is given."""
    kw.setdefault("rope", RopePositions(q=pos[..., None], k=slots.pos))
    k, v = _decoded(codec, slots, dtype)
    return View(k=k, v=v, pos=slots.pos, carry=carry, basis=codec if codec.basis else None, **kw)


def _decoded(codec: Codec, slots: SlotState, dtype: Any) -> tuple[Array, Array]:
    """Keys and values decoded for attention (`View.basis`): values in the codec's basis where it
    has one, keys too when it encodes after RoPE (keys before RoPE must be rotated by RoPE first).
    A codec without a basis is called as `decode(enc, dtype)`, as codecs written before it were."""
    if not codec.basis:
        return codec.decode(slots.k, dtype), codec.decode(slots.v, dtype)
    return codec.decode(slots.k, dtype, in_basis=codec.after_rope), codec.decode(slots.v, dtype, in_basis=True)


def _map_fields(fn, *states: SlotState) -> SlotState:
    """Apply fn(field name, *leaves) to every field of the states (k and v leaf by leaf)."""
    out = {}
    for f in dataclasses.fields(states[0]):
        xs = [getattr(s, f.name) for s in states]
        if f.name in ("k", "v"):
            out[f.name] = jax.tree.map(lambda *ys: fn(f.name, *ys), *xs)
        else:
            out[f.name] = fn(f.name, *xs)
    return type(states[0])(**out)


def head_slots(state: SlotState, n: int, lead: int = 0) -> SlotState:
    """The first n slots of every field (`lead` leading axes before B, e.g. a model's layers)."""
    return _map_fields(lambda name, x: jax.lax.slice_in_dim(x, 0, n, axis=lead + 2), state)


def put_head(state: SlotState, head: SlotState, lead: int = 0) -> SlotState:
    """`state` with its first slots replaced by `head`'s (the inverse of `head_slots`; in place
    under donation)."""
    return _map_fields(lambda name, buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), 0,
                                                                                  axis=lead + 2), state, head)


def concat(a: SlotState, b: SlotState) -> SlotState:
    """Slots of `a` followed by those of `b` (same state class), along the slot axis."""

    def cat(name, x, y):  # [B, H, Sa, ...], [B, H', Sb, ...] -> [B, max(H, H'), Sa + Sb, ...]
        h = max(x.shape[1], y.shape[1])
        x = jnp.broadcast_to(x, x.shape[:1] + (h,) + x.shape[2:])
        y = jnp.broadcast_to(y, y.shape[:1] + (h,) + y.shape[2:])
        return jnp.concatenate([x, y.astype(x.dtype)], axis=2)

    return _map_fields(cat, a, b)


def write_rows(buf: Array, x: Array, start: Int[Array, "*L B"] | Int[Array, "*L B H"], lead: int = 0) -> Array:
    """buf [*lead, B, H, S, ...] with x [*lead, B, H', T, ...] written at index start[b] of axis
    lead + 2 of row b (in place under donation). start [B]: one start per row for every leading
    index (one dynamic_update_slice per row, B static); [*lead, B]: each leading index its own (a
    model's layers of different counts); [*lead, B, H'']: each head too (H'' 1 or H); those two
    as one scatter (a vmapped dynamic_update_slice)."""
    x = jnp.broadcast_to(x, x.shape[:lead + 1] + buf.shape[lead + 1:lead + 2] + x.shape[lead + 2:])
    x = x.astype(buf.dtype)
    if start.ndim > 1:  # a start per leading index and row (and head): one scatter
        axes = lead + 1 if start.ndim == lead + 1 else lead + 2
        if axes == lead + 2:
            start = jnp.broadcast_to(start, start.shape[:-1] + buf.shape[lead + 1:lead + 2])
        put = lambda b, r, at: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            b, r, at.astype(jnp.int32), axis=lead + 2 - axes)
        for _ in range(axes):
            put = jax.vmap(put)
        return put(buf, x, start)
    zero = jnp.zeros((), jnp.int32)
    for b in range(buf.shape[lead]):
        row = x[(slice(None),) * lead + (slice(b, b + 1),)]
        idx = (zero,) * lead + (jnp.int32(b), zero, start[b].astype(jnp.int32)) + (zero,) * (buf.ndim - lead - 3)
        buf = jax.lax.dynamic_update_slice(buf, row, idx)
    return buf


def write_at(state: SlotState, new: SlotState, start: Int[Array, "*L B"] | Int[Array, "*L B H"],
             lead: int = 0) -> SlotState:
    """Write `new`'s slots contiguously at slot `start[b]` (in place under donation). `lead`:
    leading axes both states have before B (a model's stacked layers), written alike."""
    return _map_fields(lambda name, buf, x: write_rows(buf, x, start, lead), state, new)



def write_deferred(state: SlotState, writes: Deferred, lead: int = 0) -> SlotState:
    """Apply `Deferred` writes; `lead` leading axes (e.g. stacked layers): the slots are written at
    each layer's own start (a prompt scorer's layers may hold different counts), the other fields
    at the first layer's (Quest's: the layers of a run see the same positions)."""
    row = (0,) * lead
    names = [f.name for f in dataclasses.fields(writes.slots)]
    part = write_at(type(writes.slots)(**{n: getattr(state, n) for n in names}), writes.slots, writes.start, lead)
    out = {n: getattr(part, n) for n in names}
    for name, (block, first) in (writes.fields or {}).items():
        out[name] = write_rows(getattr(state, name), block, first[row], lead)
    return dataclasses.replace(state, **out)


def append_view(codec: Codec, state: SlotState, new: SlotState, pos: Int[Array, "B T"], dtype: Any, carry: Any,
                start: Int[Array, "B"] | Int[Array, "B Kp"] | None = None, **kw) -> View:
    """A view of `state`'s stored slots followed by the T `new` ones (`View.append`): positions,
    RoPE, masks then cover S + T slots, while the stored keys/values are read in place. With
    `start` (compact writes the new slots there and does nothing else; [B], or [B, Kp]: per
    position row), the stored slots [start, start + T) are read as empty: the new tokens replace
    them in this very step."""
    spos = state.pos  # [B, Kp, S]
    if start is not None:
        s = jnp.arange(spos.shape[-1])
        at = (start if start.ndim == 2 else start[:, None])[..., None]  # [B, Kp|1, 1]
        spos = jnp.where((s >= at) & (s < at + new.slots), EMPTY, spos)  # [B, Kp, S]
    npos = jnp.broadcast_to(new.pos, new.pos.shape[:1] + spos.shape[1:2] + new.pos.shape[2:])  # [B, Kp, T]
    allpos = jnp.concatenate([spos, npos.astype(spos.dtype)], axis=-1)  # [B, Kp, S + T]
    kw.setdefault("rope", RopePositions(q=pos[..., None], k=allpos))
    app = Appended(*_decoded(codec, new, dtype), new, start)
    k, v = _decoded(codec, state, dtype)
    return View(k=k, v=v, pos=allpos, carry=carry, append=app, basis=codec if codec.basis else None, **kw)


def scatter(state: SlotState, new: SlotState, slots: Int[Array, "B T"]) -> SlotState:
    """Write new slot t to slot `slots[b, t]`; out-of-range indices are dropped.

    Indices must be distinct among kept tokens (XLA leaves the order of duplicates unspecified).
    """

    def upd(name, buf, x):  # buf [B, H, S, ...], x [B, H', T, ...]
        x = jnp.broadcast_to(x, x.shape[:1] + buf.shape[1:2] + x.shape[2:])
        return jax.vmap(lambda b, y, i: b.at[:, i].set(y.astype(b.dtype), mode="drop"))(buf, x, slots)

    return _map_fields(upd, state, new)


def inverse_order(order: Int[Array, "*b V"]) -> Int[Array, "*b V"]:
    """The place of each index in `order`, a permutation along the last axis: `argsort(order)`,
    the same integers by one scatter instead of a sort (about 30x faster on CPU at 2K slots)."""
    at = jnp.broadcast_to(jnp.arange(order.shape[-1], dtype=order.dtype), order.shape)
    return jnp.put_along_axis(jnp.zeros_like(order), order, at, axis=-1, inplace=False)


def take_slots(x: Array, idx: Int[Array, "B Ki S2"]) -> Array:
    """x [B, H, S, ...] -> [B, max(H, Ki), S2, ...]: per-head slot selection (H or Ki may be 1)."""
    h = max(x.shape[1], idx.shape[1])
    x = jnp.broadcast_to(x, (x.shape[0], h) + x.shape[2:])
    idx = jnp.broadcast_to(idx, (idx.shape[0], h, idx.shape[2]))
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)


class Pending(NamedTuple):
    """The carry of an appending step: the stored slots and the step's new slots (None when
    the new tokens were already written in place)."""

    old: SlotState
    new: SlotState | None


class Spare(NamedTuple):
    """The carry of a step written into a spare slot (`SpareSlot`): the buffer attention read (the
    stored slots, then the new token in the spare last slot) and the slot `at` [B, Kp] where the
    token is kept (its keys and values are already there, read as empty by this step)."""

    buf: SlotState
    at: Int[Array, "B Kp"]


def pad_slot(state: SlotState, lead: int = 0) -> SlotState:
    """`state` with one empty slot after its last (position -1, every other field 0) in every
    field (`lead` leading axes before B)."""
    def pad(name, x):  # [*lead, B, H, S, ...] -> [*lead, B, H, S + 1, ...]
        width = [(0, 0)] * x.ndim
        width[lead + 2] = (0, 1)
        return jnp.pad(x, width, constant_values=EMPTY if name == "pos" else 0)

    return _map_fields(pad, state)


def _heads(at: Int[Array, "B Kp"], x: Array) -> tuple[Array, Array, Array]:
    """Scatter indices (batch, head, slot) [B, H] writing one slot per (row, head) of x [B, H, ...]."""
    b, h = x.shape[:2]
    return jnp.arange(b)[:, None], jnp.arange(h)[None, :], jnp.broadcast_to(at, (b, h))


def write_spare(state: SlotState, new: SlotState, at: Int[Array, "B Kp"]) -> SlotState:
    """A buffer of S + 1 slots (the last one spare and empty) with one new token written into the
    spare slot, in every field: the slots `concat(stored S, new)` holds, in place under donation.
    Its keys and values also go to slot `at` (where it is kept: an empty slot, read as empty by this
    step's view), so that after attention has read the buffer nothing of it is written but
    positions and per-slot statistics (`move_spare`)."""
    s = state.pos.shape[2] - 1

    def put(name, buf, x):  # buf [B, H, S + 1, ...], x [B, H', 1, ...]
        x = jnp.broadcast_to(x, x.shape[:1] + buf.shape[1:2] + x.shape[2:]).astype(buf.dtype)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, x, s, axis=2)
        if name in ("k", "v"):
            buf = buf.at[_heads(at, buf)].set(x[:, :, 0])
        return buf

    return _map_fields(put, state, new)


def move_spare(buf: SlotState, at: Int[Array, "B Kp"]) -> SlotState:
    """The buffer of `write_spare` after the step: slot `at` takes the spare slot's position and
    statistics (its keys and values are there already), and the spare slot is empty again."""
    s = buf.pos.shape[2] - 1
    j = jnp.arange(s + 1)

    def move(name, x):  # [B, H, S + 1, ...]
        if name in ("k", "v"):
            return x
        shape = x.shape[:3] + (1,) * (x.ndim - 3)
        target = jnp.broadcast_to(at, x.shape[:2])[:, :, None] == j  # [B, H, S + 1]
        last = jax.lax.slice_in_dim(x, s, s + 1, axis=2)  # [B, H, 1, ...]
        out = jnp.where(target.reshape(shape), last, x)
        return jnp.where((j == s).reshape((1, 1, s + 1) + (1,) * (x.ndim - 3)),
                         jnp.asarray(EMPTY if name == "pos" else 0, x.dtype), out)

    return _map_fields(move, buf)


def flat(view: View) -> View:
    """`view` with its appended tokens moved into k, v (a copy of every slot): for a policy that
    composes other policies' views (duo) and needs one slot axis."""
    if view.append is None:
        return view
    return dataclasses.replace(view, k=jnp.concatenate([view.k, view.append.k], axis=2),
                               v=jnp.concatenate([view.v, view.append.v], axis=2), append=None)



# -- length buckets: the prefix-slot layout -------------------------------------------------------
class PrefixSlots:
    """Capability: slot i holds token i (or is empty), and no field depends on the number of slots:
    a step whose positions are all below n reads and writes only slots [0, n), and equals the same
    step over the state cut to its first n slots (`head`). The engine then hands the step only those
    slots (length buckets, `models.engine.reach_of`): its cost follows the filled length, not
    max_len (full, a prompt phase). A state whose fields do not all have their slot axis at axis 2
    overrides `head` and `with_head`."""

    def head(self, state: SlotState, n: int, lead: int = 0) -> SlotState:
        """`state` cut to its first n slots (`lead` leading axes, e.g. a model's layers); every
        per-slot field, along its slot axis (by default axis 2 of every field)."""
        return head_slots(state, n, lead)

    def with_head(self, state: SlotState, head: SlotState, lead: int = 0) -> SlotState:
        """`state` with its first slots replaced by `head`'s (the inverse of `head`)."""
        return put_head(state, head, lead)


class QuietChunks:
    """Capability of a `per_token` policy (a decode-time evictor, whose chunks run as single-token
    steps): it can say that a chunk of t tokens would only append them, no token evicted and no
    statistic changed but by an observation that takes t queries at once, so that attention may
    take that chunk in one step, as a dense forward does, and reach the state the t steps would
    (outputs equal up to float rounding: keys summed in one piece). The prompt scorers and adakv
    have it: a question after their compression only appends."""

    def appends_quietly(self, state: Any, t: int) -> Any:
        """A traced bool: the t tokens only append to `state`; None: always token by token."""
        return None

    @property
    def appends_only(self) -> bool:
        """Static: every chunk `appends_quietly` answers for is known to only append (an engine
        refuses what would not: `Engine(slots=)`'s shape classes after their compression), so no
        token-by-token alternative is compiled (a chunk that would evict gets NaN outputs)."""
        return False


class SpareSlot:
    """Capability of a decode-time policy that packs its slots (filled first, then empty): a step
    of one token can write it in place. The state's buffer has one spare slot after the policy's S
    (`pad_spare`): the step writes the token there and into the first free slot
    (`write_spare`), attention reads the whole buffer, and the compaction moves only the token's
    position and statistics (`move_spare`). Attention then reads the same slots in the same order
    as the view [stored S, new token] it concatenates otherwise (the same floats), without that
    concatenation nor the packing copy after it. The engine decodes layer by layer through
    `spared()` on states padded by `pad_spare` (models.engine.layers); what a state stores is
    unchanged, its buffer holds one slot more during that decoding."""

    def spared(self) -> Any:
        """This policy on buffers with a spare slot, or None where it cannot take one."""
        return None

    @property
    def spare_slots(self) -> int:
        """1 for the policy `spared()` returns (its states carry the spare slot), else 0."""
        return 0

    def pad_spare(self, state: Any) -> Any:
        """A state of this policy with the spare slot added (one empty slot after the last)."""
        return pad_slot(state)

    def cut_spare(self, state: Any) -> Any:
        """The inverse of `pad_spare`: the state without its (empty) spare slot."""
        return head_slots(state, state.pos.shape[2] - 1)


def spare_slots(policy: Any) -> int:
    """How many spare slots the states of `policy` carry (`SpareSlot`; 0 for any other policy)."""
    return policy.spare_slots if isinstance(policy, SpareSlot) else 0


def spared(policy: Any) -> Any:
    """`policy` on buffers with a spare slot (`SpareSlot.spared`), or None."""
    return policy.spared() if isinstance(policy, SpareSlot) else None


def quiet_chunk(policy: Any, state: Any, t: int) -> tuple[Any, bool]:
    """(`appends_quietly(state, t)`, `appends_only`) of a `QuietChunks` policy; (None, False) for any
    other: its chunks run token by token."""
    if not isinstance(policy, QuietChunks):
        return None, False
    return policy.appends_quietly(state, t), policy.appends_only


def has_prefix_slots(policy: Any) -> bool:
    """Whether a step of `policy` at positions below n needs only the state's first n slots
    (`PrefixSlots`), so that the engine may hand it a length bucket."""
    return isinstance(policy, PrefixSlots)
