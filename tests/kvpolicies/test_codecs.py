"""Quantized storage: codecs (int8, int4, fp8) on any policy, and the `kivi` policy.

Every reference here is numpy written from the definitions in the module docstrings of
kvpolicies/codecs.py and kvpolicies/kivi.py (quantizers, packing, KIVI's residual rule),
plus scipy's Hadamard matrix; attention goes through tests/refs/oracle.py's dense float64 oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.linalg

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies.codecs import Absmax, Int4, get_codec
from kvpolicies.kivi import Kivi
from kvpolicies.memory import state_bytes, tree_bytes
from kvpolicies import Rope
from tests.refs.oracle import VISIBLE, default_inv_freq, dense_attention, rope_complex
from tests.refs.quant import B, D, K, N, THETA, np_int8, np_kivi_attention, np_kivi_cache, np_rotated, np_round_up

ROPE = Rope(D, THETA)
INV_FREQ = default_inv_freq(D, THETA)
SCALE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def qkv(t, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (N, K, K))


def data(kind: str, shape=(2, 3, 64, 64), seed=0) -> np.ndarray:
    """[B, K, T, D]: standard normal, or with outlier channels (x25, and a +-8 offset) as
    un-rotated keys of real models have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "outliers":
        ch = rng.choice(shape[-1], 3, replace=False)
        x[..., ch] = x[..., ch] * 25 + 8 * np.sign(rng.standard_normal(3)).astype(np.float32)
    return x


def np_hadamard(g):
    return (scipy.linalg.hadamard(g) / math.sqrt(g)).astype(np.float32)


