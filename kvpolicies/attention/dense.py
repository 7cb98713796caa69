"""The one-piece softmax: every part's logits at once, one softmax over them (a shared max and
normaliser), the parts never concatenated (but for a policy that observes per-slot fields)."""

from __future__ import annotations

import jax.numpy as jnp

from kvpolicies.attention.logits import Step, cat, observe, part_logits, softmax, sum_groups
from kvpolicies.base import Policy


def one_piece(policy: Policy, st: Step, rope):
    """(output [B, K, G, T, D], `Seen`, the most keys any query attended) of the step in one piece."""
    lgs, masks = zip(*(part_logits(st, lo, hi, kp, st.selected) for (lo, hi), kp in zip(st.cuts, st.keys)))
    probs = softmax(lgs)  # P(slot) per part, float32
    out = sum(jnp.einsum("BKGTS,BKSD->BKGTD", p.astype(vp.dtype), vp) for p, vp in zip(probs, st.vals))
    obs = policy.observes
    summed = sum_groups(cat(probs)) if {"scores", "columns"} & set(obs) else None  # [B, K, T, S']
    seen = observe(policy, st, rope, scores=summed if "scores" in obs else None,
                   columns=summed.sum(axis=2) if "columns" in obs else None,  # [B, K, S']
                   logits=cat(lgs) if "logits" in obs else None)  # [B, K, G, T, S']
    visible = sum(m.sum(axis=-1, dtype=jnp.int32) for m in masks).max()  # keys the busiest query attended
    return out, seen, visible


def last_rows_scores(st: Step, rows: int):
    """[B, K, m, S'] the probabilities of the step's last m = min(T, rows) queries, in one piece (a
    blocked chunk's `Seen.scores`)."""
    m = min(st.pos.shape[1], rows)
    sub = ([x[:, :, :, -m:] for x in st.qr], st.pos[:, -m:])
    vmask = None if st.view.mask is None else st.view.mask[..., -m:, :]
    lg_m = [part_logits(st, lo, hi, kp, None, sub, vmask)[0] for (lo, hi), kp in zip(st.cuts, st.keys)]
    return sum_groups(cat(softmax(lg_m)))
