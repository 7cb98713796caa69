"""`Scored`: the base of the score-based eviction policies (`h2o`, `tova`, `snapkv`).

Shapes: B batch, K kv heads, Kp = 1 (one token set per layer) or K (one per kv head),
S state slots, T new tokens, V = S + T view slots, D head dim.

A score-based policy keeps a fixed number of slots S. A step appends the T new tokens to the
S old slots (a view of V slots, every old slot visible to every new query), attention returns
the mass each slot received (`Seen.scores`), and `compact` keeps S of the V slots and packs
them back: kept tokens first, in text order, then empty slots (position -1). A policy that
only ranks slots writes `priority`; the top S by priority survive (ties keep the newer token).
A policy with its own compression schedule overrides `keep` instead (snapkv).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import EMPTY, Policy, SlotState, empty_slots
from kvpolicies.slots import Pending, concat, encode_new, inverse_order, take_slots, view_of

LAST_KEY = jnp.iinfo(jnp.int32).max  # sort key that puts a slot after every kept one


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accumulated(SlotState):
    """Slots plus a per-slot statistic accumulated over steps.

    mass: [B, K, S] float32 (h2o: attention received so far; snapkv: observation mass).
    """

    mass: Float[Array, "B K S"]


@dataclasses.dataclass(frozen=True)
class Scored(Policy):
    """Append the step's tokens, then keep the S slots `keep` chooses (by default: top priority)."""

    observes = ("scores",)
    accumulates: ClassVar[bool] = False  # the state carries `mass` (Accumulated)

    def kp(self, kv_heads: int) -> int:
        """Token sets per layer: one per kv head (default) or 1."""
        return kv_heads

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), self.kp(kv_heads))
        if not self.accumulates:
            return st
        return Accumulated(st.k, st.v, st.pos, mass=jnp.zeros((batch, kv_heads, st.slots), jnp.float32))

    def _new(self, state: SlotState, k, v, pos) -> SlotState:
        new = encode_new(self.codec, k, v, pos)
        if not self.accumulates:
            return new
        return Accumulated(new.k, new.v, new.pos, mass=jnp.zeros(k.shape[:3], jnp.float32))  # [B, K, T]

    def extend(self, state, k, v, pos):
        new = self._new(state, k, v, pos)
        return view_of(self.codec, concat(state, new), pos, k.dtype, carry=Pending(state, new))

    def compact(self, view, seen):
        if seen.scores is None:
            raise ValueError(f"{type(self).__name__}.compact needs the attention scores (observes={self.observes})")
        old, new = view.carry
        slots = concat(old, new)  # [B, ., V, ...]
        kept, slots = self.keep(slots, seen.scores, old.slots)
        return pack(slots, kept, old.slots)

    def keep(self, slots: SlotState, scores: Float[Array, "B K T V"], s: int) -> tuple[Bool[Array, "B Kp V"], SlotState]:
        """Which view slots survive (at most s), and the slots with their statistics updated."""
        prio, slots = self.priority(slots, scores)
        return top_mask(prio, slots.pos, s) & (slots.pos >= 0), slots

    def priority(self, slots: SlotState, scores: Float[Array, "B K T V"]) -> tuple[Float[Array, "B Kp V"], SlotState]:
        """The front door of a scorer: write this and inherit the rest (as a kvpress press writes
        `score()`). `slots` are the view's V = S + T slots (old ones, then the step's new tokens,
        `pos` -1 where empty; with `accumulates`, their `mass`), `scores` the attention each
        received from each of the step's queries, summed over each kv head's G query heads.
        Returns the priority of every slot (higher is kept; -inf never, e.g. empty slots; `inf`
        always, e.g. a recent window) and the slots with their statistics updated (h2o adds the
        step's attention to `mass`). The top S survive, ties keeping the newer token (`top_mask`),
        packed in text order (`pack`); h2o and tova are one `priority` each."""
        raise NotImplementedError


def newest(pos: Int[Array, "B Kp V"], n: int) -> Bool[Array, "B Kp V"]:
    """The n newest tokens of the view (the last new token has the largest position)."""
    last = pos[:, :, -1:]  # [B, Kp, 1]
    return (pos >= 0) & (pos > last - n)


def top_mask(prio: Float[Array, "*b V"], tie: Array, n: int) -> Bool[Array, "*b V"]:
    """True for the n slots with the largest `prio`, ties broken by the larger `tie`."""
    order = jnp.lexsort((-tie, -prio), axis=-1)  # best first
    rank = inverse_order(order)  # rank of each slot
    return rank < n


def pack(slots: SlotState, kept: Bool[Array, "B Kp V"], s: int, in_order: bool = False) -> SlotState:
    """The kept slots (at most s of them) in text order, then empty slots. `in_order`: the slots'
    positions already increase with the slot index (a prompt state's), so by counts (`compaction`),
    the same indices without a sort."""
    if in_order:
        idx = compaction(jnp.broadcast_to(kept, jnp.broadcast_shapes(kept.shape, slots.pos.shape)), s)
    else:
        idx = stable_order((jnp.where(kept, slots.pos, LAST_KEY),), s)  # [B, Kp, S]
    live = take_slots(kept, idx)  # [B, Kp, S]
    return _take(slots, idx, live)