def np_int4(x, group=32, rotation="hadamard", sdtype="float32", s=None):
    """(packed bytes, scale, decoded); the group is rotated by the orthonormal Hadamard matrix."""
    *lead, d = x.shape
    xg = x.reshape(*lead, d // group, group)
    if rotation == "hadamard":
        xg = (xg.astype(np.float64) @ np_hadamard(group).astype(np.float64)).astype(np.float32)
    s = np_round_up(np.abs(xg).max(-1) / np.float32(7), sdtype) if s is None else s  # [..., Gd]
    q = np.clip(np.round(xg / np.where(s > 0, s, 1)[..., None]), -7, 7)
    y = q * s[..., None]
    if rotation == "hadamard":
        y = y.astype(np.float64) @ np_hadamard(group).astype(np.float64)
    u = (q + 8).astype(np.uint8).reshape(*lead, d)
    packed = u[..., 0::2] | (u[..., 1::2] << 4)  # channel 2i low nibble, 2i+1 high nibble
    return packed, s, y.reshape(*lead, d).astype(np.float32)


def np_fp8(x, sdtype="float32", s=None):
    s = np_round_up(np.abs(x).max(-1, keepdims=True) / np.float32(448), sdtype) if s is None else s
    q = np.clip(x / np.where(s > 0, s, 1), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s, (q.astype(np.float32) * s).astype(np.float32)


NP_REF = {"int8": np_int8, "fp8": np_fp8}

CODEC_CASES = {
    "int8": Absmax("int8"),
    "int8-bf16": Absmax("int8", scale_dtype="bfloat16"),
    "int4": Int4(),
    "int4-g16-fp16": Int4(group=16, scale_dtype="float16"),
    "int4-plain": Int4(rotation="none"),
    "fp8": Absmax("fp8"),
    "fp8-bf16": Absmax("fp8", scale_dtype="bfloat16"),
}


@functools.partial(jax.jit, static_argnums=0)
def _roundtrip(codec, x):
    enc = codec.encode(x)
    return enc, codec.decode(enc, jnp.float32)


def roundtrip(codec, x):
    """(encoded tree, decoded float32 numpy array) of x [B, K, T, D] (one compile per codec and shape)."""
    enc, y = _roundtrip(codec, jnp.asarray(x))
    return enc, np.asarray(y)


def rel_l2(x, y):
    """Per-token relative L2 error ||x - y|| / ||x|| over the head dim."""
    return np.linalg.norm(x - y, axis=-1) / np.linalg.norm(x, axis=-1)


# ---------------------------------------------------------------------------------------------
# (1) round trip: exact agreement with the numpy codecs, and the error bounds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "outliers"])
@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_roundtrip_matches_numpy_codec_and_bounds(case, kind):
    codec = CODEC_CASES[case]
    x = data(kind)
    enc, y = roundtrip(codec, x)
    assert all(leaf.shape[:3] == x.shape[:3] for leaf in jax.tree.leaves(enc))  # [B, K, S, ...]
    sd = codec.scale_dtype
    assert enc.scale.dtype == jnp.dtype(sd)
    # the scale is the definition's up to an ulp (XLA multiplies by 1/127 rather than dividing);
    # given the stored scale, codes and decoded values must be exactly the numpy codec's
    stored = np.asarray(enc.scale, np.float32)
    ulp = float(ml_dtypes.finfo(jnp.dtype(sd)).eps) if sd != "float32" else 2.4e-7
    if isinstance(codec, Int4):
        _, s_def, _ = np_int4(x, codec.group, codec.rotation, sd)
        np.testing.assert_allclose(stored, s_def, rtol=ulp * (1 if codec.rotation == "none" else 8), atol=0)
        packed, s, ref = np_int4(x, codec.group, codec.rotation, sd, s=stored)
        assert enc.codes.dtype == jnp.uint8 and enc.codes.shape[-1] == x.shape[-1] // 2
        codes = np.asarray(enc.codes)
        if codec.rotation == "none":
            np.testing.assert_array_equal(codes, packed)
        else:  # float32 butterflies vs a float64 matmul may round a rare half-way code differently
            lo, hi = codes & 15, codes >> 4
            off = np.abs(lo.astype(int) - (packed & 15)) + np.abs(hi.astype(int) - (packed >> 4))
            assert off.max() <= 1 and (off > 0).mean() < 1e-3
        np.testing.assert_allclose(y, ref, atol=1e-5 * np.abs(x).max() if codec.rotation == "none" else
                                   float(np.max(s)) * 1.01)
        # the bound: L2 error of a group <= sqrt(group) s / 2 (elementwise s / 2 without rotation)
        g = codec.group
        err = (x - y).reshape(*x.shape[:-1], -1, g)
        sf = np.asarray(enc.scale, np.float32)
        if codec.rotation == "none":
            assert np.all(np.abs(err) <= sf[..., None] / 2 * (1 + 1e-5) + 1e-7)
        else:
            assert np.all(np.linalg.norm(err, axis=-1) <= math.sqrt(g) * sf / 2 * (1 + 1e-4))
    else:
        _, s_def, _ = NP_REF[codec.name](x, sd)
        np.testing.assert_allclose(stored, s_def, rtol=ulp, atol=0)
        codes, s, ref = NP_REF[codec.name](x, sd, s=stored)
        np.testing.assert_array_equal(np.asarray(enc.codes).astype(np.float32), codes.astype(np.float32))
        np.testing.assert_array_equal(y, ref)
        sf = np.asarray(enc.scale, np.float32)
        if codec.name == "int8":
            assert np.all(np.abs(x - y) <= sf / 2 * (1 + 1e-6))
        else:  # e4m3: 3 mantissa bits -> half-spacing 2^-4 |x| (normal), 2^-10 s (subnormal)
            assert np.all(np.abs(x - y) <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * sf) * (1 + 1e-6))


# Per-token relative L2 errors ||x - x'|| / ||x|| (max over tokens, mean): measured values x1.3.
# int8 0.0090/0.0059 normal, 0.0197/0.0144 outliers; int4 0.138/0.096, 0.113/0.063;
# int4 without rotation 0.139/0.097, 0.242/0.157; fp8 0.032/0.025, 0.032/0.014.
# normal: N(0, 1) [2, 3, 64, 64]; outliers: three channels x25 and offset +-8.
REL_ERR = {
    ("int8", "normal"): (0.012, 0.008), ("int8", "outliers"): (0.026, 0.019),
    ("int4", "normal"): (0.18, 0.125), ("int4", "outliers"): (0.15, 0.085),
    ("int4-plain", "normal"): (0.18, 0.125), ("int4-plain", "outliers"): (0.32, 0.2),
    ("fp8", "normal"): (0.042, 0.033), ("fp8", "outliers"): (0.042, 0.019),
}


@pytest.mark.parametrize("case,kind", list(REL_ERR), ids=[f"{c}-{k}" for c, k in REL_ERR])
def test_relative_errors(case, kind):
    x = data(kind, seed=1)
    _, y = roundtrip(CODEC_CASES[case], x)
    e = rel_l2(x, y)
    mx, mean = REL_ERR[(case, kind)]
    assert e.max() <= mx and e.mean() <= mean, (e.max(), e.mean())


def test_hadamard_rotation_helps_on_outlier_channels():
    x = data("outliers", seed=2)
    _, rot = roundtrip(Int4(), x)
    _, plain = roundtrip(Int4(rotation="none"), x)
    assert rel_l2(x, rot).mean() < 0.6 * rel_l2(x, plain).mean()


def test_zero_tokens_encode_to_zero():
    x = np.zeros((2, 3, 64, 64), np.float32)
    for codec in CODEC_CASES.values():
        _, y = roundtrip(codec, x)
        np.testing.assert_array_equal(y, 0)


# ---------------------------------------------------------------------------------------------
# (2) every codec on full / window / sink against the dense oracle
# ---------------------------------------------------------------------------------------------

POLICY_KW = {"full": {}, "window": dict(window=8), "sink": dict(n_sink=3, window=8)}
# One compiled shape per case, covering each slot path once per codec: full writes chunks in
# place (write_at), window decodes token by token (scatter into the ring), sink prefills in
# chunks (appended to the view, folded back into the ring).
POLICY_CHUNKS = {"full": [5], "window": [1], "sink": [6]}
ATTN_CODECS = ["int8", "int4", "fp8"]
# Measured |out - unquantized oracle| on this data (max, mean over full/window/sink): int8 0.020,
# 0.0021-0.0028; fp8 0.097, 0.0086-0.0114; int4 0.47, 0.036-0.047. Besides the rigorous
# per-query bound below, a fixed ceiling on the mean error at about 2x the measured values.
MEAN_ERR = {"int8": 0.005, "fp8": 0.025, "int4": 0.1}


def visible_sets(name, pol, t):
    return [VISIBLE[name](p, pol) for p in range(t)]


def perturbation_bound(q, k, v, kd, vd, vis, cache_ranks):
    """Rigorous bound on |o' - o| per query p and head: with δ_j the change of logit j
    (RoPE'd q_p . ΔK_j scaled) and ε = max_j |δ_j|, each p'_j / p_j lies in [e^-2ε, e^2ε], so
    |o' - o| <= max_j |ΔV_j| + (e^{2ε} - 1) max_j |V_j - c| for c the midrange of V_j.
    Returns [B, T, N, 1]."""
    q, k, v, kd, vd = (np.asarray(a, np.float64) for a in (q, k, v, kd, vd))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, t, n, 1))
    for p in range(t):
        js = np.array(vis[p])
        qpos, kpos = (len(js) - 1, np.arange(len(js))) if cache_ranks else (p, js)
        for h in range(n):
            kh = h // g
            qr = rope_complex(q[:, p, h], np.full(b, qpos), INV_FREQ)  # [B, D]
            dk = rope_complex(kd[:, js, kh] - k[:, js, kh], np.broadcast_to(kpos, (b, len(js))), INV_FREQ)
            eps = np.abs(np.einsum("bd,bjd->bj", qr, dk)).max(-1) * d**-0.5  # [B]
            vj = v[:, js, kh]  # [B, J, D]
            half = ((vj.max(1) - vj.min(1)) / 2).max(-1)  # [B]
            dv = np.abs(vd[:, js, kh] - vj).max(axis=(1, 2))  # [B]
            out[:, p, h, 0] = dv + np.expm1(2 * eps) * half
    return out


