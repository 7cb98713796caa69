"""The one place where RoPE and attention masks are computed, both from slot positions.

Shapes: B batch, T new tokens, N query heads = K kv heads x G groups, S view slots, D head dim,
Kp = 1 or K (slot positions shared by kv heads or per head), P RoPE segments.

`attend` runs one step of attention through a cache policy: the policy decides which slots
exist (`extend`/`compact`) and which are visible (`visible`), this module applies causality,
empty-slot masking, RoPE and the softmax. Prefill and decode are the same call with T >= 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, SlotState
from kvpolicies.rope import Rope


def visibility(policy: Policy, q_pos: Int[Array, "B T"], k_pos: Int[Array, "B Kp S"]) -> jax.Array:
    """[B, Kp, T, S] bool: slot filled, not in the future, and allowed by the policy."""
    k = k_pos[:, :, None, :]  # [B, Kp, 1, S]
    causal = (k >= 0) & (k <= q_pos[:, None, :, None])  # [B, Kp, T, S]
    return causal & policy.visible(q_pos, k_pos)


def attend(
    policy: Policy,
    state: SlotState,
    q: Float[Array, "B T N D"],
    k: Float[Array, "B T K D"],
    v: Float[Array, "B T K D"],
    pos: Int[Array, "B T"],
    rope: Rope,
    scale: float | None = None,
) -> tuple[Float[Array, "B T N D"], SlotState]:
    """One attention step through `policy`: returns the outputs and the policy's new state.

    q, k, v are un-rotated projections of the T new tokens at absolute positions `pos`.
    """
    n_kv = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    view = policy.extend(state, rearrange(k, "B T K D -> B K T D"), rearrange(v, "B T K D -> B K T D"), pos)
    kd, vd = policy.decode_kv(view, q.dtype)  # [B, K, S, D] each, dequantized inside the step

    rp = policy.view_rope_positions(pos, view)
    kr = rope.apply(kd, rp.k)  # [B, K, S, D]
    qh = rearrange(q, "B T (K G) D -> B K G T D", K=n_kv)
    qr = [rope.apply(qh, rp.q[:, None, None, :, p]) for p in range(rp.q.shape[-1])]  # P x [B, K, G, T, D]
    logits = [
        jnp.einsum("BKGTD,BKSD->BKGTS", x, kr, preferred_element_type=jnp.float32) for x in qr
    ]  # P x [B, K, G, T, S]
    view, selected = policy.select(view, pos, qr[0], kr)  # selected: [B, K|Kp, G|1, T, S] or None
    if rp.seg is None:
        lg = logits[0]
    else:
        seg = rp.seg[:, :, None, None, :]  # [B, Kp, 1, 1, S]
        lg = logits[0]
        for p in range(1, len(logits)):
            lg = jnp.where(seg == p, logits[p], lg)
    lg = lg * scale
    bias = policy.logit_bias(view)
    if bias is not None:
        lg = lg + bias[:, :, None, None, :].astype(jnp.float32)
    mask = visibility(policy, pos, view.pos)[:, :, None]  # [B, Kp, 1, T, S]
    if selected is not None:
        mask = mask & selected  # [B, K, G|1, T, S]
    lg = jnp.where(mask, lg, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(lg, axis=-1)  # [B, K, G, T, S] float32
    out = jnp.einsum("BKGTS,BKSD->BKGTD", probs.astype(vd.dtype), vd)
    scores = probs.sum(axis=2) if policy.needs_scores else None  # [B, K, T, S]
    new_state = policy.compact(view, scores)
    return rearrange(out, "B K G T D -> B T (K G) D"), new_state
