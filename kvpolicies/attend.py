"""`attend`: one attention step through a cache policy; the one place where RoPE and masks are
applied, both from the positions the policy's view gives.

Shapes: B batch, T new tokens, N query heads = K kv heads x G groups, S view slots, D head dim,
Kp = 1 or K (slot positions shared by kv heads or per head), P RoPE segments.

The policy decides which slots exist and how they are seen (`extend` returns a `View`: slots,
positions, RoPE positions, its own visibility mask and logit bias), optionally narrows each
query's slots (`select`), and folds the step into its state (`compact`). This module applies
causality and empty-slot masking, RoPE and the softmax. Prefill and decode are the same call
with T >= 1; for a policy that evicts after every token (`per_token`), a chunk is a scan of
T single-token steps, so the chunk size never changes its result. Pure JAX: any Flax (NNX or
linen) or plain-JAX model can call it.

Sparse reads are this module's business too. A decode step (T == 1) of a policy that declares
`gathers = True` (Quest) asks `select(view, q_rot, None)` *before* any key is rotated; the policy
answers with a `Gather` (M static: the slots each kv head reads, e.g. its top_k pages), and the
step gathers only those slots' keys, values and positions and computes RoPE, the logits and the
softmax over M slots instead of S. The result is the masked step's: the same slots, the same
logits (the same rotations of the same keys), a softmax over the same set (masked slots weigh
exactly 0 there). Chunks (T > 1) keep the masked path. In a gathered step the per-slot fields of
`Seen` (scores, k_rot, logits) are over the Gather's M slots, in its order. A view whose keys and
values live in host memory (`kvpolicies.offload`) is read the same way: a gathered step moves only
the M slots to the device, a dense step the whole view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int

from kvpolicies import limits, offload
from kvpolicies.base import Deferred, Policy, Seen, SlotState, View, check_codec, take_slots, write_deferred  # noqa: F401  (re-exported)
from kvpolicies.rope import Rope, RopeTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Gather:
    """A decode step's sparse read, as data (`select`'s answer when `attend` asks with k_rot=None):
    per kv head, n blocks of `size` consecutive view slots, block i covering slots
    [start_i, start_i + size) (Quest: its pages). M = n x size is static; a block with ok False is
    not read (a missing candidate, a page past the cache), nor are its slots past the view's end;
    the blocks must not overlap. Blocks are gathered whole (contiguous size x D copies)."""

    start: Int[Array, "B K n"]
    ok: Bool[Array, "B K n"]
    size: int = dataclasses.field(default=1, metadata=dict(static=True))


def causal(q_pos: Int[Array, "B T"], k_pos: Int[Array, "B Kp S"]) -> Bool[Array, "B Kp T S"]:
    """Slot filled and not in the query's future."""
    k = k_pos[:, :, None, :]  # [B, Kp, 1, S]
    return (k >= 0) & (k <= q_pos[:, None, :, None])  # [B, Kp, T, S]


def attend(
    policy: Policy,
    state: SlotState,
    q: Float[Array, "B T N D"],
    k: Float[Array, "B T K D"],
    v: Float[Array, "B T K D"],
    pos: Int[Array, "B T"],
    rope: Rope | RopeTable,
    scale: float | None = None,
    defer: bool = False,
) -> tuple[Float[Array, "B T N D"], SlotState | Deferred]:
    """One attention step through `policy`: returns the outputs and the policy's new state.

    q, k, v are un-rotated projections of the T new tokens at absolute positions `pos`.
    Checked (kvpolicies.limits, docs/guide/checks.md): called eagerly, shapes, the state's layout
    and positions raise ValueError (negative, not increasing, not after the state's, past a bounded
    state's slots; an exhausted paged pool); inside jit, shapes raise and the outputs of queries at
    such positions are NaN. Rings (window, sink) take any position by design.
    Inside `record_visible()`, steps traced there also report the most keys any query attended.
    defer: where the step's writes can wait (`Policy.defer`: the new tokens of a `View.append`
    with a `start`, plus any per-index fields of the policy's own, e.g. Quest's page bounds),
    return them as `Deferred` instead of the new state; the caller writes them
    (`write_deferred`), e.g. a model after its layer loop, so the stored slots are never copied
    per layer (a single jitted step that writes into the state it reads makes XLA:CPU copy it).
    """
    limits.check_step(policy, state, q, k, v, pos)  # shapes; positions and layout when concrete (eager)
    out, new_state, visible = _attend(policy, state, q, k, v, pos, rope, scale, defer)
    if limits.concrete(state, pos):
        limits.check_cache(new_state, "attend: ")  # an exhausted paged pool, as an error
    else:  # inside a caller's jit: queries at positions the state cannot take give NaN
        out = limits.poison(out, policy, state, pos)
    if _RECORDERS:
        jax.debug.callback(_report, visible)
    return out, new_state


