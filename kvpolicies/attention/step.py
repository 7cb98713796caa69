"""`attend`: one attention step through a cache policy; the one place where RoPE and masks are
applied, both from the positions the policy's view gives (docs/design/attention.md).

Shapes: B batch, T new tokens, N query heads = K kv heads x G groups, S view slots, D head dim,
Kp = 1 or K (slot positions shared by kv heads or per head), P RoPE segments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Float, Int

from kvpolicies import limits, offload
from kvpolicies.attention.blocked import blocked
from kvpolicies.attention.dense import last_rows_scores, one_piece
from kvpolicies.attention.gathered import Gather, gathered_view
from kvpolicies.attention.logits import Step, observe, out_of
from kvpolicies.attention.record import report
from kvpolicies.attention.tuning import DEFAULT, Tuning
from kvpolicies.base import Deferred, Policy, SlotState, check_codec
from kvpolicies.rope import Rope, RopeTable
from kvpolicies.slots import quiet_chunk, spare_slots


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
    tuning: Tuning | None = None,
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
    tuning: how the step runs (blocks, skipping; `Tuning`, static: a jitted caller passes it as a
    static argument); None: the defaults. It never changes which slots a query sees.
    """
    tuning = DEFAULT if tuning is None else tuning
    limits.check_step(policy, state, q, k, v, pos, rope)  # arguments, shapes; positions and layout when eager
    out, new_state, visible = attend_step(policy, state, q, k, v, pos, rope, scale, defer, tuning)
    if limits.concrete(state, pos):
        limits.check_cache(new_state, "attend: ")  # an exhausted paged pool, as an error
    elif tuning.checked:  # inside a caller's jit: queries at positions the state cannot take give NaN
        out = limits.poison(out, policy, state, pos)
    report(visible)
    return out, new_state


def attend_step(policy, state, q, k, v, pos, rope, scale, defer=False, tuning: Tuning = DEFAULT):
    """`attend` unchecked, plus the most keys any query of the step attended (int32 scalar)."""
    if policy.per_token and q.shape[1] > 1:
        quiet, only = quiet_chunk(policy, state, q.shape[1])  # None, or a traced bool: the chunk only appends
        if quiet is None:
            return token_by_token(policy, state, q, k, v, pos, rope, scale, tuning)
        if only:  # no alternative compiled: a chunk that would evict gets NaN outputs
            out, new_state, visible = whole(policy, state, q, k, v, pos, rope, scale, defer, tuning)
            return jnp.where(quiet, out, jnp.nan), new_state, visible
        return jax.lax.cond(quiet, lambda: whole(policy, state, q, k, v, pos, rope, scale, False, tuning),
                            lambda: token_by_token(policy, state, q, k, v, pos, rope, scale, tuning))
    if spare_slots(policy):  # a token written in place only appends (`SpareSlot`): an overflow's outputs are NaN
        quiet, _ = quiet_chunk(policy, state, q.shape[1])
        out, new_state, visible = whole(policy, state, q, k, v, pos, rope, scale, False, tuning)
        return jnp.where(quiet, out, jnp.nan), new_state, visible
    return whole(policy, state, q, k, v, pos, rope, scale, defer, tuning)


def whole(policy, state, q, k, v, pos, rope, scale, defer=False, tuning: Tuning = DEFAULT):
    """`attend_step` of the T tokens in one step (one piece or blocks)."""
    check_codec(policy)  # at trace time, before any compute
    st = prepare(policy, state, q, k, v, pos, rope, scale)
    blocks = use_blocks(policy, st, tuning)
    if st.view.joined and not blocks:  # one piece of a joined view: its parts as one
        st = joined(st)
    if blocks:
        out, visible, columns = blocked(st, tuning, "columns" in policy.observes)
        scores = last_rows_scores(st, policy.score_rows) if "scores" in policy.observes else None
        seen = observe(policy, st, rope, scores=scores, columns=columns)
    else:
        out, seen, visible = one_piece(policy, st, rope)
    out = rearrange(out_of(st.view.basis, out), "B K G T D -> B T (K G) D")
    writes = policy.defer(st.own, seen) if defer else None  # all compact would write, not yet written
    # (in a gathered step Seen's per-slot fields are over the M slots; compact gets the policy's own view)
    return out, policy.compact(st.own, seen) if writes is None else writes, visible


def use_blocks(policy: Policy, st: Step, tuning: Tuning) -> bool:
    """Whether a chunk attends in blocks: more than `block` slots or tokens, no selection, no
    per-slot observation but the last rows' scores (`score_rows`). Column sums (observed's prompt
    phase) take a second pass over the blocks: only for a chunk of more than `block` tokens, whose
    one-piece logits would grow with T x T; a shorter chunk keeps the one piece, faster for it."""
    x_t, s = st.pos.shape[1], st.cuts[-1][1] if st.view.joined else st.view.k.shape[2]
    observed = {"scores", "logits"} & set(policy.observes)
    rows = policy.score_rows
    return (x_t > 1 and max(s, x_t) > tuning.block and st.selected is None
            and not observed - ({"scores"} if rows else set())
            and (x_t > tuning.block or "columns" not in policy.observes))


