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
from kvpolicies.slots import Pending, concat, encode_new, take_slots, view_of

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
    rank = jnp.argsort(order, axis=-1)  # rank of each slot
    return rank < n


def pack(slots: SlotState, kept: Bool[Array, "B Kp V"], s: int) -> SlotState:
    """The kept slots (at most s of them) in text order, then empty slots."""
    key = jnp.where(kept, slots.pos, LAST_KEY)  # [B, Kp, V]
    idx = jnp.argsort(key, axis=-1)[..., :s]  # [B, Kp, S]
    live = take_slots(kept, idx)  # [B, Kp, S]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(slots):
        x = getattr(slots, f.name)
        if f.name in ("k", "v"):
            out[f.name] = jax.tree.map(lambda y: take_slots(y, idx), x)
        else:  # positions and per-slot statistics: empty slots get -1 / 0
            out[f.name] = jnp.where(live, take_slots(x, idx), EMPTY if f.name == "pos" else 0.0).astype(x.dtype)
    return type(slots)(**out)
