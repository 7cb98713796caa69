"""References for the prompt-compression baselines (knorm, random, observed, expected, pyramidkv): float64
numpy re-simulations of NVIDIA/kvpress's presses and PyramidKV's schedule
(tests/kvpolicies/test_prompt_scored.py and the registry matrix)."""

from __future__ import annotations

import dataclasses

import numpy as np

import kvpolicies
from tests.refs.oracle import default_inv_freq, rope_complex


B, N, K, D, THETA = 2, 4, 2, 16, 10000.0
G = N // K


T, MAX_LEN = 24, 64


# ------------------------------------------------------------------------------------------
# The reference: kvpress's scores, written independently
# ------------------------------------------------------------------------------------------


def np_hash(seed, head, pos):
    """RandomKeep's documented draw: murmur3's finalizer of a mix of (seed, head, position)."""
    m = 0xFFFFFFFF
    x = ((pos * 0x9E3779B1) & m) ^ ((head * 0x85EBCA77) & m) ^ ((seed * 0xC2B2AE3D) & m)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & m
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & m
    x ^= x >> 16
    return (x >> 8) / float(1 << 24)


def keydiff_scores(keys_rot):
    """kvpress's KeyDiffPress.score on one kv head's keys after RoPE [J, D] (text order): minus the
    cosine of each key with the mean of the unit keys."""
    unit = keys_rot / np.linalg.norm(keys_rot, axis=-1, keepdims=True)
    anchor = unit.mean(0)
    return -(unit @ anchor) / np.linalg.norm(anchor)


def lagkv_scores(pol, keys_rot, vals):
    """kvpress's LagKVPress.score on one kv head's keys after RoPE and values [J, D] (text order),
    token by token: partitions of lag_size after the n_sink sinks, each scored against the next."""
    n, ns, lag = len(keys_rot), pol.n_sink, pol.lag_size
    if n < ns + 2 * lag:
        return np.array([1.0 if j < ns else (j - ns) / (n - ns) for j in range(n)])
    n_part = (n - ns) // lag
    out = np.ones(n)
    for p in range(n_part - 1):
        rows = range(ns + p * lag, ns + (p + 1) * lag)
        nxt = range(ns + (p + 1) * lag, ns + (p + 2) * lag)
        total = np.zeros(lag)
        for x in (keys_rot, vals):
            lo, hi = x[list(nxt)].min(0), x[list(nxt)].max(0)
            std = np.array([np.std((x[j] - lo) / (hi - lo), ddof=1) for j in rows])
            e = np.exp(std - std.max())
            total += e / e.sum() / 2
        if not pol.cross_scoring:
            total = np.array([sum(total < total[i]) for i in range(lag)]) / lag  # the rank within the partition
        out[list(rows)] = total
    return out


def cur_scores(pol, keys, vals, js):
    """kvpress's CURPress.score on one kv head's held tokens in text order (keys [J, D], values [J, D],
    positions js): squared norms divided by their sum over blocks of local_window tokens (zero-padded
    at the end; 0: over all), combined by leverage_type, normalized to sum 1, the sinks set to 1."""
    def lev(x):
        x2 = (x.astype(np.float64) ** 2).sum(-1)
        w = pol.local_window
        if not w:
            return x2 / x2.sum()
        return np.array([x2[i] / x2[i - i % w:i - i % w + w].sum() for i in range(len(x2))])

    k2, v2 = lev(keys), lev(vals)
    s = {"kv_product": k2 * v2, "key": k2, "value": v2, "kv_avg": (k2 + v2) / 2}[pol.leverage]
    s = s / s.sum()
    s[np.asarray(js) < pol.n_sink] = 1.0
    return s


def _z(x):
    return (x - x.mean()) / max(x.std(ddof=1), 1e-6)


