"""References for `kvzip`: its streaming extension re-simulated per kv head in float64 numpy, and the
repeat prompts the tests use (tests/kvpolicies/test_kvzip.py, test_rotated.py and the registry matrix)."""

from __future__ import annotations

import numpy as np

from models.reconstruct import RepeatPrompts
from tests.refs.headwise import B, G, K, MAX_LEN, rotated


REPEAT = RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11))


# ------------------------------------------------------------------------------------------
# the stream extension (the registry reference)
# ------------------------------------------------------------------------------------------


def _probs(qr, kr, b, p, h, js):
    """Attention probabilities [G, len(js)] of query p's G heads of kv head h over positions js."""
    js = np.asarray(sorted(js))
    lg = np.einsum("jd,gd->gj", kr[b, js, h], qr[b, p, h * G:(h + 1) * G]) / np.sqrt(qr.shape[-1])
    w = np.exp(lg - lg.max(axis=1, keepdims=True))
    return js, w / w.sum(axis=1, keepdims=True)


def choose(score, pos_sets, n_sink, newest, n):
    """Head-wise choice: score[h] {pos: score}; every head keeps j < n_sink and `newest`, then the
    best of all (head, pos) until n are kept (ties: newer token, then lower head)."""
    always = [{j for j in s if j < n_sink or j == newest} for s in pos_sets]
    rest = sorted(((h, j) for h, s in enumerate(pos_sets) for j in s - always[h]),
                  key=lambda hj: (-score[hj[0]][hj[1]], -hj[1], hj[0]))
    kept = [set(a) for a in always]
    for h, j in rest[: max(n - sum(len(a) for a in always), 0)]:
        kept[h].add(j)
    return kept


def simulate_stream(pol, q, k, v, max_len=MAX_LEN):
    qr, kr = rotated(q, k)
    t = q.shape[1]
    cap = pol.capacity(max_len)
    out = np.zeros(q.shape)
    kept_all = []
    for b in range(B):
        kept = [set() for _ in range(K)]
        mass = [dict() for _ in range(K)]
        for p in range(t):
            view = [kept[h] | {p} for h in range(K)]
            for h in range(K):
                js, w = _probs(qr, kr, b, p, h, view[h])
                out[b, p, h * G:(h + 1) * G] = w @ np.asarray(v, np.float64)[b, js, h]
                for j, x in zip(js.tolist(), w.max(axis=0)):
                    mass[h][j] = max(mass[h].get(j, 0.0), x)
            if sum(len(x) for x in view) > K * cap:
                kept = choose(mass, view, pol.n_sink, p, K * min(pol.budget, cap))
            else:
                kept = view
            mass = [{j: mass[h][j] for j in kept[h]} for h in range(K)]
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


def stream_reference(pol, q, k, v, chunks=None):
    """The registry reference (tests/kvpolicies/test_policies.py)."""
    return simulate_stream(pol, q, k, v)[0]
