"""The cache-policy protocol: the stored state, the per-step view, and what attention observed.

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
capacity (`SlotState`, or a subclass adding the policy's own typed arrays). What attention needs
to know besides the view is declared as class attributes (`observes`, `per_token`, `gathers`,
`score_rows`, `rotated_keys`).

Everything else a policy may do is a capability it opts into, a class beside the code that
uses it: a token budget (`kvpolicies.budgets.Budgeted`), prompt compression
(`kvpolicies.prompt.PromptCompressor`, `Reconstructor`), a prefix-slot layout the engine can
bucket (`kvpolicies.slots.PrefixSlots`), a model-level preset (`kvpolicies.presets.Preset`), and
decode reads below its stored bytes (`kvpolicies.memory.decode_reads`). The helpers policies
build their steps from are `kvpolicies.slots` (slot writes, views) and `kvpolicies.ring`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

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



def empty_slots(codec: Codec, batch: int, kv_heads: int, head_dim: int, dtype: Any, slots: int,
                kp: int = 1) -> SlotState:
    """An empty state of `slots` slots (every position -1; `kp` position rows): `Policy.init`'s default."""
    shape = (batch, kv_heads, slots, head_dim)  # [B, K, S, D]
    return SlotState(k=codec.init(shape, dtype), v=codec.init(shape, dtype),
                     pos=jnp.full((batch, kp, slots), EMPTY, jnp.int32))



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
    start: [B] (or [B, Kp]: per position row) the slot from which `compact` writes `slots`,
           contiguously, and all it does besides is what `Policy.defer` returns (e.g. Quest's
           page bounds): the new state is `write_deferred(old state, policy.defer(view, seen))`,
           so a model may defer those writes past its layer loop (`attend(..., defer=True)`);
           None when `compact` does more than that (a ring chunk folded by `ring_compact`, an
           eviction).
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
    joined: (static) attention reads the appended slots as if they were stored after the others:
            the same blocks and pieces, so the same floats, as a view of S + T stored slots
            (`concat`'s), while the stored slots are still read where they lie.
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
    joined: bool = dataclasses.field(default=False, metadata=dict(static=True))


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



class Deferred(NamedTuple):
    """The writes of an appending step, not yet applied (`Policy.defer`): the new state is
    `write_deferred(state, writes)`. Leaves may carry leading axes (a model's stacked layers).

    slots:  the T new slots, encoded, written at slot `start` (a state of T slots: `SlotState`'s
            fields of the state).
    start:  [*L, B], or [*L, B, Kp]: per position row (broadcast to the kv heads for k, v).
    fields: other fields of the state, each {name: (block [*L, B, H, n, ...], first [*L, B])}:
            the block is written at index first[b] of the field's axis 2 (Quest: the page bounds
            of the pages the step's tokens fall in); None: no other field changes.
    """

    slots: SlotState
    start: Int[Array, "*L B"] | Int[Array, "*L B Kp"]
    fields: dict | None = None



class ReadsValues:
    """Capability: a policy whose state records what each new token's value adds to the layer's output
    through its output projection W_o (CriticalKV's prompt phase: ||v W_o||_1 per token and kv head).
    The model asks `reads_values(policy)` and then calls `read_values(state, v, pos, wo)` before the
    layer's attention step (`models.llama.block`); a policy without it compiles as before."""

    def read_values(self, state: Any, v: Float[Array, "B T K D"], pos: Int[Array, "B T"],
                    wo: Float[Array, "ND d"]) -> Any:
        """The state with the step's T tokens' observation written (`wo`: the layer's [N D, d] projection)."""
        raise NotImplementedError


def reads_values(policy: Any) -> bool:
    """Whether the model hands `policy` the step's values and the layer's output projection (`ReadsValues`)."""
    return isinstance(policy, ReadsValues)


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



def check_init(policy: Any, batch: Any, kv_heads: Any, head_dim: Any, dtype: Any, max_len: Any) -> None:
    """`Policy.init`'s arguments, checked for every policy (`Policy.__init_subclass__` wraps each
    `init`): sizes ints >= 1, and a floating dtype (keys and values are stored or decoded in it: an
    integer or bool dtype would truncate them). One ValueError naming the argument."""
    who = f"{type(policy).__name__.lower()}.init"
    for name, n in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim), ("max_len", max_len)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)) or n < 1:
            raise ValueError(f"{who}: {name}={n!r} must be an int >= 1")
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{who}: dtype={getattr(dtype, '__name__', dtype)!r} must be a floating dtype (float32, "
                         "bfloat16, float16): keys and values in an integer or bool dtype would be truncated")