@pytest.mark.parametrize("codec", ATTN_CODECS)
@pytest.mark.parametrize("name", list(POLICY_KW))
def test_codec_on_policy_vs_dense_oracle(name, codec):
    pol = kvpolicies.get(name, codec=codec, **POLICY_KW[name])
    assert pol.codec == get_codec(codec)
    t = 40
    q, k, v = qkv(t, seed=3)
    out, state = run_policy(pol, q, k, v, POLICY_CHUNKS[name], ROPE)
    # per-token codecs: a slot decodes to the round trip of its token, wherever it sits
    rt = lambda x: roundtrip(pol.codec, x.transpose(0, 2, 1, 3))[1].transpose(0, 2, 1, 3)  # noqa: E731  [B, T, K, D]
    kd, vd = rt(k), rt(v)
    vis = visible_sets(name, pol, t)
    cache_ranks = getattr(pol, "positions", "original") == "cache"
    # exact: the oracle on the quantized keys/values (slots, rings and chunks move codes + scales intact)
    np.testing.assert_allclose(out, dense_attention(q, kd, vd, vis, cache_ranks, INV_FREQ), atol=2e-5, rtol=0)
    # bounded: against the oracle of the unquantized policy
    ref = dense_attention(q, k, v, vis, cache_ranks, INV_FREQ)
    err = np.abs(out - ref)
    assert np.all(err <= perturbation_bound(q, k, v, kd, vd, vis, cache_ranks) + 1e-5)
    assert err.mean() <= MEAN_ERR[codec], err.mean()
    assert err.max() > 0  # it is quantized
    assert all(jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.float8_e4m3fn
               for x in (state.k.codes, state.v.codes))
    # the running state is exactly as big as planned (nothing grows)
    assert tree_bytes(state) == state_bytes(pol, kv_heads=K, head_dim=D, max_len=64, batch=B, dtype=jnp.float32)


