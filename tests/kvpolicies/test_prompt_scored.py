"""The prompt-compression baselines (knorm, random, observed, expected, pyramidkv) against
float64 numpy re-simulations of the reference implementations' logic (NVIDIA/kvpress's
KnormPress, RandomPress, ObservedAttentionPress, ExpectedAttentionPress; PyramidKV's schedule).

The simulator recomputes every attention probability itself and keeps Python sets of positions
per (batch row, kv head): the prompt densely, one compression after it (kvpress: score, keep the
top `budget`), then decode token by token, appending into the free slots and compressing again,
by the same rule, when a token finds none (our stream extension, also used from the first token
for streams). Expected attention's rule is written the way kvpress writes it (explicit averaged
RoPE matrices, centered covariance), not the way the library computes it (sums, rotate-half).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies import Rope
from kvpolicies.budgets import pyramid, pyramid_budgets, sized, target_bytes
from kvpolicies.expected import moments
from kvpolicies.memory import state_bytes
from tests.refs.oracle import default_inv_freq
from tests.refs.scored import kept_positions, qkv
from tests.refs.prompt_scored import B, D, G, K, MAX_LEN, N, T, THETA, expected_scores, np_hash, simulate

ROPE = Rope(D, THETA)

POLICIES = {
    "knorm": kvpolicies.get("knorm", budget=6, max_new=3),
    "random": kvpolicies.get("random", budget=6, max_new=3, seed=7),
    "observed": kvpolicies.get("observed", budget=6, max_new=3),
    "expected": kvpolicies.get("expected", budget=6, max_new=3, n_sink=2, n_future_positions=8),
    "expected_mean_only": kvpolicies.get("expected", budget=5, max_new=0, n_sink=1, n_future_positions=4,
                                         use_covariance=False, use_vnorm=False),
}


def run_prompt(pol, q, k, v, prompt_len, prompt_chunks):
    """The prompt through the prompt phase (any chunking), after_prompt once, then token by token."""
    out_p, st = run_policy(pol.prompt_policy(), q[:, :prompt_len], k[:, :prompt_len], v[:, :prompt_len],
                           prompt_chunks, ROPE, max_len=MAX_LEN)
    st = jax.jit(pol.after_prompt)(st)
    compressed = kept_positions(st)
    if prompt_len == q.shape[1]:
        return out_p, st, compressed
    out_d, st = run_policy(pol, q[:, prompt_len:], k[:, prompt_len:], v[:, prompt_len:], [1], ROPE,
                           state=st, start=prompt_len)
    return np.concatenate([out_p, out_d], axis=1), st, compressed


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_prompt_protocol_matches_the_reference(name):
    """The paper's protocol: the prompt densely (any chunking: 3 x 5 here), one compression to
    exactly `budget` tokens per kv head by kvpress's score, then append-only decode (and the
    stream rule once max_new is exhausted): outputs and kept tokens as the simulation's."""
    pol = POLICIES[name]
    q, k, v = qkv(T, seed=11)
    out, state, compressed = run_prompt(pol, q, k, v, 15, [5])
    ref, kept = simulate(pol, q, k, v, prompt_len=15)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert kept_positions(state) == kept
    assert all(len(u) == pol.budget for kb in compressed for u in kb)  # compressed once, to the budget
    assert any(kb[0] != kb[1] for kb in compressed)  # per kv head
    if isinstance(pol, kvpolicies.Expected):  # kvpress: the n_sink first tokens are always kept
        assert all(u[: pol.n_sink] == list(range(pol.n_sink)) for kb in compressed for u in kb)


@pytest.mark.parametrize("name", list(POLICIES))
def test_stream_matches_the_reference(name):
    """A stream (Engine.score): the same rule from the first token, any chunk (6 here; the
    registry matrix runs 5 then 1)."""
    pol = POLICIES[name]
    q, k, v = qkv(T, seed=12)
    ref, kept = simulate(pol, q, k, v)
    out, state = run_policy(pol, q, k, v, [6], ROPE, max_len=MAX_LEN)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert kept_positions(state) == kept


def test_prompt_shorter_than_the_budget_is_kept_whole():
    pol = POLICIES["observed"]
    q, k, v = qkv(8, seed=2)
    _, state, compressed = run_prompt(pol, q, k, v, 5, [2])
    assert compressed == [[list(range(5))] * K] * B
    assert kept_positions(state) == [[list(range(8))] * K] * B  # 5 + 3 decoded = capacity 9 not exceeded