def _attend(policy, state, q, k, v, pos, rope, scale, defer=False):
    """`attend`, plus the most keys any query of the step attended (int32 scalar)."""
    if policy.per_token and q.shape[1] > 1:
        return _token_by_token(policy, state, q, k, v, pos, rope, scale)
    check_codec(policy)  # at trace time, before any compute
    n_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rotated = policy.rotated_keys  # stored keys are already rotated: rotate only the new ones, once
    k = rearrange(k, "B T K D -> B K T D")
    if rotated:
        k = rope.apply(k, pos[:, None, :])  # [B, K, T, D] at the tokens' positions
    view = policy.extend(state, k, rearrange(v, "B T K D -> B K T D"), pos)

    own = view  # the policy's own view: `compact` folds the step into the state from it
    rp = view.rope
    qh = rearrange(q, "B T (K G) D -> B K G T D", K=n_kv)
    qr = [rope.apply(qh, rp.q[:, None, None, :, p]) for p in range(rp.q.shape[-1])]  # P x [B, K, G, T, D]
    basis = view.basis  # values (and keys stored after RoPE) decoded in a codec's basis: `View.basis`
    if basis is not None and basis.after_rope:  # the keys are: rotate the queries into it instead
        if not rotated or "k_rot" in policy.observes or type(policy).select is not Policy.select:
            raise TypeError(f"{type(policy).__name__}: keys decoded in a codec's basis are read by attention only "
                            "(a policy with rotated_keys that neither observes k_rot nor selects)")
        qr = [basis.to_basis(x) for x in qr]
    gathered = q.shape[1] == 1 and policy.gathers
    if gathered:  # a sparse decode read: only the gathered slots are moved, rotated and attended
        gather = policy.select(view, qr[0], None)
        if not isinstance(gather, Gather):
            raise TypeError(f"{type(policy).__name__} gathers: select(view, q_rot, None) must return a Gather "
                            f"at decode (T == 1), got {type(gather).__name__}")
        view = _gathered_view(view, gather)  # S -> M slots below
    else:
        view = dataclasses.replace(view, k=offload.device(view.k), v=offload.device(view.v))  # a host tier: all of it
    rp = view.rope
    app = view.append  # the new tokens, read after the S stored slots (None: all in view.k)
    s = view.k.shape[2]
    kr = view.k if rotated else rope.apply(view.k, rp.k[..., :s])  # [B, K, S, D]
    # The view's S' slots in parts, each read where it lies: the S stored slots, then the T
    # appended ones. Logits, masks and the softmax's exponentials stay per part (one softmax:
    # a shared max and normaliser), so no [.., S'] buffer is ever concatenated.
    if app is None:
        cuts, keys, vals = [(0, s)], [kr], [view.v]
    else:
        t = app.k.shape[2]
        cuts, keys, vals = [(0, s), (s, s + t)], [kr, app.k if rotated else rope.apply(app.k, rp.k[..., s:])], [view.v, app.v]
    # keys of every slot the view holds (stored then new): built only for a policy that reads them
    k_all = kr if app is None else None
    if app is not None and ("k_rot" in policy.observes or type(policy).select is not Policy.select):
        k_all = jnp.concatenate(keys, axis=2)  # [B, K, S', D]
    selected = None if gathered else policy.select(view, qr[0], k_all)  # [B, K|Kp, G|1, T, S'] or None
    lowest = jnp.finfo(jnp.float32).min
    x_t = q.shape[1]

    def visibility(kpos, vmask, sel, q_pos=pos):
        """Which slots each query sees [B, Kp|K, 1|G, T, S_part]: filled, not in its future, and
        in the view's mask and the policy's selection (cut to these slots)."""
        mask = causal(q_pos, kpos)  # [B, Kp, T, S_part]
        if vmask is not None:
            mask = mask & vmask
        mask = mask[:, :, None]  # [B, Kp, 1, T, S_part]
        if sel is not None:
            mask = mask & sel  # [B, K, G|1, T, S_part]
        return mask

    def masked_logits(kp, kpos, vmask, bias, seg, sel, queries=None, mask=None):
        """Masked, scaled logits [B, K, G, T, S_part] float32 and the mask, of the slots whose keys
        are kp [B, K, S_part, D], positions kpos [B, Kp, S_part] (and the view's mask, bias, RoPE
        segments and the policy's selection, cut to these slots); `queries`: (rotated queries,
        positions) of some of the step's queries instead of all; `mask`: the visibility, when the
        caller has it (`True`: every slot is visible to every query, so no mask is applied)."""
        qs, q_pos = (qr, pos) if queries is None else queries
        if x_t == 1:  # decode: keys as the matmul's left operand, so that XLA:CPU reads them as
            # stored instead of first copying them transposed (a 4K SmolLM2 step: 94 -> 80 ms)
            lgs = [jnp.moveaxis(jnp.einsum("BKSD,BKGTD->BKSGT", kp, x, preferred_element_type=jnp.float32), 2, -1)
                   for x in qs]
        else:  # a chunk: the other way round (the keys-first form made a 512-token chunk 2.7x slower)
            lgs = [jnp.einsum("BKGTD,BKSD->BKGTS", x, kp, preferred_element_type=jnp.float32) for x in qs]
        lg = lgs[0]
        if seg is not None:
            seg = seg[:, :, None, None, :]  # [B, Kp, 1, 1, S_part]
            for p in range(1, len(lgs)):
                lg = jnp.where(seg == p, lgs[p], lg)
        if mask is True and bias is None:  # the caller scales (XLA:CPU then fuses it into its exp)
            return lg, None
        lg = lg * scale
        if bias is not None:
            lg = lg + bias[:, :, None, None, :].astype(jnp.float32)
        if mask is True:
            return lg, None
        if mask is None:
            mask = visibility(kpos, vmask, sel, q_pos)
        return jnp.where(mask, lg, lowest), mask

    def part(lo, hi, kp):
        cut = lambda a: None if a is None else a[..., lo:hi]  # noqa: E731  (every per-slot field: last axis)
        return masked_logits(kp, view.pos[..., lo:hi], cut(view.mask), cut(view.bias), cut(rp.seg), cut(selected))

    def softmax(lgs):  # one softmax over the parts' logits (a shared max and normaliser): P per part
        top = functools.reduce(jnp.maximum, [lg.max(axis=-1, keepdims=True) for lg in lgs])  # [B, K, G, T, 1]
        exps = [jnp.exp(lg - top) for lg in lgs]
        total = sum(e.sum(axis=-1, keepdims=True) for e in exps)
        return [e / total for e in exps]  # float32

    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)  # noqa: E731  (observers only)
    observed = {"scores", "logits"} & set(policy.observes)  # per-slot probabilities a policy reads
    rows = policy.score_rows  # compact reads only the scores of the last `rows` queries
    # Column sums (observed's prompt phase) take a second pass over the blocks: only for a chunk of
    # more than BLOCK tokens, whose one-piece logits would grow with T x T (a 4K prompt in one chunk:
    # 2.98 -> 1.43 GB peak, 134-144 -> 162-204 tok/s); a chunk of at most BLOCK keeps the one
    # piece, faster for it (a 4K prompt in chunks of 512: 219-241 tok/s, in blocks 197-205)
    sums_columns = "columns" in policy.observes
    if (x_t > 1 and max(s, x_t) > BLOCK and selected is None and not observed - ({"scores"} if rows else set())
            and (x_t > BLOCK or not sums_columns)):
        out, visible, columns = _blocked(masked_logits, visibility, cuts, keys, vals, view, lowest, qr, pos, scale,
                                         sums_columns)
        out = rearrange(_out_of(basis, out), "B K G T D -> B T (K G) D")
        scores = None
        if "scores" in observed:  # those queries' probabilities in one piece: [B, K, G, m, S'] logits
            m = min(x_t, rows)
            sub = ([x[:, :, :, -m:] for x in qr], pos[:, -m:])
            lg_m = [masked_logits(kp, view.pos[..., lo:hi], None if view.mask is None else view.mask[..., -m:, lo:hi],
                                  None if view.bias is None else view.bias[..., lo:hi],
                                  None if rp.seg is None else rp.seg[..., lo:hi], None, sub)[0]
                    for (lo, hi), kp in zip(cuts, keys)]
            scores = _sum_groups(cat(softmax(lg_m)))  # [B, K, m, S']
        seen = Seen(scores=scores, columns=columns, k_rot=k_all if "k_rot" in policy.observes else None,
                    q=qh if "q" in policy.observes else None,
                    rope=(rope.rope if isinstance(rope, RopeTable) else rope) if "rope" in policy.observes else None)
        writes = policy.defer(own, seen) if defer else None
        return out, policy.compact(own, seen) if writes is None else writes, visible

    lgs, masks = zip(*(part(lo, hi, kp) for (lo, hi), kp in zip(cuts, keys)))
    probs = softmax(lgs)  # P(slot) per part, float32
    out = sum(jnp.einsum("BKGTS,BKSD->BKGTD", p.astype(vp.dtype), vp) for p, vp in zip(probs, vals))
    summed = _sum_groups(cat(probs)) if {"scores", "columns"} & set(policy.observes) else None  # [B, K, T, S']
    seen = Seen(
        scores=summed if "scores" in policy.observes else None,
        columns=summed.sum(axis=2) if sums_columns else None,  # [B, K, S']
        k_rot=k_all if "k_rot" in policy.observes else None,
        q=qh if "q" in policy.observes else None,  # [B, K, G, T, D]
        rope=(rope.rope if isinstance(rope, RopeTable) else rope) if "rope" in policy.observes else None,
        logits=cat(lgs) if "logits" in policy.observes else None,  # [B, K, G, T, S']
    )
    visible = sum(m.sum(axis=-1, dtype=jnp.int32) for m in masks).max()  # keys the busiest query attended
    out = rearrange(_out_of(basis, out), "B K G T D -> B T (K G) D")
    writes = policy.defer(own, seen) if defer else None  # all compact would write, not yet written
    if writes is not None:
        return out, writes, visible
    # (in a gathered step Seen's per-slot fields are over the M slots; compact gets the policy's own view)
    return out, policy.compact(own, seen), visible


