"""`paged`: the cache stored as fixed-size blocks in a per-layer pool, addressed through a
per-sequence block table (a layout, not an eviction rule): `full`, `window` or `sink` over pages.

Shapes: B batch, T new tokens, K kv heads, D head dim, blk tokens per block (`block`),
NB blocks in the pool (static: `blocks`, or enough for every row at its peak), M block-table
entries per sequence (static), S = M * blk + T view slots.

State (`PagedState`, one layer; every leaf gains a leading layer axis when a model stacks layers):
    k, v   [NB, K, blk, ...] the pool, codec-encoded (int8/int4/fp8 blocks carry their per-token
           scales as leaves of the same layout, so a block is its codes *and* its scales)
    pos    [NB, blk] the position each slot holds, -1 empty
    table  [B, M] physical block of each table entry, -1 none
    refs   [NB] how many table entries (over all rows) point at each block; 0 = free
    overflow [1] int32, 1 once an allocation found the pool exhausted (see below)

Table entry of logical block j (tokens j*blk .. j*blk+blk-1): `full` uses entry j
(M = ceil(max_len / blk)); `window`/`sink` keep the ceil(n_sink / blk) sink blocks in the first
entries and the others in a ring of R = (window - 1) // blk + 2 entries, which always holds every
block that a future query can still see. A block is freed as soon as its last token is outside
every future query's window (block-granular eviction, so less than one block of evicted tokens
per sequence stays stored next to the partly written newest block, plus the non-sink tail of the
last sink block when n_sink is not a multiple of the block).

One step (`extend` then `compact`, inside the jitted step): the view gathers the row's blocks
through its table ([B, K, M*blk, D]) plus the T new tokens, with their positions, so attention
(`kvpolicies.attend`) applies causality and the dense policy's visibility from positions: the
outputs are the dense `full`/`window`/`sink` outputs (same codec, same numbers up to the order of
the softmax sum). `compact` then releases dead blocks, allocates (lowest free block first, in
order of logical block then row) a block for every table entry that receives tokens and has
none, copies a block that is shared (refs > 1) before a row writes into it (copy-on-write), and
scatters the surviving new tokens into their blocks.

Pool exhaustion is never silent: the step sets `overflow`, drops the writes it could not place,
and every later view of that state has NaN values (so logits are NaN); `check(cache)` raises a
ValueError naming the pool size. With the default pool (blocks=None: batch x the blocks a row
holds at most) it cannot happen; it can with an explicit smaller `blocks` or after `fork`.

Host-side helpers over a cache (one state, or the Engine's tuple of stacked states):
`fork(cache, rows)` (beam search / best-of-N / multi-query: row b of the result is row rows[b]
of the input, sharing its blocks, refcounts recomputed, rows dropped free their blocks),
`check(cache)` (invariants), `occupancy(cache)` (blocks in use, bytes), `fragmentation(cache)`
(allocated slots per sequence holding no token a future query sees), `block_hashes` /
`PrefixIndex` (hash chains of full prompt blocks: which blocks a batch of prompts can share).

Ours vs vLLM's PagedAttention (Kwon et al., SOSP 2023): the ideas are theirs — a block pool with
per-sequence block tables, on-demand allocation, reference counts with copy-on-write for forked
sequences (parallel sampling, beam search), and prefix blocks identified by the hash of their
tokens and of the prefix before them (vLLM's automatic prefix caching). What is ours: it is
pure functional JAX (allocation by argsort over the refcounts inside the jitted step, no free-list
object, no custom kernel: attention reads the gathered blocks as a dense view); every layer
holds its own table and refcounts (identical across layers, as the allocation is deterministic);
a row that writes into a shared block always copies it (vLLM lets the last holder write in
place); window/sink over pages (block-granular freeing) is ours (vLLM frees sliding-window blocks
similarly, but has no attention-sink layout); prefix sharing is executed as prefill the common
prefix once with batch 1, then `fork` and feed each row's suffix (no scheduler, no cache of past
requests' blocks). No code was taken from vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.base import EMPTY, Policy, SlotState, View, held_sorted
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.limits import Bounded
from kvpolicies.memory import tree_nbytes
from kvpolicies.slots import concat, encode_new, view_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedState:
    """A layer's block pool, slot positions, block tables, refcounts and exhaustion flag (see the
    module docstring for shapes)."""

    k: Any  # [NB, K, blk, ...]
    v: Any  # [NB, K, blk, ...]
    pos: Int[Array, "NB blk"]
    table: Int[Array, "B M"]
    refs: Int[Array, "NB"]
    overflow: Int[Array, "1"]

    def held(self, row: int, kv_heads: int, policy: Any) -> list[np.ndarray]:
        """The positions in the blocks row `row`'s table points at (shared by the kv heads)."""
        ids = np.asarray(self.table[row])
        return [held_sorted(np.asarray(self.pos)[ids[ids >= 0]].reshape(-1))] * kv_heads

    @staticmethod
    def join_rows(states: list) -> "PagedState":
        return concat_rows(states)  # pools joined, tables re-based


