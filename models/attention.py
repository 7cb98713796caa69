"""The one place where RoPE and attention masks are computed, both from slot positions.

Shapes: B batch, T new tokens, N query heads = K kv heads x G groups, S view slots, D head dim,
Kp = 1 or K (slot positions shared by kv heads or per head), P RoPE segments.

`attend` runs one step of attention through a cache policy: the policy decides which slots
exist (`extend`/`compact`) and which are visible (`visible`), this module applies causality,
empty-slot masking, RoPE and the softmax. Prefill and decode are the same call with T >= 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, SlotState


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding (rotate-half layout), with optional Llama-3 frequency scaling."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] | None = None

    def inv_freq(self) -> np.ndarray:
        """[D/2] float32 inverse frequencies (a trace-time constant)."""
        d = self.head_dim
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
        inv = inv.astype(np.float32)
        sc = dict(self.scaling) if self.scaling else None
        if sc is None or sc.get("rope_type", sc.get("type", "default")) == "default":
            return inv
        kind = sc.get("rope_type", sc.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
        # Llama 3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        ramp = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return np.where(medium, ramp, scaled).astype(np.float32)

    def apply(self, x: Float[Array, "*b L D"], pos: Int[Array, "*b L"]) -> Float[Array, "*b L D"]:
        """Rotate x at positions pos (pos broadcasts against x's leading axes)."""
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq())  # [*b, L, D/2]
        cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
        x1, x2 = jnp.split(x, 2, axis=-1)  # [*b, L, D/2] each
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


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