# A chunk (T > 1) over more than BLOCK stored slots attends block by block with an online softmax
# (a running max, normaliser and output per query), so that its [B, K, G, T, S] logits never
# materialise: each block's logits, exponentials and mask stay small enough for the CPU's caches.
# One 512-query chunk over 4,096 SmolLM2 slots (a layer's attention alone): 106 ms in one piece,
# 43 ms in blocks of 512 (256: 53 ms, 1,024: 56 ms). A chunk of more than BLOCK tokens also runs
# its queries in tiles of BLOCK, and reads its own (appended) tokens in tiles of BLOCK slots, so
# that nothing grows with T x T: a 4,096-token prompt prefilled in one chunk held [K, G, T, T]
# logits of ~600 MB per SmolLM2 layer and ran at 203 tok/s, against 317 in tiles (chunks of 512:
# 333-376, the same machine).
BLOCK = 512
# Each stored block is first checked against the chunk's visibility (for all blocks at once,
# before any is read; with causality alone, from the queries' first and last positions): a block
# no query sees (empty slots: a prompt's stored part past its filled length, the chunk's
# own not-yet-written slots) is skipped without reading it, so a chunk's attention work follows
# the filled length, not the length bucket; a block every query sees whole is attended without a
# mask (and with its scale fused into the exponential); the rest are masked. The result is the
# same (a skipped block adds exactly 0; an unmasked one the same numbers). A 4K prompt's prefill
# in chunks of 512: 1.07-1.19x faster. Deciding inside a scan over every block (its mask, then a
# cond) made a skipped block cost time too; deciding first and looping over the blocks to read:
# an 8K prompt, alternated, one chunk 192-202 -> 217-250 tok/s, chunks of 512 203-223 -> 228-250. With RoPE segments (sink in cache mode: its sinks pair with
# another query rotation than its window), a block holding no sink computes one segment's logits
# instead of every segment's and a select between them, and so does a piece outside the blocks
# (the stored remainder, a chunk's own tokens) whose slots all pair with segment 0. SKIP_BLOCKS =
# False masks every block and computes every segment (the A/B of benchmarks.attention_ab).
SKIP_BLOCKS = True
# A block's softmax (its max, exponentials and their sum) runs over its logits as [(B K G tq), s]
# rows: XLA:CPU splits an elementwise kernel across its threads along the leading axes, and over
# [B, K, G, tq, s] it split SmolLM2's K = 3 kv heads two ways (one thread did two thirds of the
# exponentials); over the rows it splits evenly. The same numbers bit for bit. A steady-state chunk of
# the default command (sink 4 + 4,096, 512 tokens): 1.06-1.08x faster (medians of 10-20 alternated
# rounds). FLAT_ROWS = False: the [B, K, G, tq, s] form (benchmarks.attention_ab's A/B).
FLAT_ROWS = True


