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
        return nll, cache, eng.continue_generate(eng.compress(state), [], 12), eng.traces["logits"]

    nll, cache, toks, traces = run()
    # prompt chunks of 256 ending at 256..1024 -> bucket 1024; at 1280 -> 1536; the last (20 tokens) -> 1536
    assert traces == 3
    with monkeypatch.context() as m:
        no_buckets(m)
        ref_nll, ref_cache, ref_toks, ref_traces = run()
    assert ref_traces == 2  # the whole cache: one trace per chunk length
    np.testing.assert_array_equal(toks, ref_toks)
    np.testing.assert_allclose(nll, ref_nll, atol=1e-5, rtol=0)
    assert jax.tree.structure(cache) == jax.tree.structure(ref_cache)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