@pytest.mark.parametrize("codec", ATTN_CODECS)
@pytest.mark.parametrize("name", list(POLICY_KW))
def test_after_rope_codec_encodes_rotated_keys_vs_dense_oracle(name, codec):
    """`<codec>_after_rope`: each key is rotated at its token position, then quantized (deployed
    caches' order). The oracle (float64 RoPE) sees keys whose rotation is that round trip: k' =
    R(-p) Q(R(p) k), so its own R(p) (or, in sink's cache mode, R(rank) with the queries' relative
    distance unchanged) gives back Q(R(p) k). Values are encoded as without after_rope."""
    pol = kvpolicies.get(name, codec=f"{codec}_after_rope", **POLICY_KW[name])
    assert pol.codec == dataclasses.replace(get_codec(codec), after_rope=True) and pol.rotated_keys
    t = 40
    q, k, v = qkv(t, seed=3)
    out, state = run_policy(pol, q, k, v, POLICY_CHUNKS[name], ROPE)
    pos = np.broadcast_to(np.arange(t), (B, t))[:, :, None]  # [B, T, 1]
    kr = rope_complex(k.astype(np.float64), pos, INV_FREQ).astype(np.float32)  # [B, T, K, D] rotated
    rt = lambda x: roundtrip(pol.codec, x.transpose(0, 2, 1, 3))[1].transpose(0, 2, 1, 3)  # noqa: E731  [B, T, K, D]
    kd = rope_complex(rt(kr).astype(np.float64), -pos, INV_FREQ)
    vis = visible_sets(name, pol, t)
    cache_ranks = getattr(pol, "positions", "original") == "cache"
    np.testing.assert_allclose(out, dense_attention(q, kd, rt(v), vis, cache_ranks, INV_FREQ), atol=2e-5, rtol=0)
    # the same bound against the unquantized policy as before RoPE, and not the same numbers as it
    ref = dense_attention(q, k, v, vis, cache_ranks, INV_FREQ)
    assert np.abs(out - ref).mean() <= MEAN_ERR[codec]
    before, _ = run_policy(kvpolicies.get(name, codec=codec, **POLICY_KW[name]), q, k, v, POLICY_CHUNKS[name], ROPE)
    assert np.abs(out - before).max() > 1e-4
    # the stored slots hold the rotated keys' codes (scales of Q(R(p) k), not of k)
    slot_pos = np.asarray(state.pos)[:, 0]  # [B, S]
    want = roundtrip(pol.codec, kr.transpose(0, 2, 1, 3))[1]  # [B, K, T, D]
    got = np.asarray(pol.codec.decode(state.k, jnp.float32))  # [B, K, S, D]
    for b in range(B):
        filled = slot_pos[b] >= 0
        np.testing.assert_allclose(got[b][:, filled], want[b][:, slot_pos[b][filled]], rtol=1e-6, atol=1e-6)  # a wrong code: >= 1e-2
    assert tree_bytes(state) == state_bytes(pol, kv_heads=K, head_dim=D, max_len=64, batch=B, dtype=jnp.float32)


@pytest.mark.parametrize("name,kw,codec", [("full", {}, "int4"), ("sink", dict(n_sink=3, window=8), "int4_after_rope"),
                                           ("quest", dict(page=4, top_k=2, window=5), "int4")])
def test_int4_is_read_in_its_hadamard_basis(name, kw, codec, monkeypatch):
    """int4 decodes a group to H y (y = code x scale): attention reads the values, and the keys
    when they are stored after RoPE, as y (`View.basis`), rotates each query into the basis
    and each output out of it. The same numbers, to float32 rounding, as attention over the
    decoded slots: in one piece, in blocks (Tuning(block=4)), and in quest's gathered decode steps."""
    from kvpolicies.attention import Tuning

    pol = kvpolicies.get(name, codec=codec, **kw)
    q, k, v = qkv(24, seed=7)
    step = lambda t: functools.partial(jax.jit, static_argnums=(0, 6))(  # noqa: E731  (traced anew: tuning, basis)
        lambda p, st, q, k, v, pos, rope: kvpolicies.attend(p, st, q, k, v, pos, rope, tuning=t))
    outs = {}
    for basis in (True, False):
        for block in (4, 10**9):
            with monkeypatch.context() as m:
                if not basis:
                    m.setattr(Int4, "basis", property(lambda self: False))
                outs[basis, block], state = run_policy(pol, q, k, v, [9, 1], ROPE, step=step(Tuning(block=block)))
    for key, out in outs.items():
        np.testing.assert_allclose(out, outs[False, 10**9], atol=2e-6, rtol=0, err_msg=repr(key))
    # the view holds the values (and the keys after RoPE) in the basis: H applied to the decoded slots
    c = pol.codec
    view = pol.extend(state, jnp.asarray(k[:, :1]).transpose(0, 2, 1, 3), jnp.asarray(v[:, :1]).transpose(0, 2, 1, 3),
                      jnp.full((B, 1), 24, jnp.int32))
    assert view.basis == c
    np.testing.assert_allclose(view.v, c.to_basis(c.decode(state.v, jnp.float32)), atol=1e-6, rtol=0)
    keys = c.decode(state.k, jnp.float32)
    np.testing.assert_allclose(view.k, c.to_basis(keys) if c.after_rope else keys, atol=1e-6, rtol=0)
    np.testing.assert_allclose(c.from_basis(c.to_basis(keys)), keys, atol=1e-6, rtol=0)  # H is its own inverse
    p8 = kvpolicies.get(name, codec="int8", **kw)  # int8 has no basis: decoded in full
    assert p8.extend(p8.init(B, K, D, jnp.float32, 64), view.k[:, :, :1], view.v[:, :, :1],
                     jnp.zeros((B, 1), jnp.int32)).basis is None