def _blocked(masked_logits, visibility, cuts, keys, vals, view, lowest, qr, pos, scale, columns=False):
    """Attention of a chunk over the view's parts (`cuts`, `keys`, `vals`: the stored slots, then
    the appended ones), the stored part in blocks of BLOCK slots and its remainder, then the
    appended part, each folded into a running softmax. How each block is read (skipped, whole,
    masked) is decided for all blocks at once, before any is read; a loop then reads only the
    blocks some query sees, in slot order (a skipped block costs nothing). That loop's trip count
    is traced (a while loop), so reverse-mode autodiff does not pass through a blocked chunk
    (nothing here differentiates one: the recall model trains on ~100-token sequences). A chunk of more than BLOCK queries
    attends in query tiles of BLOCK (a lax.scan; queries and appended slots padded to whole tiles),
    each reading its appended part in tiles of BLOCK slots too, skipped, unmasked or masked like
    the stored blocks: no buffer grows with T x T, and a tile's causal future is not computed.
    columns: also the attention each slot received, summed over the G query heads and the T
    queries ([B, K, S'] float32, `Seen.columns`): a second pass over the same blocks, once each
    query's softmax max and normaliser are final (each block's logits computed again).
    Returns the output [B, K, G, T, D] (in the values' dtype), the most keys any query attended
    (int32) and the column sums (None without `columns`)."""
    t = pos.shape[1]
    tiled = t > BLOCK
    mask_t = view.mask is not None and view.mask.shape[2] > 1  # the view's mask has a query axis
    split = lambda x, pattern: None if x is None else rearrange(x, pattern, s=BLOCK)  # noqa: E731

    def as_blocks(kp, vp, lo, hi, fill=0):
        """Slots [lo, hi) as whole blocks, split once for every query tile (xs of a lax.scan; the
        view's mask apart, cut per tile): keys, values, positions, bias, RoPE segments. fill:
        empty slots (position -1) appended to make the last block whole."""
        grow = lambda x, value=0: None if x is None else jnp.pad(  # noqa: E731  the last axis: + fill
            x[..., lo:hi], [(0, 0)] * (x.ndim - 1) + [(0, fill)], constant_values=value)
        kv_pad = [(0, 0), (0, 0), (0, fill), (0, 0)]
        return (split(jnp.pad(kp, kv_pad), "B K (n s) D -> n B K s D"), split(jnp.pad(vp, kv_pad), "B K (n s) D -> n B K s D"),
                split(grow(view.pos, -1), "B P (n s) -> n B P s"), split(grow(view.bias), "B P (n s) -> n B P s"),
                split(grow(view.rope.seg), "B P (n s) -> n B P s"))

    def with_mask(xs, vmask_q, lo, hi, fill=0):  # a scan's xs with the view's mask (cut to a query tile) added
        vm = None if vmask_q is None else split(
            jnp.pad(vmask_q[..., lo:hi], [(0, 0)] * 3 + [(0, fill)]), "B P T (n s) -> n B P T s")
        return xs[:3] + (vm,) + xs[3:]

    (lo, hi), kp, vp = cuts[0], keys[0], vals[0]
    n, rest = divmod(hi - lo, BLOCK)
    stored = as_blocks(kp[:, :, :n * BLOCK], vp[:, :, :n * BLOCK], lo, lo + n * BLOCK) if n else None
    appended = None
    if tiled and len(cuts) > 1:  # the appended part in tiles, padded with empty slots
        (a_lo, a_hi), = cuts[1:]
        a_fill = -(a_hi - a_lo) % BLOCK
        appended = as_blocks(keys[1], vals[1], a_lo, a_hi, a_fill)

    def tile(qs, q_pos, vmask_q, real=None):
        """Queries qs (P x [B, K, G, tq, D]) at q_pos [B, tq], the view's mask cut to them; real
        [tq] bool: the queries that are not a tile's padding (None: all)."""
        queries = (qs, q_pos)

        def fold(carry, kp, vp, kpos, vmask, bias, seg, mask=None):  # one block of slots into the running softmax
            top, total, acc, seen = carry
            every = mask is True  # every query sees every slot: no mask applied
            lg, mask = masked_logits(kp, kpos, vmask, bias, seg, None, queries, mask=mask)  # [B, K, G, tq, s], [B, Kp, 1, tq, s]
            shape = lg.shape
            if FLAT_ROWS:  # the softmax's elementwise passes over [(B K G tq), s] rows (bitcasts, free)
                lg, top, total = (rearrange(x, "B K G T S -> (B K G T) S") for x in (lg, top, total))
            if every and bias is None:  # unscaled logits: scale their max, and inside the exp
                # (the same numbers: rounding is monotonic, so max(scale * lg) = scale * max(lg))
                new_top = jnp.maximum(top, lg.max(axis=-1, keepdims=True) * scale)  # [(B K G tq), 1]
                e = jnp.exp(lg * scale - new_top)
            else:
                new_top = jnp.maximum(top, lg.max(axis=-1, keepdims=True))
                # masked logits are float32's lowest, so exp(lg - new_top) = 0 once any slot was visible; the
                # blocks before that (all masked, top = lowest) add exp(0) = 1s, which the first visible
                # slot's decay exp(lowest - top) = 0 erases exactly (a query always sees itself)
                e = jnp.exp(lg - new_top)
            decay = jnp.exp(top - new_top)
            total = total * decay + e.sum(axis=-1, keepdims=True)
            if FLAT_ROWS:
                e = e.reshape(shape)
                new_top, total, decay = (x.reshape(shape[:-1] + (1,)) for x in (new_top, total, decay))
            pv = jnp.einsum("BKGTS,BKSD->BKGTD", e.astype(vp.dtype), vp, preferred_element_type=jnp.float32)
            count = kp.shape[2] if every else mask.sum(axis=-1, dtype=jnp.int32)  # visible slots per query
            return new_top, total, acc * decay + pv, seen + count

        def branches(xs):
            """How each of the n blocks xs is read, from all their visibility masks at once: [n] int32,
            0 skipped (no query sees a slot of it), 1 whole (every query sees every slot: no mask
            applied), 2 masked; with RoPE segments (sink in cache mode), + 2 for a block whose slots
            all pair with segment 0's query rotation (one logits matmul, not one per segment)."""
            kpos, vmask, seg = xs[2], xs[3], xs[5]
            n = kpos.shape[0]
            if vmask is None:  # causal only: from the queries' extremes, per batch row (the same answer)
                filled = kpos >= 0  # [n, B, Kp, BLOCK]
                q_max, q_min = (f(q_pos, axis=1)[None, :, None, None] for f in (jnp.max, jnp.min))  # [1, B, 1, 1]
                some = (filled & (kpos <= q_max)).reshape(n, -1).any(axis=1)
                every = (filled & (kpos <= q_min)).reshape(n, -1).all(axis=1)
            else:
                mask = jax.vmap(lambda p, vm: visibility(p, vm, None, q_pos))(kpos, vmask).reshape(n, -1)
                some, every = mask.any(axis=1), mask.all(axis=1)
            branch = jnp.where(every, 1, jnp.where(some, 2, 0))
            if seg is not None:
                branch = jnp.where((branch > 0) & (seg == 0).reshape(seg.shape[0], -1).all(axis=1), branch + 2, branch)
            return branch

        def reads(x, run):  # run(x, mask) for branches 1, 2 (3, 4) of a block x, as thunks
            mask = lambda: visibility(x[2], x[3], None, q_pos)  # noqa: E731  [B, Kp, 1, tq, BLOCK]
            fns = [lambda: run(x, True), lambda: run(x, mask())]
            if x[5] is not None:
                one = x[:5] + (None,)
                fns += [lambda: run(one, True), lambda: run(one, mask())]
            return fns

        def blocks(carry, xs):
            """The n blocks xs folded into the running softmax: only those some query sees, in slot
            order (a loop over their count: a skipped block costs nothing), each read whole or masked."""
            if not SKIP_BLOCKS:  # every block masked
                return jax.lax.scan(lambda c, x: (fold(c, *x, mask=visibility(x[2], x[3], None, q_pos)), None),
                                    carry, xs)[0]
            branch = branches(xs)
            order = jnp.argsort(branch == 0, stable=True)  # the blocks to read first, in slot order

            def body(i, c):
                j = order[i]
                x = jax.tree.map(lambda a: a[j], xs)
                return jax.lax.switch(branch[j] - 1, reads(x, lambda x, mask: fold(c, *x, mask=mask)))

            return jax.lax.fori_loop(0, (branch > 0).sum(), body, carry)

        def piece(lo, hi, kp, vp, a=None, b=None):  # the view's per-slot fields of slots [lo, hi), kp/vp cut to [a, b)
            cut = lambda x: None if x is None else x[..., lo:hi]  # noqa: E731
            return kp[:, :, a:b], vp[:, :, a:b], view.pos[..., lo:hi], cut(vmask_q), cut(view.bias), cut(view.rope.seg)

        def parts(one, many):
            """one(x) for the remainder and the untiled appended parts, many(xs) for the scanned
            blocks, over the view's slots in order: the list of their results."""
            got = [many(with_mask(stored, vmask_q, lo, lo + n * BLOCK))] if n else []
            if rest:
                got.append(one(piece(lo + n * BLOCK, hi, kp, vp, n * BLOCK, None)))
            if appended is not None:  # the appended slots in tiles
                got.append(many(with_mask(appended, vmask_q, a_lo, a_hi, a_fill)))
            else:
                got += [one(piece(c_lo, c_hi, c_kp, c_vp)) for (c_lo, c_hi), c_kp, c_vp in zip(cuts[1:], keys[1:], vals[1:])]
            return got

        b_, k_, g_, t_, _ = qs[0].shape
        carry = (jnp.full((b_, k_, g_, t_, 1), lowest), jnp.zeros((b_, k_, g_, t_, 1), jnp.float32),
                 jnp.zeros((b_, k_, g_, t_, vp.shape[-1]), jnp.float32), jnp.zeros(view.pos.shape[:2] + (1, t_), jnp.int32))
        def fold_piece(c, x):
            """A piece outside the blocks (the stored remainder, the chunk's own slots) into the
            running softmax; with RoPE segments, one logits matmul when all its slots pair with
            segment 0's query rotation (a chunk's own tokens, once past the sinks)."""
            if x[5] is None or not SKIP_BLOCKS:
                return fold(c, *x)
            return jax.lax.cond((x[5] == 0).all(), lambda: fold(c, *x[:5], None), lambda: fold(c, *x))

        for f in parts(lambda x: lambda c: fold_piece(c, x), lambda xs: lambda c: blocks(c, xs)):
            carry = f(carry)
        top, total, acc, seen = carry
        if tiled:  # in tiles, a query that saw no slot (none in practice: a query sees itself) has
            total = jnp.where(total > 0, total, 1)  # skipped every block: 0, not 0 / 0
        out = (acc / total).astype(vals[0].dtype)
        if not columns:
            return out, seen.max(), None
        weight = 1 / total if real is None else jnp.where(real[:, None], 1 / total, 0)  # [B, K, G, tq, 1]

        def column(x, mask=None):  # [B, K, s]: a block's probabilities (final max and normaliser), summed
            lg, _ = masked_logits(x[0], x[2], x[3], x[4], x[5], None, queries, mask=mask)
            if mask is True and x[4] is None:  # unscaled logits (as in fold)
                lg = lg * scale
            return _sum_groups(jnp.exp(lg - top) * weight).sum(axis=2)

        def column_blocks(xs):  # the scanned blocks' column sums, in slot order: [B, K, n x BLOCK]
            if SKIP_BLOCKS:
                zero = jnp.zeros((b_, k_, BLOCK), jnp.float32)
                got = jax.lax.scan(lambda c, xb: (c, jax.lax.switch(xb[1], [lambda: zero] + reads(xb[0], column))),
                                   None, (xs, branches(xs)))[1]
            else:
                got = jax.lax.scan(lambda c, x: (c, column(x, visibility(x[2], x[3], None, q_pos))), None, xs)[1]
            return rearrange(got, "n B K s -> B K (n s)")

        cols = jnp.concatenate(parts(column, column_blocks), axis=-1)
        if appended is not None:
            cols = cols[..., :cols.shape[-1] - a_fill]  # the appended tiles' empty fill
        return out, seen.max(), cols

    if not tiled:
        return tile(qr, pos, view.mask)
    # Query tiles: pad the queries to whole tiles with copies of the last query (dropped after)
    n_q = -(-t // BLOCK)
    pad = n_q * BLOCK - t
    edge = lambda x, axis: jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)], mode="edge")  # noqa: E731
    by_tile = lambda x, axis: jnp.moveaxis(  # noqa: E731  [.., n_q x BLOCK, ..] -> [n_q, .., BLOCK, ..]
        x.reshape(x.shape[:axis] + (n_q, BLOCK) + x.shape[axis + 1:]), axis, 0)
    qs = [by_tile(edge(x, 3), 3) for x in qr]  # P x [n_q, B, K, G, BLOCK, D]
    q_pos = by_tile(edge(pos, 1), 1)  # [n_q, B, BLOCK]
    vmask = by_tile(edge(view.mask, 2), 2) if mask_t else None  # [n_q, B, Kp, BLOCK, S']
    real = (jnp.arange(n_q * BLOCK) < t).reshape(n_q, BLOCK)  # [n_q, BLOCK]: not padding

    def one(cols, x):
        qs_i, pos_i, vmask_i, real_i = x
        out, seen, c = tile(list(qs_i), pos_i, vmask_i if mask_t else view.mask, real_i)
        return (cols if c is None else cols + c), (out, seen)

    cols = jnp.zeros((pos.shape[0], keys[0].shape[1], cuts[-1][1] - cuts[0][0]), jnp.float32) if columns else None
    cols, (out, seen) = jax.lax.scan(one, cols, (tuple(qs), q_pos, vmask, real))
    out = rearrange(out, "n B K G s D -> B K G (n s) D")[:, :, :, :t]
    return out, seen.max(), cols


