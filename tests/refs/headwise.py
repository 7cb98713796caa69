"""References for head-varying memory (`adakv`, `duo`, and the head-wise `kvzip` / `kvzap`): attention
recomputed per kv head over that head's own kept positions in float64 numpy, Ada-KV's allocation
and DuoAttention's split re-simulated (tests/kvpolicies/test_adakv.py, test_duo.py, test_kvzip.py,
test_kvzap.py and the registry matrix)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kvpolicies import Rope
from kvpolicies.adakv import head_of
from tests.refs.oracle import default_inv_freq, rope_complex


B, N, K, D, THETA = 2, 4, 2, 16, 10000.0
G = N // K
ROPE = Rope(D, THETA)
MAX_LEN = 64


def qkv(t, seed=0, head_scale=(2.5, 2.5)):
    """Random q, k, v; kv head h's keys scaled by head_scale[h] (a large scale: peaked attention,
    a small one: diffuse), so that heads differ in how many tokens their scores favour."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (N, K, K))
    return q, (k * np.asarray(head_scale, np.float32)[None, None, :, None]).astype(np.float32), v


def rotated(q, k):
    t = q.shape[1]
    inv = default_inv_freq(D, THETA)
    qq, kk = (np.asarray(a, np.float64) for a in (q, k))
    qr = rope_complex(qq, np.broadcast_to(np.arange(t)[None, :, None], qq.shape[:3]), inv)
    kr = rope_complex(kk, np.broadcast_to(np.arange(t)[None, :, None], kk.shape[:3]), inv)
    return qr, kr


def attend_sets(qr, kr, v, b, p, h, js):
    """Outputs [G, D] of query p's G query heads of kv head h over key positions js, and the
    probabilities [len(js)] summed over G."""
    js = np.asarray(sorted(js))
    outs, mass = [], np.zeros(len(js))
    for g in range(G):
        lg = kr[b, js, h] @ qr[b, p, h * G + g] / np.sqrt(D)
        w = np.exp(lg - lg.max())
        w /= w.sum()
        outs.append(w @ np.asarray(v, np.float64)[b, js, h])
        mass += w
    return np.stack(outs), dict(zip(js.tolist(), mass))


# ------------------------------------------------------------------------------------------
# Ada-KV reference
# ------------------------------------------------------------------------------------------


def adakv_allocate(win, cand, b, alpha, r):
    """kvpress's AdaKVPress rule over SnapKV scores, per kv head h: win[h] {pos: observation
    mass}, cand[h] the candidate positions. Returns the chosen candidates per head."""
    kh = len(win)
    pooled = [{j: max(win[h][i] for i in cand[h] if abs(i - j) <= r) for j in cand[h]} for h in range(kh)]
    n_safe = int(alpha * b)
    safe = [set(sorted(cand[h], key=lambda j, h=h: (-pooled[h][j], -win[h][j], j))[:n_safe]) for h in range(kh)]
    items = [(h, j) for h in range(kh) for j in cand[h]]
    items.sort(key=lambda hj: (-(math.inf if hj[1] in safe[hj[0]] else pooled[hj[0]][hj[1]]), -win[hj[0]][hj[1]],
                               hj[0], hj[1]))
    chosen = [set() for _ in range(kh)]
    for h, j in items[: kh * b]:
        chosen[h].add(j)
    return chosen


def simulate_adakv(pol, q, k, v, prompt_len=0, max_len=MAX_LEN):
    """Outputs [B, T, N, D] and kept[b][h] (sorted positions). prompt_len > 0: the paper's
    protocol (dense prompt, one compression from its last obs_window queries, then decode);
    0: a stream from the first token (re-compression on overflow)."""
    qr, kr = rotated(q, k)
    t = q.shape[1]
    w, r = pol.obs_window, pol.kernel // 2
    cap = min(pol.budget + w + pol.max_new, max_len)
    b_ = min(pol.budget + w, cap) - w
    out = np.zeros(q.shape)
    kept_all = []
    for b in range(B):
        kept = [set() for _ in range(K)]
        obs = [dict() for _ in range(K)]
        if prompt_len:
            win = [dict.fromkeys(range(prompt_len), 0.0) for _ in range(K)]
            for p in range(prompt_len):
                for h in range(K):
                    o, mass = attend_sets(qr, kr, v, b, p, h, range(p + 1))
                    out[b, p, h * G:(h + 1) * G] = o
                    if p >= prompt_len - w:
                        for j, m in mass.items():
                            win[h][j] += m
            kept = [set(range(prompt_len)) for _ in range(K)]
            if prompt_len > min(pol.budget + w, cap):
                recent = {j for j in range(prompt_len) if j > prompt_len - 1 - w}
                cand = [set(range(prompt_len)) - recent for _ in range(K)]
                chosen = adakv_allocate(win, cand, b_, pol.alpha_safeguard, r)
                kept = [recent | chosen[h] for h in range(K)]
        for p in range(prompt_len, t):
            view = [kept[h] | {p} for h in range(K)]
            n = sum(len(x) for x in view)
            for h in range(K):
                o, mass = attend_sets(qr, kr, v, b, p, h, view[h])
                out[b, p, h * G:(h + 1) * G] = o
                obs[h] = {j: obs[h].get(j, 0.0) + (mass[j] if n >= K * (cap + 2 - w) else 0.0) for j in view[h]}
            if n > K * cap:
                recent = {j for j in view[0] if j > p - w}
                cand = [view[h] - recent for h in range(K)]
                chosen = adakv_allocate(obs, cand, b_, pol.alpha_safeguard, r)
                kept = [recent | chosen[h] for h in range(K)]
                obs = [dict() for _ in range(K)]
            else:
                kept = view
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


def kept_by_head(state):
    """[b][h] sorted positions of an adakv state (the pool's segments)."""
    pos = np.asarray(state.pos).reshape(state.pos.shape[0], 1, -1)  # rows -> one pool
    head = np.asarray(head_of(jnp.asarray(pos), K))
    return [[sorted(int(x) for x in pos[b, 0][head[b, 0] == h]) for h in range(K)] for b in range(pos.shape[0])]


def adakv_reference(pol, q, k, v, chunks=None):
    """The registry reference (tests/kvpolicies/test_policies.py): a stream, token by token."""
    return simulate_adakv(pol, q, k, v)[0]


# ------------------------------------------------------------------------------------------
# Duo reference
# ------------------------------------------------------------------------------------------


def simulate_duo(pol, q, k, v):
    """Retrieval kv heads: causal attention over every token; streaming: j < sink or j > p - recent."""
    qr, kr = rotated(q, k)
    t = q.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for p in range(t):
            for h in range(K):
                js = range(p + 1) if pol.heads[h] else [j for j in range(p + 1) if j < pol.sink or j > p - pol.recent]
                out[b, p, h * G:(h + 1) * G] = attend_sets(qr, kr, v, b, p, h, js)[0]
    return out


def duo_reference(pol, q, k, v, chunks=None):
    return simulate_duo(pol, q, k, v)
