"""The cache-policy protocol: the stored state, the per-step view, and the slot helpers.

Shapes (one legend for the whole library):
    B batch, T new tokens in this step, S cache slots (or view slots), K kv heads,
    Kp = 1 or K (slot positions shared by all kv heads, or per head), G query heads per kv
    head, D head dim, P RoPE segments (see `RopePositions`).

Every slot records the absolute token position it holds (-1 = empty). Keys are stored
*before* RoPE, so a policy chooses which positions RoPE sees; a policy whose RoPE positions are
its slots' token positions, fixed once written, may declare `rotated_keys` instead (stored
rotated: a decode step then rotates one new key, not every slot's); with a codec, only if the
codec encodes keys after RoPE (`Codec.after_rope`, `keys_rotated`).

A policy author writes three methods (plus `capacity` and, if the state has more than slots,
`init`); `kvpolicies.attend` runs one step with them and asks the policy nothing else:

    view  = policy.extend(state, k, v, pos)     # View: everything attention reads, as data
    mask  = policy.select(view, q_rot, k_rot)   # query-dependent sparsity only (Quest); pure
    out, seen = attention(q, view, mask)        # causality from view.pos, RoPE from view.rope
    state = policy.compact(view, seen)          # back to the fixed capacity
    writes = policy.defer(view, seen)           # optional: compact's writes as data (Deferred),
                                                #   for a model to apply after its layer loop

Prefill is the same step with T > 1. A policy's hyperparameters live on a frozen dataclass
(hashable, static under jit); its state is a registered dataclass of arrays with a fixed
capacity (`SlotState`, or a subclass adding the policy's own typed arrays). Accounting is
declared on the protocol too: `decode_reads` (bytes one decode step reads), `budget_field`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.checks import check_choice, check_int  # noqa: F401  (re-exported for policy files)
from kvpolicies.codecs import Codec, Identity

EMPTY = -1  # position of an empty slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """A policy's stored cache for one layer: encoded keys/values and slot positions.

    k, v: codec-encoded pytrees whose leaves all have layout [B, K, S, ...].
    pos:  [B, Kp, S] int32 absolute positions, -1 for empty slots.
    A policy that stores more declares a subclass with typed fields; the slot helpers below
    treat every extra field as per-slot ([B, K|Kp, S, ...]) unless the policy says otherwise.
    """

    k: Any
    v: Any
    pos: Int[Array, "B Kp S"]

    @property
    def slots(self) -> int:
        return self.pos.shape[-1]

    # -- what the engine asks a state (one layer's, numpy leaves; or a run's, stacked) ------------
    def held(self, row: int, kv_heads: int, policy: Any) -> list[np.ndarray]:
        """The sorted positions this layer's state holds for batch row `row`, per kv head
        (`Engine.kept_positions`): Kp = 1 position rows are shared by the heads."""
        pos = np.asarray(self.pos[row])  # [Kp, S]
        sets = [held_sorted(p) for p in (pos[None] if pos.ndim == 1 else pos)]
        return sets * kv_heads if len(sets) == 1 else sets

    @staticmethod
    def join_rows(states: list) -> Any:
        """A run's states of single prompts (leaves [L, 1, ...]) as one batch (the engine's ragged
        generation): concatenated along the batch axis."""
        return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *states)


def held_sorted(pos: np.ndarray) -> np.ndarray:
    """The distinct filled positions of `pos`, sorted (int64)."""
    return np.unique(pos[pos >= 0]).astype(np.int64)


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


class Appended(NamedTuple):
    """A step's T new tokens, read by attention *after* the view's stored slots, so that the
    stored slots are read where they are, never copied into a bigger buffer first.

    k, v:  [B, K, T, D] the new tokens as attention reads them (encoded, then decoded).
    slots: the T new slots, encoded (a state of T slots).
    start: [B] the slot from which `compact` writes `slots`, contiguously, and all it does
           besides is what `Policy.defer` returns (e.g. Quest's page bounds): the new state is
           `write_deferred(old state, policy.defer(view, seen))`, so a model may defer those
           writes past its layer loop (`attend(..., defer=True)`); None when `compact` does
           more than that (a ring chunk folded by `ring_compact`, an eviction).
    """

    k: Float[Array, "B K T D"]
    v: Float[Array, "B K T D"]
    slots: "SlotState"
    start: Int[Array, "B"] | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class View:
    """What one attention step reads, as data (built by `extend`, consumed by `attend`).

    k, v:   [B, K, S, D] keys (un-rotated) and values, decoded to the step's dtype.
    pos:    [B, Kp, S'] slot positions; attention masks empty slots (< 0) and future ones.
    rope:   the positions RoPE sees (segments included).
    mask:   [B, Kp, T, S'] the policy's own visibility rule (None: every past slot is visible).
    bias:   [B, Kp, S'] added to every query's logit for a slot (None: no bias).
    carry:  private to the policy: whatever `compact` needs (stored slots, new tokens...).
    append: the step's new tokens, read after the S stored slots (None: k, v hold every slot).
            With it, pos / rope / mask / bias cover S' = S + T slots: the stored ones, then the
            new ones (`append_view` builds such a view).
    basis:  the codec whose orthonormal basis v (and k too, when the codec encodes after RoPE)
            is decoded in (`Codec.decode(..., in_basis=True)`): attention then rotates the
            queries (for keys) and its outputs (for values) instead of every slot. None: k and v
            are decoded in full (`view_of` and `append_view` set it for a codec with a `basis`).
    """

    k: Float[Array, "B K S D"]
    v: Float[Array, "B K S D"]
    pos: Int[Array, "B Kp S"]
    rope: RopePositions
    mask: Bool[Array, "B Kp T S"] | None = None
    bias: Float[Array, "B Kp S"] | None = None
    carry: Any = None
    append: Appended | None = None
    basis: Codec | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Seen:
    """What attention observed, for `compact` (a field is None unless the policy `observes` it).

    scores: [B, K, T, S] attention probabilities summed over the G query heads of a kv head (the
            last min(T, n) rows only, for a policy whose `score_rows` is n).
    k_rot:  [B, K, S, D] the view's keys after RoPE.
    q:      [B, K, G, T, D] the step's queries before RoPE (expected attention's statistics).
    rope:   the `Rope` attention applied (static; to rotate to positions the step does not hold).
    logits: [B, K, G, T, S] float32 scaled logits, masked slots at float32's lowest value
            (a softmax over another set of slots: kvzip's reconstruction scores).
    columns: [B, K, S] float32 attention probabilities summed over the G query heads and all T
            queries: the attention each slot received from the step (observed attention's
            column sums; a chunk attended in blocks computes them block by block too).
    """

    scores: Float[Array, "B K T S"] | None = None
    k_rot: Float[Array, "B K S D"] | None = None
    q: Float[Array, "B K G T D"] | None = None
    rope: Any = dataclasses.field(default=None, metadata=dict(static=True))
    logits: Float[Array, "B K G T S"] | None = None
    columns: Float[Array, "B K S"] | None = None


def keys_rotated(codec: Codec) -> bool:
    """`rotated_keys` of a policy that keeps its keys at their text positions and reads them only
    in attention: always without a codec (same numbers), and with a codec that encodes them after
    RoPE (`Codec.after_rope`; a codec before RoPE quantizes the un-rotated keys)."""
    return isinstance(codec, Identity) or codec.after_rope


def check_codec(policy: "Policy") -> None:
    """ValueError if the policy's codec encodes keys after RoPE but the policy stores them
    un-rotated (it re-indexes positions, scores or re-reads its stored keys)."""
    codec = getattr(policy, "codec", None)
    if codec is not None and codec.after_rope and not policy.rotated_keys:
        raise ValueError(f"{type(policy).__name__.lower()}.codec={codec.name} with after_rope=True: this policy "
                         "stores its keys un-rotated (it re-indexes their positions or reads them outside "
                         "attention); after_rope needs full, window, sink or duo")


def tree_nbytes(tree) -> int:
    """Bytes of all array leaves of a concrete or abstract (`jax.eval_shape`) pytree."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def meta_fields(state: SlotState) -> dict[str, Any]:
    """Everything a state stores besides its encoded keys and values (positions, bookkeeping)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in ("k", "v")}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class: the protocol every cache policy implements (see the module docstring).

    Subclasses are frozen dataclasses with a `codec` field; class attributes declare the rest.
    """

    # Which `Seen` fields `compact` needs ("scores", "k_rot", "q", "rope", "logits", "columns"); attention
    # computes only those.
    observes: ClassVar[tuple[str, ...]] = ()
    # A decode-time evictor: attention runs a chunk as T single-token steps (a scan inside the
    # compiled step), so eviction happens after every token and `chunk` never changes a result.
    per_token: ClassVar[bool] = False
    # The field a token budget sets (kvpolicies.budgets), None for policies without a budget.
    budget_field: ClassVar[str | None] = None
    # field -> run-level config key it follows in `python -m evals.run` (e.g. h2o's heavy <- budget);
    # every other field takes its dataclass default, and `codec` always follows the run's codec.
    run_keys: ClassVar[dict[str, str]] = {}
    # A sparse reader (Quest): at decode (T == 1) `attend` asks `select(view, q_rot, None)` before
    # rotating any key, and reads only the slots of the `kvpolicies.attend.Gather` it answers.
    gathers: ClassVar[bool] = False
    # A prompt compressor that scores the prompt with a second model pass (kvzip's context
    # reconstruction): the engine runs `reconstruction()` policies over its repeat inputs
    # between the prompt phase and `after_prompt`.
    reconstructs: ClassVar[bool] = False
    # Slot i holds token i (or is empty), and no field depends on the number of slots: a step
    # whose positions are all below n reads and writes only slots [0, n), and equals the same
    # step over the state cut to its first n slots (`head_slots`). The engine then hands the step
    # only those slots (length buckets, `models.engine.reach_of`): its cost follows the filled
    # length, not max_len (full).
    prefix_slots: ClassVar[bool] = False
    codec: Codec = Identity()

    @property
    def score_rows(self) -> int | None:
        """`compact` reads `Seen.scores` of only the step's last n queries (n = this, or T if fewer):
        attention then hands it those rows ([B, K, n, S]) and may attend a chunk in blocks (a
        prompt phase that keeps the rows of its newest W queries). None: every row."""
        return None

    @property
    def rotated_keys(self) -> bool:
        """Keys are stored already rotated (a speed choice, same results): `attend` rotates each new
        key once, at its token position, before `extend`, and reads stored and appended keys as they
        are. Only for a policy whose view gives every filled slot RoPE key position = its `pos`
        (text positions; RoPE segments may still rotate the queries differently, as `sink`'s cache
        mode does) and whose stored keys nothing but attention reads (no scoring of stored keys),
        and, with a codec, only if it encodes keys after RoPE (`keys_rotated(codec)`, as `Full`).
        A quantizing policy may declare it to quantize rotated keys (`kivi`'s `after_rope`, its
        reference's order): then it is a choice of what is quantized, not only of speed.
        A policy that does not declare it rejects a codec with `after_rope` (`check_codec`)."""
        return False

    # -- sizes ---------------------------------------------------------------------------
    def capacity(self, max_len: int) -> int:
        """Number of slots the state holds for sequences of up to `max_len` tokens."""
        raise NotImplementedError

    def init(self, batch: int, kv_heads: int, head_dim: int, dtype: Any, max_len: int) -> SlotState:
        """An empty state (all positions -1)."""
        return empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len))

    @classmethod
    def for_tokens(cls, n: int, **kw) -> "Policy":
        """The policy that keeps n tokens in all (its budget field set to n; see kvpolicies.budgets)."""
        if cls.budget_field is None:
            raise ValueError(f"{cls.__name__} has no token budget")
        return cls(**{cls.budget_field: n}, **kw)

    # -- one step ------------------------------------------------------------------------
    def extend(
        self,
        state: SlotState,
        k: Float[Array, "B K T D"],
        v: Float[Array, "B K T D"],
        pos: Int[Array, "B T"],
    ) -> View:
        """The view attention reads: the old slots and the T new (un-rotated) tokens."""
        raise NotImplementedError

    def select(
        self, view: View, q_rot: Float[Array, "B K G T D"], k_rot: Float[Array, "B K S D"]
    ) -> Bool[Array, "B K|Kp G|1 T S"] | None:
        """Query-dependent sparsity: the slots each (rotated) query may read; None = no limit."""
        return None

    def compact(self, view: View, seen: Seen) -> SlotState:
        """The state after the step, back at the fixed capacity."""
        raise NotImplementedError

    def defer(self, view: View, seen: Seen) -> "Deferred | None":
        """The step's writes, not yet applied, when they are all `compact` would do (the new state
        is then `write_deferred(state, writes)`), else None. By default the appended new slots at
        `View.append.start`; a policy that also folds the step into per-index fields of its own
        (Quest's page bounds) adds those writes (`Deferred.fields`)."""
        app = view.append
        return None if app is None or app.start is None else Deferred(app.slots, app.start)

    # -- length buckets (`prefix_slots` policies only) -------------------------------------
    def head(self, state: SlotState, n: int, lead: int = 0) -> SlotState:
        """`state` cut to its first n slots (`lead` leading axes, e.g. a model's layers); every
        per-slot field, along its slot axis (by default axis 2 of every field)."""
        return head_slots(state, n, lead)

    def with_head(self, state: SlotState, head: SlotState, lead: int = 0) -> SlotState:
        """`state` with its first slots replaced by `head`'s (the inverse of `head`)."""
        return put_head(state, head, lead)

    # -- prompt compressors (compress once after the whole prompt) -------------------------
    def prompt_policy(self) -> "Policy":
        """The policy that holds a prompt before `after_prompt` (itself, for streaming policies)."""
        return self

    def after_prompt(self, state: SlotState) -> SlotState:
        """The state after the whole prompt, as decoding starts (a prompt compressor compresses
        the `prompt_policy()` state here, once); unchanged for streaming policies."""
        return state

    def stack(self, n_layers: int) -> tuple["Policy", ...]:
        """The per-layer policies of a model of n_layers layers that runs this policy: itself in
        every layer, except model-level presets (quest keeps layers 0-1 dense, pyramidkv gives
        each layer its pyramid budget)."""
        return (self,) * n_layers

    # -- accounting ----------------------------------------------------------------------
    def decode_reads(self, state: SlotState, context: int) -> tuple[int, int]:
        """(kv bytes, meta bytes) of `state` (concrete or abstract) that the decode step of the
        query at position `context` reads. By default every filled slot: min(S, context + 1)."""
        s = state.slots
        filled = min(s, context + 1)
        kv, meta = tree_nbytes((state.k, state.v)), tree_nbytes(meta_fields(state))
        return kv * filled // s, meta * filled // s


# ---------------------------------------------------------------------------------------
# Slot helpers. Encoded k/v leaves have layout [B, K, S, ...]; pos has [B, Kp, S]; any extra
# field of a state is per slot, [B, K|Kp, S, ...].
# ---------------------------------------------------------------------------------------


def empty_slots(codec: Codec, batch: int, kv_heads: int, head_dim: int, dtype: Any, slots: int,
                kp: int = 1) -> SlotState:
    shape = (batch, kv_heads, slots, head_dim)  # [B, K, S, D]
    return SlotState(k=codec.init(shape, dtype), v=codec.init(shape, dtype),
                     pos=jnp.full((batch, kp, slots), EMPTY, jnp.int32))


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


def write_rows(buf: Array, x: Array, start: Int[Array, "B"], lead: int = 0) -> Array:
    """buf [*lead, B, H, S, ...] with x [*lead, B, H', T, ...] written at index start[b] of axis
    lead + 2 of row b (in place under donation: one dynamic_update_slice per row, B static)."""
    x = jnp.broadcast_to(x, x.shape[:lead + 1] + buf.shape[lead + 1:lead + 2] + x.shape[lead + 2:])
    x = x.astype(buf.dtype)
    zero = jnp.zeros((), jnp.int32)
    for b in range(buf.shape[lead]):
        row = x[(slice(None),) * lead + (slice(b, b + 1),)]
        idx = (zero,) * lead + (jnp.int32(b), zero, start[b].astype(jnp.int32)) + (zero,) * (buf.ndim - lead - 3)
        buf = jax.lax.dynamic_update_slice(buf, row, idx)
    return buf


def write_at(state: SlotState, new: SlotState, start: Int[Array, "B"], lead: int = 0) -> SlotState:
    """Write `new`'s slots contiguously at slot `start[b]` (in place under donation). `lead`:
    leading axes both states have before B (a model's stacked layers), written alike."""
    return _map_fields(lambda name, buf, x: write_rows(buf, x, start, lead), state, new)


class Deferred(NamedTuple):
    """The writes of an appending step, not yet applied (`Policy.defer`): the new state is
    `write_deferred(state, writes)`. Leaves may carry leading axes (a model's stacked layers).

    slots:  the T new slots, encoded, written at slot `start` (a state of T slots: `SlotState`'s
            fields of the state).
    start:  [*L, B].
    fields: other fields of the state, each {name: (block [*L, B, H, n, ...], first [*L, B])}:
            the block is written at index first[b] of the field's axis 2 (Quest: the page bounds
            of the pages the step's tokens fall in); None: no other field changes.
    """

    slots: SlotState
    start: Int[Array, "*L B"]
    fields: dict | None = None


def write_deferred(state: SlotState, writes: Deferred, lead: int = 0) -> SlotState:
    """Apply `Deferred` writes; `lead` leading axes (e.g. stacked layers) share one `start`
    (the layers of a run hold one policy and see the same positions)."""
    row = (0,) * lead
    names = [f.name for f in dataclasses.fields(writes.slots)]
    part = write_at(type(writes.slots)(**{n: getattr(state, n) for n in names}), writes.slots, writes.start[row], lead)
    out = {n: getattr(part, n) for n in names}
    for name, (block, first) in (writes.fields or {}).items():
        out[name] = write_rows(getattr(state, name), block, first[row], lead)
    return dataclasses.replace(state, **out)


def append_view(codec: Codec, state: SlotState, new: SlotState, pos: Int[Array, "B T"], dtype: Any, carry: Any,
                start: Int[Array, "B"] | None = None, **kw) -> View:
    """A view of `state`'s stored slots followed by the T `new` ones (`View.append`): positions,
    RoPE, masks then cover S + T slots, while the stored keys/values are read in place. With
    `start` (compact writes the new slots there and does nothing else), the stored slots
    [start, start + T) are read as empty: the new tokens replace them in this very step."""
    spos = state.pos  # [B, Kp, S]
    if start is not None:
        s = jnp.arange(spos.shape[-1])
        over = (s >= start[:, None]) & (s < start[:, None] + new.slots)  # [B, S]
        spos = jnp.where(over[:, None, :], EMPTY, spos)
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


def take_slots(x: Array, idx: Int[Array, "B Ki S2"]) -> Array:
    """x [B, H, S, ...] -> [B, max(H, Ki), S2, ...]: per-head slot selection (H or Ki may be 1)."""
    h = max(x.shape[1], idx.shape[1])
    x = jnp.broadcast_to(x, (x.shape[0], h) + x.shape[2:])
    idx = jnp.broadcast_to(idx, (idx.shape[0], h, idx.shape[2]))
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)


# Ring buffers (window, sink): new tokens go to slot `slot_of(pos)`; a slot is overwritten only
# by a token at least `window` positions later, when the old one is no longer visible to it.


class Pending(NamedTuple):
    """The carry of an appending step: the stored slots and the step's new slots (None when
    the new tokens were already written in place)."""

    old: SlotState
    new: SlotState | None


def flat(view: View) -> View:
    """`view` with its appended tokens moved into k, v (a copy of every slot): for a policy that
    composes other policies' views (duo) and needs one slot axis."""
    if view.append is None:
        return view
    return dataclasses.replace(view, k=jnp.concatenate([view.k, view.append.k], axis=2),
                               v=jnp.concatenate([view.v, view.append.v], axis=2), append=None)


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