def _out_of(basis, out: Float[Array, "B K G T D"]) -> Float[Array, "B K G T D"]:
    """An attention output over values decoded in `basis` (`View.basis`) rotated out of it, in float32."""
    return out if basis is None else basis.from_basis(out.astype(jnp.float32)).astype(out.dtype)


def _sum_groups(p: Float[Array, "B K G T S"]) -> Float[Array, "B K T S"]:
    """p summed over its G query heads, as G - 1 elementwise adds: XLA:CPU compiles the same sum
    written as a reduction over the middle axis into a kernel that took ~140 ms per SmolLM2 layer
    for a 512-token chunk over 4K slots (it made snapkv's prompt phase 2x slower than `full`'s)."""
    return functools.reduce(jnp.add, [p[:, :, g] for g in range(p.shape[2])])


def _gathered_view(view: View, g: Gather) -> View:
    """The view's S stored slots restricted to the Gather's M = n x size slots (keys and values
    moved from a host tier if they live there), then its appended new tokens (`View.append`) as
    they are; unread slots get position -1, so causality masks them."""
    s, size = view.k.shape[2], g.size
    if size > s:  # blocks longer than the stored slots: gather slot by slot
        return _gathered_view(view, _slotwise(g, s))
    start = jnp.clip(g.start, 0, s - size)  # [B, K, n] a block past the end is read from s - size
    slots = start[..., None] + jnp.arange(size)  # [B, K, n, size]
    ok = g.ok[..., None] & (slots >= g.start[..., None])  # [B, K, n, size]: only the block's own slots
    b, k, n = start.shape
    slots, ok = slots.reshape(b, k, n * size), ok.reshape(b, k, n * size)  # [B, K, M]
    k_, v_ = offload.fetch((view.k, view.v), start, size)  # [B, K, M, D] each

    def per_slot(x, fill=None):  # [B, Kp, S(+T)] -> [B, K, M(+T)]: the gathered slots, then the appended ones
        got = take_slots(x[..., :s], slots)
        if fill is not None:
            got = jnp.where(ok, got, fill)
        if view.append is None:
            return got
        new = x[..., s:]
        return jnp.concatenate([got, jnp.broadcast_to(new, new.shape[:1] + got.shape[1:2] + new.shape[2:])], axis=-1)

    rp = view.rope
    rope = type(rp)(q=rp.q, k=per_slot(rp.k), seg=None if rp.seg is None else per_slot(rp.seg))
    mask = None if view.mask is None else per_slot(view.mask[:, :, 0])[:, :, None]  # [B, K, 1, M(+T)]
    bias = None if view.bias is None else per_slot(view.bias)  # [B, K, M(+T)]
    return View(k=k_, v=v_, pos=per_slot(view.pos, -1), rope=rope, mask=mask, bias=bias, carry=view.carry,
                append=view.append, basis=view.basis)


