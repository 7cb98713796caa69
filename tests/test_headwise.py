"""Head-varying memory: `adakv` (Ada-KV over SnapKV scores) and `duo` (DuoAttention-style split).

References written independently of the library, in float64 numpy: attention recomputed per kv
head over that head's own kept positions (Python sets), Ada-KV's allocation re-simulated from
kvpress's AdaKVPress rule (safeguard: each head's top floor(alpha b) first, then the top K b of
the layer's flattened candidate scores), DuoAttention's masks from the authors' definition
(retrieval: every key; streaming: j < sink or j > p - recent). Stored bytes against closed forms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from helpers import run_policy
from kvpolicies import Rope
from kvpolicies.adakv import AdaKV, head_of
from kvpolicies.budgets import sized
from kvpolicies.duo import Duo, heads_from_scores
from kvpolicies.memory import bytes_read_per_step, stack_bytes, state_bytes
from oracle import default_inv_freq, rope_complex

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


def _rotated(q, k):
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
    qr, kr = _rotated(q, k)
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


ADA = AdaKV(budget=5, obs_window=3, kernel=3, max_new=4)


def adakv_reference(pol, q, k, v, chunks=None):
    """The registry reference (tests/test_policies.py): a stream, token by token."""
    return simulate_adakv(pol, q, k, v)[0]


@pytest.mark.parametrize("chunks", [[1], [5]], ids=str)
def test_adakv_stream_matches_the_reference(chunks):
    """A stream from the first token: compression on overflow every max_new + 1 tokens; any chunk."""
    q, k, v = qkv(26, seed=1, head_scale=(4.0, 0.3))
    out, state = run_policy(ADA, q, k, v, chunks, ROPE, max_len=MAX_LEN)
    ref, kept = simulate_adakv(ADA, q, k, v)
    assert kept_by_head(state) == kept
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    counts = [[len(x) for x in kb] for kb in kept]
    assert all(sum(c) <= K * ADA.capacity(MAX_LEN) for c in counts)
    assert any(c[0] != c[1] for c in counts), counts  # the heads keep different numbers of tokens


def test_adakv_prompt_protocol_matches_the_reference():
    """The paper's protocol: dense prompt, one head-adaptive compression, decode appends (and the
    decode slots overflow once here, re-compressing)."""
    pol = AdaKV(budget=6, obs_window=3, kernel=3, max_new=3)
    q, k, v = qkv(30, seed=2, head_scale=(5.0, 0.2))
    L = 22
    prompt = pol.prompt_policy()
    out_p, st = run_policy(prompt, q[:, :L], k[:, :L], v[:, :L], [8], ROPE, max_len=MAX_LEN)
    st = jax.jit(pol.after_prompt)(st)
    after = kept_by_head(st)
    out_d, st = run_policy(pol, q[:, L:], k[:, L:], v[:, L:], [1], ROPE, max_len=MAX_LEN, state=st, start=L)
    ref, kept = simulate_adakv(pol, q, k, v, prompt_len=L)
    np.testing.assert_allclose(np.concatenate([out_p, out_d], axis=1), ref, atol=1e-5, rtol=0)
    assert kept_by_head(st) == kept
    counts = [[len(x) for x in kb] for kb in after]
    assert all(sum(c) == K * (pol.budget + pol.obs_window) for c in counts)  # K x (b + w) in all
    assert any(c[0] != c[1] for c in counts), counts


def test_adakv_allocation_and_safeguard():
    """The allocation alone against the numpy rule, on scores built so that head 0 would win
    every slot: the safeguard still gives head 1 floor(alpha b); alpha = 0 gives it none."""
    rng = np.random.default_rng(5)
    v_ = 40
    pos = np.broadcast_to(np.arange(v_), (1, K, v_)).astype(np.int32)
    window = rng.uniform(0.5, 1.0, (1, K, v_)).astype(np.float32)
    window[0, 1] *= 1e-3  # head 1: tiny scores
    for alpha, budget in [(0.2, 10), (0.0, 10), (0.5, 7), (0.2, 3), (1.0, 10)]:  # alpha = 1: snapkv's per-head top b
        pol = AdaKV(budget=budget, obs_window=4, kernel=3, max_new=0, alpha_safeguard=alpha)
        kept = np.asarray(pol._compress(jnp.asarray(window), jnp.asarray(pos), pol.capacity(MAX_LEN)))
        recent = set(range(v_ - 4, v_))
        cand = [set(range(v_ - 4)) for _ in range(K)]
        win = [dict(enumerate(window[0, h].astype(np.float64))) for h in range(K)]
        chosen = adakv_allocate(win, cand, budget, alpha, 1)
        assert [set(np.flatnonzero(kept[0, h]).tolist()) for h in range(K)] == [recent | c for c in chosen]
        assert len(chosen[1]) == int(alpha * budget) and len(chosen[0]) == 2 * budget - int(alpha * budget)


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype,itemsize", [(jnp.bfloat16, 2), (jnp.float32, 4)])
def test_adakv_stores_exactly_what_snapkv_stores(codec, dtype, itemsize):
    """Closed form per layer: K x S slots, S = budget + obs_window + max_new; a slot stores its
    key and value (codec bytes) plus an int32 position and a float32 observation mass; identical
    to snapkv's state at the same budget, and a byte budget sizes both to the same fields."""
    kh, d, max_len = 4, 64, 8192
    head = {"none": d * itemsize, "int8": d + 4, "int4": d // 2 + (d // 32) * 4}[codec]
    for budget in (100, 1024):
        ada, snap = (kvpolicies.get(n, codec=codec, budget=budget) for n in ("adakv", "snapkv"))
        s = budget + 32 + 256
        a = state_bytes(ada, kv_heads=kh, head_dim=d, max_len=max_len, dtype=dtype)
        assert a == state_bytes(snap, kv_heads=kh, head_dim=d, max_len=max_len, dtype=dtype)
        assert a.kv == 2 * kh * s * head and a.meta == kh * s * (4 + 4)
    for b in (600, 0.05):
        ada = sized("adakv", b, max_len=max_len, kv_heads=kh, head_dim=d, dtype=dtype, codec=codec)
        snap = sized("snapkv", b, max_len=max_len, kv_heads=kh, head_dim=d, dtype=dtype, codec=codec)
        assert (ada.budget, ada.obs_window, ada.max_new) == (snap.budget, snap.obs_window, snap.max_new)
        assert state_bytes(ada, kv_heads=kh, head_dim=d, max_len=max_len, dtype=dtype) == \
            state_bytes(snap, kv_heads=kh, head_dim=d, max_len=max_len, dtype=dtype)


def test_adakv_through_the_engine_compresses_once_and_decodes():
    """A 2-layer model: prefill (dense prompt phase, after_prompt per layer under vmap), then a
    decode step; the decode state has snapkv's shapes."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    pol = AdaKV(budget=6, obs_window=3, kernel=3, max_new=4)
    eng = Engine(model, pol, max_len=48)
    tokens = np.random.default_rng(0).integers(0, 97, (1, 30)).astype(np.int32)
    _, cache = eng.prefill(tokens)
    assert eng.prompts_compressed == 1
    (st,) = cache
    assert st.pos.shape == (2, 1, K, pol.capacity(48))  # [L, B, K rows, S]
    counts = [[len(x) for x in kb] for kb in kept_by_head(jax.tree.map(lambda x: x[0], st))]
    assert sum(counts[0]) == K * (6 + 3)
    logits, cache = eng.step(cache, tokens[:, :1], 30)  # one decode step appends to every head
    counts = [[len(x) for x in kb] for kb in kept_by_head(jax.tree.map(lambda x: x[0], cache[0]))]
    assert sum(counts[0]) == K * (6 + 3 + 1) and np.isfinite(np.asarray(logits)).all()


# ------------------------------------------------------------------------------------------
# Duo reference
# ------------------------------------------------------------------------------------------


def simulate_duo(pol, q, k, v):
    """Retrieval kv heads: causal attention over every token; streaming: j < sink or j > p - recent."""
    qr, kr = _rotated(q, k)
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


@pytest.mark.parametrize("heads", [(1, 0), (0, 1), (0, 0), (1, 1)], ids=str)
def test_duo_matches_the_reference_with_any_chunk(heads):
    pol = Duo(sink=2, recent=5, heads=heads)
    q, k, v = qkv(23, seed=3)
    ref = simulate_duo(pol, q, k, v)
    for chunks in ([1], [6], [64]) if heads == (1, 0) else ([6],):
        out, _ = run_policy(pol, q, k, v, chunks, ROPE, max_len=MAX_LEN)
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0, err_msg=str(chunks))


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_duo_stores_the_closed_form(codec):
    """Per layer: Kr x max_len + Ks x (sink + recent) slots of keys and values, plus one int32
    position per retrieval slot and per streaming slot (a group without heads stores nothing)."""
    kh, d, max_len = 4, 64, 4096
    head = {"none": 2 * d, "int8": d + 4}[codec]  # bf16
    for heads in [(1, 0, 0, 1), (0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 0, 0)]:
        pol = kvpolicies.get("duo", codec=codec, heads=heads)
        kr, ks = sum(heads), kh - sum(heads)
        got = state_bytes(pol, kv_heads=kh, head_dim=d, max_len=max_len)
        assert got.kv == 2 * head * (kr * max_len + ks * (64 + 256))  # the default sink 64 + recent 256
        assert got.meta == 4 * ((max_len if kr else 0) + (64 + 256 if ks else 0))
    full = state_bytes(kvpolicies.get("full"), kv_heads=kh, head_dim=d, max_len=max_len)
    assert state_bytes(kvpolicies.get("duo", heads=(1,) * kh), kv_heads=kh, head_dim=d, max_len=max_len) == full
    # a decode step reads every retrieval slot so far and the streaming ring
    ctx = 1000
    read = bytes_read_per_step(kvpolicies.get("duo", heads=(1, 0, 0, 1)), kv_heads=kh, head_dim=d, max_len=max_len,
                               context=ctx).read
    assert read.kv == 2 * 2 * d * (2 * (ctx + 1) + 2 * 320) and read.meta == 4 * (ctx + 1 + 320)


def test_duo_stack_runs_per_layer_patterns_in_the_engine():
    """A pattern with different heads per layer: one state per run of equal layers, exact bytes
    (the sum of the layers' closed forms); the model runs through them (chunk invariance:
    tests/test_policies.py::test_chunk_never_changes_a_result)."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    layers = kvpolicies.get("duo", sink=2, recent=5, pattern=((0.9, 0.1), (0.9, 0.2), (0.0, 0.7))).stack(3)
    assert [p.heads for p in layers] == [(1, 0), (1, 0), (0, 1)]
    eng = Engine(model, layers, max_len=40)
    cache = eng.init_cache()
    assert len(cache) == 2 and cache[0].pos.shape == (2, 1, 1, 40) and cache[0].stream_pos.shape == (2, 1, 1, 7)
    per_layer = 2 * 8 * 4 * (40 + 7) + 4 * (40 + 7)  # float32: one retrieval head, one streaming head
    assert stack_bytes(layers, kv_heads=2, head_dim=8, max_len=40, dtype=jnp.float32).total == 3 * per_layer
    tokens = np.random.default_rng(1).integers(0, 97, (1, 36)).astype(np.int32)
    logits, cache = eng.prefill(tokens)
    assert np.isfinite(np.asarray(logits)).all()
    held = np.where(np.arange(40) < 36, np.arange(40), -1)  # layer 2's retrieval head: every token so far
    np.testing.assert_array_equal(np.asarray(cache[1].pos)[0, 0, 0], held)
    assert sorted(np.asarray(cache[1].stream_pos)[0, 0, 0].tolist()) == [0, 1, 31, 32, 33, 34, 35]


def _two_head_model(a=14.0, theta=100.0):
    """One layer, 2 kv heads (G = 1), every token embedded as the same vector (so q and k are the
    same at every position). Head 0: q = 0, uniform attention over all keys (far back); head 1:
    q = k = a along the RoPE pair of frequency theta^(-1/2), so its logits a^2 cos(0.1 d) / sqrt(D)
    fall with the distance d: it attends locally."""
    from models.config import LlamaConfig
    from models.llama import Llama, init_params

    d_, hd = 16, 8
    cfg = LlamaConfig(vocab_size=5, d_model=d_, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=hd, d_ff=16,
                      rope_theta=theta)
    p = init_params(cfg)
    p["embed"][:] = 1.0
    p["layers"]["attn_norm"][:] = 1.0
    p["layers"]["wq"][:] = 0.0
    p["layers"]["wk"][:] = 0.0
    p["layers"]["wq"][0, 0, hd + 2] = a  # query head 1, channel 2 (pairs with 6): inv_freq theta^(-2/4)
    p["layers"]["wk"][0, 0, hd + 2] = a
    return Llama(cfg, p)


def test_calibration_ranks_a_far_reaching_head_above_a_local_one():
    from evals.duo_calibrate import calibrate_duo

    sink, recent, t = 2, 4, 30
    scores = calibrate_duo(_two_head_model(), np.zeros(t, np.int32), sink=sink, recent=recent, chunk=10)
    assert scores.shape == (1, 2)
    # head 0 attends uniformly: query p puts (p - recent - sink + 1) / (p + 1) beyond the pattern
    exact = np.mean([(p - recent - sink + 1) / (p + 1) for p in range(sink + recent, t)])
    np.testing.assert_allclose(scores[0, 0], exact, atol=1e-5)
    assert scores[0, 1] < 0.02 < 0.3 < scores[0, 0]
    assert heads_from_scores(scores, sparsity=0.5).tolist() == [[1, 0]]
    late = calibrate_duo(_two_head_model(), np.zeros(t, np.int32), sink=sink, recent=recent, chunk=10, start=20)
    exact = np.mean([(p - recent - sink + 1) / (p + 1) for p in range(20, t)])  # only queries at p >= start
    np.testing.assert_allclose(late[0, 0], exact, atol=1e-5)
