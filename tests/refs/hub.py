"""References for the presses whose kvpress version downloads its arrays (qfilter, ...): their rules
re-simulated in float64 numpy, written from kvpress's code and the papers, not from the library
(the registry matrix, tests/refs/registry.py; tests/kvpolicies/test_kvpress_parity_hub.py)."""

from __future__ import annotations

import numpy as np

from tests.refs.oracle import default_inv_freq, rope_complex

THETA = 10000.0


def qfilter_filter(pol, kv_heads: int, head_dim: int) -> np.ndarray:
    """The layer's [K, D] filter: the policy's own, or (filters="random") numpy's default_rng(0) standard
    normal draw of that shape in float32 (the documented draw)."""
    if pol.filter is not None:
        return np.asarray(pol.filter, np.float64)
    return np.random.default_rng(0).standard_normal((kv_heads, head_dim)).astype(np.float32).astype(np.float64)


def qfilter_scores(f: np.ndarray, keys_rot: np.ndarray) -> np.ndarray:
    """kvpress's QFilterPress.score of one kv head: -(filter * keys).sum(-1), keys after RoPE [J, D]."""
    return -(keys_rot * f).sum(-1)


def qfilter_stream(pol, q, k, v, chunks=None, max_len: int = 64):
    """A stream from token 0, token by token: each kv head attends over its kept tokens and the new one;
    when they number more than S = budget + max_new, the `budget` best by kvpress's score stay (ties:
    the newer). Outputs [B, T, N, D] float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    kh = k.shape[2]
    g = n // kh
    inv = default_inv_freq(d, THETA)
    at = np.broadcast_to(np.arange(t)[None, :, None], (b_, t, 1))
    qr, kr = rope_complex(q, at, inv), rope_complex(k, at, inv)
    f = qfilter_filter(pol, kh, d)
    cap = min(pol.budget + pol.max_new, max_len)
    out = np.zeros((b_, t, n, d))
    for b in range(b_):
        for h in range(kh):
            kept: list[int] = []
            for p in range(t):
                js = np.array(kept + [p])
                for gi in range(g):
                    lg = kr[b, js, h] @ qr[b, p, h * g + gi] / np.sqrt(d)
                    w = np.exp(lg - lg.max())
                    out[b, p, h * g + gi] = (w / w.sum()) @ v[b, js, h]
                kept = list(js)
                if len(kept) > cap:
                    sc = qfilter_scores(f[h], kr[b, js, h])
                    kept = sorted(sorted(js.tolist(), key=lambda j: (-sc[list(js).index(j)], -j))[:pol.budget])
    return out


def kept_qfilter(pol, t, m):
    """kvpress QFilterPress on transformers' cached keys (after RoPE) t["keys"][layer] [K, n, D]: per kv
    head the n_kept (ratio) or `budget` best by -<f, k>, ties to the newer (the prompt matrix)."""
    n = t["atts"][0].shape[-1]
    n_keep = max(1, int(n * (1 - pol.ratio))) if pol.ratio else pol.budget
    out = []
    for layer in range(m.n_layers):
        keys = np.asarray(t["keys"][layer], np.float64)  # [K, n, D]
        f = qfilter_filter(pol, keys.shape[0], keys.shape[-1])
        out.append([sorted(sorted(range(n), key=lambda j, s=qfilter_scores(f[h], keys[h]): (-s[j], -j))[:n_keep])
                    for h in range(m.k)])
    return out


def expected_stats_stream(pol, q, k, v, mu, cov, max_len: int = 64):
    """ExpectedStats's stream from token 0, token by token: each kv head attends over its kept tokens and the
    new one; when they number more than S = budget + max_new, the `budget` best stay by kvpress's
    ExpectedAttentionPress.score with the given statistics (mu [N, D], cov [N, D, D] of the pre-RoPE queries,
    rotated by RoPE averaged over the F positions after the newest token), the n_sink first tokens first.
    Outputs [B, T, N, D] float64."""
    from tests.refs.prompt_scored import avg_rope_matrix

    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t, n, d = q.shape
    kh = k.shape[2]
    g = n // kh
    inv = default_inv_freq(d, THETA)
    at = np.broadcast_to(np.arange(t)[None, :, None], (b_, t, 1))
    qr, kr = rope_complex(q, at, inv), rope_complex(k, at, inv)
    cap = min(pol.budget + pol.max_new, max_len)
    out = np.zeros((b_, t, n, d))
    for b in range(b_):
        for h in range(kh):
            kept: list[int] = []
            for p in range(t):
                js = np.array(kept + [p])
                for gi in range(g):
                    lg = kr[b, js, h] @ qr[b, p, h * g + gi] / np.sqrt(d)
                    w = np.exp(lg - lg.max())
                    out[b, p, h * g + gi] = (w / w.sum()) @ v[b, js, h]
                kept = list(js)
                if len(kept) <= cap:
                    continue
                r = avg_rope_matrix(p + 1, pol.n_future_positions, inv)
                sink = js < pol.n_sink
                keys = kr[b, js[~sink], h]
                probs = []
                for gi in range(g):
                    m, c = r @ mu[h * g + gi], r @ cov[h * g + gi] @ r.T
                    lg = keys @ m / np.sqrt(d)
                    if pol.use_covariance:
                        lg = lg + np.einsum("ji,ij->j", keys @ c, keys.T) / d / 2
                    e = np.exp(lg - lg.max())
                    probs.append(e / e.sum())
                sc = np.full(len(js), np.inf)
                sc[~sink] = (np.mean(probs, axis=0) + pol.epsilon) * np.linalg.norm(v[b, js[~sink], h], axis=-1)
                kept = sorted(sorted(js.tolist(), key=lambda j: (-sc[list(js).index(j)], -j))[:pol.budget])
    return out