@dataclasses.dataclass(frozen=True)
class Paged(Bounded, Policy):
    """Paged storage of `full` (window=None), `window` (n_sink=0) or `sink` (StreamingLLM, both
    position modes): the same visibility and RoPE as the dense policy, stored in blocks of
    `block` tokens from a pool of `blocks` blocks per layer (None: batch x blocks a row needs)."""

    block: int = 16
    window: int | None = None
    n_sink: int = 0
    positions: Literal["original", "cache"] = "cache"
    blocks: int | None = None
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("paged", "block", self.block, 1)
        if self.window is not None:
            check_int("paged", "window", self.window, 1)
        check_int("paged", "n_sink", self.n_sink, 0)
        if self.window is None and self.n_sink:
            raise ValueError(f"paged.n_sink={self.n_sink!r}: sinks need a window (window=None keeps every token)")
        check_choice("paged", "positions", self.positions, ("original", "cache"))
        if self.blocks is not None:
            check_int("paged", "blocks", self.blocks, 1)

    # -- sizes ---------------------------------------------------------------------------
    def dense(self) -> Policy:
        """The dense policy with the same visibility and RoPE (what this layout must equal)."""
        from kvpolicies.full import Full
        from kvpolicies.sink import Sink
        from kvpolicies.window import Window

        if self.window is None:
            return Full(codec=self.codec)
        if self.n_sink == 0:
            return Window(window=self.window, codec=self.codec)
        return Sink(n_sink=self.n_sink, window=self.window, positions=self.positions, codec=self.codec)

    def _split(self) -> tuple[int, int | None]:
        """(sink entries, ring entries) of the table; ring None: `full` (entry j = block j)."""
        if self.window is None:
            return 0, None
        return -(-self.n_sink // self.block), (self.window - 1) // self.block + 2

    def table_len(self, max_len: int) -> int:
        """M: entries of a row's block table."""
        ns, ring = self._split()
        return -(-max_len // self.block) if ring is None else ns + ring

    def blocks_per_row(self, max_len: int) -> int:
        """The most blocks one sequence of up to max_len tokens holds at once."""
        return min(self.table_len(max_len), -(-max_len // self.block))

    def capacity(self, max_len: int) -> int:
        """Slots one sequence can hold at once (its peak blocks x block)."""
        return self.blocks_per_row(max_len) * self.block

    @property
    def ring_buffer(self) -> bool:
        """With a window, the table's ring entries are reused: any position fits (`limits.Ring`)."""
        return self.window is not None

    def limit(self, state: PagedState) -> int | None:
        """`full` layout: entry j holds positions [j*blk, (j+1)*blk), so M*blk positions (`Bounded`)."""
        return None if self.window is not None else int(state.table.shape[-1]) * self.block

    def pool_blocks(self, batch: int, max_len: int) -> int:
        return batch * self.blocks_per_row(max_len) if self.blocks is None else self.blocks

    def init(self, batch, kv_heads, head_dim, dtype, max_len) -> PagedState:
        nb, m = self.pool_blocks(batch, max_len), self.table_len(max_len)
        shape = (nb, kv_heads, self.block, head_dim)  # [NB, K, blk, D]
        return PagedState(k=self.codec.init(shape, dtype), v=self.codec.init(shape, dtype),
                          pos=jnp.full((nb, self.block), EMPTY, jnp.int32),
                          table=jnp.full((batch, m), EMPTY, jnp.int32),
                          refs=jnp.zeros((nb,), jnp.int32), overflow=jnp.zeros((1,), jnp.int32))

    # -- one step ------------------------------------------------------------------------
    def extend(self, state: PagedState, k: Float[Array, "B K T D"], v: Float[Array, "B K T D"],
               pos: Int[Array, "B T"]) -> View:
        b, m = state.table.shape
        ids = jnp.maximum(state.table, 0)  # [B, M]

        def gather(leaf):  # [NB, K, blk, ...] -> [B, K, M*blk, ...]
            g = jnp.moveaxis(leaf[ids], 2, 1)  # [B, K, M, blk, ...]
            return g.reshape(g.shape[:2] + (m * self.block,) + g.shape[4:])

        old_pos = jnp.where(state.table[..., None] >= 0, state.pos[ids], EMPTY)  # [B, M, blk]
        old = SlotState(k=jax.tree.map(gather, state.k), v=jax.tree.map(gather, state.v),
                        pos=old_pos.reshape(b, 1, m * self.block))  # [B, 1, M*blk]
        new = encode_new(self.codec, k, v, pos)  # T slots
        slots = concat(old, new)  # [B, K, S, ...]
        dense = self.dense()
        kw = {}
        if self.window is not None:
            kp = slots.pos[:, :, None, :]  # [B, 1, 1, S]
            kw["mask"] = (kp < self.n_sink) | (kp > pos[:, None, :, None] - self.window)  # [B, 1, T, S]
        if self.n_sink and self.positions == "cache":
            kw["rope"] = dense._rope(pos, slots.pos)  # StreamingLLM's ranks: a function of positions only
        view = view_of(self.codec, slots, pos, k.dtype, carry=(state, new, pos), **kw)
        poison = jnp.where(state.overflow > 0, jnp.nan, 0).astype(view.v.dtype)  # exhausted pool: NaN, never silent
        return dataclasses.replace(view, v=view.v + poison)

    def _entry(self, j, ns, ring):
        """Table entry of logical block j."""
        return j if ring is None else jnp.where(j < ns, j, ns + (j - ns) % ring)

    def _targets(self, last, m, ns, ring):
        """[B, M] the logical block each table entry must hold after a step whose last position
        per row is `last` [B] (-1: none)."""
        s = jnp.arange(m)[None, :]  # [1, M]
        hi = (last // self.block)[:, None]  # [B, 1] the newest block
        if ring is None:
            return jnp.where(s <= hi, s, EMPTY)
        # oldest window block a future query (position >= last + 1) sees: its last token > last + 1 - window
        lo = jnp.maximum((last[:, None] - self.window + 2) // self.block, ns)  # [B, 1]
        jr = lo + (s - lo) % ring  # the unique j in [lo, lo + ring) whose entry is s (for s >= ns)
        jr = jnp.where(jr <= hi, jr, EMPTY)
        return jnp.where(s < ns, jnp.where(s <= hi, s, EMPTY), jr)  # [B, M]

    def compact(self, view: View, seen) -> PagedState:
        state, new, pos = view.carry
        b, m = state.table.shape
        nb = state.refs.shape[0]
        ns, ring = self._split()
        last = pos[:, -1]  # [B]
        rows = jnp.arange(b)[:, None]  # [B, 1]
        target = self._targets(last, m, ns, ring)  # [B, M]

        # which new tokens are kept (their block is still live) and which entries they write
        tok_j = pos // self.block  # [B, T]
        tok_e = self._entry(tok_j, ns, ring)  # [B, T]
        keep_tok = tok_j == jnp.take_along_axis(target, tok_e, axis=1)  # [B, T]
        writes = jnp.zeros((b, m), bool).at[rows, tok_e].max(keep_tok)  # [B, M]

        table, refs = state.table, state.refs
        ids = jnp.maximum(table, 0)  # [B, M]
        held = jnp.where(table >= 0, state.pos[ids].max(axis=-1) // self.block, EMPTY)  # [B, M] logical block held
        keep = (table >= 0) & (held == target)  # [B, M]
        release = (table >= 0) & ~keep  # dead blocks
        cow = keep & writes & (refs[ids] > 1)  # shared block about to be written: copy it first
        need = writes & (~keep | cow)  # a fresh block, or the copy

        refs = refs.at[jnp.where(release | cow, table, nb)].add(-1, mode="drop")
        free = refs == 0  # [NB]
        free_ids = jnp.argsort(~free, stable=True)  # free blocks first, ascending
        key = jnp.where(need, target * b + rows, jnp.iinfo(jnp.int32).max).reshape(-1)  # logical block, then row
        order = jnp.argsort(key, stable=True)
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size)).reshape(b, m)  # [B, M]
        got = need & (rank < free.sum())
        new_id = jnp.where(got, free_ids[jnp.minimum(rank, nb - 1)], EMPTY)  # [B, M]
        overflow = state.overflow | (need.sum() > free.sum()).astype(jnp.int32)
        refs = refs.at[jnp.where(got, new_id, nb)].add(1, mode="drop")
        table = jnp.where(need, new_id, jnp.where(keep, table, EMPTY))  # [B, M]

        # new blocks: a copy of the shared block (copy-on-write) or empty positions (fresh)
        dst = jnp.where(got, new_id, nb)  # [B, M], out of range = no block
        src = jnp.maximum(jnp.where(cow, state.table, new_id), 0)  # [B, M]
        copy = lambda buf: buf.at[dst].set(buf[src], mode="drop")  # noqa: E731
        k_pool, v_pool = jax.tree.map(copy, state.k), jax.tree.map(copy, state.v)
        pos_pool = state.pos.at[dst].set(jnp.where(cow[..., None], state.pos[src], EMPTY), mode="drop")

        # the kept new tokens into their blocks
        blk_of = jnp.take_along_axis(table, tok_e, axis=1)  # [B, T]
        at = jnp.where(keep_tok & (blk_of >= 0), blk_of, nb)  # [B, T]
        off = pos % self.block  # [B, T]
        put = lambda buf, x: buf.at[at, :, off].set(jnp.swapaxes(x, 1, 2).astype(buf.dtype), mode="drop")  # noqa: E731
        k_pool = jax.tree.map(put, k_pool, new.k)  # x [B, K, T, ...] -> [B, T, K, ...]
        v_pool = jax.tree.map(put, v_pool, new.v)
        pos_pool = pos_pool.at[at, off].set(pos, mode="drop")
        return PagedState(k=k_pool, v=v_pool, pos=pos_pool, table=table, refs=refs, overflow=overflow)

    # -- accounting ----------------------------------------------------------------------
    def decode_reads(self, state, context):
        """The blocks the row's table points at when the query at `context` is decoded (its
        table entries' blocks: full every block so far, window/sink the live ones) and the table."""
        nb, blk = state.refs.shape[-1], self.block
        ns, ring = self._split()
        filled = context // blk + 1
        live = filled if ring is None else min(filled, ns + ring)
        per_block_kv = tree_nbytes((state.k, state.v)) // nb
        per_block_pos = tree_nbytes(state.pos) // nb
        b = state.table.shape[0]
        table = tree_nbytes(state.table) // b
        return per_block_kv * live, per_block_pos * live + table


# ---------------------------------------------------------------------------------------------
# Host-side helpers: pure functions over a state or the Engine's cache (tuple of stacked states).
# ---------------------------------------------------------------------------------------------


def _states(cache) -> list[PagedState]:
    return [s for s in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, PagedState)) if isinstance(s, PagedState)]


def count_refs(table: Int[Array, "... B M"], n_blocks: int) -> Int[Array, "... NB"]:
    """References to each block from the tables (entries < 0 count for nothing)."""
    lead = table.shape[:-2]
    flat = table.reshape((-1,) + table.shape[-2:])  # [L, B, M]
    one = lambda t: jnp.zeros((n_blocks,), jnp.int32).at[jnp.where(t >= 0, t, n_blocks)].add(1, mode="drop")  # noqa: E731
    return jax.vmap(one)(flat).reshape(lead + (n_blocks,))


def fork(cache: PagedState | tuple[PagedState, ...], rows: Sequence[int]) -> PagedState | tuple[PagedState, ...]:
    """Row b of the result is row rows[b] of `cache` (beam search's reorder, best-of-N, several
    queries over one prompt): tables are copied, blocks shared, refcounts recomputed; a row left
    out releases its blocks. No key or value is copied (a write into a shared block copies it).
    The pool arrays are the input's (a jitted step that donates the result invalidates both).
    `rows`: a non-empty sequence of ints in [0, B) (ValueError otherwise)."""
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"fork: rows must be a non-empty sequence of row indices, got {rows!r}")
    idx = jnp.asarray(arr.astype(np.int32))

    def one(st):
        if not isinstance(st, PagedState):
            raise ValueError(f"fork: a paged cache, got {type(st).__name__}")
        b = st.table.shape[-2]
        if arr.min() < 0 or arr.max() >= b:
            raise ValueError(f"fork: rows {arr.tolist()} must be in [0, {b}) (the cache has {b} rows)")
        table = jnp.take(st.table, idx, axis=-2)  # [..., B', M]
        return dataclasses.replace(st, table=table, refs=count_refs(table, st.refs.shape[-1]))

    return one(cache) if isinstance(cache, PagedState) else tuple(one(s) for s in cache)


def concat_rows(states: Sequence[PagedState]) -> PagedState:
    """One state whose rows are those of `states` in order (each its own pool): the pools are
    joined and every table re-based onto its pool's new offset (Engine's ragged batches)."""
    axis = states[0].table.ndim - 2  # the pool axis: 0, or 1 under a leading layer axis
    offset, tables = 0, []
    for st in states:
        tables.append(jnp.where(st.table >= 0, st.table + offset, EMPTY))
        offset += st.refs.shape[-1]
    cat = lambda *xs: jnp.concatenate(xs, axis=axis)  # noqa: E731
    return PagedState(k=jax.tree.map(cat, *[s.k for s in states]), v=jax.tree.map(cat, *[s.v for s in states]),
                      pos=cat(*[s.pos for s in states]), table=cat(*tables), refs=cat(*[s.refs for s in states]),
                      overflow=jnp.max(jnp.stack([s.overflow for s in states]), axis=0))


def check(cache) -> None:
    """Raise ValueError unless every state's invariants hold: no exhausted pool; refcount of
    each block = number of table entries pointing at it; a row's entries point at distinct
    blocks; every referenced block holds a token and a free block is referenced by no table."""
    for i, st in enumerate(_states(cache)):
        nb = st.refs.shape[-1]
        if np.asarray(st.overflow).any():
            raise ValueError(f"paged cache (run {i}): the pool of {nb} blocks per layer was exhausted (writes were "
                             f"dropped); give Paged a larger `blocks` or fewer rows")
        table, refs, pos = np.asarray(st.table), np.asarray(st.refs), np.asarray(st.pos)
        want = np.asarray(count_refs(st.table, nb))
        if not (refs == want).all():
            raise ValueError(f"paged cache (run {i}): refcounts {refs.reshape(-1, nb)[0]} != table references "
                             f"{want.reshape(-1, nb)[0]}")
        t = table.reshape((-1,) + table.shape[-2:])
        for row in t.reshape(-1, t.shape[-1]):
            used = row[row >= 0]
            if len(set(used.tolist())) != len(used):
                raise ValueError(f"paged cache (run {i}): a row's table points twice at one block: {row}")
        held = (pos.reshape((-1,) + pos.shape[-2:]) >= 0).any(-1)  # [L, NB]
        if ((refs.reshape(held.shape) > 0) & ~held).any():
            raise ValueError(f"paged cache (run {i}): a referenced block holds no token")


def occupancy(cache) -> dict[str, int]:
    """Blocks in use (refcount > 0, a shared block once) and in the pool, summed over layers,
    and the bytes of the used blocks (keys, values, scales and slot positions)."""
    used = total = nbytes = 0
    for st in _states(cache):
        refs = np.asarray(st.refs)
        per_block = tree_nbytes((st.k, st.v, st.pos)) // refs.size  # one block of one layer
        u = int((refs > 0).sum())
        used, total, nbytes = used + u, total + refs.size, nbytes + u * per_block
    return {"used_blocks": used, "pool_blocks": total, "used_bytes": nbytes}


def fragmentation(cache, policy: Paged, next_pos: Sequence[int] | int) -> dict[str, Any]:
    """Per sequence (first layer), slots of its blocks that hold no token a future query sees:
    `unwritten` (the newest block's tail: vLLM's internal fragmentation, < 1 block) and `evicted`
    (tokens out of every future window still held in a live block, window/sink only, < 1 block),
    for rows whose next query is at position next_pos[b]."""
    st = _states(cache)[0]
    table, pos = np.asarray(st.table), np.asarray(st.pos)
    table = table.reshape((-1,) + table.shape[-2:])[0]  # [B, M] first layer
    pos = pos.reshape((-1,) + pos.shape[-2:])[0]  # [NB, blk]
    nxt = np.broadcast_to(np.asarray(next_pos), (table.shape[0],))
    unwritten, evicted, blocks = [], [], []
    for b, row in enumerate(table):
        p = pos[row[row >= 0]]  # [n, blk]
        blocks.append(len(p))
        unwritten.append(int((p < 0).sum()))
        if policy.window is None:
            evicted.append(0)
        else:
            seen = (p < policy.n_sink) | (p > nxt[b] - policy.window)
            evicted.append(int(((p >= 0) & ~seen).sum()))
    return {"blocks": blocks, "unwritten": unwritten, "evicted": evicted, "block": policy.block}


# -- prefix sharing: hash chains of full prompt blocks (vLLM's automatic prefix caching key) ------


def block_hashes(tokens: Sequence[int], block: int) -> list[str]:
    """The hash of each *full* block of `tokens`: sha256 of (the previous block's hash, this
    block's ids), so equal hashes mean equal whole prefixes, not just equal blocks."""
    out, parent = [], ""
    ids = np.asarray(tokens, np.int64)
    for j in range(len(ids) // block):
        parent = hashlib.sha256(parent.encode() + ids[j * block:(j + 1) * block].tobytes()).hexdigest()
        out.append(parent)
    return out


class PrefixIndex:
    """Maps block hashes to physical block ids: `lookup` gives the longest run of a prompt's full
    blocks already stored, `insert` records a prompt's blocks (host side, ours: no eviction)."""

    def __init__(self, block: int):
        self.block = block
        self.blocks: dict[str, int] = {}

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """Physical ids of the prompt's leading full blocks found in the index."""
        out = []
        for h in block_hashes(tokens, self.block):
            if h not in self.blocks:
                break
            out.append(self.blocks[h])
        return out

    def insert(self, tokens: Sequence[int], ids: Sequence[int]) -> None:
        for h, i in zip(block_hashes(tokens, self.block), ids):
            self.blocks.setdefault(h, int(i))


def shared_blocks(prompts: Sequence[Sequence[int]], block: int) -> dict[str, int]:
    """Blocks a batch of prompts needs with and without sharing full prefix blocks (partial last
    blocks are never shared): `independent` = sum of ceil(len / block), `shared` = distinct hash
    chains + each prompt's partial block, `shared_tokens` = prompt tokens whose block is another
    prompt's (not prefilled again)."""
    seen: set[str] = set()
    indep = shared = saved = 0
    for p in prompts:
        hs = block_hashes(p, block)
        indep += -(-len(p) // block)
        shared += (len(p) % block > 0)
        for h in hs:
            if h in seen:
                saved += block
            else:
                seen.add(h)
                shared += 1
    return {"independent": indep, "shared": shared, "shared_tokens": saved}


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all prompts share."""
    a = [np.asarray(p) for p in prompts]
    n = min(len(p) for p in a)
    for i in range(n):
        if any(p[i] != a[0][i] for p in a[1:]):
            return i
    return n


__all__ = ["Paged", "PagedState", "PrefixIndex", "block_hashes", "check", "common_prefix", "concat_rows", "count_refs",
           "fork",
           "fragmentation", "occupancy", "shared_blocks"]