def test_keys_in_a_codec_basis_are_refused_where_a_policy_reads_them():
    """A policy whose view holds keys in int4's basis (after RoPE) but that observes its rotated
    keys would get them in the wrong basis: attention refuses it at trace time."""
    from kvpolicies.full import Full

    @dataclasses.dataclass(frozen=True)
    class Reads(Full):
        observes = ("k_rot",)

    q, k, v = qkv(4)
    with pytest.raises(TypeError, match="keys decoded in a codec's basis are read by attention only"):
        run_policy(Reads(codec=get_codec("int4_after_rope")), q, k, v, [4], ROPE)


@pytest.mark.parametrize("name,kw", [("h2o", dict(heavy=4, recent=3)), ("snapkv", dict(budget=5, obs_window=3)),
                                     ("multires", dict(window=3, branch=2, slots_per_level=2, levels=3)),
                                     ("quest", dict(page=4, top_k=2, window=5)), ("kivi", {})])
def test_after_rope_codec_is_refused_where_keys_stay_unrotated(name, kw):
    """A policy that re-indexes, scores or re-reads its stored keys keeps them un-rotated: an
    after-RoPE codec there is an error at construction (`kvpolicies.get`) and at trace time."""
    with pytest.raises(ValueError, match=r"after_rope=True: this policy stores its keys un-rotated|kivi.codec="):
        kvpolicies.get(name, codec="int8_after_rope", **kw)
    if name == "kivi":
        return
    pol = dataclasses.replace(kvpolicies.get(name, **kw), codec=get_codec("int8_after_rope"))
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="after_rope=True: this policy stores its keys un-rotated"):
        run_policy(pol, q, k, v, [4], ROPE)


def test_ring_state_holds_encoded_newest_tokens():
    pol = kvpolicies.get("sink", codec="int8", **POLICY_KW["sink"])  # n_sink 3, window 8
    q, k, v = qkv(40, seed=4)
    _, st = run_policy(pol, q, k, v, POLICY_CHUNKS["sink"], ROPE)
    pos = np.asarray(st.pos)[0, 0]
    assert sorted(pos.tolist()) == [0, 1, 2] + list(range(32, 40))
    kt = k.transpose(0, 2, 1, 3)[:, :, pos]  # [B, K, S, D], the tokens the slots should hold
    stored = np.asarray(st.k.scale)
    np.testing.assert_allclose(stored, np_int8(kt)[1], rtol=2.4e-7)
    np.testing.assert_array_equal(np.asarray(st.k.codes), np_int8(kt, s=stored)[0])


@functools.partial(jax.jit, static_argnums=0)
def _dequantize(pol, state, n):
    return pol.dequantize(state, n, jnp.float32)


def kivi_decoded(pol, state, n):
    """Decoded keys and values [B, n, K, D] of a KIVI state holding n tokens."""
    kd, vd = _dequantize(pol, state, jnp.full((B,), n, jnp.int32))  # [B, K, S, D]
    return np.asarray(kd).transpose(0, 2, 1, 3)[:, :n], np.asarray(vd).transpose(0, 2, 1, 3)[:, :n]


KIVI_CASES = {
    "2bit": (Kivi(bits=2, group=4, residual=8), 40, 64),
    "4bit": (Kivi(bits=4, group=4, residual=8), 40, 64),
    "r16g8": (Kivi(bits=2, group=8, residual=16), 40, 64),
    "short-cap": (Kivi(bits=2, group=4, residual=16), 10, 10),  # capacity < R, not a multiple of G
    "cap-not-mult": (Kivi(bits=2, group=4, residual=8), 30, 30),  # 30 slots, 8 key groups
    "pre-rope": (Kivi(bits=2, group=4, residual=8, after_rope=False), 40, 64),  # keys quantized un-rotated
}
# [12, 8] on 40 tokens with R = 8: chunks longer than R, equal to R, flushing 1 and 2 key blocks
# in one step, block boundaries inside chunks. [10]: with R = 8 the 4th step flushes 2 blocks;
# with R = 16 steps flush 0 or 1 block and the residual wraps.
SCHEDULES = {"one-by-one": [1], "chunks": [12, 8], "prefill": [64], "tens": [10]}


KIVI_MATRIX = [("2bit", "one-by-one"), ("2bit", "chunks"), ("2bit", "prefill"), ("4bit", "tens"),
               ("r16g8", "tens"), ("short-cap", "one-by-one"), ("cap-not-mult", "tens"), ("pre-rope", "chunks")]


