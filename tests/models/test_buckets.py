"""Length buckets: a step of a `PrefixSlots` policy (full) reads only the cache's first `reach`
slots, the smallest bucket that holds its positions (`models.engine.reach_of`).

References: the same engine with buckets off (every step reads all max_len slots, the path before
buckets), closed-form bucket sizes, and XLA's own cost analysis of the compiled step.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpolicies
import models.engine.steps as engine_mod  # reach_of reads REACH_MIN here
from models.config import LlamaConfig
from models.engine import Engine, reach_of
from models.llama import Llama

CFG = LlamaConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG)


def no_buckets(monkeypatch):
    monkeypatch.setattr(engine_mod, "REACH_MIN", 10**9)  # every bucket >= max_len: the whole cache


def test_bucket_sizes():
    fine = [reach_of(e, 10**6) for e in (1, 1024, 1025, 1280, 1281, 1537, 1793, 2049, 2561, 3585, 4097)]
    assert fine == [1024, 1024, 1280, 1280, 1536, 1792, 2048, 2560, 3072, 4096, 5120]
    coarse = [reach_of(e, 10**6, fine=False) for e in (1, 1025, 1537, 2049, 3073, 4097, 6145)]
    assert coarse == [1024, 1536, 2048, 3072, 4096, 6144, 8192]
    # a bucket never reaches max_len: None means the whole cache
    assert reach_of(1000, 1024) is None and reach_of(1000, 1025) == 1024 and reach_of(3000, 3072) is None
    # at most 25 % (decode) / 50 % (chunks) more slots than the step needs, past the first bucket
    for end in range(1025, 40000, 37):
        assert end <= reach_of(end, 10**6) <= 1.25 * end and end <= reach_of(end, 10**6, False) <= 1.5 * end


def test_buckets_equal_the_whole_cache(model, monkeypatch):
    """Scoring a 1,400-token stream in chunks of 512 and greedy decoding through buckets equal the
    same engine reading all 1,600 slots; one trace per bucket reached."""
    pol = kvpolicies.get("full")
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 1400)
    eng = Engine(model, pol, max_len=1600)
    got = eng.score(ids, chunk=512)
    # chunks ending at 512 and 1024 -> bucket 1024; the last (1399, padded to 1536) -> 1536
    assert eng.traces["nll"] == 2
    toks = eng.generate(ids[None, :1100], 30)  # decode positions 1100..1128 -> bucket 1280
    with monkeypatch.context() as m:
        no_buckets(m)
        ref = Engine(model, pol, max_len=1600)
        want = ref.score(ids, chunk=512)
        assert ref.traces["nll"] == 1
        np.testing.assert_array_equal(ref.generate(ids[None, :1100], 30), toks)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_mixed_stack_cuts_only_prefix_runs(model, monkeypatch):
    """A stack with int8 `full` and `window` layers: only the full runs are cut (their codec's
    scales with them); the window run (not PrefixSlots) reads its own slots as before."""
    full8 = kvpolicies.get("full", codec="int8")
    stack = (full8, kvpolicies.get("window", window=700), full8)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 1600)
    got = Engine(model, stack, max_len=2100).score(ids, chunk=400)
    no_buckets(monkeypatch)
    want = Engine(model, stack, max_len=2100).score(ids, chunk=400)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_decode_step_cost_follows_the_filled_length(model):
    """XLA's cost analysis of the compiled decode step at position 1,000: in a 16,384-slot cache
    it does exactly the work (flops) of the same step in a 1,024-slot cache (before buckets: every
    slot, ~15x), and the cache it returns is the whole 16,384-slot cache with the new token in
    it. (XLA's 'bytes accessed' counts a fused dynamic slice's whole operand, so it cannot tell.)"""
    import jax.numpy as jnp

    def compiled(max_len, reach):
        eng = Engine(model, kvpolicies.get("full"), max_len=max_len)
        cache = eng.init_cache(1)
        tok, pos = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 1000, jnp.int32)
        cost = eng._logits_step.lower(eng.params, cache, tok, pos, reach=reach).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return cost["flops"], (eng, cache, tok, pos)

    assert reach_of(1001, 16384) == 1024
    small, _ = compiled(1024, None)
    whole, _ = compiled(16384, None)
    big, (eng, cache, tok, pos) = compiled(16384, 1024)
    assert big == small and whole >= 8 * small, (big, small, whole)
    _, out = eng._logits_step(eng.params, cache, tok, pos, reach=1024)
    assert out[0].pos.shape[-1] == 16384 and int(out[0].pos[0, 0, 0, 1000]) == 1000


def test_prompt_phase_buckets_equal_the_whole_cache(model, monkeypatch):
    """A prompt compressor's dense prompt phase through buckets: its state (slots, the newest
    queries' attention rows, column sums, query statistics) equals the whole-cache state, and
    snapkv's prompt -> compress -> decode gives the same ids."""
    import jax

    from kvpolicies.prompt import PromptPhase

    phase = PromptPhase(obs_window=32, columns=True, query_sink=4)  # every collector at once
    snap = kvpolicies.get("snapkv", budget=256)
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, 1400)

    def run():
        nll, cache = Engine(model, phase, max_len=1600).score(ids, chunk=512, return_cache=True)
        eng = Engine(model, snap, max_len=1600)
        state = eng.prompt(ids[None, :1300], chunk=256)
        return nll, cache, eng.continue_generate(eng.compress(state), [], 12), eng.traces["logits"], state

    nll, cache, toks, traces, state = run()
    # every prompt chunk reads the bucket of the prompt's end (1300 -> 1536): one trace per chunk length
    # (256 and the last 20), the first chunk's included (the query statistics exist from init_cache)
    assert traces == 2
    with monkeypatch.context() as m:
        no_buckets(m)
        ref_nll, ref_cache, ref_toks, ref_traces, ref_state = run()
    assert ref_traces == 2  # the whole cache: one trace per chunk length
    # a staged prompt through its end's bucket is the whole cache's bit for bit: the blocks past every
    # query are skipped (and the first step adds its query sums to zeros)
    for a, b in zip(jax.tree.leaves((state.cache, state.logits)), jax.tree.leaves((ref_state.cache, ref_state.logits)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(toks, ref_toks)
    np.testing.assert_allclose(nll, ref_nll, atol=1e-5, rtol=0)
    assert jax.tree.structure(cache) == jax.tree.structure(ref_cache)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_query_statistics_exist_from_init_so_the_first_piece_shares_the_step(model):
    """Expected attention's prompt phase sums the queries (query_sink): `init_cache` makes those sums
    zeros for the model's G, so the first of equal pieces runs the step the others run (one trace),
    and the sums equal those of the prompt fed in one step."""
    eng = Engine(model, kvpolicies.get("expected", budget=256), max_len=1600)
    fresh = eng.init_cache(1, prompt=True).runs[0].extra
    g = CFG.n_heads // CFG.n_kv_heads
    assert fresh["q_sq"].shape == (CFG.n_layers, 1, CFG.n_kv_heads, g, CFG.head_dim, CFG.head_dim)
    assert not np.asarray(fresh["q_sum"]).any() and not np.asarray(fresh["q_n"]).any()
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, 1024)
    state = eng.prompt(ids[None], chunk=256)
    assert eng.traces["logits"] == 1
    extra = state.cache[0].extra
    np.testing.assert_array_equal(np.asarray(extra["q_n"]), np.full((CFG.n_layers, 1), 1024 - 4, np.float32))
    # the same sums as the prompt in one step (float32 rounding apart: other groupings of the sums)
    whole = Engine(model, kvpolicies.get("expected", budget=256), max_len=1600).prompt(ids[None]).cache[0].extra
    for name in ("q_sum", "q_sq"):
        np.testing.assert_allclose(np.asarray(extra[name]), np.asarray(whole[name]), rtol=1e-5, atol=1e-4)
    assert np.abs(np.asarray(extra["q_sum"])).max() > 1  # not zeros