def _checked(init):
    def checked(self, batch, kv_heads, head_dim, dtype, max_len, *args, **kwargs):
        check_init(self, batch, kv_heads, head_dim, dtype, max_len)
        return init(self, batch, kv_heads, head_dim, dtype, max_len, *args, **kwargs)

    return functools.wraps(init)(checked)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class: the protocol every cache policy implements (see the module docstring).

    Subclasses are frozen dataclasses with a `codec` field; class attributes declare the rest (a
    subclass may declare one as a property of its fields).
    """

    # Which `Seen` fields `compact` needs ("scores", "k_rot", "q", "rope", "logits", "columns"); attention
    # computes only those.
    observes: ClassVar[tuple[str, ...]] = ()
    # A decode-time evictor: attention runs a chunk as T single-token steps (a scan inside the
    # compiled step), so eviction happens after every token and `chunk` never changes a result.
    per_token: ClassVar[bool] = False
    # A sparse reader (Quest): at decode (T == 1) `attend` asks `select(view, q_rot, None)` before
    # rotating any key, and reads only the slots of the `kvpolicies.attend.Gather` it answers.
    gathers: ClassVar[bool] = False
    # `compact` reads `Seen.scores` of only the step's last n queries (n = this, or T if fewer):
    # attention then hands it those rows ([B, K, n, S]) and may attend a chunk in blocks (a prompt
    # phase that keeps the rows of its newest W queries). None: every row.
    score_rows: ClassVar[int | None] = None
    # Keys are stored already rotated (a speed choice, same results): `attend` rotates each new key
    # once, at its token position, before `extend`, and reads stored and appended keys as they are.
    # Only for a policy whose view gives every filled slot RoPE key position = its `pos` (text
    # positions; RoPE segments may still rotate the queries differently, as `sink`'s cache mode
    # does) and whose stored keys nothing but attention reads (no scoring of stored keys), and,
    # with a codec, only if it encodes keys after RoPE (`keys_rotated(codec)`, as `Full`). A
    # quantizing policy may declare it to quantize rotated keys (`kivi`'s `after_rope`, its
    # reference's order): then it is a choice of what is quantized, not only of speed. A policy
    # that does not declare it rejects a codec with `after_rope` (`check_codec`).
    rotated_keys: ClassVar[bool] = False
    codec: Codec = Identity()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "init" in cls.__dict__:  # every policy's init checks its arguments first (`check_init`)
            cls.init = _checked(cls.__dict__["init"])

    # -- sizes ---------------------------------------------------------------------------
    def capacity(self, max_len: int) -> int:
        """Number of slots the state holds for sequences of up to `max_len` tokens."""
        raise NotImplementedError

    def init(self, batch: int, kv_heads: int, head_dim: int, dtype: Any, max_len: int) -> SlotState:
        """An empty state (all positions -1)."""
        check_init(self, batch, kv_heads, head_dim, dtype, max_len)
        return empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len))

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

    def defer(self, view: View, seen: Seen) -> Deferred | None:
        """The step's writes, not yet applied, when they are all `compact` would do (the new state
        is then `kvpolicies.slots.write_deferred(state, writes)`), else None. By default the
        appended new slots at `View.append.start`; a policy that also folds the step into per-index
        fields of its own (Quest's page bounds) adds those writes (`Deferred.fields`)."""
        app = view.append
        return None if app is None or app.start is None else Deferred(app.slots, app.start)
