"""References for simlayerkv and cap, written from kvpress's SimLayerKVPress and CapPress: their rules on
transformers' tensors (the prompt matrix, tests/kvpolicies/test_prompt_matrix.py) and their stream
extensions re-simulated token by token in float64 (the registry matrix, tests/refs/registry.py)."""

from __future__ import annotations

import numpy as np

from tests.refs.oracle import default_inv_freq, dense_attention, rope_complex
from tests.refs.prompt_scored import avg_rope_matrix

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


def cap_scores(pol, qs, keys_rot, vals, js, start, inv) -> dict:
    """kvpress's CapPress.score over the keys at positions js: qs [G', n, D] pre-RoPE queries (one
    anchor per row: their mean, times RoPE averaged over start .. start + n_future_positions - 1),
    keys_rot [J, D] after RoPE, vals [J, D]; the n_sink first tokens score +inf (kept first)."""
    r = avg_rope_matrix(start, pol.n_future_positions, inv)
    sink = np.array([j < pol.n_sink for j in js])
    k, v = keys_rot[~sink], vals[~sink]
    kn = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    per_head = []
    for qh in qs:
        mu = np.mean(qh, axis=0) @ r.T
        stat = np.clip(kn @ (mu / max(np.linalg.norm(mu), 1e-12)), -1.0, 1.0)
        w = np.exp(pol.tau * stat - np.max(pol.tau * stat))
        gram = np.eye(k.shape[-1]) + (v * (w + pol.epsilon)[:, None]).T @ v  # I + sum_j (w_j + eps) v_j v_j^T
        per_head.append(w * np.einsum("jd,jd->j", v, np.linalg.solve(gram, v.T).T))
    out = np.full(len(js), np.inf)
    out[~sink] = np.mean(per_head, axis=0)
    return dict(zip(js, out))


def kept_cap(pol, t, m):
    """kvpress CapPress on transformers' cached keys (after RoPE) and values and the pre-RoPE queries of
    its layer inputs (one anchor per query head): per kv head, the n_kept best."""
    n = t["atts"][0].shape[-1]
    n_keep = max(1, int(n * (1 - pol.ratio))) if pol.ratio else pol.budget
    out = []
    for layer in range(m.n_layers):
        q = m.qkv(layer, t["hidden"][layer], np.arange(n))[0]  # [T, H, D] pre-RoPE
        heads = []
        for h in range(m.k):
            sc = cap_scores(pol, [q[pol.n_sink:, h * m.g + g] for g in range(m.g)], t["keys"][layer][h],
                            t["values"][layer][h], list(range(n)), n, m.inv)
            heads.append(sorted(sorted(sc, key=lambda j: (-sc[j], -j))[:n_keep]))
        out.append(heads)
    return out


def cap_stream(pol, q, k, v, chunks=None):
    """A stream from token 0: each token attends to the slots it joins; the pre-RoPE queries at positions
    >= n_sink accumulate, pooled over a kv head's query heads (one anchor per kv head); when the slots
    then number more than budget + max_new, the budget best by cap_scores (RoPE averaged from the next
    position) stay, per kv head. Outputs [B, T, N, D] float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    kh = k.shape[2]
    g = n // kh
    inv = default_inv_freq(d, THETA)
    at = np.arange(t)
    qr = rope_complex(q, np.broadcast_to(at[None, :, None], q.shape[:3]), inv)
    kr = rope_complex(k, np.broadcast_to(at[None, :, None], k.shape[:3]), inv)
    out = np.zeros(q.shape)
    for b in range(b_):
        for h in range(kh):
            held, seen = [], []
            for p in range(t):
                held.append(p)
                for x in range(h * g, (h + 1) * g):
                    lg = kr[b, held, h] @ qr[b, p, x] / np.sqrt(d)
                    w = np.exp(lg - lg.max())
                    out[b, p, x] = (w / w.sum()) @ v[b, held, h]
                if p >= pol.n_sink:
                    seen.extend(q[b, p, h * g:(h + 1) * g])
                if len(held) > pol.budget + pol.max_new:
                    sc = cap_scores(pol, [np.array(seen)], kr[b, held, h], v[b, held, h], held, p + 1, inv)
                    held = sorted(sorted(held, key=lambda j: (-sc[j], -j))[:pol.budget])
    return out