def compactor_scores(pol, q, k, v, phi, inv, att=None):
    """kvpress's CompactorPress / NonCausalAttnPress / LeverageScorePress scores of one layer, float64,
    written from kvpress's code: q [H, n, D] queries and k [K, n, D] keys before RoPE, v [K, n, D],
    phi [K, D, R] the sketch. -> [K, n], the sinks +inf. Between the sinks: blending z(leverage) +
    z(pool3(non-causal chunked attention column sums x |v|)), z over every head. `att` [K, n]: the
    attention term given instead (the stream extension's mass; q unused)."""
    kh, n, d = k.shape
    left = min(pol.sink_start, n)
    right = min(pol.sink_end, max(0, n - left))
    sl, m = slice(left, n - right), n - left - right
    score = np.zeros((kh, m))
    if pol.attention and att is not None:
        x = np.pad(att[:, sl] * np.linalg.norm(v[:, sl], axis=-1), ((0, 0), (1, 1)))
        score = _z((x[:, :-2] + x[:, 1:-1] + x[:, 2:]) / 3)
    elif pol.attention:
        cs, g = pol.chunk_size, q.shape[0] // kh
        pos = np.arange(n)[None]
        qr, kr = rope_complex(q, pos, inv)[:, sl], rope_complex(k, pos, inv)[:, sl]
        n_ch = -(-m // cs)
        pad = n_ch * cs - m
        att = np.zeros((kh, n_ch * cs))
        for h in range(q.shape[0]):
            qq = np.concatenate([qr[h], np.zeros((pad, d))])
            kk = np.concatenate([kr[h // g], np.zeros((pad, d))])
            for c in range(n_ch):
                dots = qq[c * cs:(c + 1) * cs] @ kk[c * cs:(c + 1) * cs].T
                if c == n_ch - 1 and pad:  # kvpress: pad queries' rows 0, then pad keys' columns -1e-9
                    bad = np.arange(c * cs, (c + 1) * cs) >= m
                    dots[bad, :] = 0.0
                    dots[:, bad] = -1e-9
                w = np.exp(dots - dots.max(-1, keepdims=True))
                att[h // g, c * cs:(c + 1) * cs] += (w / w.sum(-1, keepdims=True)).sum(0) / g  # mean over the group
        x = att[:, :m] * np.linalg.norm(v[:, sl], axis=-1)
        x = np.pad(x, ((0, 0), (1, 1)))
        score = _z((x[:, :-2] + x[:, 1:-1] + x[:, 2:]) / 3)
    weight = pol.weight if pol.attention else 1.0
    if weight:
        lev = np.zeros((kh, m))
        for h in range(kh):
            y = (k[h, sl] - k[h, sl].mean(0)) @ phi[h]  # [m, R]
            gram = y.T @ y
            gram = (gram + gram.T) / 2 + 1e-2 * np.eye(len(gram))
            lev[h] = np.clip(np.einsum("jr,rj->j", y, np.linalg.solve(gram, y.T)), 0, None)
        score = score + weight * _z(lev)
    out = np.full((kh, n), np.inf)
    out[:, sl] = score
    return out


def compactor_stream(pol, q, k, v, phi, max_len=MAX_LEN):
    """Outputs [B, T, N, D] of a stream from token 0 through Compactor's stream extension: token by
    token, every head's held tokens plus the new one attend (text positions), each slot's mass grows
    by the attention it receives (summed over G), and a view of more than budget + max_new tokens
    keeps per head the budget best by compactor_scores with that mass as the attention term."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    inv = default_inv_freq(d, THETA)
    at = lambda x: np.broadcast_to(np.arange(t)[None, :, None], x.shape[:3])  # noqa: E731
    qr, kr = rope_complex(q, at(q), inv), rope_complex(k, at(k), inv)
    cap = min(max_len, pol.budget + pol.max_new)
    out = np.zeros((b_, t, n, d))
    for b in range(b_):
        kept, mass = [[] for _ in range(K)], [dict() for _ in range(K)]
        for p in range(t):
            for h in range(K):
                js = kept[h] + [p]
                for g in range(G):
                    lg = kr[b, js, h] @ qr[b, p, h * G + g] / np.sqrt(d)
                    w = np.exp(lg - lg.max())
                    w /= w.sum()
                    out[b, p, h * G + g] = w @ v[b, js, h]
                    for j, x in zip(js, w):
                        mass[h][j] = mass[h].get(j, 0.0) + x
                kept[h] = js
            if len(kept[0]) > cap:
                js = np.array(kept)  # [K, J] (every head holds as many)
                att = np.array([[mass[h][j] for j in js[h]] for h in range(K)])
                sc = compactor_scores(pol, None, np.stack([k[b, js[h], h] for h in range(K)]),
                                      np.stack([v[b, js[h], h] for h in range(K)]), phi, inv, att=att)
                kept = [sorted(js[h][sorted(range(len(js[h])), key=lambda i: (-sc[h, i], -js[h][i]))[:pol.budget]])
                        for h in range(K)]
                kept = [[int(j) for j in x] for x in kept]
    return out


def avg_rope_matrix(start, n_future, inv):
    """kvpress's apply_avg_rope: R = mean_t (cos_t I + sin_t P), P the rotate-half matrix."""
    h = len(inv)
    p = np.zeros((2 * h, 2 * h))
    p[h:, :h], p[:h, h:] = np.eye(h), -np.eye(h)
    rs = []
    for t in range(start, start + n_future):
        ang = np.concatenate([t * inv, t * inv])
        rs.append(np.cos(ang)[:, None] * np.eye(2 * h) + np.sin(ang)[:, None] * p)
    return np.mean(rs, axis=0)


def expected_scores(pol, qs, keys_rot, vals, js, start, inv):
    """kvpress's ExpectedAttentionPress.score over the keys at positions js: qs [G', n, D]
    pre-RoPE queries (one Gaussian per row), keys_rot [J, D] after RoPE, vals [J, D]."""
    d = keys_rot.shape[-1]
    r = avg_rope_matrix(start, pol.n_future_positions, inv)
    sink = np.array([j < pol.n_sink for j in js])
    k, v = keys_rot[~sink], vals[~sink]
    per_head = []
    for qh in qs:
        mu = qh.mean(0)
        cen = qh - mu
        cov = cen.T @ cen / len(qh)
        mu, cov = mu @ r.T, r @ cov @ r.T
        lg = k @ mu / np.sqrt(d)
        if pol.use_covariance:
            lg = lg + np.einsum("ji,ij->j", k @ cov, k.T) / d / 2
        w = np.exp(lg - lg.max())
        per_head.append(w / w.sum())
    sc = np.mean(per_head, axis=0)
    if pol.use_vnorm:
        sc = (sc + pol.epsilon) * np.linalg.norm(v, axis=-1)
    out = np.full(len(js), np.inf)
    out[~sink] = sc
    return dict(zip(js, out))


def simulate(pol, q, k, v, prompt_len=0, max_len=MAX_LEN):
    """Outputs [B, T, N, D] and the final kept positions [b][head] (sorted lists): the prompt
    (prompt_len > 0) densely, one compression, then token by token (a stream from token 0)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    inv = default_inv_freq(d, THETA)
    at = lambda x: np.broadcast_to(np.arange(t)[None, :, None], x.shape[:3])  # noqa: E731
    qr, kr = rope_complex(q, at(q), inv), rope_complex(k, at(k), inv)
    name = type(pol).__name__
    cap = min(max_len, pol.budget + pol.max_new)
    n_keep = min(pol.budget, cap)
    out = np.zeros((b_, t, n, d))
    kept_all = []

    def top(scores, n_):
        return set(sorted(scores, key=lambda j: (-scores[j], -j))[:n_])

    def rule(b, h, view, last, mass, qs_pooled):
        """Stream scores of the view (kvpress's score with what the stream has seen so far)."""
        js = sorted(view)
        if name == "Knorm":
            return {j: -np.linalg.norm(k[b, j, h]) for j in js}
        if name == "RandomKeep":
            return {j: np_hash(pol.seed, h, j) for j in js}
        if name == "Observed":
            return {j: mass[j] / (last - j + 1) for j in js}
        if name == "KeyDiff":
            return dict(zip(js, keydiff_scores(kr[b, js, h])))
        if name == "LagKV":  # our stream extension: the held tokens in text order
            return dict(zip(js, lagkv_scores(pol, kr[b, js, h], v[b, js, h])))
        if name == "CUR":  # blocks of the held tokens in text order
            return dict(zip(js, cur_scores(pol, k[b, js, h], v[b, js, h], js)))
        return expected_scores(pol, [np.array(qs_pooled)], kr[b, js, h], v[b, js, h], js, last + 1, inv)

    for b in range(b_):
        kept = [set() for _ in range(K)]
        mass = [dict() for _ in range(K)]
        qs = [[] for _ in range(K)]  # expected: pooled pre-RoPE queries at positions >= n_sink
        if prompt_len:
            L = prompt_len
            for h in range(K):
                probs = np.zeros((G, L, L))
                for g in range(G):
                    lg = qr[b, :L, h * G + g] @ kr[b, :L, h].T / np.sqrt(d)
                    lg = np.where(np.tril(np.ones((L, L), bool)), lg, -np.inf)
                    w = np.exp(lg - lg.max(-1, keepdims=True))
                    probs[g] = w / w.sum(-1, keepdims=True)
                    out[b, :L, h * G + g] = probs[g] @ v[b, :L, h]
                js = list(range(L))
                if name == "Knorm":
                    sc = {j: -np.linalg.norm(k[b, j, h]) for j in js}
                elif name == "RandomKeep":
                    sc = {j: np_hash(pol.seed, h, j) for j in js}
                elif name == "KeyDiff":
                    sc = dict(zip(js, keydiff_scores(kr[b, :L, h])))
                elif name == "LagKV":
                    sc = dict(zip(js, lagkv_scores(pol, kr[b, :L, h], v[b, :L, h])))
                elif name == "CUR":
                    sc = dict(zip(js, cur_scores(pol, kr[b, :L, h], v[b, :L, h], js)))
                elif name == "Observed":  # kvpress: attentions.sum(2) / n_tokens_in_sum, mean over the group
                    col = probs.sum(1) / np.arange(L, 0, -1)  # [G, L]
                    sc = dict(zip(js, col.mean(0)))
                else:  # per query head statistics of the queries after the first n_sink
                    heads = [q[b, pol.n_sink:L, h * G + g] for g in range(G)]
                    sc = expected_scores(pol, heads, kr[b, :L, h], v[b, :L, h], js, L, inv)
                kept[h] = top(sc, n_keep) if L > n_keep else set(js)
                mass[h] = {j: probs.sum((0, 1))[j] for j in kept[h]}
                qs[h] = [q[b, p, h * G + g] for p in range(pol.n_sink, L) for g in range(G)] \
                    if name == "Expected" else []
        for p in range(prompt_len, t):
            for h in range(K):
                view = kept[h] | {p}
                js = np.array(sorted(view))
                m = np.zeros(t)
                for g in range(G):
                    lg = kr[b, js, h] @ qr[b, p, h * G + g] / np.sqrt(d)
                    w = np.exp(lg - lg.max())
                    w /= w.sum()
                    out[b, p, h * G + g] = w @ v[b, js, h]
                    m[js] += w
                mass[h] = {j: mass[h].get(j, 0.0) + m[j] for j in view}
                if name == "Expected" and p >= pol.n_sink:
                    qs[h] += [q[b, p, h * G + g] for g in range(G)]
                kept[h] = top(rule(b, h, view, p, mass[h], qs[h]), n_keep) if len(view) > cap else view
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


# ------------------------------------------------------------------------------------------
# The registry matrix's references (tests/kvpolicies/test_policies.py REFERENCES)
# ------------------------------------------------------------------------------------------


def stream_ref(pol, q, k, v, chunks):
    """A stream from token 0: the stream extension, whatever the chunk (per_token)."""
    return simulate(pol, q, k, v)[0]


def pyramid_ref(pol, q, k, v, chunks):
    """One layer of pyramidkv is snapkv at its budget (test_scored's SnapKV simulation)."""
    from tests.refs.scored import simulate as snap_simulate

    fields = {f.name: getattr(pol, f.name) for f in dataclasses.fields(kvpolicies.SnapKV)}
    return snap_simulate(kvpolicies.SnapKV(**fields), q, k, v, [1])[0]
