"""The cache-policy protocol, the slot state every policy stores, and slot helpers.

Shapes (one legend for the whole library):
    B batch, T new tokens in this step, S cache slots (or view slots), K kv heads,
    Kp = 1 or K (slot positions shared by all kv heads, or per head), G query heads per kv
    head, D head dim, P RoPE segments (see `RopePositions`).

Every slot records the absolute token position it holds (-1 = empty). Keys are stored
*before* RoPE, so a policy may choose which positions RoPE sees (`RopePositions`).

One step of attention through a policy is
    view  = policy.extend(state, k, v, pos)   # what attention reads: old slots + new tokens
    out, scores = attention(q, view, ...)       # masks from view.pos, policy.visible()
    state = policy.compact(view, scores)        # back to the fixed capacity
and prefill is the same step with T > 1. A policy's hyperparameters live on a frozen dataclass
(hashable, static under jit); its state is a pytree of arrays with a fixed capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.codecs import Codec, Identity

EMPTY = -1  # position of an empty slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """A policy's cache for one layer: encoded keys/values, slot positions, extra arrays.

    k, v: codec-encoded pytrees whose leaves all have layout [B, K, S, ...].
    pos:  [B, Kp, S] int32 absolute positions, -1 for empty slots.
    aux:  policy-specific arrays (e.g. accumulated attention mass), leaves [B, K|Kp, S, ...].
    n_new: static; in a view, how many trailing slots are new tokens not yet folded into the
          fixed-capacity state (0 in a state, and in a view written in place).
    """

    k: Any
    v: Any
    pos: Int[Array, "B Kp S"]
    aux: dict[str, Array] = dataclasses.field(default_factory=dict)
    n_new: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def slots(self) -> int:
        return self.pos.shape[-1]


class RopePositions(NamedTuple):
    """Which positions RoPE sees for queries and keys.

    q:   [B, T, P] query positions, one per segment.
    k:   [B, Kp, S] key positions (int, or float e.g. for a summary at its tokens' mean position).
    seg: [B, Kp, S] int segment of each key (which query position to pair it with),
         or None when P == 1.
    The score of query t with key s uses RoPE(q[t, seg[s]]) . RoPE(k[s]).
    """

    q: Int[Array, "B T P"]
    k: Int[Array, "B Kp S"]
    seg: Int[Array, "B Kp S"] | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class: the protocol every cache policy implements.

    Subclasses are frozen dataclasses with a `codec` field. `needs_scores` policies receive
    per-slot attention mass in `compact`.
    """

    needs_scores: ClassVar[bool] = False
    # The field a token budget sets (kvpolicies.budgets), None for policies without a budget.
    budget_field: ClassVar[str | None] = None
    # field -> run-level config key it follows in `python -m evals.run` (e.g. h2o's heavy <- budget);
    # every other field takes its dataclass default, and `codec` always follows the run's codec.
    run_keys: ClassVar[dict[str, str]] = {}
    codec: Codec = Identity()

    # -- sizes ---------------------------------------------------------------------------
    def capacity(self, max_len: int) -> int:
        """Number of slots the state holds for sequences of up to `max_len` tokens."""
        raise NotImplementedError

    def init(self, batch: int, kv_heads: int, head_dim: int, dtype: Any, max_len: int) -> SlotState:
        """An empty state (all positions -1)."""
        s = self.capacity(max_len)
        shape = (batch, kv_heads, s, head_dim)  # [B, K, S, D]
        return SlotState(
            k=self.codec.init(shape, dtype),
            v=self.codec.init(shape, dtype),
            pos=jnp.full((batch, 1, s), EMPTY, jnp.int32),
        )

    # -- one step ------------------------------------------------------------------------
    def extend(
        self,
        state: SlotState,
        k: Float[Array, "B K T D"],
        v: Float[Array, "B K T D"],
        pos: Int[Array, "B T"],
    ) -> SlotState:
        """The view attention reads: the old slots and the T new (un-rotated) tokens."""
        raise NotImplementedError

    def decode_kv(self, view: SlotState, dtype: Any) -> tuple[Float[Array, "B K S D"], Float[Array, "B K S D"]]:
        """Keys and values of a view as arrays, decoded inside attention (not kept after the step)."""
        return self.codec.decode(view.k, dtype), self.codec.decode(view.v, dtype)

    def visible(self, q_pos: Int[Array, "B T"], k_pos: Int[Array, "B Kp S"]) -> Bool[Array, "B Kp T S"]:
        """The policy's own visibility rule (causality and empty slots are handled by attention)."""
        return jnp.ones(q_pos.shape[:1] + k_pos.shape[1:2] + q_pos.shape[1:] + k_pos.shape[2:], bool)

    def rope_positions(self, q_pos: Int[Array, "B T"], k_pos: Int[Array, "B Kp S"]) -> RopePositions:
        """Positions RoPE sees; by default the tokens' positions in the text."""
        return RopePositions(q=q_pos[..., None], k=k_pos)

    def logit_bias(self, view: SlotState) -> Float[Array, "B Kp S"] | None:
        """Added to every query's logit for a slot (e.g. log(count) of a summary slot)."""
        return None

    def view_rope_positions(self, q_pos: Int[Array, "B T"], view: SlotState) -> RopePositions:
        """RoPE positions when they depend on more than slot positions (e.g. a summary slot's
        token count); by default `rope_positions(q_pos, view.pos)`. Key positions may be float."""
        return self.rope_positions(q_pos, view.pos)

    def select(
        self,
        view: SlotState,
        q_pos: Int[Array, "B T"],
        q_rot: Float[Array, "B K G T D"],
        k_rot: Float[Array, "B K S D"],
    ) -> tuple[SlotState, Bool[Array, "B K|Kp G|1 T S"] | None]:
        """Query-dependent selection, called by attention after RoPE: the view (possibly with
        bookkeeping derived from the rotated keys, e.g. Quest's page bounds) and a mask of the
        slots each query may read (None: no restriction beyond `visible`)."""
        return view, None

    def compact(self, view: SlotState, scores: Float[Array, "B K T S"] | None = None) -> SlotState:
        """Reduce a view back to the fixed capacity (scores: attention mass summed over G)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
# Slot helpers. Encoded k/v leaves have layout [B, K, S, ...]; pos has [B, Kp, S].
# ---------------------------------------------------------------------------------------


def encode_new(codec: Codec, k: Array, v: Array, pos: Int[Array, "B T"]) -> SlotState:
    """The T new tokens as a state of T slots."""
    return SlotState(k=codec.encode(k), v=codec.encode(v), pos=pos[:, None, :].astype(jnp.int32))


def broadcast_pos(pos: Int[Array, "B Kp S"], kp: int) -> Int[Array, "B Kp S"]:
    return jnp.broadcast_to(pos, (pos.shape[0], kp, pos.shape[2]))


def concat(a: SlotState, b: SlotState) -> SlotState:
    """Slots of `a` followed by the new slots `b` (aux is dropped; policies re-derive it)."""
    kp = max(a.pos.shape[1], b.pos.shape[1])
    cat = lambda x, y: jnp.concatenate([x, y.astype(x.dtype)], axis=2)  # noqa: E731  [B, K, Sa+Sb, ...]
    return SlotState(
        k=jax.tree.map(cat, a.k, b.k),
        v=jax.tree.map(cat, a.v, b.v),
        pos=cat(broadcast_pos(a.pos, kp), broadcast_pos(b.pos, kp)),
        n_new=b.slots,
    )


def write_at(state: SlotState, new: SlotState, start: Int[Array, "B"]) -> SlotState:
    """Write `new`'s slots contiguously at slot `start[b]` (in place under donation)."""

    def upd(buf, x):  # buf [B, K, S, ...], x [B, K, T, ...]
        return jax.vmap(lambda b, y, i: jax.lax.dynamic_update_slice_in_dim(b, y.astype(b.dtype), i, axis=1))(
            buf, x, start
        )

    return dataclasses.replace(
        state,
        k=jax.tree.map(upd, state.k, new.k),
        v=jax.tree.map(upd, state.v, new.v),
        pos=upd(state.pos, broadcast_pos(new.pos, state.pos.shape[1])),
    )


def scatter(state: SlotState, new: SlotState, slots: Int[Array, "B T"]) -> SlotState:
    """Write new slot t to slot `slots[b, t]`; out-of-range indices are dropped.

    Indices must be distinct among kept tokens (XLA leaves the order of duplicates unspecified).
    """

    def upd(buf, x):  # buf [B, K, S, ...], x [B, K, T, ...]
        return jax.vmap(lambda b, y, i: b.at[:, i].set(y.astype(b.dtype), mode="drop"))(buf, x, slots)

    return dataclasses.replace(
        state,
        k=jax.tree.map(upd, state.k, new.k),
        v=jax.tree.map(upd, state.v, new.v),
        pos=upd(state.pos, broadcast_pos(new.pos, state.pos.shape[1])),
    )


def take_slots(x: Array, idx: Int[Array, "B Ki S2"]) -> Array:
    """x [B, H, S, ...] -> [B, max(H, Ki), S2, ...]: per-head slot selection (H or Ki may be 1)."""
    h = max(x.shape[1], idx.shape[1])
    x = jnp.broadcast_to(x, (x.shape[0], h) + x.shape[2:])
    idx = jnp.broadcast_to(idx, (idx.shape[0], h, idx.shape[2]))
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)


