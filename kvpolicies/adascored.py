"""`AdaScored`: Ada-KV's head-adaptive budgets (Feng et al. 2024, arXiv:2407.11550; authors' repo
FFY0/AdaKV) over any prompt scorer, as kvpress's `AdaKVPress(press)` runs it: the kv heads of a
layer share one budget of K x n_kept prompt tokens, each head keeping as many as its scores win,
with real per-head memory. (`adakv` is the same rule over SnapKV's scores, with its stream rule.)

Shapes: B batch, K kv heads, S = n_kept(max_len) + max_new slots per kv head on average,
P = K x S pool slots per layer, T new tokens, V = P + K x T view slots, M = max_len (the prompt
phase's slots), D head dim.

Storage: `CountedPool`, one pool of P slots per layer shared by the K kv heads, stored as K rows
of S slots (the layout of `kvpolicies.adakv.HeadPool`: head h's slots are one contiguous segment
of the flat pool, in text order, segments in head order, empty slots last) plus each head's
number of slots, `counts` [B, K] int32: a generic scorer need not keep each head's newest token
(adakv's segments end there, `kvpolicies.adakv.head_of`), so the segment boundaries are stored,
K int32 per layer and batch row. Nothing else: no per-slot statistic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.adakv import HeadPool, as_rows, pack_by_head, pool_view, prompt_pool
from kvpolicies.base import EMPTY, Policy, SlotState, empty_slots
from kvpolicies.codecs import Codec, Identity
from kvpolicies.checks import check_int
from kvpolicies.prompt import KeptTable, PromptCompressor, PromptState
from kvpolicies.prompt_scored import PromptScored
from kvpolicies.scored import top_mask
from kvpolicies.slots import QuietChunks


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CountedPool(SlotState):
    """A layer's pool of P = K x S slots shared by its kv heads, K rows [B, K, S, ...] of one flat
    pool grouped by head (rows are not heads), `counts` [B, K] int32: each head's slots, and `stats`:
    the inner press's statistics beside its slots (expected's query sums; None for most)."""

    counts: Int[Array, "B K"]
    stats: Any = None

    def held(self, row, kv_heads, policy):
        """Each head's segment of the flat pool (its `counts` slots, after the previous heads')."""
        flat = np.asarray(self.pos[row]).reshape(-1)  # [K * S]
        ends = np.cumsum(np.asarray(self.counts[row]))
        return [np.sort(flat[e - c:e]).astype(np.int64) for c, e in zip(np.asarray(self.counts[row]), ends)]


def heads_of(counts: Int[Array, "B K"], p: int) -> Int[Array, "B 1 P"]:
    """The kv head of each flat pool slot from the heads' counts (K for the empty slots after them)."""
    ends = jnp.cumsum(counts, axis=-1)  # [B, K]
    j = jnp.arange(p)  # [P]
    return (j[None, :, None] >= ends[:, None, :]).sum(axis=-1, dtype=jnp.int32)[:, None, :]  # [B, 1, P]


def allocate(prio: Float[Array, "B K V"], tie: Array, cand: Bool[Array, "B K V"], n_kept: Int[Array, "B 1 1"],
             n_safe: Int[Array, "B 1 1"]) -> Bool[Array, "B K V"]:
    """kvpress's `AdaKVPress.compress` on priorities: each head's top `n_safe` candidates get the
    largest score (the safeguard), then the layer keeps its K x n_kept best candidates over all heads
    together (flattened [K, V]; ties: the larger `tie`, then the lower head and slot)."""
    b, kh, v = prio.shape
    prio = jnp.where(cand, prio, -jnp.inf)
    safe = top_mask(prio, tie, n_safe) & cand  # [B, K, V]
    prio = jnp.where(safe, jnp.inf, prio)
    flat = top_mask(prio.reshape(b, kh * v), tie.reshape(b, kh * v), (kh * n_kept)[:, :, 0])  # [B, K V]
    return flat.reshape(b, kh, v) & cand


