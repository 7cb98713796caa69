"""What every path shares: the prepared step (`Step`), visibility, masked logits, the softmax
over a view's parts, and `Seen` (what attention observed), built in one place.

Shapes: B batch, T new tokens, N query heads = K kv heads x G groups, S view slots, D head dim,
Kp = 1 or K (slot positions shared by kv heads or per head), P RoPE segments.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import Policy, Seen, View
from kvpolicies.rope import RopeTable

LOWEST = jnp.finfo(jnp.float32).min  # a masked logit (exp(LOWEST - max) == 0)


class Step(NamedTuple):
    """One step prepared for the softmax paths (`step.prepare`).

    qr:       P x [B, K, G, T, D] the queries rotated once per RoPE segment (into the codec's
              basis where the keys are decoded in one).
    qh:       [B, K, G, T, D] the queries before RoPE.
    pos:      [B, T] the queries' positions.
    view:     the view attention reads (gathered, moved from a host tier).
    own:      the policy's own view (`compact` folds the step into the state from it).
    cuts:     [(lo, hi)] the view's parts: the S stored slots, then the T appended ones.
    keys, vals: per part, [B, K, S_part, D] (keys rotated).
    k_all:    [B, K, S', D] every slot's rotated keys, for a policy that reads them (else None).
    selected: the policy's selection [B, K|Kp, G|1, T, S'] or None.
    scale:    the logits' scale.
    """

    qr: list
    qh: Float[Array, "B K G T D"]
    pos: Int[Array, "B T"]
    view: View
    own: View
    cuts: list
    keys: list
    vals: list
    k_all: Any
    selected: Any
    scale: float


def causal(q_pos: Int[Array, "B T"], k_pos: Int[Array, "B Kp S"]) -> Bool[Array, "B Kp T S"]:
    """Slot filled and not in the query's future."""
    k = k_pos[:, :, None, :]  # [B, Kp, 1, S]
    return (k >= 0) & (k <= q_pos[:, None, :, None])  # [B, Kp, T, S]


def visibility(kpos, vmask, sel, q_pos):
    """Which slots each query sees [B, Kp|K, 1|G, T, S_part]: filled, not in its future, and
    in the view's mask and the policy's selection (cut to these slots)."""
    mask = causal(q_pos, kpos)  # [B, Kp, T, S_part]
    if vmask is not None:
        mask = mask & vmask
    mask = mask[:, :, None]  # [B, Kp, 1, T, S_part]
    if sel is not None:
        mask = mask & sel  # [B, K, G|1, T, S_part]
    return mask


def masked_logits(st: Step, kp, kpos, vmask, bias, seg, sel, queries=None, mask=None):
    """Masked, scaled logits [B, K, G, T, S_part] float32 and the mask, of the slots whose keys
    are kp [B, K, S_part, D], positions kpos [B, Kp, S_part] (and the view's mask, bias, RoPE
    segments and the policy's selection, cut to these slots); `queries`: (rotated queries,
    positions) of some of the step's queries instead of all; `mask`: the visibility, when the
    caller has it (`True`: every slot is visible to every query, so no mask is applied)."""
    qs, q_pos = (st.qr, st.pos) if queries is None else queries
    if st.pos.shape[1] == 1:  # decode: keys as the matmul's left operand, so that XLA:CPU reads them
        # as stored instead of first copying them transposed
        lgs = [jnp.moveaxis(jnp.einsum("BKSD,BKGTD->BKSGT", kp, x, preferred_element_type=jnp.float32), 2, -1)
               for x in qs]
    else:  # a chunk: the other way round (the keys-first form is slower for a chunk)
        lgs = [jnp.einsum("BKGTD,BKSD->BKGTS", x, kp, preferred_element_type=jnp.float32) for x in qs]
    lg = lgs[0]
    if seg is not None:
        seg = seg[:, :, None, None, :]  # [B, Kp, 1, 1, S_part]
        for p in range(1, len(lgs)):
            lg = jnp.where(seg == p, lgs[p], lg)
    if mask is True and bias is None:  # the caller scales (XLA:CPU then fuses it into its exp)
        return lg, None
    lg = lg * st.scale
    if bias is not None:
        lg = lg + bias[:, :, None, None, :].astype(jnp.float32)
    if mask is True:
        return lg, None
    if mask is None:
        mask = visibility(kpos, vmask, sel, q_pos)
    return jnp.where(mask, lg, LOWEST), mask


def part_logits(st: Step, lo: int, hi: int, kp, sel=None, queries=None, vmask=None):
    """`masked_logits` of the view's slots [lo, hi) whose keys are kp; `vmask`: the view's mask
    already cut to the queries (default: the view's own)."""
    view = st.view
    cut = lambda a: None if a is None else a[..., lo:hi]  # noqa: E731  (every per-slot field: last axis)
    return masked_logits(st, kp, view.pos[..., lo:hi], cut(view.mask) if vmask is None else vmask[..., lo:hi],
                         cut(view.bias), cut(view.rope.seg), cut(sel), queries)


def softmax(lgs):
    """One softmax over the parts' logits (a shared max and normaliser): P per part, float32."""
    top = functools.reduce(jnp.maximum, [lg.max(axis=-1, keepdims=True) for lg in lgs])  # [B, K, G, T, 1]
    exps = [jnp.exp(lg - top) for lg in lgs]
    total = sum(e.sum(axis=-1, keepdims=True) for e in exps)
    return [e / total for e in exps]


def cat(xs):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)


def sum_groups(p: Float[Array, "B K G T S"]) -> Float[Array, "B K T S"]:
    """p summed over its G query heads, as G - 1 elementwise adds: XLA:CPU compiles the same sum
    written as a reduction over the middle axis into a much slower kernel."""
    return functools.reduce(jnp.add, [p[:, :, g] for g in range(p.shape[2])])


def out_of(basis, out: Float[Array, "B K G T D"]) -> Float[Array, "B K G T D"]:
    """An attention output over values decoded in `basis` (`View.basis`) rotated out of it, in float32."""
    return out if basis is None else basis.from_basis(out.astype(jnp.float32)).astype(out.dtype)


def observe(policy: Policy, st: Step, rope, scores=None, columns=None, logits=None) -> Seen:
    """What attention observed, for `compact`: only the fields the policy `observes`."""
    obs = policy.observes
    return Seen(scores=scores, columns=columns, k_rot=st.k_all if "k_rot" in obs else None,
                q=st.qh if "q" in obs else None,  # [B, K, G, T, D]
                rope=(rope.rope if isinstance(rope, RopeTable) else rope) if "rope" in obs else None,
                logits=logits)
