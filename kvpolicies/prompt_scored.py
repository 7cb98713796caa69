"""`PromptScored`: the base of the prompt compressors (snapkv, knorm, random, observed, expected).

Shapes: B batch, K kv heads, S slots (= kept + max_new), T new tokens, V = S + T view slots,
D head dim.

Such a method ranks the prompt's tokens once, after the whole prompt, and keeps the `kept()`
best per kv head (kvpress's `ScorerPress`: score, then top-k). The paper's protocol (retrieval:
`Engine.generate` / `prefill` of a fresh prompt): the prompt is held densely by a `PromptPhase`
(which also collects what the ranking needs: snapkv's last-window rows, observed's column sums,
expected's query statistics), `after_prompt` keeps the best `kept()` tokens (if there are more),
and decoding appends into the `max_new` free slots.

Our extension, for streams (`Engine.score`) and generation beyond `max_new`, the same for every
subclass: decoding is token by token (`per_token`), and a token that finds no free slot (the
view holds S + 1 tokens) triggers the same compression, to `kept()` tokens, ranked by what the
state has seen so far. Memory is fixed whatever the length; chunk never changes which tokens are
kept. A chunk in which no head overflows (a question appended after the compression, as kvpress
appends it) evicts nothing: when `observe` takes T queries at once (`@chunked`: snapkv's window
mass, expected's query sums, observed's column sums, or nothing kept), it attends in one piece,
as a dense forward does (`appends_quietly`), with the same slots after it as its single-token
steps, statistics and outputs equal up to float rounding (tests/models/test_shape_classes.py).

`ratio` (kvpress's compression ratio; 0 = off, `budget` sizes): the compression after the prompt
keeps `kept_for(n)` of the n prompt tokens per kv head, kvpress's n_kept = max(1, int(n (1 - ratio)))
(window and sinks included), whatever n; the state has int(max_len (1 - ratio)) + max_new slots.
Streams (`Engine.score`) recompress to that many tokens minus max_new.

`interval`, `target` (0: off) are kvpress's `DecodingPress` schedule (compression_interval,
target_size) for compression while decoding: whenever the cache would hold `target + interval`
tokens per kv head, it is compressed back to `target` by the same ranking (the state has
max(kept after the prompt, target + interval - 1) slots; `max_new` is then unused). After a
prompt that keeps `target` tokens this is kvpress's rule exactly: every `interval` decoded
tokens, the cache (prompt, question and answer so far) compressed to `target`. kvpress counts
forward steps from the end of the prefill (a q-token question is one step); we count tokens and
restart from what the cache holds, so after a prompt that keeps m != target tokens the first
compression comes after target + interval - m tokens instead of `interval` steps.

A subclass declares its fields (at least `budget` and `max_new`) and writes `rank`; it
overrides `observe` / `restart` to keep statistics in the state, `prompt_rank` when the prompt
is ranked from what the prompt phase collected, and `split` / `join` for statistics that are
not per slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import SlotState, View, keys_rotated
from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_int
from kvpolicies.prompt import KeptTable, PromptCompressor, PromptPhase, PromptState
from kvpolicies.scored import Accumulated, Scored, append_packed, pack, top_mask
from kvpolicies.slots import (Pending, QuietChunks, Spare, SpareSlot, append_view, concat, move_spare, pad_slot, view_of,
                              write_spare)
from kvpolicies.ties import TIES, torch_cpu_top_mask


def chunked(observe):
    """Mark a `PromptScored.observe` that takes a step of T queries as T single-token steps would."""
    observe.chunked = True
    return observe


@dataclasses.dataclass(frozen=True)
class PromptScored(Budgeted, KeptTable, PromptCompressor, QuietChunks, SpareSlot, Scored):
    """Keep the `kept()` best-ranked tokens after the prompt, append after; recompress on overflow."""

    per_token = True
    budget_field = "budget"
    label: ClassVar[str] = "prompt scorer"  # the registry name, for error messages
    observes = ()
    # what the prompt phase collects: PromptPhase fields (columns, query_sink) -> values
    collects: ClassVar[dict[str, Any]] = {}
    # rows of `kept_table`: the kept counts, then the ranking's own per-length counts (`rank_given`); -1: as
    # many as the table has
    table_rows: ClassVar[int] = 1

    ratio: float = 0.0  # kvpress's compression ratio (fraction of the prompt removed); 0: `budget` sizes
    interval: int = 0  # kvpress's DecodingPress compression_interval (0: off, the stream rule on overflow)
    target: int = 0  # kvpress's DecodingPress target_size: tokens per kv head after a decode-time compression
    # a shape class's decode slots per kv head (`KeptTable.shape_class`; 0: sized by ratio or budget):
    # the count kept after the prompt is then given as data (`after_prompt(state, table)`)
    slots: int = dataclasses.field(default=0, metadata={"engine": True})  # set by the engine, not a CLI field
    # decode steps write their token into a spare slot after the S (`SpareSlot`; a shape class's decoding)
    spare: bool = dataclasses.field(default=False, metadata={"engine": True})
    # a shape class that only answers (evals.shared_answers' canonical form): its stored keys are rotated
    # (RoPE at their text positions, written once) so no step rotates them again; states come rotated
    rotated: bool = dataclasses.field(default=False, metadata={"engine": True, "later": True})  # later: keys kept
    # exact ties at the prompt's compression: "newer" keeps the newer token; "torch_cpu" what torch.topk keeps on
    # the CPU (kvpress's choice there, replayed: kvpolicies.ties); not part of any method, off by default
    ties: str = dataclasses.field(default="newer", metadata={"later": True})

    def __post_init__(self):
        check_int(self.label, "budget", self.budget, 0)
        check_int(self.label, "max_new", self.max_new, 0)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise ValueError(f"{self.label}.ratio={self.ratio!r}: must be a number in [0, 1) (0: off)")
        check_int(self.label, "interval", self.interval, 0)
        check_int(self.label, "target", self.target, 0)
        check_int(self.label, "slots", self.slots, 0)
        if self.rotated and not (self.slots and not self.interval and keys_rotated(self.codec)):
            raise ValueError(f"{self.label}(rotated=True): only a shape class that only appends (slots, no interval) "
                             f"with keys stored after RoPE (no codec, or one after RoPE), got slots={self.slots}, "
                             f"interval={self.interval}, codec={self.codec.name}")
        if self.ties not in TIES:
            raise ValueError(f"{self.label}.ties={self.ties!r}: must be one of {list(TIES)}")
        if self.ties != "newer" and not self.ties_decided_here():
            raise ValueError(f"{self.label}(ties={self.ties!r}): {type(self).__name__} breaks the ties of its prompt "
                             "compression its own way (a choice inside its priorities, or a compression of its "
                             "own); ties= is for a prompt scorer ranked by one top-k")
        if bool(self.interval) != bool(self.target):
            raise ValueError(f"{self.label}: interval={self.interval} and target={self.target} go together "
                             "(compression while decoding: every `interval` tokens back to `target`; 0 and 0: off)")

    def ties_decided_here(self) -> bool:
        """Whether `ties` decides the prompt's compression: `after_prompt`'s one top-k over `prompt_rank`'s
        priorities does. A subclass whose priorities are a choice of its own (each a top-k of its own:
        Chunked, Critical) or that compresses its own way says False, unless it breaks its ties there by
        `ties` too (ChunkKV); `ties="torch_cpu"` is refused where it is False, never ignored."""
        return type(self).after_prompt is PromptScored.after_prompt

    @property
    def rotated_keys(self) -> bool:
        return self.rotated

    def kept(self) -> int:
        """Tokens per kv head after a compression (the budget; snapkv adds its window)."""
        return self.budget

    def kept_for(self, n: int) -> int:
        """Tokens per kv head kept of an n-token prompt when `ratio` is set: kvpress's
        `compute_n_kept` (window and sinks included)."""
        return max(1, int(n * (1 - self.ratio)))

    def capacity(self, max_len):
        if self.slots:
            return min(self.slots, max_len)
        prompt = self.kept_for(max_len) if self.ratio else self.kept()
        if self.interval:
            return min(max(prompt, self.target + self.interval - 1), max_len)
        return min(prompt + self.max_new, max_len)

    def stream_kept(self, s: int) -> int:
        """Tokens per kv head after a compression on overflow (S = `s` slots)."""
        if self.interval:
            return min(self.target, s)
        return max(s - self.max_new, 1) if self.ratio or self.slots else min(self.kept(), s)

    def overflows(self, count: Int[Array, "B K"], s: int) -> Bool[Array, "B K 1"]:
        """Where a decode step's view (`count` tokens, the new one included) is compressed: no free
        slot for the new token, or with `interval`, `target + interval` tokens held."""
        over = count > s
        if self.interval:
            over = over | (count >= self.target + self.interval)
        return over[..., None]

    def kept_table(self, max_len: int) -> np.ndarray | None:
        """Tokens per kv head kept after an n-token prompt, for n in [0, max_len] (`KeptTable`;
        None with `interval`, whose compressions while decoding are part of the method)."""
        return None if self.interval or self.slots else self._counts(max_len)

    def _counts(self, max_len: int) -> np.ndarray:
        s = self.capacity(max_len)
        if not self.ratio:
            return np.full(max_len + 1, min(self.kept(), s), np.int32)
        return np.minimum([self.kept_for(n) for n in range(max_len + 1)], s).astype(np.int32)

    def shape_class(self, slots: int) -> "PromptScored":
        return dataclasses.replace(self, ratio=0.0, budget=0, slots=slots)

    def n_kept(self, count: Int[Array, "B K"], s: int, max_len: int, table: Array | None = None) -> Array:
        """Tokens per kv head after the prompt's compression ([B, K, 1]; `count` prompt tokens;
        `table`: the kept counts given as data, a shape class's)."""
        if table is None:
            if self.slots:
                raise ValueError(f"{self.label}(slots={self.slots}): a shape class keeps the counts it is given: "
                                 "after_prompt(state, table)")
            table = self._counts(max_len)  # static
        return jnp.minimum(jnp.asarray(table)[count], s)[..., None]

    # -- the ranking (subclasses) -----------------------------------------------------------
    def rank_given(self, state: PromptState, slots: SlotState, keys: Float[Array, "B K V D"], stats: Any,
                   rows: Int[Array, "R N"]) -> tuple[Float[Array, "B K V"], Array]:
        """`prompt_rank` of a shape class whose ranking reads per-length counts of its own (`table_rows` - 1
        rows of `kept_table` after the kept counts, given as data): the ranking its exact policy computes
        from its fields."""
        raise NotImplementedError(f"{self.label}: table_rows={self.table_rows} without rank_given")

    def rank(self, slots: SlotState, keys: Float[Array, "B K V D"], stats: Any, seen: Any
             ) -> tuple[Float[Array, "B K V"], Array]:
        """The front door of a prompt compressor: write this (and its fields) and inherit the rest,
        as a kvpress `ScorerPress` writes `score()`. (priority, tie) of every slot [B, K, V]: the top
        `kept()` by priority survive (-inf never: `rank_by` gives that to empty slots), ties keep
        the larger `tie` (by default the position: the newer token). `keys` are the slots' keys
        before RoPE, decoded to float; `stats` what `split` keeps beside the slots; `seen` the
        step's `Seen` on a stream's overflow, None after the prompt (`prompt_rank` ranks from the
        prompt phase's state instead, when the ranking needs what it collected). Knorm is one
        `rank`: the negated L2 norm of the keys."""
        raise NotImplementedError

    def prompt_rank(self, state: PromptState, slots: SlotState, keys: Float[Array, "B K V D"], stats: Any):
        """The ranking after the prompt, from the prompt phase's state (default: `rank`)."""
        return self.rank(slots, keys, stats, None)

    @chunked
    def observe(self, slots: SlotState, stats: Any, view: View, seen: Any, count: Int[Array, "B K"], s: int):
        """(slots, stats) after a decode step's query (default: unchanged). An override marked
        `@chunked` takes a step of T queries as T single-token steps would (up to float rounding),
        so that a chunk that evicts nothing attends in one piece (`appends_quietly`)."""
        return slots, stats

    def restart(self, slots: SlotState, over: Bool[Array, "B K 1"]) -> SlotState:
        """The slots after a compression (where `over`) (default: unchanged)."""
        return slots

    def split(self, state: SlotState) -> tuple[SlotState, Any]:
        """(per-slot state, per-layer statistics) (default: no statistics)."""
        return state, None

    def join(self, slots: SlotState, stats: Any) -> SlotState:
        return slots

    def from_prompt(self, state: PromptState, pos: Int[Array, "B K S"]) -> tuple[SlotState, Any]:
        """(slots, statistics) of the decode state, from the prompt phase's state (slots
        [B, K, max_len]: every prompt token; `mass` zeros when the state accumulates)."""
        if self.rotated:
            raise ValueError(f"{self.label}(rotated=True) answers compressed states it is given (rotated keys); "
                             "it runs no prompt of its own")
        if not self.accumulates:
            return SlotState(state.k, state.v, pos), None
        return Accumulated(state.k, state.v, pos, mass=jnp.zeros(pos.shape, jnp.float32)), None

    # -- the protocol -------------------------------------------------------------------------
    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return pad_slot(st) if self.spare else st

    def extend(self, state, k, v, pos):
        slots, stats = self.split(state)
        new = self._new(slots, k, v, pos)
        if self.spare:  # the token into the spare slot and the first free one (`SpareSlot`)
            if k.shape[2] != 1:
                raise ValueError(f"{self.label}(spare=True): a step of one token at a time, got {k.shape[2]}")
            at = (slots.pos[..., :-1] >= 0).sum(axis=-1, dtype=jnp.int32)  # [B, K]: the first free slot (packed)
            buf = write_spare(slots, new, at)  # [B, K, S + 1, ...]
            return view_of(self.codec, buf, pos, k.dtype, carry=(Spare(buf, at), stats))
        if self.appends_in_place:  # a chunk after the compression: written after the filled slots
            at = (slots.pos >= 0).sum(axis=-1, dtype=jnp.int32)  # [B, Kp]: each head's first free slot (packed)
            return append_view(self.codec, slots, new, pos, k.dtype, carry=(Pending(slots, new), stats), start=at,
                               joined=True)
        return view_of(self.codec, concat(slots, new), pos, k.dtype, carry=(Pending(slots, new), stats))

    @property
    def appends_in_place(self) -> bool:
        """A chunk of a shape class (`appends_only`) whose step changes nothing but its new slots
        (`observe` not overridden, no accumulated mass): its view reads the stored slots where they
        lie and the new ones after them as one sequence (`View.joined`: the floats of the
        concatenated view), and it writes the new slots after each head's filled ones
        (`Appended.start`: the packing `compact` would do, the same slots), which a model may defer
        past its layer loop (`attend(..., defer=True)`), each head at its own count."""
        return (self.appends_only and not self.spare and not self.accumulates
                and type(self).observe is PromptScored.observe and type(self).split is PromptScored.split)

    def compact(self, view, seen):
        if isinstance(view.carry[0], Spare):  # appends only (`appends_only`; an overflow's outputs are NaN)
            (buf, at), stats = view.carry
            count = (buf.pos >= 0).sum(axis=-1)  # [B, K] tokens in the view
            buf, stats = self.observe(buf, stats, view, seen, count, buf.slots - 1)
            return self.join(move_spare(buf, at), stats)
        (old, new), stats = view.carry
        slots = concat(old, new)  # [B, K, V, ...]; one new token (per_token)
        s = old.slots
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K] tokens in the view
        slots, stats = self.observe(slots, stats, view, seen, count, s)
        over = self.overflows(count, s)  # [B, K, 1]: no free slot for the new token (or `interval`'s turn)

        def evict():  # the ranking's sorts and the packing only on a step where some head overflows
            keys = view.k if view.append is None else jnp.concatenate([view.k, view.append.k], axis=2)  # [B, K, V, D]
            prio, tie = self.rank(slots, keys, stats, seen)
            kept = jnp.where(over, top_mask(prio, tie, self.stream_kept(s)) & filled, filled)
            return pack(self.restart(slots, over), kept, s)

        # else the new tokens go to each head's first free slots (`append_packed`: pack's result, unsorted)
        appends = ~over.any() & (new.pos >= 0).all()
        return self.join(jax.lax.cond(appends, lambda: append_packed(slots, s), evict), stats)

    def appends_quietly(self, state, t):
        """No head overflows within the t tokens (nor `interval`'s turn comes), for a policy whose
        `observe` is `@chunked` (else None: token by token)."""
        if not getattr(type(self).observe, "chunked", False):
            return None
        count = (self.split(state)[0].pos >= 0).sum(axis=-1)  # [B, K] before the step
        return ~self.overflows(count + t, state.pos.shape[-1] - self.spare_slots).any()

    @property
    def appends_only(self):
        """A shape class (`slots`): its engine refuses chunks past the free slots after the compression."""
        return bool(self.slots) and not self.interval

    def spared(self):
        """A shape class appends only: its decode steps can write in place (`SpareSlot`)."""
        return dataclasses.replace(self, spare=True) if self.appends_only else None

    @property
    def spare_slots(self):
        return int(self.spare)

    def pad_spare(self, state):
        slots, stats = self.split(state)
        return self.join(pad_slot(slots), stats)

    def cut_spare(self, state):
        slots, stats = self.split(state)
        return self.join(super().cut_spare(slots), stats)

    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=0, **self.collects)

    def after_prompt(self, state: PromptState, table: Array | None = None) -> SlotState:
        s = self.capacity(state.slots)  # decode slots (the prompt state has max_len slots)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, max_len, D]
        pos = jnp.broadcast_to(state.pos, keys.shape[:3])  # [B, K, max_len]
        slots, stats = self.from_prompt(state, pos)
        filled = pos >= 0
        count = filled.sum(axis=-1)  # [B, K]
        rows = None  # a table of `table_rows` > 1: the kept counts, then what `rank_given` reads
        if table is not None and self.table_rows != 1:
            table, rows = table[0], table[1:]
        n = self.n_kept(count, s, state.slots, table)  # [B, K, 1]
        prio, tie = self.prompt_rank(state, slots, keys, stats) if rows is None else \
            self.rank_given(state, slots, keys, stats, rows)
        # a prompt state: slot i holds position i, so a row's first `count` slots are its scores in index order
        best = torch_cpu_top_mask(prio, count, n[..., 0]) if self.ties == "torch_cpu" else top_mask(prio, tie, n)
        kept = jnp.where(count[..., None] > n, best & filled, filled)
        packed = pack(slots, kept, s, in_order=True)
        return self.join(pad_slot(packed) if self.spare else packed, stats)


def rank_by(prio: Float[Array, "B K V"], pos: Int[Array, "B K V"]) -> tuple[Float[Array, "B K V"], Array]:
    """(priority, tie) with empty slots never kept and ties keeping the newer token."""
    return jnp.where(pos >= 0, prio, -jnp.inf), pos