def test_expected_statistics_equal_numpy():
    """The prompt phase's query statistics (any chunking) are the mean and population covariance
    of the pre-RoPE queries after the first n_sink, per query head."""
    pol = POLICIES["expected"]
    q, k, v = qkv(T, seed=5)
    for chunks in ([T], [8]):
        _, st = run_policy(pol.prompt_policy(), q, k, v, chunks, ROPE, max_len=MAX_LEN)
        mu, cov = moments(st.extra)
        ref_q = np.asarray(q, np.float64)[:, pol.n_sink:].reshape(B, T - pol.n_sink, K, G, D)
        ref_mu = ref_q.mean(1)  # [B, K, G, D]
        cen = ref_q - ref_mu[:, None]
        ref_cov = np.einsum("btkgi,btkgj->bkgij", cen, cen) / (T - pol.n_sink)
        np.testing.assert_allclose(np.asarray(mu), ref_mu, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(cov), ref_cov, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(st.extra["inv_freq"]), default_inv_freq(D, THETA), rtol=1e-6)
    assert np.abs(ref_cov).max() > 0.1  # not trivially zero


def test_random_is_seeded_and_roughly_uniform():
    q, k, v = qkv(20, seed=1)
    a = run_prompt(POLICIES["random"], q, k, v, 20, [20])[2]
    b = run_prompt(dataclasses.replace(POLICIES["random"], seed=8), q, k, v, 20, [20])[2]
    assert a != b and a[0] == a[1]  # the seed changes the subset; batch rows draw the same
    draws = np.asarray(kvpolicies.random_keep.uniform_hash(3, jnp.arange(4)[:, None], jnp.arange(4096)[None]))
    assert 0 <= draws.min() and draws.max() < 1 and abs(draws.mean() - 0.5) < 0.01
    np.testing.assert_allclose(draws[2, :50], [np_hash(3, 2, p) for p in range(50)], rtol=0, atol=0)


def test_knorm_keeps_the_lowest_norms_after_the_prompt():
    pol = POLICIES["knorm"]
    q, k, v = qkv(16, seed=4)
    _, _, compressed = run_prompt(pol, q, k, v, 16, [4])
    norms = np.linalg.norm(k[:, :16], axis=-1)  # [B, 16, K]
    for b in range(B):
        for h in range(K):
            assert compressed[b][h] == sorted(np.argsort(norms[b, :, h])[: pol.budget].tolist())


# ------------------------------------------------------------------------------------------
# PyramidKV: a SnapKV-selection stack with the pyramid schedule
# ------------------------------------------------------------------------------------------


def test_pyramidkv_stack_is_snapkv_with_pyramid_budgets():
    pol = kvpolicies.get("pyramidkv", budget=100, obs_window=8, kernel=5, max_new=16)
    layers = pol.stack(12)
    assert all(type(p) is kvpolicies.SnapKV for p in layers)
    budgets = [p.budget for p in layers]
    assert sum(budgets) == 12 * 100 and budgets == list(pyramid_budgets(1200, 12, 20.0))
    assert budgets[0] > budgets[-1] and budgets == sorted(budgets, reverse=True)
    # the paper's end points: top k / beta, bottom 2 k - k / beta (k = 100)
    assert abs(budgets[-1] - 5) <= 1 and abs(budgets[0] - 195) <= 1
    assert all((p.obs_window, p.kernel, p.max_new) == (8, 5, 16) for p in layers)
    assert layers == pyramid("snapkv", 1200, 12, obs_window=8, kernel=5, max_new=16)
    # stored bytes equal uniform snapkv's at the same budget
    kw = dict(kv_heads=3, head_dim=64, max_len=4096)
    uni = sum(state_bytes(kvpolicies.get("snapkv", budget=100, obs_window=8, kernel=5, max_new=16), **kw).total
              for _ in range(12))
    assert sum(state_bytes(p, **kw).total for p in layers) == uni == 12 * state_bytes(pol, **kw).total


def test_pyramidkv_beta_is_checked():
    with pytest.raises(ValueError, match=r"pyramidkv.beta=0.5"):
        kvpolicies.get("pyramidkv", beta=0.5)


# ------------------------------------------------------------------------------------------
# Budgets: every baseline sized to the same stored bytes
# ------------------------------------------------------------------------------------------

KB, DB, MB = 2, 64, 8192  # kv heads, head dim, max_len of the budget tests (bf16)


def slot_bytes(name):
    """Independent: keys + values (bf16) + int32 position per head (+ float32 mass per head)."""
    per = 2 * KB * DB * 2 + 4 * KB
    return per + (4 * KB if name in ("observed", "pyramidkv") else 0)


def fixed_bytes(name):
    """Bytes that are not per slot: expected's running query sums (D + D^2 per head, and a count)."""
    return 4 * (KB * (DB + DB * DB) + 1) if name == "expected" else 0


@pytest.mark.parametrize("budget", [600, 0.05])
@pytest.mark.parametrize("name", ["knorm", "random", "observed", "expected", "pyramidkv"])
def test_sized_to_the_same_bytes(name, budget):
    kw = dict(max_len=MB, kv_heads=KB, head_dim=DB, dtype="bfloat16")
    pol = sized(name, budget, **kw)
    tgt = target_bytes(budget, **kw)
    slots = pol.capacity(MB)
    assert slots == (tgt - fixed_bytes(name)) // slot_bytes(name)
    got = state_bytes(pol, kv_heads=KB, head_dim=DB, max_len=MB).total
    assert got == slots * slot_bytes(name) + fixed_bytes(name) <= tgt and tgt - got < slot_bytes(name)
    assert pol.max_new == 256 and slots == pol.kept() + pol.max_new