def joined(st: Step) -> Step:
    """A joined view's step (`View.joined`) with its parts concatenated: one part of S + T slots,
    the one piece a view of S + T stored slots reads."""
    if len(st.cuts) == 1:
        return st
    cat = lambda xs: jnp.concatenate(xs, axis=2)  # noqa: E731
    return st._replace(cuts=[(st.cuts[0][0], st.cuts[-1][1])], keys=[cat(st.keys)], vals=[cat(st.vals)])


def prepare(policy: Policy, state, q, k, v, pos, rope, scale) -> Step:
    """The policy's view of the step, the rotated queries and keys, split into the view's parts
    (its S stored slots, then its T appended ones), and the policy's selection."""
    n_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rotated = policy.rotated_keys  # stored keys are already rotated: rotate only the new ones, once
    k = rearrange(k, "B T K D -> B K T D")
    if rotated:
        k = rope.apply(k, pos[:, None, :])  # [B, K, T, D] at the tokens' positions
    view = own = policy.extend(state, k, rearrange(v, "B T K D -> B K T D"), pos)
    qh = rearrange(q, "B T (K G) D -> B K G T D", K=n_kv)
    rq = view.rope.q
    qr = [rope.apply(qh, rq[:, None, None, :, p]) for p in range(rq.shape[-1])]  # P x [B, K, G, T, D]
    basis = view.basis  # values (and keys stored after RoPE) decoded in a codec's basis: `View.basis`
    if basis is not None and basis.after_rope:  # the keys are: rotate the queries into it instead
        if not rotated or "k_rot" in policy.observes or type(policy).select is not Policy.select:
            raise TypeError(f"{type(policy).__name__}: keys decoded in a codec's basis are read by attention only "
                            "(a policy with rotated_keys that neither observes k_rot nor selects)")
        qr = [basis.to_basis(x) for x in qr]
    gathered = q.shape[1] == 1 and policy.gathers
    view = read_view(policy, view, qr[0]) if gathered else \
        dataclasses.replace(view, k=offload.device(view.k), v=offload.device(view.v))  # a host tier: all of it
    cuts, keys, vals, k_all = split_parts(policy, view, rope, rotated)
    selected = None if gathered else policy.select(view, qr[0], k_all)  # [B, K|Kp, G|1, T, S'] or None
    return Step(qr, qh, pos, view, own, cuts, keys, vals, k_all, selected, scale)


def read_view(policy: Policy, view, q_rot):
    """A sparse decode read: the view cut to the slots of the `Gather` the policy selects."""
    gather = policy.select(view, q_rot, None)
    if not isinstance(gather, Gather):
        raise TypeError(f"{type(policy).__name__} gathers: select(view, q_rot, None) must return a Gather "
                        f"at decode (T == 1), got {type(gather).__name__}")
    return gathered_view(view, gather)  # S -> M slots


def split_parts(policy: Policy, view, rope, rotated: bool):
    """The view's S' slots in parts, each read where it lies: the S stored slots, then the T
    appended ones (cuts, rotated keys, values per part), and every slot's rotated keys for a
    policy that reads them (else None). Logits, masks and the softmax's exponentials stay per
    part (one softmax: a shared max and normaliser), so no [.., S'] buffer is ever concatenated."""
    rp, app = view.rope, view.append
    s = view.k.shape[2]
    kr = view.k if rotated else rope.apply(view.k, rp.k[..., :s])  # [B, K, S, D]
    if app is None:
        return [(0, s)], [kr], [view.v], kr
    t = app.k.shape[2]
    keys = [kr, app.k if rotated else rope.apply(app.k, rp.k[..., s:])]
    k_all = None
    if "k_rot" in policy.observes or type(policy).select is not Policy.select:
        k_all = jnp.concatenate(keys, axis=2)  # [B, K, S', D]
    return [(0, s), (s, s + t)], keys, [view.v, app.v], k_all


def token_by_token(policy, state, q, k, v, pos, rope, scale, tuning: Tuning = DEFAULT):
    """A chunk as T single-token steps (lax.scan inside the compiled step): exact per-token eviction."""

    def step(st, x):
        qt, kt, vt, pt = x  # [B, N, D], [B, K, D], [B, K, D], [B]
        out, st, vis = attend_step(policy, st, qt[:, None], kt[:, None], vt[:, None], pt[:, None], rope, scale,
                                   tuning=tuning)
        return st, (out[:, 0], vis)  # [B, N, D], []

    state, (out, vis) = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, pos)))
    return jnp.moveaxis(out, 0, 1), state, vis.max()  # [B, T, N, D]
