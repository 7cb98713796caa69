"""The model: full forward equals prefill-then-decode position by position (MaxText's test),
compiled steps are reused, generation and scoring agree with step-by-step decoding."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama, policy_runs

CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=96)
T = 33


@pytest.fixture(scope="module")
def model():
    return Llama(CFG)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, T)).astype(np.int32)


POLICY_SETS = {
    "full": kvpolicies.get("full"),
    "window": kvpolicies.get("window", window=6),
    "sink": kvpolicies.get("sink", n_sink=2, window=6),
    "hybrid": (kvpolicies.get("window", window=5),) * 2 + (kvpolicies.get("full"),) + (kvpolicies.get("window", window=5),),
}


def forward(model, policies, tokens):
    """Whole sequence in one call."""
    b, t = tokens.shape
    cache = model.init_cache(policies, b, t)
    logits, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache, policies)
    return np.asarray(logits)


@pytest.mark.parametrize("name", list(POLICY_SETS))
@pytest.mark.parametrize("prefill", [1, 10])
def test_forward_equals_prefill_then_decode(model, tokens, name, prefill):
    pols = POLICY_SETS[name]
    ref = forward(model, pols, tokens)
    eng = Engine(model, pols, max_len=T)
    logits, cache = eng.step(eng.init_cache(2), tokens[:, :prefill], 0)
    np.testing.assert_allclose(np.asarray(logits), ref[:, prefill - 1], atol=1e-5)
    for t in range(prefill, T):
        logits, cache = eng.step(cache, tokens[:, t:t + 1], t)
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=1e-5, err_msg=f"position {t}")


def test_policies_change_the_output(model, tokens):
    full = forward(model, POLICY_SETS["full"], tokens)
    win = forward(model, POLICY_SETS["window"], tokens)
    np.testing.assert_allclose(win[:, :6], full[:, :6], atol=1e-5)  # identical inside the window
    assert np.abs(win[:, 10:] - full[:, 10:]).max() > 1e-4


def test_hybrid_runs():
    w, f = kvpolicies.get("window", window=5), kvpolicies.get("full")
    assert policy_runs((w, w, f, w), 4) == ((0, 2, w), (2, 3, f), (3, 4, w))
    assert policy_runs(f, 3) == ((0, 3, f),)
    with pytest.raises(ValueError, match="3 policies for a model of 4 layers"):
        policy_runs((w, w, f), 4)


def test_decoding_100_tokens_compiles_the_step_once(model):
    eng = Engine(model, kvpolicies.get("sink", n_sink=2, window=16), max_len=128)
    _, cache = eng.step(eng.init_cache(1), np.arange(5)[None], 0)
    for t in range(5, 105):
        _, cache = eng.step(cache, np.array([[t % CFG.vocab_size]]), t)
    assert eng.traces["decode"] == 1
    assert eng.traces["logits"] == 1  # the prefill shape


def test_generate_scan_equals_stepwise_greedy(model, tokens):
    pol = kvpolicies.get("sink", n_sink=2, window=8)
    eng = Engine(model, pol, max_len=64)
    got = eng.generate(tokens[0, :12], 20)
    logits, cache = eng.step(eng.init_cache(1), tokens[:1, :12], 0)
    want = []
    for t in range(12, 32):
        nxt = int(np.argmax(np.asarray(logits)[0]))
        want.append(nxt)
        logits, cache = eng.step(cache, np.array([[nxt]]), t)
    assert got.tolist() == want
    assert eng.generate(tokens[:, :12], 20).shape == (2, 20)


def test_score_is_chunk_invariant_and_matches_forward(model, tokens):
    pol = kvpolicies.get("sink", n_sink=2, window=6)
    ref = forward(model, pol, tokens)  # [B, T, V]
    lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    want = -np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    eng = Engine(model, pol, max_len=T)
    for chunk in (1, 5, 64):
        np.testing.assert_allclose(eng.score(tokens, chunk=chunk), want, atol=2e-5)


def test_full_matmul_precision_changes_nothing_on_the_cpu(model, tokens):
    """evals.run's jax_default_matmul_precision 'highest' (float32 on GPUs and TPUs too) leaves the
    CPU's float32 scores bit for bit as they are."""
    import jax

    pol = kvpolicies.get("sink", n_sink=2, window=6)
    plain = np.asarray(Engine(model, pol, max_len=T).score(tokens, chunk=8))
    with jax.default_matmul_precision("highest"):
        highest = np.asarray(Engine(model, pol, max_len=T).score(tokens, chunk=8))
    np.testing.assert_array_equal(highest, plain)


@pytest.mark.parametrize("name", ["full", "h2o", "quest"])
def test_score_pads_a_ragged_last_chunk_and_compiles_once(model, tokens, name):
    """A stream of 2.5 chunks compiles one step (its last chunk padded at the end), with the NLL
    of one chunk per token; padding stops where the pads would pass max_len."""
    pol = {"full": kvpolicies.get("full"), "h2o": kvpolicies.get("h2o", heavy=4, recent=4),
           "quest": kvpolicies.get("quest", page=4, top_k=2)}[name]
    stream = tokens[0, :21]  # 20 fed: chunks of 8, 8, 4
    eng = Engine(model, pol, max_len=32)
    nll = eng.score(stream, chunk=8)
    assert eng.traces["nll"] == 1 and nll.shape == (20,)
    np.testing.assert_allclose(nll, Engine(model, pol, max_len=32).score(stream, chunk=1), atol=1e-5, rtol=0)
    tight = Engine(model, pol, max_len=20)  # the pads of the last chunk would sit at 20..23
    np.testing.assert_allclose(tight.score(stream, chunk=8), nll, atol=1e-5, rtol=0)
    assert tight.traces["nll"] == 2