@pytest.mark.parametrize("case,sched", KIVI_MATRIX, ids=[f"{c}-{s}" for c, s in KIVI_MATRIX])
def test_kivi_matches_numpy_kivi(case, sched):
    pol, t, max_len = KIVI_CASES[case]
    q, k, v = qkv(t, seed=5)
    chunks = SCHEDULES[sched]
    out, state = run_policy(pol, q, k, v, chunks, ROPE, max_len=max_len)
    # every token is a decode step whatever the chunk (per_token): the reference's decode rule
    np.testing.assert_allclose(out, np_kivi_attention(q, k, v, [1], pol.bits, pol.group, pol.residual, pol.after_rope),
                               atol=3e-5, rtol=0)
    kd, vd = kivi_decoded(pol, state, t)  # the stored keys: rotated (the default) or not
    kr, vr = np_kivi_cache(np_rotated(k) if pol.after_rope else k, v, t, pol.bits, pol.group, pol.residual)
    np.testing.assert_allclose(kd, kr, atol=1e-5, rtol=0)
    np.testing.assert_allclose(vd, vr, atol=1e-5, rtol=0)
    assert np.asarray(state.pos)[0, 0].tolist() == list(range(t)) + [-1] * (max_len - t)
    assert tree_bytes(state) == state_bytes(pol, kv_heads=K, head_dim=D, max_len=max_len, batch=B, dtype=jnp.float32)
    if t > pol.residual:  # some tokens left the residual: the queries read a quantized past
        full, _ = run_policy(kvpolicies.get("full"), q, k, v, chunks, ROPE, max_len=max_len)
        assert np.abs(out - full).max() > 1e-3