def _slotwise(g: Gather, s: int) -> Gather:
    """The same read as blocks of one slot (slots past the view's end not read)."""
    slots = g.start[..., None] + jnp.arange(g.size)  # [B, K, n, size]
    ok = g.ok[..., None] & (slots < s)
    b, k, n, size = slots.shape
    return Gather(jnp.minimum(slots, s - 1).reshape(b, k, n * size), ok.reshape(b, k, n * size), 1)


def _token_by_token(policy, state, q, k, v, pos, rope, scale):
    """A chunk as T single-token steps (lax.scan inside the compiled step): exact per-token eviction."""

    def step(st, x):
        qt, kt, vt, pt = x  # [B, N, D], [B, K, D], [B, K, D], [B]
        out, st, vis = _attend(policy, st, qt[:, None], kt[:, None], vt[:, None], pt[:, None], rope, scale)
        return st, (out[:, 0], vis)  # [B, N, D], []

    state, (out, vis) = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, pos)))
    return jnp.moveaxis(out, 0, 1), state, vis.max()  # [B, T, N, D]


# -- measuring what attention read: the most keys any query attended ---------------------------
_RECORDERS: list[dict[str, int]] = []  # open `record_visible` contexts (host side)


def _report(visible) -> None:
    for rec in _RECORDERS:
        rec["max_visible"] = max(rec["max_visible"], int(visible))


def recording() -> bool:
    """Whether a `record_visible` context is open (steps traced now report what they attended)."""
    return bool(_RECORDERS)


@contextlib.contextmanager
def record_visible():
    """Record the most keys any query attended, as {"max_visible": n}, over the attention steps
    run inside the context. Measured from the masks attention applied (causal, the view's own
    mask, empty slots, `select`), by a host callback compiled only into steps traced while a
    recorder is open (a step traced outside records nothing; nothing is compiled in otherwise)."""
    rec = {"max_visible": 0}
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)
