"""References for quantized storage (codecs int8 / int4 / fp8 and the `kivi` policy): numpy quantizers,
packing and KIVI's residual rule written from the module docstrings of kvpolicies/codecs.py and
kvpolicies/kivi.py (tests/kvpolicies/test_codecs.py, test_rotated.py and the registry matrix)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tests.refs.oracle import default_inv_freq, rope_complex


B, N, K, D, THETA = 2, 4, 2, 32, 10000.0


# ---------------------------------------------------------------------------------------------
# numpy references of the codecs (from the definitions, independently of kvpolicies.codecs)
# ---------------------------------------------------------------------------------------------


def np_round_up(x: np.ndarray, sdtype: str) -> np.ndarray:
    """Smallest value of sdtype >= x, as float32."""
    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[sdtype]
    y = x.astype(dt).astype(np.float32)
    up = np.nextafter(x.astype(dt), np.array(np.inf, dt)).astype(np.float32)
    return np.where(y < x, up, y)


def np_int8(x, sdtype="float32", s=None):
    """(codes, scale, decoded); `s` overrides the scale (to compare codes given a scale)."""
    s = np_round_up(np.abs(x).max(-1, keepdims=True) / np.float32(127), sdtype) if s is None else s
    q = np.clip(np.round(x / np.where(s > 0, s, 1)), -127, 127)
    return q.astype(np.int8), s, (q * s).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# (3) KIVI against an independent numpy implementation of the paper's algorithm
# ---------------------------------------------------------------------------------------------


def np_asym(x, bits, axis):
    """Asymmetric min/max quantization over `axis` (float32 throughout), returns x'."""
    top = np.float32(2**bits - 1)
    mn, mx = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    s = (mx - mn) / top
    q = np.clip(np.round((x - mn) / np.where(s > 0, s, 1)), 0, top)
    return (q * s + mn).astype(np.float32)


def np_kivi_cache(k, v, n, bits, g, r):
    """What KIVI stores after n tokens, decoded: k, v [B, T, K, D] -> [B, n, K, D] each.
    Keys: tokens j < R floor(n / R) quantized per channel over aligned groups of G tokens;
    values: tokens j < n - R quantized per token over groups of G channels."""
    kq, vq = k[:, :n].copy(), v[:, :n].copy()
    for a in range(0, r * (n // r), g):
        kq[:, a:a + g] = np_asym(k[:, a:a + g], bits, axis=1)  # min/max over the G tokens, per channel
    for j in range(max(n - r, 0)):
        x = v[:, j].reshape(v.shape[0], v.shape[2], -1, g)  # [B, K, D/G, G]
        vq[:, j] = np_asym(x, bits, axis=-1).reshape(v.shape[0], v.shape[2], -1)
    return kq, vq


def np_rotated(k):
    """Keys [B, T, K, D] rotated at positions 0..T-1 (float64 RoPE, then float32)."""
    pos = np.broadcast_to(np.arange(k.shape[1]), k.shape[:2])[:, :, None]  # [B, T, 1]
    return rope_complex(k.astype(np.float64), pos, default_inv_freq(k.shape[-1], THETA)).astype(np.float32)


def np_kivi_attention(q, k, v, chunks, bits, g, r, after_rope=True):
    """Outputs [B, T, N, D]: each query of a step sees the cache as stored before the step
    plus the step's tokens in full precision. after_rope: the keys are rotated at their
    positions before they are stored and quantized (the reference's order); else stored
    un-rotated and rotated when attended."""
    b, t, n, d = q.shape
    gq = n // k.shape[2]
    inv = default_inv_freq(d, THETA)
    if after_rope:
        k = np_rotated(k)
    out = np.zeros((b, t, n, d))
    start, i = 0, 0
    while start < t:
        end = min(start + chunks[i % len(chunks)], t)
        kc, vc = np_kivi_cache(k, v, start, bits, g, r)
        kk = np.concatenate([kc, k[:, start:end]], axis=1).astype(np.float64)  # [B, end, K, D]
        vv = np.concatenate([vc, v[:, start:end]], axis=1).astype(np.float64)
        for p in range(start, end):
            for h in range(n):
                qr = rope_complex(q[:, p, h].astype(np.float64), np.full(b, p), inv)
                kr = kk[:, :p + 1, h // gq] if after_rope else \
                    rope_complex(kk[:, :p + 1, h // gq], np.broadcast_to(np.arange(p + 1), (b, p + 1)), inv)
                lg = np.einsum("bd,bjd->bj", qr, kr) * d**-0.5
                w = np.exp(lg - lg.max(-1, keepdims=True))
                out[:, p, h] = np.einsum("bj,bjd->bd", w / w.sum(-1, keepdims=True), vv[:, :p + 1, h // gq])
        start, i = end, i + 1
    return out