def check_int(owner: str, name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raise ValueError naming the field, its value and the allowed range."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{owner}.{name}={value!r}: must be an int {rng}")


def check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r}: must be one of {choices}")


# Ring buffers (window, sink): new tokens go to slot `slot_of(pos)`; a slot is overwritten only
# by a token at least `window` positions later, when the old one is no longer visible to it.


def ring_extend(state: SlotState, new: SlotState, slots: Int[Array, "B T"]) -> SlotState:
    """Decode (T == 1) writes in place; a chunk is appended so its early queries still see the
    slots its later tokens will overwrite."""
    if new.slots == 1:
        return scatter(state, new, slots)
    return concat(state, new)


def split_view(view: SlotState) -> tuple[SlotState, SlotState]:
    """(old slots, new slots) of a view built by `concat`."""
    cap = view.slots - view.n_new
    old = jax.tree.map(lambda x: x[:, :, :cap], dataclasses.replace(view, n_new=0))  # [B, K, cap, ...]
    new = jax.tree.map(lambda x: x[:, :, cap:], dataclasses.replace(view, n_new=0))  # [B, K, T, ...]
    return old, new


def ring_compact(view: SlotState, slot_of, keep_of) -> SlotState:
    """Fold the appended chunk of a ring view back into the ring (only surviving tokens).

    slot_of(pos [B, T], capacity) -> slots; keep_of(pos [B, T]) -> bool, True for the tokens
    that are the last writer of their slot.
    """
    if view.n_new == 0:
        return view
    old, new = split_view(view)
    pos = new.pos[:, 0]  # [B, T]
    slots = jnp.where(keep_of(pos), slot_of(pos, old.slots), old.slots)  # out of range = dropped
    return scatter(old, new, slots)