def test_engine_rejects_too_long_sequences(model):
    eng = Engine(model, kvpolicies.get("full"), max_len=8)
    with pytest.raises(ValueError, match="exceeds the engine's max_len=8"):
        eng.generate(np.arange(5), 5)


def test_qkv_bias_and_untied_head():
    cfg = LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8, d_ff=40,
                      qkv_bias=True, tie_embeddings=False)
    m = Llama(cfg)
    toks = np.random.default_rng(1).integers(0, 50, (1, 12)).astype(np.int32)
    ref = forward(m, kvpolicies.get("full"), toks)
    eng = Engine(m, kvpolicies.get("full"), max_len=12)
    logits, cache = eng.step(eng.init_cache(1), toks[:, :4], 0)
    for t in range(4, 12):
        logits, cache = eng.step(cache, toks[:, t:t + 1], t)
    np.testing.assert_allclose(np.asarray(logits), ref[:, -1], atol=1e-5)


@pytest.mark.slow
def test_bfloat16_weights_and_cache_keep_perplexity_and_halve_the_state():
    """SmolLM2 in bfloat16 (weights, activations and cache): perplexity of the first 512 tokens
    of the default text within 0.5 % of float32 (1,024 tokens: 18.2104 vs 18.2047, +0.03 %), and
    the cache state is half the bytes."""
    from evals.data import default_text
    from kvpolicies.memory import state_bytes
    from models.engine import perplexity
    from models.loading import load_default_model

    ppl, nbytes = {}, {}
    for dt in ("float32", "bfloat16"):
        model, tok = load_default_model(dt)
        ids = np.asarray(tok.encode(default_text()[:8000]), np.int32)[:512]
        eng = Engine(model, kvpolicies.get("full"), max_len=512)
        nll, cache = eng.score(ids, chunk=256, return_cache=True)
        ppl[dt] = perplexity(nll)
        assert cache[0].k.dtype == jnp.dtype(dt)
        cfg = model.cfg
        nbytes[dt] = state_bytes(kvpolicies.get("full"), kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                 max_len=512, dtype=jnp.dtype(dt))
    assert abs(ppl["bfloat16"] / ppl["float32"] - 1) < 0.005, ppl
    assert nbytes["bfloat16"].kv * 2 == nbytes["float32"].kv


@pytest.mark.parametrize("rope", [
    kvpolicies.Rope(8, 10000.0),
    kvpolicies.Rope(64, 1e6),
    kvpolicies.Rope(64, 500000.0, (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                                   ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_table_rotates_like_the_trigonometry(rope, dtype):
    """A tabulated RoPE (cos/sin gathered) rotates as Rope.apply does: positions inside the table
    (negative ones too: |p| with the sine negated) to float32 rounding, positions past it through
    the fallback, exactly."""
    import jax

    table = rope.table(300)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 40, rope.head_dim)), dtype)
    inside = jnp.asarray(np.random.default_rng(2).integers(-299, 300, (2, 1, 40)), jnp.int32)
    past = inside.at[1, 0, 7].set(5000)
    apply = jax.jit(lambda r, x, p: r.apply(x, p))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(apply(table, x, inside), np.float32),
                               np.asarray(rope.apply(x, inside), np.float32), atol=tol)
    np.testing.assert_array_equal(np.asarray(apply(table, x, past)), np.asarray(jax.jit(rope.apply)(x, past)))
    assert table.inv_freq().tolist() == rope.inv_freq().tolist()
    # the cond around cos/sin only (layer-by-layer decoding) rotates as the cond around the rotation,
    # to the last bit but for XLA's fusion choices (a fused multiply-add may round once instead of twice)
    angles = dataclasses.replace(table, cond_angles=True)
    for p in (inside, past):
        got, want = np.asarray(apply(angles, x, p), np.float32), np.asarray(apply(table, x, p), np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * float(jnp.finfo(dtype).eps) * np.abs(want).max())


RAGGED = {  # a per-token evictor, a prompt compressor (head-wise), a sparse reader over a dense cache
    "h2o": kvpolicies.get("h2o", heavy=4, recent=4),
    "adakv": kvpolicies.get("adakv", budget=8, obs_window=4, kernel=3, max_new=8),
    "quest": kvpolicies.get("quest", page=4, top_k=2),
}


@pytest.mark.parametrize("name", list(RAGGED))
def test_ragged_batches_equal_one_row_at_a_time(model, name):
    """generate and score take rows of different lengths in one batch (generate: each row
    prefilled alone, decoded together at its own positions; score: padded at the end) and give
    each row what it gets alone."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (16, 8, 24)]  # whole chunks of 8
    eng = Engine(model, RAGGED[name], max_len=T)
    together = eng.generate([r.tolist() for r in rows], 6, chunk=8)
    alone = [eng.generate(r, 6, chunk=8) for r in rows]
    np.testing.assert_array_equal(together, np.stack(alone))
    scored = eng.score([r.tolist() for r in rows], chunk=8)
    for got, r in zip(scored, rows):
        np.testing.assert_allclose(got, eng.score(r, chunk=8), atol=1e-5, rtol=0)
