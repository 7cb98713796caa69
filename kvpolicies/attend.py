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

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import Policy, Seen, SlotState
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
) -> tuple[Float[Array, "B T N D"], SlotState]:
    """One attention step through `policy`: returns the outputs and the policy's new state.

    q, k, v are un-rotated projections of the T new tokens at absolute positions `pos`.
    Inside `record_visible()`, steps traced there also report the most keys any query attended.
    """
    out, new_state, visible = _attend(policy, state, q, k, v, pos, rope, scale)
    if _RECORDERS:
        jax.debug.callback(_report, visible)
    return out, new_state


def _attend(policy, state, q, k, v, pos, rope, scale):
    """`attend`, plus the most keys any query of the step attended (int32 scalar)."""
    if policy.per_token and q.shape[1] > 1:
        return _token_by_token(policy, state, q, k, v, pos, rope, scale)
    n_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    view = policy.extend(state, rearrange(k, "B T K D -> B K T D"), rearrange(v, "B T K D -> B K T D"), pos)

    rp = view.rope
    kr = rope.apply(view.k, rp.k)  # [B, K, S, D]
    qh = rearrange(q, "B T (K G) D -> B K G T D", K=n_kv)
    qr = [rope.apply(qh, rp.q[:, None, None, :, p]) for p in range(rp.q.shape[-1])]  # P x [B, K, G, T, D]
    logits = [
        jnp.einsum("BKGTD,BKSD->BKGTS", x, kr, preferred_element_type=jnp.float32) for x in qr
    ]  # P x [B, K, G, T, S]
    selected = policy.select(view, qr[0], kr)  # [B, K|Kp, G|1, T, S] or None
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
    probs = jax.nn.softmax(lg, axis=-1)  # [B, K, G, T, S] float32
    out = jnp.einsum("BKGTS,BKSD->BKGTD", probs.astype(view.v.dtype), view.v)
    seen = Seen(
        scores=probs.sum(axis=2) if "scores" in policy.observes else None,  # [B, K, T, S]
        k_rot=kr if "k_rot" in policy.observes else None,
        q=qh if "q" in policy.observes else None,  # [B, K, G, T, D]
        rope=(rope.rope if isinstance(rope, RopeTable) else rope) if "rope" in policy.observes else None,
        logits=lg if "logits" in policy.observes else None,  # [B, K, G, T, S]
    )
    new_state = policy.compact(view, seen)
    visible = mask.sum(axis=-1, dtype=jnp.int32).max()  # keys the busiest query attended
    return rearrange(out, "B K G T D -> B T (K G) D"), new_state, visible


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
