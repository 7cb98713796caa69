"""References for `multires` (alias `hier`) and `quest`: numpy oracles written from their definitions,
token by token (tests/kvpolicies/test_multires_quest.py and the registry matrix)."""

from __future__ import annotations

import numpy as np

from tests.refs.oracle import default_inv_freq, rope_complex


B, N, K, D, THETA, T = 2, 4, 2, 16, 10000.0, 40


INV = default_inv_freq(D, THETA)


# ---------------------------------------------------------------------------------------------
# Oracles (float64, complex RoPE, plain Python bookkeeping; nothing shared with the library)
# ---------------------------------------------------------------------------------------------


def hier_oracle(q, k, v, pol):
    """Simulate the levels literally: blocks of `branch` tokens leave the raw window when their
    newest token is no longer among the newest `window`; a full level merges its oldest
    `branch` entries into the next level (the top level drops its oldest) before appending.
    Each entry is the list of token positions it stands for."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    br, m, nl = pol.branch, pol.slots_per_level, pol.levels
    raw, levels, out = [], [[] for _ in range(nl)], np.zeros_like(q)

    def insert(lv, toks):
        if len(levels[lv]) == m:
            if lv == nl - 1:
                levels[lv].pop(0)
            else:
                insert(lv + 1, sum(levels[lv][:br], []))
                del levels[lv][:br]
        levels[lv].append(toks)

    for p in range(t):
        raw.append(p)
        entries = [e for lv in reversed(range(nl)) for e in levels[lv]] + [[j] for j in raw]  # oldest first
        km = np.stack([k[:, e].mean(1) for e in entries], 1)  # [B, E, K, D]
        vm = np.stack([v[:, e].mean(1) for e in entries], 1)
        logc = np.log([len(e) for e in entries])
        if pol.positions == "mean":
            kpos, qpos = np.array([np.mean(e) for e in entries]), p
        else:
            kpos, qpos = np.arange(len(entries), dtype=float), len(entries) - 1
        for h in range(n):
            qr = rope_complex(q[:, p, h], np.full(b, qpos), INV)  # [B, D]
            kr = rope_complex(km[:, :, h // g], np.broadcast_to(kpos, (b, len(entries))), INV)  # [B, E, D]
            lg = np.einsum("bd,bed->be", qr, kr) * d**-0.5 + logc
            w = np.exp(lg - lg.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, p, h] = np.einsum("be,bed->bd", w, vm[:, :, h // g])
        while len(raw) >= br and raw[br - 1] <= p + 1 - pol.window:  # prepare for query p + 1
            insert(0, raw[:br])
            del raw[:br]
    return out, [e for lv in reversed(range(nl)) for e in levels[lv]] + [[j] for j in raw]


def quest_oracle(q, k, v, pol, prompt=0):
    """Quest query by query. The first `prompt` queries are a prompt: each attends to every
    earlier token. Every later query, per batch row and kv head: the pages holding its newest
    max(window, 1) tokens (at least its own page) are read; among the pages before them, the
    top_k - 1 with the highest bound sum_d max(q_d min_d, q_d max_d) over keys rotated at their
    positions (max over the group's query heads; ties -> lower page) are read too. Returns the
    outputs and {(p, b, kv head): tokens read} for the sparse queries."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    kh_n = k.shape[2]
    g, P = n // kh_n, pol.page
    out, sizes = np.zeros_like(q), {}
    for p in range(t):
        dense = p < prompt
        always = {j // P for j in range(max(0, p - max(pol.window, 1) + 1), p + 1)}  # pages always read
        for bb in range(b):
            for kh in range(kh_n):
                heads = list(range(kh * g, (kh + 1) * g))
                kr = rope_complex(k[bb, : p + 1, kh], np.arange(p + 1), INV)  # [p+1, D]
                if dense:
                    vis = list(range(p + 1))
                else:
                    qr = rope_complex(q[bb, p, heads], np.full(g, p), INV)  # [G, D]
                    score = []
                    for c in range(min(always)):
                        lo, hi = kr[c * P:(c + 1) * P].min(0), kr[c * P:(c + 1) * P].max(0)
                        score.append(np.maximum(qr * lo, qr * hi).sum(-1).max())
                    chosen = sorted(range(len(score)), key=lambda c: (-score[c], c))[: pol.top_k - 1]
                    vis = [j for j in range(p + 1) if j // P in always or j // P in chosen]
                    sizes[p, bb, kh] = len(vis)
                for h in heads:
                    lg = kr[vis] @ rope_complex(q[bb, p, h], np.asarray(p), INV) * d**-0.5
                    w = np.exp(lg - lg.max())
                    out[bb, p, h] = (w / w.sum()) @ v[bb, vis, kh]
    return out, sizes
