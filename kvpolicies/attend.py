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
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import Policy, Seen, SlotState, write_at
from kvpolicies.rope import Rope, RopeTable


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
    Inside `record_visible()`, steps traced there also report the most keys any query attended.
    defer: where the step only writes its new tokens (`View.append` with a `start`), return
    them as `Deferred` instead of the new state; the caller writes them (`write_deferred`),
    e.g. a model after its layer loop, so the stored slots are never copied per layer.
    """
    out, new_state, visible = _attend(policy, state, q, k, v, pos, rope, scale, defer)
    if _RECORDERS:
        jax.debug.callback(_report, visible)
    return out, new_state


class Deferred(NamedTuple):
    """The writes of an appending step, not yet applied: the new state is
    `write_at(state, slots, start)` (leaves may carry leading axes, e.g. a model's layers)."""

    slots: SlotState  # the T new slots, encoded
    start: Int[Array, "*L B"]


def write_deferred(state: SlotState, writes: Deferred, lead: int = 0) -> SlotState:
    """Apply `Deferred` writes; `lead` leading axes (e.g. stacked layers) share one `start`
    (the layers of a run hold one policy and see the same positions)."""
    start = writes.start[(0,) * lead]  # [B]
    return write_at(state, writes.slots, start, lead=lead)


def _attend(policy, state, q, k, v, pos, rope, scale, defer=False):
    """`attend`, plus the most keys any query of the step attended (int32 scalar)."""
    if policy.per_token and q.shape[1] > 1:
        return _token_by_token(policy, state, q, k, v, pos, rope, scale)
    n_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    view = policy.extend(state, rearrange(k, "B T K D -> B K T D"), rearrange(v, "B T K D -> B K T D"), pos)

    rp = view.rope
    app = view.append  # the new tokens, read after the S stored slots (None: all in view.k)
    s = view.k.shape[2]
    kr = rope.apply(view.k, rp.k[..., :s])  # [B, K, S, D]
    kr_new = None if app is None else rope.apply(app.k, rp.k[..., s:])  # [B, K, T, D]
    qh = rearrange(q, "B T (K G) D -> B K G T D", K=n_kv)
    qr = [rope.apply(qh, rp.q[:, None, None, :, p]) for p in range(rp.q.shape[-1])]  # P x [B, K, G, T, D]

    def dots(x):  # [B, K, G, T, D] -> [B, K, G, T, S'] float32 (S' = S + T with new tokens)
        lg = jnp.einsum("BKGTD,BKSD->BKGTS", x, kr, preferred_element_type=jnp.float32)
        if app is None:
            return lg
        return jnp.concatenate([lg, jnp.einsum("BKGTD,BKSD->BKGTS", x, kr_new, preferred_element_type=jnp.float32)], -1)

    logits = [dots(x) for x in qr]  # P x [B, K, G, T, S']
    # keys of every slot the view holds (stored then new): built only for a policy that reads them
    k_all = kr if app is None else None
    if app is not None and ("k_rot" in policy.observes or type(policy).select is not Policy.select):
        k_all = jnp.concatenate([kr, kr_new], axis=2)  # [B, K, S', D]
    selected = policy.select(view, qr[0], k_all)  # [B, K|Kp, G|1, T, S'] or None
    lg = logits[0]
    if rp.seg is not None:
        seg = rp.seg[:, :, None, None, :]  # [B, Kp, 1, 1, S]
        for p in range(1, len(logits)):
            lg = jnp.where(seg == p, logits[p], lg)
    lg = lg * scale
    if view.bias is not None:
        lg = lg + view.bias[:, :, None, None, :].astype(jnp.float32)
    mask = causal(pos, view.pos)  # [B, Kp, T, S]
    if view.mask is not None:
        mask = mask & view.mask
    mask = mask[:, :, None]  # [B, Kp, 1, T, S]
    if selected is not None:
        mask = mask & selected  # [B, K, G|1, T, S]
    lg = jnp.where(mask, lg, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(lg, axis=-1)  # [B, K, G, T, S'] float32
    pv = probs.astype(view.v.dtype)
    out = jnp.einsum("BKGTS,BKSD->BKGTD", pv[..., :s], view.v)
    if app is not None:
        out = out + jnp.einsum("BKGTS,BKSD->BKGTD", pv[..., s:], app.v)
    seen = Seen(
        scores=probs.sum(axis=2) if "scores" in policy.observes else None,  # [B, K, T, S']
        k_rot=k_all if "k_rot" in policy.observes else None,
        q=qh if "q" in policy.observes else None,  # [B, K, G, T, D]
        rope=(rope.rope if isinstance(rope, RopeTable) else rope) if "rope" in policy.observes else None,
        logits=lg if "logits" in policy.observes else None,  # [B, K, G, T, S]
    )
    visible = mask.sum(axis=-1, dtype=jnp.int32).max()  # keys the busiest query attended
    out = rearrange(out, "B K G T D -> B T (K G) D")
    if defer and app is not None and app.start is not None:
        return out, Deferred(app.slots, app.start), visible  # compact would only write these
    return out, policy.compact(view, seen), visible


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
