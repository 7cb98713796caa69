"""Every registered policy against an independent reference (the registry matrix), the
position-based policies against the dense numpy oracle in depth, and identities between policies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpolicies
from tests.refs.helpers import run_policy
from tests.refs.registry import REFERENCES, ROPE, qkv, reference


# Policies checked exactly against the oracle: registry name -> instances (small windows so
# that the test lengths cross them). Every registered policy must appear here.
EXACT = {
    "full": [kvpolicies.get("full")],
    "window": [kvpolicies.get("window", window=8), kvpolicies.get("window", window=1)],
    "sink": [kvpolicies.get("sink", n_sink=3, window=8), kvpolicies.get("sink", n_sink=3, window=8, positions="original"),
             kvpolicies.get("sink", n_sink=1, window=5), kvpolicies.get("sink", n_sink=0, window=6)],
}


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_registered_policy_matches_reference(name, chunks=(5, 1)):
    assert name in REFERENCES, f"policy {name!r} is registered but has no reference: add it to REFERENCES"
    instances, ref = REFERENCES[name]
    q, k, v = qkv(24, seed=3)
    for pol in instances:
        out, _ = run_policy(pol, q, k, v, list(chunks), ROPE)
        np.testing.assert_allclose(out, ref(pol, q, k, v, list(chunks)), atol=3e-5, rtol=0, err_msg=repr(pol))


@pytest.fixture(scope="module")
def tiny_model():
    from models.config import LlamaConfig
    from models.llama import Llama

    return Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_chunk_never_changes_a_result(name, tiny_model):
    """`chunk` is an execution detail: streaming NLL and the final state are the same for
    chunks of 1, 7 and 64 tokens, for every registered policy (a real model, 2 layers)."""
    from models.engine import Engine

    pol = REFERENCES[name][0][0]
    tokens = np.random.default_rng(4).integers(0, 97, 43).astype(np.int32)  # 42 fed: 6 chunks of 7, one of 64
    eng = Engine(tiny_model, (pol,) * tiny_model.cfg.n_layers, max_len=48)  # the policy itself in every layer
    nll, states = {}, {}
    for c in (1, 7, 64):
        nll[c], states[c] = eng.score(tokens, chunk=c, return_cache=True)
    for c in (7, 64):
        np.testing.assert_allclose(nll[c], nll[1], atol=1e-5, rtol=0, err_msg=f"{name} chunk {c}")
        for a, b in zip(jax.tree.leaves(states[c]), jax.tree.leaves(states[1])):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)
            else:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name,pol,want", [
    ("full", kvpolicies.get("full"), 42),  # every fed token, by the last query
    ("sink", kvpolicies.get("sink", n_sink=2, window=5), 7),
    ("h2o", kvpolicies.get("h2o", heavy=4, recent=4), 9),  # 8 slots + the token that joins, whatever the chunk
    ("tova", kvpolicies.get("tova", budget=6), 7),
    ("snapkv", kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4), 13),  # stream rule
])
def test_record_visible_measures_the_keys_queries_attended(name, pol, want, tiny_model):
    """`record_visible` reads the masks attention applied: a chunk of 7 (or 64) never lets a
    query of an evictor see more than its slots + 1, the bound a per-token step has."""
    from models.engine import Engine

    tokens = np.random.default_rng(4).integers(0, 97, 43).astype(np.int32)
    for chunk in (7, 64):
        with kvpolicies.record_visible() as rec:
            Engine(tiny_model, pol, max_len=48).score(tokens, chunk=chunk)
        assert rec["max_visible"] == want, (name, chunk, rec)


def test_record_visible_sees_snapkvs_dense_prompt(tiny_model):
    from models.engine import Engine

    pol = kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4)
    prompt = np.random.default_rng(5).integers(0, 97, (1, 30)).astype(np.int32)
    eng = Engine(tiny_model, pol, max_len=40)
    with kvpolicies.record_visible() as rec:
        logits, cache = eng.prefill(prompt, chunk=8)
    assert rec["max_visible"] == 30  # the whole prompt, densely, in chunks of 8
    with kvpolicies.record_visible() as rec:
        eng.step(cache, np.asarray(logits).argmax(-1)[:, None], 30)
    assert rec["max_visible"] == 5 + 3 + 1  # compressed to budget + obs_window, plus the new token


def test_references_cover_only_registered_policies():
    assert set(REFERENCES) == set(kvpolicies.POLICIES)


CASES = [(name, i) for name, pols in EXACT.items() for i in range(len(pols))]


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}{i}" for n, i in CASES])
@pytest.mark.parametrize("t", [5, 23, 40])
@pytest.mark.parametrize("chunks", [[1], [3], [64], [17, 1], [2, 5, 1]], ids=str)
def test_policy_matches_dense_oracle(name, i, t, chunks):
    pol = EXACT[name][i]
    q, k, v = qkv(t, seed=t)
    out, _ = run_policy(pol, q, k, v, chunks, ROPE)
    np.testing.assert_allclose(out, reference(name, pol, q, k, v), atol=2e-5, rtol=0)


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}{i}" for n, i in CASES])
def test_chunked_equals_token_by_token_bitwise_close(name, i):
    pol = EXACT[name][i]
    q, k, v = qkv(37, seed=1)
    one, s1 = run_policy(pol, q, k, v, [1], ROPE)
    chunked, s2 = run_policy(pol, q, k, v, [7, 3, 64], ROPE)
    np.testing.assert_allclose(chunked, one, atol=1e-5, rtol=0)
    # the final states hold the same tokens in the same slots
    np.testing.assert_array_equal(np.asarray(s1.pos), np.asarray(s2.pos))
    np.testing.assert_allclose(np.asarray(s1.k), np.asarray(s2.k), atol=0)


def test_window_at_least_t_equals_full():
    q, k, v = qkv(30)
    full, _ = run_policy(kvpolicies.get("full"), q, k, v, [4], ROPE)
    for w in (30, 31, 100):
        win, _ = run_policy(kvpolicies.get("window", window=w), q, k, v, [4], ROPE)
        np.testing.assert_allclose(win, full, atol=1e-5)


def test_sink_without_sinks_equals_window():
    q, k, v = qkv(30)
    win, _ = run_policy(kvpolicies.get("window", window=7), q, k, v, [1], ROPE)
    for mode in ("original", "cache"):
        snk, _ = run_policy(kvpolicies.get("sink", n_sink=0, window=7, positions=mode), q, k, v, [1], ROPE)
        np.testing.assert_allclose(snk, win, atol=1e-5)


def test_sink_position_modes_differ_after_eviction_only():
    q, k, v = qkv(30)
    a, _ = run_policy(kvpolicies.get("sink", n_sink=2, window=6, positions="original"), q, k, v, [1], ROPE)
    b, _ = run_policy(kvpolicies.get("sink", n_sink=2, window=6, positions="cache"), q, k, v, [1], ROPE)
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-5)  # nothing evicted before position 8
    assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-3


def test_ring_states_hold_exactly_the_newest_tokens():
    q, k, v = qkv(29)
    _, st_ = run_policy(kvpolicies.get("sink", n_sink=3, window=8), q, k, v, [5], ROPE)
    assert sorted(np.asarray(st_.pos)[0, 0].tolist()) == [0, 1, 2] + list(range(21, 29))
    _, st_ = run_policy(kvpolicies.get("window", window=8), q, k, v, [64], ROPE)
    assert sorted(np.asarray(st_.pos)[1, 0].tolist()) == list(range(21, 29))


def test_capacity_capped_by_max_len():
    assert kvpolicies.get("window", window=4096).capacity(100) == 100
    assert kvpolicies.get("sink", n_sink=4, window=4096).capacity(10_000) == 4100
    q, k, v = qkv(12)
    pol = kvpolicies.get("sink", n_sink=4, window=4096)
    out, st_ = run_policy(pol, q, k, v, [5, 1], ROPE, max_len=12)
    assert st_.pos.shape[-1] == 12
    np.testing.assert_allclose(out, reference("sink", pol, q, k, v), atol=2e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(1, 33),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    n_sink=st.integers(0, 4),
    window=st.integers(1, 12),
    mode=st.sampled_from(["original", "cache"]),
)
def test_sink_random_chunking_matches_oracle(t, chunks, n_sink, window, mode):
    pol = kvpolicies.get("sink", n_sink=n_sink, window=window, positions=mode)
    q, k, v = qkv(t, seed=t + 100 * window)
    out, _ = run_policy(pol, q, k, v, chunks, ROPE)
    np.testing.assert_allclose(out, reference("sink", pol, q, k, v), atol=2e-5)


@pytest.mark.parametrize(
    "name,kw,msg",
    [
        ("window", dict(window=0), "window.window=0"),
        ("sink", dict(n_sink=-1), "sink.n_sink=-1"),
        ("sink", dict(positions="rank"), "sink.positions='rank'"),
        ("window", dict(window=2.5), "window.window=2.5"),
        ("nope", dict(), "must be one of"),
        ("sink", dict(windw=3), "has no field"),
    ],
)
def test_bad_hyperparameters_raise_clear_errors(name, kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        kvpolicies.get(name, **kw)


def test_policies_are_hashable_static():
    a, b = kvpolicies.get("sink", n_sink=4, window=16), kvpolicies.get("sink", n_sink=4, window=16)
    assert hash(a) == hash(b) and a == b
    assert kvpolicies.get("sink", n_sink=4, window=16) != kvpolicies.get("sink", n_sink=4, window=17)


def test_state_is_arrays_only_and_fixed_capacity():
    pol = kvpolicies.get("sink", n_sink=2, window=5)
    q, k, v = qkv(20)
    _, s_a = run_policy(pol, q[:, :9], k[:, :9], v[:, :9], [3], ROPE, max_len=20)
    _, s_b = run_policy(pol, q, k, v, [3], ROPE, max_len=20)
    import jax

    la, lb = jax.tree.leaves(s_a), jax.tree.leaves(s_b)
    assert [x.shape for x in la] == [x.shape for x in lb]
    assert all(isinstance(x, jnp.ndarray) for x in la)