@pytest.mark.parametrize("case,others", [("2bit", ["chunks", "prefill"]), ("r16g8", ["tens"])])
def test_kivi_chunked_state_equals_token_by_token(case, others):
    pol, t, max_len = KIVI_CASES[case]
    q, k, v = qkv(t, seed=6)
    _, one = run_policy(pol, q, k, v, [1], ROPE, max_len=max_len)
    for chunks in (SCHEDULES[o] for o in others):
        _, other = run_policy(pol, q, k, v, chunks, ROPE, max_len=max_len)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kivi_residual_rule_counts():
    """After n tokens: R floor(n/R) keys and max(n - R, 0) values quantized (exact match of the
    residual slots with the raw inputs, and the others differ; keys before RoPE, so that the
    stored keys are the inputs themselves)."""
    pol, t, _ = KIVI_CASES["pre-rope"]
    q, k, v = qkv(t, seed=7)
    for n in (7, 8, 9, 15, 16, 17, 23):
        _, st = run_policy(pol, q[:, :n], k[:, :n], v[:, :n], [1], ROPE, max_len=64)
        kd, vd = kivi_decoded(pol, st, n)
        exact_k = np.all(kd == k[:, :n], axis=(0, 2, 3))
        exact_v = np.all(vd == v[:, :n], axis=(0, 2, 3))
        assert exact_k.tolist() == [j >= 8 * (n // 8) for j in range(n)], n
        assert exact_v.tolist() == [j >= n - 8 for j in range(n)], n


def test_kivi_bf16_scales_keep_the_half_step_bound():
    pol = Kivi(bits=2, group=4, residual=8, scale_dtype="bfloat16", after_rope=False)  # stored keys = inputs
    q, k, v = qkv(40, seed=8)
    _, st = run_policy(pol, q, k, v, [10], ROPE, max_len=40)
    kd, vd = kivi_decoded(pol, st, 40)
    ks = np.asarray(st.k.scale, np.float32)  # [B, K, Sg, D]
    kstep = np.repeat(ks, 4, axis=2)[:, :, :40].transpose(0, 2, 1, 3)  # [B, T, K, D]
    assert np.all(np.abs(kd - k) <= kstep / 2 * (1 + 1e-3) + 1e-6)
    vs = np.asarray(st.v.scale, np.float32)  # [B, K, S, D/G]
    vstep = np.repeat(vs, 4, axis=3).transpose(0, 2, 1, 3)
    assert np.all(np.abs(vd - v) <= vstep / 2 * (1 + 1e-3) + 1e-6)
    assert st.k.scale.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# (4) bytes: the state holds codes and scales, exactly the closed form
# ---------------------------------------------------------------------------------------------


def codec_slot_bytes(codec, d):
    """Bytes of one slot of one kv head (keys or values)."""
    sb = SCALE_BYTES[codec.scale_dtype]
    if isinstance(codec, Int4):
        return d // 2 + (d // codec.group) * sb
    return d + sb  # int8, fp8: one byte per element, one scale


# kv bytes relative to a bf16 cache at D = 64: int8/fp8 (64 + 4) / 128, int4 (32 + 2 * 4) / 128,
# with bf16 scales int8 (64 + 2) / 128 and int4 at group 16 (32 + 4 * 2) / 128.
BYTES_CASES = {"int8": (Absmax("int8"), 0.53125), "int4": (Int4(), 0.3125), "fp8": (Absmax("fp8"), 0.53125),
               "int8-bf16": (Absmax("int8", scale_dtype="bfloat16"), 0.515625),
               "int4-g16-bf16": (Int4(group=16, scale_dtype="bfloat16"), 0.3125)}


@pytest.mark.parametrize("case", list(BYTES_CASES))
@pytest.mark.parametrize("name,kw,slots", [("full", {}, 8192), ("window", dict(window=1024), 1024),
                                           ("sink", dict(n_sink=4, window=1024), 1028)])
def test_codec_state_bytes_closed_form(case, name, kw, slots):
    codec, ratio = BYTES_CASES[case]
    L, Kh, Dh, Bt = 30, 3, 64, 2
    pol = kvpolicies.get(name, codec=codec, **kw)
    sb = state_bytes(pol, kv_heads=Kh, head_dim=Dh, max_len=8192, n_layers=L, batch=Bt, dtype=jnp.bfloat16)
    assert sb.kv == 2 * L * Bt * Kh * slots * codec_slot_bytes(codec, Dh)
    assert sb.meta == L * Bt * slots * 4
    bf16 = state_bytes(kvpolicies.get(name, **kw), kv_heads=Kh, head_dim=Dh, max_len=8192, n_layers=L, batch=Bt)
    assert sb.kv / bf16.kv == ratio


def kivi_closed_form(pol, s, d, cache_bytes):
    g, sb = pol.group, SCALE_BYTES[pol.scale_dtype]
    sg, dp, rr = -(-s // g), d * pol.bits // 8, min(pol.residual, s)
    keys = sg * g * dp + 2 * sg * d * sb + rr * d * cache_bytes
    values = s * dp + 2 * s * (d // g) * sb + rr * d * cache_bytes
    return keys + values


@pytest.mark.parametrize("pol", [Kivi(bits=2), Kivi(bits=4), Kivi(bits=2, scale_dtype="float16"),
                                 Kivi(bits=2, group=64, residual=128)], ids=["2bit", "4bit", "2bit-fp16", "g64"])
@pytest.mark.parametrize("max_len", [8192, 1000, 100])
def test_kivi_state_bytes_closed_form(pol, max_len):
    L, Kh, Dh, Bt = 30, 3, 64, 2
    sb = state_bytes(pol, kv_heads=Kh, head_dim=Dh, max_len=max_len, n_layers=L, batch=Bt, dtype=jnp.bfloat16)
    assert sb.kv == L * Bt * Kh * kivi_closed_form(pol, max_len, Dh, 2)
    assert sb.meta == L * Bt * max_len * 4


def test_kivi_2bit_is_a_quarter_of_bf16_at_long_context():
    # 2-bit: 16 B of codes + 16 B of scales/zeros per token for keys and for values (float32
    # scales, G = 32, D = 64) = 64 B vs 256 B of bf16 -> 0.25, plus the two 128-token residuals.
    kw = dict(kv_heads=3, head_dim=64, max_len=131072, n_layers=30)
    full = state_bytes(kvpolicies.get("full"), **kw).kv
    assert state_bytes(Kivi(bits=2), **kw).kv / full == pytest.approx(0.25 + 2 * 128 / 131072 / 2, abs=1e-9)
    fp16 = state_bytes(Kivi(bits=2, scale_dtype="float16"), **kw).kv
    assert fp16 / full == pytest.approx(0.1875 + 1 / 1024, abs=1e-9)  # 48 B per token


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: Int4(group=3), "int4.group=3"),
        (lambda: Int4(group=24), "int4.group=24: must be a power of two"),
        (lambda: Int4(group=0), "int4.group=0"),
        (lambda: Int4(rotation="random"), "int4.rotation='random'"),
        (lambda: Absmax("int8", scale_dtype="float64"), "int8.scale_dtype='float64'"),
        (lambda: get_codec("fp8", scale_dtype="float8"), "fp8.scale_dtype='float8'"),
        (lambda: Absmax("int4"), "absmax.name='int4': must be one of"),
        (lambda: Absmax("int8", after_rope=1), "int8.after_rope=1: must be True or False"),
        (lambda: get_codec("int4_after_rope", after_rope="yes"), "int4.after_rope='yes'"),
        (lambda: get_codec("none", after_rope=True), "none.after_rope=True: the identity codec quantizes nothing"),
        (lambda: get_codec("int3"), "codec='int3': must be one of"),
        (lambda: get_codec("int8", group=4), "has no field"),
        (lambda: Int4(group=64).init((1, 1, 4, 32), jnp.float32), "int4.group=64: must divide head_dim=32"),
        (lambda: kvpolicies.get("kivi", bits=3), "kivi.bits=3"),
        (lambda: kvpolicies.get("kivi", group=32, residual=48), "kivi.residual=48: must be a multiple of group=32"),
        (lambda: kvpolicies.get("kivi", residual=0), "kivi.residual=0"),
        (lambda: kvpolicies.get("kivi", codec="int8"), "kivi.codec="),
        (lambda: kvpolicies.get("kivi", group=32).init(1, 1, 16, jnp.float32, 64),
         "kivi.group=32: must divide head_dim=16"),
    ],
)
def test_bad_hyperparameters_raise(make, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        make()


def test_codec_registry_names_fields_and_records():
    # int8 and fp8 are one class whose `name` is the code format: registry names, stored dtypes,
    # results records ({name, fields}) and static-argument identity (eq/hash) per format
    assert sorted(kvpolicies.CODECS) == ["fp8", "fp8_after_rope", "int4", "int4_after_rope", "int8",
                                         "int8_after_rope", "none"]
    i8, f8 = get_codec("int8"), get_codec("fp8", scale_dtype="bfloat16")
    assert (i8, f8) == (Absmax("int8"), Absmax("fp8", scale_dtype="bfloat16"))
    assert len({i8, Absmax("int8"), Absmax("fp8"), f8}) == 3 and i8 != Absmax("fp8")
    # records (results keys): after_rope only when set, so that runs recorded before it keep their keys
    assert i8.record() == {"name": "int8", "scale_dtype": "float32"}
    assert f8.record() == {"name": "fp8", "scale_dtype": "bfloat16"}
    r8 = get_codec("int8_after_rope", scale_dtype="bfloat16")
    assert r8 == Absmax("int8", scale_dtype="bfloat16", after_rope=True) and r8 != Absmax("int8", scale_dtype="bfloat16")
    assert r8.record() == {"name": "int8", "scale_dtype": "bfloat16", "after_rope": True}
    assert get_codec("int4_after_rope") == Int4(after_rope=True) and get_codec("int4", after_rope=True).after_rope
    assert {n: str(c.init((1, 1, 2, 32), jnp.float32).codes.dtype) for n, c in kvpolicies.CODECS.items()
            if n != "none"} == {"int8": "int8", "int4": "uint8", "fp8": "float8_e4m3fn", "int8_after_rope": "int8",
                                "int4_after_rope": "uint8", "fp8_after_rope": "float8_e4m3fn"}
    assert Absmax() == i8


# ---------------------------------------------------------------------------------------------
# (6) compile once; (5) SmolLM2 perplexity
# ---------------------------------------------------------------------------------------------


def test_kivi_decode_compiles_once_over_100_steps():
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    cfg = LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=96)
    eng = Engine(Llama(cfg), kvpolicies.get("kivi", bits=2, group=4, residual=8), max_len=128)
    cache = eng.init_cache(1)
    for t in range(105):  # 13 key flushes (R = 8) and 97 value quantizations, one compiled step
        logits, cache = eng.step(cache, np.array([[(7 * t) % cfg.vocab_size]]), t)
    assert eng.traces["decode"] == 1 and sum(eng.traces.values()) == 1
    assert np.isfinite(np.asarray(logits)).all()
    pos = np.asarray(cache[0].pos)  # [L, B, 1, S]
    assert (pos[..., :105] == np.arange(105)).all() and (pos[..., 105:] == -1).all()


@pytest.mark.slow
def test_smollm2_perplexity_with_quantized_caches():
    """Codecs over 1,024 tokens; KIVI (token by token, the reference's decode step: each step
    dequantizes the whole cache, so it is the slow one) over the first 512."""
    from evals.data import default_text
    from models.engine import Engine, perplexity
    from models.loading import load_default_model

    model, tok = load_default_model()
    ids = np.asarray(tok.encode(default_text()[:20000]), np.int32)[:1024]
    assert len(ids) == 1024

    def ppl(pol, n=1024):
        return perplexity(Engine(model, pol, max_len=n, cache_dtype=jnp.float32).score(ids[:n], chunk=256))

    base, base512 = ppl(kvpolicies.get("full")), ppl(kvpolicies.get("full"), 512)
    got = {name: ppl(kvpolicies.get("full", codec=name)) for name in ("int8", "int4", "int8_after_rope", "int4_after_rope")}
    got |= {name: ppl(pol, 512) for name, pol in {
        "kivi4": kvpolicies.get("kivi", bits=4),
        "kivi2": kvpolicies.get("kivi", bits=2),
    }.items()}
    print(f"\nSmolLM2-135M ppl: 1024 tokens full {base:.3f} int8 {got['int8']:.3f} int4 {got['int4']:.3f} "
          f"after RoPE: int8 {got['int8_after_rope']:.3f} int4 {got['int4_after_rope']:.3f}; "
          f"512 tokens full {base512:.3f} kivi4 {got['kivi4']:.3f} kivi2 {got['kivi2']:.3f}")
    assert 10 < base < 40
    assert abs(got["int8"] / base - 1) < 0.01 and abs(got["int8_after_rope"] / base - 1) < 0.01
    assert abs(got["int4"] / base - 1) < 0.05
    # int4 after RoPE costs more on this model than before it (measured: +6.1 % here, +5.9 % in
    # benchmarks.policy_zoo's chunks of 64; int4 before RoPE +2.8 % / +2.2 %; since 2026-12-02 read
    # in the Hadamard basis with H a matmul: before, +5.2 / +6.6 and +3.3 / +3.2, rounding noise)
    assert 1.0 < got["int4_after_rope"] / base < 1.09
    assert abs(got["kivi4"] / base512 - 1) < 0.03
    assert 1.0 < got["kivi2"] / base512 < 1.15  # 2 bits costs something, not everything
