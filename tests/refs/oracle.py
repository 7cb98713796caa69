"""A dense numpy oracle for attention through a cache policy, written independently of the library.

For every query position p it builds the set of key positions the policy's definition says p
can see, the RoPE distance of each pair (text positions, or ranks inside the cache), and runs
plain softmax attention in float64. RoPE here uses complex rotation, not the library's code.
"""

from __future__ import annotations

import numpy as np


def rope_complex(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x [..., D] at positions pos [...] (rotate-half layout: pairs are (i, i + D/2))."""
    h = x.shape[-1] // 2
    z = x[..., :h] + 1j * x[..., h:]
    z = z * np.exp(1j * pos[..., None] * inv_freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)


# Visible key positions for query p, per registered policy name (the policy's *definition*).
def visible_full(p, pol):
    return list(range(p + 1))


def visible_window(p, pol):
    return [j for j in range(p + 1) if j > p - pol.window]


def visible_sink(p, pol):
    return [j for j in range(p + 1) if j < pol.n_sink or j > p - pol.window]


def visible_paged(p, pol):  # a layout: the visibility of full (window=None) or sink (n_sink=0: window)
    return visible_full(p, pol) if pol.window is None else visible_sink(p, pol)


VISIBLE = {"full": visible_full, "window": visible_window, "sink": visible_sink, "paged": visible_paged}

def dense_attention(q, k, v, visible_sets, cache_ranks: bool, inv_freq, scale=None):
    """q [B, T, N, D], k/v [B, T, K, D]; visible_sets[p] = list of key positions (same per batch).

    cache_ranks: rotate by rank inside the visible set (query = last rank) instead of positions.
    Returns [B, T, N, D] float64.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = np.zeros((b, t, n, d))
    for p in range(t):
        js = np.array(visible_sets[p])
        if cache_ranks:
            qpos, kpos = len(js) - 1, np.arange(len(js))
        else:
            qpos, kpos = p, js
        for h in range(n):
            kh = h // g
            qr = rope_complex(q[:, p, h], np.full(b, qpos), inv_freq)  # [B, D]
            kr = rope_complex(k[:, js, kh], np.broadcast_to(kpos, (b, len(js))), inv_freq)  # [B, J, D]
            lg = np.einsum("bd,bjd->bj", qr, kr) * scale
            w = np.exp(lg - lg.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, p, h] = np.einsum("bj,bjd->bd", w, v[:, js, kh])
    return out