def test_bad_hyperparameters_raise():
    for name, kw, msg in [("knorm", dict(budget=-1), r"knorm.budget=-1"), ("random", dict(seed=-1), r"random.seed=-1"),
                          ("observed", dict(max_new=-1), r"observed.max_new=-1"),
                          ("expected", dict(n_sink=-1), r"expected.n_sink=-1"),
                          ("expected", dict(n_future_positions=0), r"expected.n_future_positions=0"),
                          ("expected", dict(epsilon=-0.1), r"expected.epsilon=-0.1")]:
        with pytest.raises(ValueError, match=msg):
            kvpolicies.get(name, **kw)


def test_expected_keeps_what_kvpress_keeps_on_transformers_tensors(tiny_qwen):
    """Expected attention through our engine keeps, per layer and KV head, exactly the tokens that
    kvpress's ExpectedAttentionPress.score ranks best when it is computed (float64, kvpress's
    formulas) from transformers' own tensors of the same prompt: the layer's normed input for
    the pre-RoPE queries, the cache's post-RoPE keys and values (a tiny random Qwen2)."""
    import torch
    from transformers import DynamicCache

    from models.engine import Engine

    ref, ours = tiny_qwen
    pol = kvpolicies.get("expected", budget=12, max_new=4, n_sink=2, n_future_positions=16)
    ctx = np.random.default_rng(3).integers(0, 64, (1, 40)).astype(np.int32)
    t = ctx.shape[1]
    state = Engine(ours, pol, max_len=48).compress(Engine(ours, pol, max_len=48).prompt(ctx, chunk=9))
    cache = DynamicCache()
    with torch.no_grad():
        out = ref(torch.tensor(ctx, dtype=torch.long), past_key_values=cache, use_cache=True,
                  output_hidden_states=True)
    cfg = ref.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (np.arange(0, d, 2) / d))
    for layer in range(cfg.num_hidden_layers):
        attn = ref.model.layers[layer].self_attn
        with torch.no_grad():
            h = ref.model.layers[layer].input_layernorm(out.hidden_states[layer])  # the attention's input
            q = attn.q_proj(h).view(1, t, -1, d).transpose(1, 2).double().numpy()[0]  # [N, T, D] pre-RoPE
        keys = cache.layers[layer].keys.double().numpy()[0]  # [K, T, D] post-RoPE
        vals = cache.layers[layer].values.double().numpy()[0]
        st = jax.tree.map(lambda x: x[layer], state.cache[0])
        for kv in range(cfg.num_key_value_heads):
            sc = expected_scores(pol, [q[kv * g + i, pol.n_sink:] for i in range(g)], keys[kv], vals[kv],
                                 list(range(t)), t, inv)
            want = set(sorted(range(t), key=lambda j: (-sc[j], -j))[: pol.budget])
            got = {int(p) for p in np.asarray(st.pos)[0, kv] if p >= 0}
            assert got == want, (layer, kv)


@pytest.mark.parametrize("cross_scoring", [False, True])
@pytest.mark.parametrize("n", [7, 30, 41])  # too short to score (< n_sink + 2 lag), 2 scored partitions + remainder
def test_keydiff_and_lagkv_scores_equal_numpy(n, cross_scoring):
    """KeyDiff's and LagKV's scores of a view whose slots are out of text order (the rule reads them
    in text order), against tests/refs/prompt_scored's float64 kvpress re-simulations."""
    from tests.refs.prompt_scored import keydiff_scores, lagkv_scores

    rng = np.random.default_rng(n)
    pos = np.full((1, 1, 48), -1, np.int32)
    pos[0, 0, :n] = rng.permutation(n)
    k, v = (rng.standard_normal((1, 1, 48, D)).astype(np.float32) for _ in range(2))
    order = np.argsort(pos[0, 0, :n])  # text order of the filled slots
    lag = kvpolicies.get("lagkv", n_sink=2, lag_size=8, cross_scoring=cross_scoring)
    got, _ = lag.score(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
    want = lagkv_scores(lag, k[0, 0, :n][order].astype(np.float64), v[0, 0, :n][order].astype(np.float64))
    np.testing.assert_allclose(np.asarray(got)[0, 0, :n][order], want, atol=1e-6, rtol=0)
    assert np.all(np.asarray(got)[0, 0, n:] == -np.inf)
    got, _ = kvpolicies.get("keydiff").score(jnp.asarray(k), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(got)[0, 0, :n][order], keydiff_scores(k[0, 0, :n][order].astype(np.float64)),
                               atol=1e-6, rtol=0)
