"""`adakv`: Ada-KV's head-wise budgets over SnapKV scores.

References written independently of the library, in float64 numpy (tests/refs/headwise.py):
attention recomputed per kv head over that head's own kept positions (Python sets), Ada-KV's
allocation re-simulated from kvpress's AdaKVPress rule (safeguard: each head's top floor(alpha b)
first, then the top K b of the layer's flattened candidate scores). Stored bytes against closed forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies.adakv import AdaKV
from kvpolicies.budgets import sized
from kvpolicies.memory import state_bytes
from tests.refs.headwise import K, MAX_LEN, ROPE, adakv_allocate, kept_by_head, qkv, simulate_adakv


ADA = AdaKV(budget=5, obs_window=3, kernel=3, max_new=4)


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