def _take(slots: SlotState, idx: Int[Array, "B Kp S"], live: Bool[Array, "B Kp S"]) -> SlotState:
    """Slot `idx` of every field (positions -1 and statistics 0 where not `live`)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(slots):
        x = getattr(slots, f.name)
        if f.name in ("k", "v"):
            out[f.name] = jax.tree.map(lambda y: take_slots(y, idx), x)
        else:  # positions and per-slot statistics: empty slots get -1 / 0
            out[f.name] = jnp.where(live, take_slots(x, idx), EMPTY if f.name == "pos" else 0.0).astype(x.dtype)
    return type(slots)(**out)


def append_packed(slots: SlotState, s: int) -> SlotState:
    """`pack(slots, slots.pos >= 0, s)` when nothing is evicted, without sorting: the view is s packed
    slots (filled ones first, in text order) and t = V - s new tokens after them (all filled), c + t
    <= s with c old filled slots. Slot j takes old slot j (j < c), new token j - c (c <= j < c + t),
    else old slot j - t (empty: position -1, statistics 0), the indices `pack` computes by a sort:
    the same values at the same indices in every field."""
    t = slots.pos.shape[2] - s
    c = (slots.pos[:, :, :s] >= 0).sum(axis=-1, dtype=jnp.int32)[..., None]  # [B, Kp, 1]
    j = jnp.arange(s, dtype=jnp.int32)  # [S]
    idx = jnp.where(j < c, j, jnp.where(j < c + t, s + j - c, j - t))  # [B, Kp, S]
    live = j < c + t
    return _take(slots, idx, live)


# A step appends at most this many tokens to packed slots for `stable_order` to try a merge first
MERGE_NEW = 8


def stable_order(keys: tuple[Int[Array, "B Kp V"], ...], s: int) -> Int[Array, "B Kp S"]:
    """The first s indices of the stable sort of the V slots by `keys` (lexicographic, the first
    key most significant): `jnp.lexsort(keys[::-1])[..., :s]`. When the view is s packed slots
    and up to MERGE_NEW new ones (a decode step: `pack`, `pack_by_head`), both parts usually
    already in order (the kept old slots packed in order, as the last step left them, then
    empty slots; the new tokens in order), that sort is a merge of the two, computed from
    counts in O(s x T) comparisons instead of sorting every slot at every token: the same
    indices, tested against the sort. (Not for slots known to be in order already: `compaction`.)"""
    v = keys[0].shape[-1]
    full = lambda: jnp.lexsort(keys[::-1], axis=-1)[..., :s].astype(jnp.int32)  # noqa: E731
    if not 0 < v - s <= MERGE_NEW:
        return full()
    old = tuple(k[..., :s] for k in keys)  # [B, Kp, S]
    new = tuple(k[..., s:] for k in keys)  # [B, Kp, T]
    ordered = ~_lex_lt(tuple(k[..., 1:] for k in old), tuple(k[..., :-1] for k in old)).any()
    ordered &= ~_lex_lt(tuple(k[..., 1:] for k in new), tuple(k[..., :-1] for k in new)).any()
    return jax.lax.cond(ordered, lambda: _merge(old, new, s), full)


def compaction(live: Bool[Array, "B Kp V"], s: int) -> Int[Array, "B Kp S"]:
    """The first s of: the `live` slots in slot order, then the others in slot order, by counts. It
    is `stable_order((jnp.where(live, key, LAST_KEY),), s)` for any key that does not decrease
    along the live slots: a prompt state's positions (slot i holds position i), so packing what a
    prompt compressor keeps, or ordering its candidates by position, needs no sort (the sort of
    2K slots per head and layer was half of a SmolLM2 compression on XLA:CPU)."""
    n = live.sum(axis=-1, keepdims=True, dtype=jnp.int32)
    at = jnp.where(live, jnp.cumsum(live, axis=-1, dtype=jnp.int32) - 1,
                   n + jnp.cumsum(~live, axis=-1, dtype=jnp.int32) - 1)  # [B, Kp, V]: each slot's place
    return inverse_order(at)[..., :s]


def _lex_lt(a: tuple[Array, ...], b: tuple[Array, ...]) -> Array:
    """a < b lexicographically, elementwise (the first key most significant)."""
    lt = a[-1] < b[-1]
    for x, y in zip(a[-2::-1], b[-2::-1]):
        lt = (x < y) | ((x == y) & lt)
    return lt


def _merge(old: tuple[Array, ...], new: tuple[Array, ...], s: int) -> Int[Array, "B Kp S"]:
    """The stable order of two sorted runs (old first: ties keep old before new): old slot i goes
    to i + #(new < it), new slot j to j + #(old <= it); the first s of that permutation."""
    before = _lex_lt(tuple(k[..., None, :] for k in new), tuple(k[..., :, None] for k in old))  # [B, Kp, S, T]
    t = before.shape[-1]
    at_old = jnp.arange(s) + before.sum(axis=-1)  # [B, Kp, S]
    at_new = jnp.arange(t) + (~before).sum(axis=-2)  # [B, Kp, T]
    at = jnp.concatenate([at_old, at_new], axis=-1).astype(jnp.int32)  # [B, Kp, V]: a permutation
    b, kp = at.shape[:2]
    order = jnp.zeros(at.shape, jnp.int32).at[jnp.arange(b)[:, None, None], jnp.arange(kp)[None, :, None], at].set(
        jnp.broadcast_to(jnp.arange(s + t, dtype=jnp.int32), at.shape), unique_indices=True)
    return order[..., :s]
