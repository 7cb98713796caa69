"""The registry reference of `kvcompose` (tests/kvpolicies/test_policies.py): its stream extension
re-simulated per kv head in float64 numpy. Its prompt rule (the pass over [context, context] and the
choice over all layers) is checked in tests/kvpolicies/test_prompt_matrix.py (tests/refs/prompt_protocol
.kept_kvcompose) and beside kvpress in tests/kvpolicies/test_kvpress_parity_kvcompose.py."""

from __future__ import annotations

import numpy as np

from tests.refs.headwise import B, G, K, MAX_LEN, rotated


def simulate_stream(pol, q, k, v, max_len=MAX_LEN):
    """Outputs [B, T, N, D] and the kept positions [B][K]: every token appended; a slot's mass is the
    most attention it received from one query, averaged over the kv head's G query heads; a kv head
    holding more than S slots keeps its S - max_new best by mass (ties: the newer token)."""
    qr, kr = rotated(q, k)
    v = np.asarray(v, np.float64)
    t, d = q.shape[1], q.shape[-1]
    cap = pol.capacity(max_len)
    out = np.zeros(q.shape)
    kept_all = []
    for b in range(B):
        kept = [set() for _ in range(K)]
        mass = [dict() for _ in range(K)]
        for p in range(t):
            for h in range(K):
                js = np.asarray(sorted(kept[h] | {p}))
                lg = np.einsum("jd,gd->gj", kr[b, js, h], qr[b, p, h * G:(h + 1) * G]) / np.sqrt(d)
                w = np.exp(lg - lg.max(axis=1, keepdims=True))
                w /= w.sum(axis=1, keepdims=True)  # [G, J]
                out[b, p, h * G:(h + 1) * G] = w @ v[b, js, h]
                for j, x in zip(js.tolist(), w.mean(axis=0)):
                    mass[h][j] = max(mass[h].get(j, 0.0), x)
                view = set(js.tolist())
                if len(view) > cap:
                    view = set(sorted(view, key=lambda j: (-mass[h][j], -j))[:max(cap - pol.max_new, 1)])
                kept[h] = view
                mass[h] = {j: mass[h][j] for j in view}
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


def stream_reference(pol, q, k, v, chunks=None):
    return simulate_stream(pol, q, k, v)[0]
