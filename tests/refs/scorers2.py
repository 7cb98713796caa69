"""References for simlayerkv (and the scorers that follow it): its lazy-layer rule on transformers'
attention weights (the prompt matrix, tests/kvpolicies/test_prompt_matrix.py) and its stream
extension re-simulated token by token (the registry matrix, tests/refs/registry.py)."""

from __future__ import annotations

import numpy as np

from tests.refs.oracle import default_inv_freq, dense_attention

THETA = 10000.0


def simlayerkv_lazy(pol, att: np.ndarray) -> bool:
    """kvpress SimLayerKVPress.is_lazy on one layer's attention weights [H, T, T] (softmax over every
    key, causal): the last n_last rows without their own n_last columns, averaged over heads and rows,
    summed over the first n_initial and the n_recent keys before the last n_last, above lazy_threshold;
    never for a prompt of at most n_initial + n_recent + n_last tokens or lazy_threshold 1."""
    n = att.shape[-1]
    if pol.lazy_threshold == 1.0 or n <= pol.n_initial + pol.n_recent + pol.n_last:
        return False
    a = att[:, n - pol.n_last:, :n - pol.n_last].mean(axis=(0, 1))  # [n - n_last]
    return a[:pol.n_initial].sum() + a[len(a) - pol.n_recent:].sum() > pol.lazy_threshold


def kept_simlayerkv(pol, t, m):
    """Per layer (every kv head alike): a lazy layer's first n_initial and last n_recent - n_last
    prompt tokens (kvpress's slices), every token otherwise."""
    n = t["atts"][0].shape[-1]
    out = []
    for att in t["atts"]:
        keep = (list(range(pol.n_initial)) + list(range(n - (pol.n_recent - pol.n_last), n))
                if simlayerkv_lazy(pol, att) else list(range(n)))
        out.append([sorted(set(keep))] * m.k)
    return out


def simlayerkv_stream(pol, q, k, v, chunks=None):
    """A stream from token 0 (no prompt phase): the token joins the slots it attends with; when they
    then number more than S = budget + max_new, the first n_initial tokens and the newest stay,
    `budget` in all (every layer trimmed as a lazy one)."""
    t, d = q.shape[1], q.shape[-1]
    s, keep = pol.budget + pol.max_new, pol.budget
    held, vis = [], []
    for p in range(t):
        held = held + [p]
        vis.append(list(held))
        if len(held) > s:
            sinks = [j for j in held if j < pol.n_initial]
            sinks = sinks[max(len(sinks) - keep, 0):]  # ties keep the newer token
            held = sinks + [j for j in held if j >= pol.n_initial][len(held) - len(sinks) - (keep - len(sinks)):]
    return dense_attention(q, k, v, vis, False, default_inv_freq(d, THETA))