@dataclasses.dataclass(frozen=True)
class AdaScored(PromptCompressor, QuietChunks, KeptTable, Policy):
    """kvpress's `AdaKVPress(press, alpha_safeguard)` over the prompt scorer `press` (a
    `kvpolicies.compat.kvpress(...)` result whose `ratio` is this policy's).

    After the prompt (n tokens): `press` ranks every token of every kv head (its `prompt_rank`, what
    kvpress's `press.score` returns, tokens it always keeps at +inf as kvpress's max + 1), n_kept =
    max(1, int(n (1 - ratio))), each head's top n_safe = max(1, int(alpha_safeguard n_kept)) are
    safeguarded, and the layer keeps its K x n_kept best tokens over all heads (`allocate`).
    kvpress masks the others (every head still stores n tokens); we store each head's share only,
    in a pool of K x (n_kept + max_new) slots, each head's count beside it. The question and the
    answer are appended to every head.

    Our extension (streams, generation past `max_new`): decoding is token by token, and a token
    that finds the pool full triggers the same choice over the pool's tokens, ranked by `press`'s
    stream rule (`rank`), to K x max(S - max_new, 1) tokens. Statistics `press` keeps beside its
    slots (expected's query sums) are kept in the pool and updated by `press.observe`; per-slot ones
    (snapkv's and observed's accumulated attention) are not supported (SnapKV's form is `adakv`)."""

    per_token = True

    press: PromptScored = None
    ratio: float = 0.5
    alpha_safeguard: float = 0.2
    max_new: int = 256
    codec: Codec = Identity()
    # a shape class's slots per kv head on average (`KeptTable.shape_class`; 0: sized by ratio)
    slots: int = dataclasses.field(default=0, metadata={"engine": True})  # set by the engine, not a CLI field

    def __post_init__(self):
        if not isinstance(self.press, PromptScored) or self.press.accumulates or self.press.interval or (
                type(self.press).restart is not PromptScored.restart):
            raise ValueError(f"adascored.press={self.press!r}: must be a prompt scorer without per-slot statistics "
                             "(knorm, keydiff, lagkv, random, expected, kvpress's StreamingLLM; adakv is SnapKV's)")
        r = self.ratio
        check_int("adascored", "slots", self.slots, 0)
        if self.slots and r != 0:
            raise ValueError(f"adascored(slots={self.slots}): a shape class keeps the counts it is given, ratio=0 "
                             f"(got {r!r})")
        if not self.slots and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1):
            raise ValueError(f"adascored.ratio={r!r}: must be a number in (0, 1)")
        if self.press.ratio != r:
            raise ValueError(f"adascored.press.ratio={self.press.ratio!r}: must be the wrapper's ratio {r!r}")
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"adascored.alpha_safeguard={a!r}: must be a number in [0, 1]")
        if isinstance(self.max_new, bool) or not isinstance(self.max_new, int) or self.max_new < 0:
            raise ValueError(f"adascored.max_new={self.max_new!r}: must be an int >= 0")
        if self.codec != self.press.codec:
            raise ValueError(f"adascored.codec={self.codec!r}: must be the inner press's ({self.press.codec!r})")

    @property
    def observes(self):
        return self.press.observes

    def kept_for(self, n: int) -> int:
        """Tokens per kv head on average kept of an n-token prompt (kvpress's n_kept)."""
        return max(1, int(n * (1 - self.ratio)))

    def _safe(self, n_kept):
        """kvpress's safeguard: max(1, int(alpha n_kept)) candidates per head (0 if alpha is 0)."""
        n_safe = jnp.floor(n_kept * self.alpha_safeguard).astype(jnp.int32)
        return jnp.maximum(n_safe, 1) if self.alpha_safeguard > 0 else n_safe

    def capacity(self, max_len):
        """Slots per kv head on average (the pool holds kv_heads x this many)."""
        if self.slots:
            return min(self.slots, max_len)
        return min(self.kept_for(max_len) + self.max_new, max_len)

    def kept_table(self, max_len: int) -> np.ndarray | None:
        """[max_len + 1] int32: tokens per kv head on average kept after an n-token prompt (`KeptTable`)."""
        if self.slots:
            return None
        return np.minimum([self.kept_for(n) for n in range(max_len + 1)], self.capacity(max_len)).astype(np.int32)

    def shape_class(self, slots: int) -> "AdaScored":
        return dataclasses.replace(self, ratio=0.0, slots=slots, press=self.press.shape_class(slots))

    def _table(self, max_len: int, table: Array | None) -> Array:
        """The kept counts of `after_prompt`: those given (a shape class's), else this policy's own."""
        if table is not None:
            return jnp.asarray(table)
        if self.slots:
            raise ValueError(f"{type(self).__name__.lower()}(slots={self.slots}): a shape class keeps the counts it is "
                             "given: after_prompt(state, table)")
        return jnp.asarray(self.kept_table(max_len))  # static

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), kv_heads)  # [B, K, S, D]
        shapes = jax.eval_shape(lambda: self.press.split(self.press.init(batch, kv_heads, head_dim, dtype, 1))[1])
        stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)  # the press's statistics, empty
        return CountedPool(st.k, st.v, st.pos, counts=jnp.zeros((batch, kv_heads), jnp.int32), stats=stats)

    # -- one decode step: the pool plus the new tokens in every head -----------------------------
    def extend(self, state, k, v, pos):
        b, kh, s = state.pos.shape
        pool = HeadPool(state.k, state.v, state.pos, mass=jnp.zeros(state.pos.shape, jnp.float32))
        view = pool_view(self.codec, pool, k, v, pos, head=heads_of(state.counts, kh * s))
        wide = lambda x: jnp.broadcast_to(x, (b, kh) + x.shape[2:])  # noqa: E731  [B, 1, V] -> [B, K, V]
        return dataclasses.replace(view, pos=wide(view.pos), rope=view.rope._replace(k=wide(view.rope.k)),
                                   carry=(*view.carry, state.stats))

    def compact(self, view, seen):
        slots, head, p, stats = view.carry  # [B, 1, V] flat slots, their heads, P, the press's statistics
        b, kh = view.k.shape[:2]
        filled = slots.pos >= 0  # [B, 1, V]
        mine = (head == jnp.arange(kh)[None, :, None]) & filled  # [B, K, V]: each head's slots
        wide = lambda x: jnp.broadcast_to(x, (b, kh) + x.shape[2:])  # noqa: E731  [B, 1, V, ...] -> [B, K, V, ...]
        per_head = SlotState(jax.tree.map(wide, slots.k), jax.tree.map(wide, slots.v), jnp.where(mine, slots.pos, EMPTY))
        _, stats = self.press.observe(per_head, stats, view, seen, mine.sum(axis=-1), p // kh)  # e.g. query sums
        over = filled.sum(axis=-1, keepdims=True) > p  # [B, 1, 1]: no free slot (one token per head: per_token)

        def evict():  # the ranking's sorts only on a step where the pool overflows
            prio, tie = self.press.rank(per_head, view.k, stats, seen)  # [B, K, V]
            n_kept = jnp.full((b, 1, 1), max(p // kh - self.max_new, 1), jnp.int32)
            kept = allocate(prio, tie, mine, n_kept, self._safe(n_kept)).any(axis=1, keepdims=True)
            return jnp.where(over, kept, filled)  # [B, 1, V]

        kept = jax.lax.cond(over.any(), evict, lambda: filled)
        return self.store_kept(slots, kept, head, p, kh, stats)

    def store_kept(self, slots: HeadPool, kept: Bool[Array, "B 1 V"], head: Int[Array, "B 1 V"], p: int, kh: int,
               stats: Any) -> CountedPool:
        pool = as_rows(pack_by_head(slots, kept, head, p), kh)
        counts = ((head == jnp.arange(kh)[None, :, None]) & kept).sum(axis=-1, dtype=jnp.int32)  # [B, K]
        return CountedPool(pool.k, pool.v, pool.pos, counts=counts, stats=stats)

    def appends_quietly(self, state, t):
        """No pool overflows within the t tokens (each adds a slot to every head); None (token by token)
        when `press.observe` takes one query at a time."""
        if not getattr(type(self.press).observe, "chunked", False):
            return None
        kh = state.pos.shape[1]
        n = state.counts.sum(axis=-1)  # [B] filled slots of the pool
        return ~(n + kh * t > kh * state.pos.shape[2]).any()

    # -- kvpress's protocol: the whole prompt densely, then one compression ----------------------
    def prompt_policy(self):
        return dataclasses.replace(self.press.prompt_policy(), of=self)

    def after_prompt(self, state: PromptState, table: Array | None = None) -> CountedPool:
        m = state.slots  # max_len
        s = self.capacity(m)
        counts = self._table(m, table)  # [M + 1]
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, M, D]
        b, kh = keys.shape[:2]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        slots, stats = self.press.from_prompt(state, pos)
        prio, tie = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        filled = pos >= 0
        n = filled.sum(axis=-1, keepdims=True)[:, :1]  # [B, 1, 1] prompt tokens (every head holds them)
        n_kept = counts[n]  # [B, 1, 1]: kvpress's max(1, int(n (1 - ratio)))
        kept = allocate(prio, tie, filled, n_kept, self._safe(n_kept))  # [B, K, M]
        pool = prompt_pool(state, kept, jnp.zeros((b, kh, m), jnp.float32), kh * s)
        return CountedPool(pool.k, pool.v, pool.pos, counts=kept.sum(axis=-1, dtype=jnp.int32), stats=stats)
