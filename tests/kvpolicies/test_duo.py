"""`duo`: DuoAttention's split of kv heads into retrieval heads (every key) and streaming heads.

References written independently of the library, in float64 numpy (tests/refs/headwise.py):
attention recomputed per kv head over that head's own kept positions (Python sets), DuoAttention's
masks from the authors' definition (retrieval: every key; streaming: j < sink or j > p - recent).
Stored bytes against closed forms; the calibration of evals.duo_calibrate on a two-head model.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies.duo import Duo, heads_from_scores
from kvpolicies.memory import bytes_read_per_step, stack_bytes, state_bytes
from tests.refs.headwise import MAX_LEN, ROPE, qkv, simulate_duo


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
    tests/kvpolicies/test_policies.py::test_chunk_never_changes_a_result)."""
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
