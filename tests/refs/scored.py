"""References for the score-based policies (h2o, tova, snapkv, pyramid): a float64 numpy simulation of each
paper's rule step by step, written independently of the library (tests/kvpolicies/test_scored.py,
test_prompt_scored.py's pyramidkv and the registry matrix)."""

from __future__ import annotations

import numpy as np

from tests.refs.oracle import default_inv_freq, rope_complex


B, N, K, D, THETA = 2, 4, 2, 16, 10000.0
G = N // K
MAX_LEN = 64


# ------------------------------------------------------------------------------------------
# The oracle: sets of kept positions per (batch, unit); a unit is a kv head, or the layer.
# ------------------------------------------------------------------------------------------


def schedule(chunks, t):
    out, s, i = [], 0, 0
    while s < t:
        c = min(chunks[i % len(chunks)], t - s)
        out.append((s, s + c))
        s, i = s + c, i + 1
    return out


def simulate(pol, q, k, v, chunks, max_len=MAX_LEN):
    """Outputs [B, T, N, D] and the final kept positions: kept[b][unit] (sorted lists)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    inv = default_inv_freq(d, THETA)
    qr = rope_complex(q, np.broadcast_to(np.arange(t)[None, :, None], q.shape[:3]), inv)
    kr = rope_complex(k, np.broadcast_to(np.arange(t)[None, :, None], k.shape[:3]), inv)
    name = type(pol).__name__
    layer = name == "TOVA" and pol.scope == "layer"
    units = 1 if layer else K
    snap = lambda: pol.budget + pol.obs_window + pol.max_new  # noqa: E731
    cap = min(max_len, {"H2O": lambda: pol.heavy + pol.recent, "TOVA": lambda: pol.budget, "SnapKV": snap,
                        "Finch": snap}[name]())  # Finch: SnapKV at kernel 1, its keys re-rotated (below)
    ranks = name == "Finch" and pol.rerotate
    out = np.zeros((b_, t, n, d))
    kept_all = []
    for b in range(b_):
        kept = [set() for _ in range(units)]
        acc = [dict() for _ in range(K)]  # h2o: accumulated mass per position
        obs = [dict() for _ in range(K)]  # snapkv: decode observation mass
        for s, e in schedule(chunks, t):
            mass = np.zeros((K, e - s, t))  # mass[h, i, j]: query s+i -> key j, summed over G
            for i, p in enumerate(range(s, e)):
                for h in range(K):
                    js = np.array(sorted(kept[0 if layer else h] | set(range(s, p + 1))))
                    kj = rope_complex(k[b, js, h], np.arange(len(js)), inv) if ranks else kr[b, js, h]  # [J, D]
                    for g in range(G):
                        qp = (rope_complex(q[b, p, h * G + g], np.array(len(js) - 1), inv) if ranks
                              else qr[b, p, h * G + g])
                        lg = kj @ qp / np.sqrt(d)
                        w = np.exp(lg - lg.max())
                        w /= w.sum()
                        out[b, p, h * G + g] = w @ v[b, js, h]
                        mass[h, i, js] += w
            view = [kept[u] | set(range(s, e)) for u in range(units)]
            for u in range(units):
                if name == "H2O":
                    for j in view[u]:
                        acc[u][j] = acc[u].get(j, 0.0) + mass[u, :, j].sum()
                    if len(view[u]) > cap:
                        recent = {j for j in view[u] if j > e - 1 - pol.recent}
                        rest = sorted(view[u] - recent, key=lambda j: (-acc[u][j], -j))
                        kept[u] = recent | set(rest[: cap - len(recent)])
                    else:
                        kept[u] = view[u]
                    acc[u] = {j: acc[u][j] for j in kept[u]}
                elif name == "TOVA":
                    last = mass[:, -1].sum(0) if layer else mass[u, -1]  # [t]
                    if len(view[u]) > cap:
                        kept[u] = set(sorted(view[u], key=lambda j: (-last[j], -j))[:cap])
                    else:
                        kept[u] = view[u]
                else:  # SnapKV
                    w, r, n_keep = pol.obs_window, pol.kernel // 2, min(pol.budget + pol.obs_window, cap)
                    before = len(kept[u])
                    for i in range(e - s):
                        if before + i + 1 >= cap + 2 - w:
                            for j in view[u]:
                                obs[u][j] = obs[u].get(j, 0.0) + mass[u, i, j]
                    over = len(view[u]) > (cap if e - s == 1 else n_keep)
                    if over:
                        if e - s > 1:
                            win = {j: mass[u, -w:, j].sum() for j in view[u]}
                        else:
                            win = {j: obs[u].get(j, 0.0) for j in view[u]}
                        recent = {j for j in view[u] if j > e - 1 - w}
                        cand = view[u] - recent
                        pooled = {j: max(win[i] for i in cand if abs(i - j) <= r) for j in cand}
                        best = sorted(cand, key=lambda j: (-pooled[j], -win[j]))
                        kept[u] = recent | set(best[: n_keep - len(recent)])
                        obs[u] = {}
                    else:
                        kept[u] = view[u]
                        obs[u] = {j: obs[u].get(j, 0.0) for j in kept[u]}
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


def qkv(t, seed=0):
    """Random q, k, v; keys scaled so that attention is peaked and the tokens each head
    prefers depend on content, not only on age."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (N, K, K))
    return q, 2.5 * k, v


def kept_positions(state):
    """[b][unit] sorted lists of the positions a state holds."""
    pos = np.asarray(state.pos)
    return [[sorted(int(x) for x in pos[b, u] if x >= 0) for u in range(pos.shape[1])] for b in range(pos.shape[0])]
