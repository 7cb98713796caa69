"""The blocked online softmax: a chunk (T > 1) over more than `Tuning.block` slots folds them
block by block into a running max, normaliser and output per query, so its [B, K, G, T, S]
logits never materialise (docs/design/attention.md).

The stored slots are cut into whole blocks (a `Block` each, scanned) and a remainder; the
chunk's own appended slots are read as one piece, or, for a chunk of more than `block` tokens
(read in query tiles of `block`), in tiles of `block` slots. A `joined` view (`View.joined`) is
cut as if its appended slots were stored after the others: the stored slots' whole blocks read
where they lie, then the rest of them and the new slots concatenated (at most block - 1 + T
slots copied) and cut into whole blocks and a remainder, so the blocks and pieces are those of a
view of S + T stored slots. How each block is read (skipped,
whole, masked) is decided for all blocks at once, before any is read; a loop then reads only
the blocks some query sees, in slot order. Its trip count is traced (a while loop), so
reverse-mode autodiff does not pass through a blocked chunk.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from kvpolicies.attention.logits import LOWEST, Step, masked_logits, sum_groups, visibility
from kvpolicies.attention.tuning import Tuning


class Block(NamedTuple):
    """Slots read together, as arrays; with a leading [n] axis, n blocks (a scan's xs).
    k, v [B, K, s, D]; pos, bias, seg [B, Kp, s] (bias, seg None when the view has none);
    mask [B, Kp, T, s] the view's own mask cut to the queries (None: none)."""

    k: Any
    v: Any
    pos: Any
    mask: Any
    bias: Any
    seg: Any


class Layout(NamedTuple):
    """How the view's slots are cut: the stored part [lo, hi) as n whole blocks (`stored`) and a
    remainder of `rest` slots; the appended part [a_lo, a_hi) in tiles padded with `a_fill`
    empty slots (`appended`), or None when it is read as one piece. A joined view: `tail`, the
    stored remainder and the appended slots as one sequence (in place of both)."""

    lo: int
    hi: int
    n: int
    rest: int
    stored: Block | None
    appended: Block | None
    a_lo: int
    a_hi: int
    a_fill: int
    tail: Tail | None = None


class Tail(NamedTuple):
    """A joined view's last slots [lo, hi): the stored remainder then the appended slots, keys and
    values [B, K, hi - lo, D] concatenated, as n whole blocks (`blocks`, None when n is 0) and a
    remainder."""

    lo: int
    hi: int
    k: Any
    v: Any
    n: int
    blocks: Block | None


class Tile(NamedTuple):
    """Queries read together: qs P x [B, K, G, tq, D] at pos [B, tq]; mask: the view's mask cut to
    them; real [tq]: the queries that are not a tile's padding (None: all)."""

    qs: list
    pos: Any
    mask: Any
    real: Any


def as_blocks(st: Step, kp, vp, lo: int, hi: int, block: int, fill: int = 0) -> Block:
    """Slots [lo, hi) as whole blocks (mask None: added per query tile by `with_mask`). fill:
    empty slots (position -1) appended to make the last block whole."""
    view = st.view
    split = lambda x, pattern: None if x is None else rearrange(x, pattern, s=block)  # noqa: E731
    grow = lambda x, value=0: None if x is None else jnp.pad(  # noqa: E731  the last axis: + fill
        x[..., lo:hi], [(0, 0)] * (x.ndim - 1) + [(0, fill)], constant_values=value)
    kv_pad = [(0, 0), (0, 0), (0, fill), (0, 0)]
    return Block(split(jnp.pad(kp, kv_pad), "B K (n s) D -> n B K s D"),
                 split(jnp.pad(vp, kv_pad), "B K (n s) D -> n B K s D"),
                 split(grow(view.pos, -1), "B P (n s) -> n B P s"), None,
                 split(grow(view.bias), "B P (n s) -> n B P s"), split(grow(view.rope.seg), "B P (n s) -> n B P s"))


def with_mask(xs: Block, vmask_q, lo: int, hi: int, block: int, fill: int = 0) -> Block:
    """Blocks with the view's mask (cut to a query tile) added."""
    vm = None if vmask_q is None else rearrange(
        jnp.pad(vmask_q[..., lo:hi], [(0, 0)] * 3 + [(0, fill)]), "B P T (n s) -> n B P T s", s=block)
    return xs._replace(mask=vm)


def layout(st: Step, tiled: bool, block: int) -> Layout:
    """The stored part in whole blocks and a remainder; the appended part in tiles when `tiled`."""
    (lo, hi), kp, vp = st.cuts[0], st.keys[0], st.vals[0]
    n, rest = divmod(hi - lo, block)
    stored = as_blocks(st, kp[:, :, :n * block], vp[:, :, :n * block], lo, lo + n * block, block) if n else None
    if st.view.joined and len(st.cuts) > 1:
        return Layout(lo, hi, n, 0, stored, None, 0, 0, 0, joined_tail(st, lo + n * block, n * block, block))
    appended, a_lo, a_hi, a_fill = None, 0, 0, 0
    if tiled and len(st.cuts) > 1:  # the appended part in tiles, padded with empty slots
        (a_lo, a_hi), = st.cuts[1:]
        a_fill = -(a_hi - a_lo) % block
        appended = as_blocks(st, st.keys[1], st.vals[1], a_lo, a_hi, block, a_fill)
    return Layout(lo, hi, n, rest, stored, appended, a_lo, a_hi, a_fill)


def joined_tail(st: Step, lo: int, a: int, block: int) -> Tail:
    """A joined view's slots from view slot `lo` (stored slot `a`) on, as one sequence."""
    (_, hi), = st.cuts[-1:]
    k = jnp.concatenate([st.keys[0][:, :, a:]] + list(st.keys[1:]), axis=2)  # [B, K, hi - lo, D]
    v = jnp.concatenate([st.vals[0][:, :, a:]] + list(st.vals[1:]), axis=2)
    n = (hi - lo) // block
    blocks = as_blocks(st, k[:, :, :n * block], v[:, :, :n * block], lo, lo + n * block, block) if n else None
    return Tail(lo, hi, k, v, n, blocks)


def piece(st: Step, vmask_q, lo: int, hi: int, kp, vp, a=None, b=None) -> Block:
    """The view's per-slot fields of slots [lo, hi), kp/vp cut to [a, b)."""
    cut = lambda x: None if x is None else x[..., lo:hi]  # noqa: E731
    view = st.view
    return Block(kp[:, :, a:b], vp[:, :, a:b], view.pos[..., lo:hi], cut(vmask_q), cut(view.bias),
                 cut(view.rope.seg))


def parts(st: Step, lay: Layout, vmask_q, block: int, one, many) -> list:
    """one(x) for the remainder and the untiled appended parts, many(xs) for the scanned blocks,
    over the view's slots in order: the list of their results."""
    lo, hi, n = lay.lo, lay.hi, lay.n
    got = [many(with_mask(lay.stored, vmask_q, lo, lo + n * block, block))] if n else []
    if lay.tail is not None:  # joined: the tail's whole blocks, then its remainder
        tl = lay.tail
        t_mid = tl.lo + tl.n * block
        if tl.n:
            got.append(many(with_mask(tl.blocks, vmask_q, tl.lo, t_mid, block)))
        if t_mid < tl.hi:
            got.append(one(piece(st, vmask_q, t_mid, tl.hi, tl.k, tl.v, tl.n * block, None)))
        return got
    if lay.rest:
        got.append(one(piece(st, vmask_q, lo + n * block, hi, st.keys[0], st.vals[0], n * block, None)))
    if lay.appended is not None:  # the appended slots in tiles
        got.append(many(with_mask(lay.appended, vmask_q, lay.a_lo, lay.a_hi, block, lay.a_fill)))
    else:
        got += [one(piece(st, vmask_q, c_lo, c_hi, c_kp, c_vp))
                for (c_lo, c_hi), c_kp, c_vp in zip(st.cuts[1:], st.keys[1:], st.vals[1:])]
    return got


def fold(st: Step, tl: Tile, tuning: Tuning, carry, x: Block, mask=None):
    """One block of slots into the running softmax (top, total, acc, seen)."""
    top, total, acc, seen = carry
    every = mask is True  # every query sees every slot: no mask applied
    lg, mask = masked_logits(st, x.k, x.pos, x.mask, x.bias, x.seg, None, (tl.qs, tl.pos), mask=mask)
    shape = lg.shape  # [B, K, G, tq, s]
    if tuning.flat_rows:  # the softmax's elementwise passes over [(B K G tq), s] rows (bitcasts, free)
        lg, top, total = (rearrange(a, "B K G T S -> (B K G T) S") for a in (lg, top, total))
    if every and x.bias is None:  # unscaled logits: scale their max, and inside the exp
        # (the same numbers: rounding is monotonic, so max(scale * lg) = scale * max(lg))
        new_top = jnp.maximum(top, lg.max(axis=-1, keepdims=True) * st.scale)
        e = jnp.exp(lg * st.scale - new_top)
    else:
        new_top = jnp.maximum(top, lg.max(axis=-1, keepdims=True))
        # masked logits are float32's lowest, so exp(lg - new_top) = 0 once any slot was visible; the
        # blocks before that (all masked, top = lowest) add exp(0) = 1s, which the first visible
        # slot's decay exp(lowest - top) = 0 erases exactly (a query always sees itself)
        e = jnp.exp(lg - new_top)
    decay = jnp.exp(top - new_top)
    total = total * decay + e.sum(axis=-1, keepdims=True)
    if tuning.flat_rows:
        e = e.reshape(shape)
        new_top, total, decay = (a.reshape(shape[:-1] + (1,)) for a in (new_top, total, decay))
    pv = jnp.einsum("BKGTS,BKSD->BKGTD", e.astype(x.v.dtype), x.v, preferred_element_type=jnp.float32)
    count = x.k.shape[2] if every else mask.sum(axis=-1, dtype=jnp.int32)  # visible slots per query
    return new_top, total, acc * decay + pv, seen + count


def branches(xs: Block, q_pos):
    """How each of the n blocks xs is read, from all their visibility masks at once: [n] int32,
    0 skipped (no query sees a slot of it), 1 whole (every query sees every slot: no mask
    applied), 2 masked; with RoPE segments (sink in cache mode), + 2 for a block whose slots
    all pair with segment 0's query rotation (one logits matmul, not one per segment)."""
    n = xs.pos.shape[0]
    if xs.mask is None:  # causal only: from the queries' extremes, per batch row (the same answer)
        filled = xs.pos >= 0  # [n, B, Kp, block]
        q_max, q_min = (f(q_pos, axis=1)[None, :, None, None] for f in (jnp.max, jnp.min))  # [1, B, 1, 1]
        some = (filled & (xs.pos <= q_max)).reshape(n, -1).any(axis=1)
        every = (filled & (xs.pos <= q_min)).reshape(n, -1).all(axis=1)
    else:
        mask = jax.vmap(lambda p, vm: visibility(p, vm, None, q_pos))(xs.pos, xs.mask).reshape(n, -1)
        some, every = mask.any(axis=1), mask.all(axis=1)
    branch = jnp.where(every, 1, jnp.where(some, 2, 0))
    if xs.seg is not None:
        branch = jnp.where((branch > 0) & (xs.seg == 0).reshape(xs.seg.shape[0], -1).all(axis=1), branch + 2, branch)
    return branch


def reads(x: Block, q_pos, run):
    """run(x, mask) for branches 1, 2 (3, 4) of a block x, as thunks."""
    mask = lambda: visibility(x.pos, x.mask, None, q_pos)  # noqa: E731  [B, Kp, 1, tq, block]
    fns = [lambda: run(x, True), lambda: run(x, mask())]
    if x.seg is not None:
        one = x._replace(seg=None)
        fns += [lambda: run(one, True), lambda: run(one, mask())]
    return fns


def fold_blocks(st: Step, tl: Tile, tuning: Tuning, carry, xs: Block):
    """The n blocks xs folded into the running softmax: only those some query sees, in slot
    order (a loop over their count: a skipped block costs nothing), each read whole or masked."""
    if not tuning.skip_blocks:  # every block masked
        return jax.lax.scan(lambda c, x: (fold(st, tl, tuning, c, x, mask=visibility(x.pos, x.mask, None, tl.pos)),
                                          None), carry, xs)[0]
    branch = branches(xs, tl.pos)
    order = jnp.argsort(branch == 0, stable=True)  # the blocks to read first, in slot order

    def body(i, c):
        j = order[i]
        x = jax.tree.map(lambda a: a[j], xs)
        return jax.lax.switch(branch[j] - 1, reads(x, tl.pos, lambda x, mask: fold(st, tl, tuning, c, x, mask=mask)))

    return jax.lax.fori_loop(0, (branch > 0).sum(), body, carry)


def fold_piece(st: Step, tl: Tile, tuning: Tuning, carry, x: Block):
    """A piece outside the blocks (the stored remainder, the chunk's own slots) into the running
    softmax; with RoPE segments, one logits matmul when all its slots pair with segment 0's query
    rotation (a chunk's own tokens, once past the sinks)."""
    if x.seg is None or not tuning.skip_blocks:
        return fold(st, tl, tuning, carry, x)
    return jax.lax.cond((x.seg == 0).all(), lambda: fold(st, tl, tuning, carry, x._replace(seg=None)),
                        lambda: fold(st, tl, tuning, carry, x))


def tile(st: Step, lay: Layout, tl: Tile, tuning: Tuning, columns: bool, tiled: bool):
    """One query tile's attention over every slot: (output [B, K, G, tq, D] in the values' dtype,
    the most keys one of its queries attended, its column sums [B, K, S'] or None)."""
    b_, k_, g_, t_, _ = tl.qs[0].shape
    carry = (jnp.full((b_, k_, g_, t_, 1), LOWEST), jnp.zeros((b_, k_, g_, t_, 1), jnp.float32),
             jnp.zeros((b_, k_, g_, t_, st.vals[0].shape[-1]), jnp.float32),
             jnp.zeros(st.view.pos.shape[:2] + (1, t_), jnp.int32))
    for f in parts(st, lay, tl.mask, tuning.block, lambda x: lambda c: fold_piece(st, tl, tuning, c, x),
                   lambda xs: lambda c: fold_blocks(st, tl, tuning, c, xs)):
        carry = f(carry)
    top, total, acc, seen = carry
    if tiled:  # in tiles, a query that saw no slot (none in practice: a query sees itself) has
        total = jnp.where(total > 0, total, 1)  # skipped every block: 0, not 0 / 0
    out = (acc / total).astype(st.vals[0].dtype)
    if not columns:
        return out, seen.max(), None
    return out, seen.max(), tile_columns(st, lay, tl, tuning, top, total)


def tile_columns(st: Step, lay: Layout, tl: Tile, tuning: Tuning, top, total):
    """[B, K, S'] the attention each slot received from the tile's queries (summed over G and the
    queries): a second pass over the same blocks with the final max and normaliser."""
    b_, k_ = tl.qs[0].shape[:2]
    weight = 1 / total if tl.real is None else jnp.where(tl.real[:, None], 1 / total, 0)  # [B, K, G, tq, 1]

    def column(x: Block, mask=None):  # [B, K, s]: a block's probabilities, summed
        lg, _ = masked_logits(st, x.k, x.pos, x.mask, x.bias, x.seg, None, (tl.qs, tl.pos), mask=mask)
        if mask is True and x.bias is None:  # unscaled logits (as in fold)
            lg = lg * st.scale
        return sum_groups(jnp.exp(lg - top) * weight).sum(axis=2)

    def column_blocks(xs: Block):  # the scanned blocks' column sums, in slot order: [B, K, n x block]
        if tuning.skip_blocks:
            zero = jnp.zeros((b_, k_, tuning.block), jnp.float32)
            got = jax.lax.scan(lambda c, xb: (c, jax.lax.switch(xb[1], [lambda: zero] + reads(xb[0], tl.pos, column))),
                               None, (xs, branches(xs, tl.pos)))[1]
        else:
            got = jax.lax.scan(lambda c, x: (c, column(x, visibility(x.pos, x.mask, None, tl.pos))), None, xs)[1]
        return rearrange(got, "n B K s -> B K (n s)")

    cols = jnp.concatenate(parts(st, lay, tl.mask, tuning.block, column, column_blocks), axis=-1)
    if lay.appended is not None:
        cols = cols[..., :cols.shape[-1] - lay.a_fill]  # the appended tiles' empty fill
    return cols


def blocked(st: Step, tuning: Tuning, columns: bool = False):
    """Attention of a chunk in blocks: (output [B, K, G, T, D] in the values' dtype, the most keys
    any query attended (int32), the column sums [B, K, S'] float32 or None without `columns`).
    A chunk of more than `block` queries attends in query tiles of `block` (a lax.scan; queries
    padded to whole tiles with copies of the last query, dropped after)."""
    block, t, view = tuning.block, st.pos.shape[1], st.view
    tiled = t > block
    lay = layout(st, tiled, block)
    if not tiled:
        return tile(st, lay, Tile(st.qr, st.pos, view.mask, None), tuning, columns, tiled)
    mask_t = view.mask is not None and view.mask.shape[2] > 1  # the view's mask has a query axis
    n_q = -(-t // block)
    pad = n_q * block - t
    edge = lambda x, axis: jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)], mode="edge")  # noqa: E731
    by_tile = lambda x, axis: jnp.moveaxis(  # noqa: E731  [.., n_q x block, ..] -> [n_q, .., block, ..]
        x.reshape(x.shape[:axis] + (n_q, block) + x.shape[axis + 1:]), axis, 0)
    qs = [by_tile(edge(x, 3), 3) for x in st.qr]  # P x [n_q, B, K, G, block, D]
    q_pos = by_tile(edge(st.pos, 1), 1)  # [n_q, B, block]
    vmask = by_tile(edge(view.mask, 2), 2) if mask_t else None  # [n_q, B, Kp, block, S']
    real = (jnp.arange(n_q * block) < t).reshape(n_q, block)  # [n_q, block]: not padding

    def one(cols, x):
        qs_i, pos_i, vmask_i, real_i = x
        out, seen, c = tile(st, lay, Tile(list(qs_i), pos_i, vmask_i if mask_t else view.mask, real_i), tuning,
                            columns, tiled)
        return (cols if c is None else cols + c), (out, seen)

    cols = jnp.zeros((st.pos.shape[0], st.keys[0].shape[1], st.cuts[-1][1] - st.cuts[0][0]), jnp.float32) \
        if columns else None
    cols, (out, seen) = jax.lax.scan(one, cols, (tuple(qs), q_pos, vmask, real))
    out = rearrange(out, "n B K G s D -> B K G (n s) D")[:, :, :, :t]
    return out, seen.max(), cols
