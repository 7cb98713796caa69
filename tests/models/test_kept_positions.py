"""`Engine.kept_positions`: per layer and kv head, the positions a prompted state's cache holds,
for every registered policy (prompt -> compress on a tiny random model, 40 prompt tokens)."""

from __future__ import annotations

import numpy as np
import pytest

import kvpolicies
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama
from models.reconstruct import RepeatPrompts

T = 40
POLICIES = {
    "full": (kvpolicies.get("full"), lambda h: range(T)),
    "window": (kvpolicies.get("window", window=8), lambda h: range(T - 8, T)),
    "sink": (kvpolicies.get("sink", n_sink=3, window=8), lambda h: [*range(3), *range(T - 8, T)]),
    "multires": (kvpolicies.get("multires", window=3, branch=2, slots_per_level=2, levels=3), None),  # summaries
    "quest": (kvpolicies.get("quest", page=4, top_k=2, window=5), lambda h: range(T)),  # stores all, selects per query
    "h2o": (kvpolicies.get("h2o", heavy=4, recent=3), 7),
    "tova": (kvpolicies.get("tova", budget=6), (6,)),
    "snapkv": (kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4), 8),
    "finch": (kvpolicies.get("finch", budget=5, obs_window=3, max_new=4), 8),
    # a bare Engine runs the preset's stack: 2 layers at budgets 5 + 5 on the pyramid (the window in each)
    "pyramidkv": (kvpolicies.get("pyramidkv", budget=5, obs_window=3, kernel=3, max_new=4), "pyramid10"),
    "knorm": (kvpolicies.get("knorm", budget=6, max_new=3, dense_layers=0), (6,)),  # kvpress's every-layer form
    "random": (kvpolicies.get("random", budget=6, max_new=3, seed=1), (6,)),
    "keydiff": (kvpolicies.get("keydiff", budget=6, max_new=3), (6,)),
    # every layer lazy (threshold 0): the 2 sinks and the newest n_recent - n_last = 5
    "simlayerkv": (kvpolicies.get("simlayerkv", lazy_threshold=0.0, n_recent=6, n_initial=2, max_new=3),
                   lambda h: [0, 1, *range(T - 5, T)]),
    "cap": (kvpolicies.get("cap", budget=6, max_new=3, n_sink=2, n_future_positions=8), (6,)),
    "qfilter": (kvpolicies.get("qfilter", budget=6, max_new=3, filters="random"), (6,)),
    "cur": (kvpolicies.get("cur", budget=6, max_new=3, n_sink=1, local_window=4), (6,)),
    "compactor": (kvpolicies.get("compactor", budget=6, max_new=3, sink_start=1, sink_end=1, sketch_dim=4), (6,)),
    "lagkv": (kvpolicies.get("lagkv", budget=6, max_new=3, n_sink=1, lag_size=3), (6,)),
    "observed": (kvpolicies.get("observed", budget=6, max_new=3), (6,)),
    "expected": (kvpolicies.get("expected", budget=6, max_new=3, n_sink=2, n_future_positions=8), (6,)),
    "adakv": (kvpolicies.get("adakv", budget=5, obs_window=3, kernel=3, max_new=4), "pool8"),
    "kvzip": (kvpolicies.get("kvzip", budget=5, max_new=3, n_sink=2), "pool5"),
    "kvgrad": (kvpolicies.get("kvgrad", budget=5, max_new=3, n_sink=2), "pool5"),
    "kvzap": (kvpolicies.get("kvzap", budget=5, max_new=3, window=2, surrogate="random"), "pool5"),
    "kvcompose": (kvpolicies.get("kvcompose", budget=6, max_new=3), (6,)),  # a budget: uniform layers
    "duo": (kvpolicies.get("duo", sink=2, recent=5, heads=(1, 0)), lambda h: range(T) if h == 0 else [0, 1, *range(T - 5, T)]),
    "kivi": (kvpolicies.get("kivi", bits=2, group=4, residual=8), lambda h: range(T)),
    "paged": (kvpolicies.get("paged", block=3), lambda h: range(T)),
    "think": (kvpolicies.get("think", max_new=4), lambda h: range(T)),  # every token (fewer key channels)
    # the budget counts snapkv's window, as the inner press's
    "critical": (kvpolicies.get("critical", budget=8, max_new=4, press=kvpolicies.get("snapkv", obs_window=3, kernel=3)),
                 (8,)),
}


@pytest.fixture(scope="module")
def tiny_model():
    return Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))


def test_every_registered_policy_is_covered():
    assert set(POLICIES) == set(kvpolicies.POLICIES)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_kept_positions(name, tiny_model):
    pol, want = POLICIES[name]
    eng = Engine(tiny_model, pol, max_len=48, repeat=RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11)))
    tokens = np.random.default_rng(4).integers(0, 97, (1, T)).astype(np.int32)
    prompted = eng.prompt(tokens)
    assert all(list(h) == list(range(T)) for layer in eng.kept_positions(prompted) for h in layer) or not \
        eng.compresses  # a prompt phase holds every prompt token
    kept = eng.kept_positions(eng.compress(prompted))
    assert len(kept) == 2 and all(len(layer) == 2 for layer in kept)
    for layer in kept:
        for h, pos in enumerate(layer):
            assert pos.dtype == np.int64 and np.all(np.diff(pos) > 0) and (len(pos) == 0 or 0 <= pos[0] <= pos[-1] < T)
            if callable(want):
                np.testing.assert_array_equal(pos, list(want(h)), err_msg=f"{name} head {h}")
            elif isinstance(want, int):  # n tokens, the newest (a window) among them
                assert len(pos) == want and pos[-1] == T - 1, (name, h, pos)
            elif isinstance(want, tuple):
                assert len(pos) == want[0], (name, h, pos)
        if isinstance(want, str) and want.startswith("pyramid"):
            continue
        if isinstance(want, str):  # a head pool: the layer's K x budget tokens shared, every head keeps the newest
            assert sum(len(p) for p in layer) == 2 * int(want[4:]), (name, layer)
            assert all(p[-1] == T - 1 for p in layer)
    if isinstance(want, str) and want.startswith("pyramid"):  # per layer b_i + obs_window, b_0 >= b_1, sum b_i = 10
        counts = [len(layer[0]) - 3 for layer in kept]
        assert sum(counts) == int(want[7:]) and counts[0] >= counts[1], counts
        assert all(len(h) == len(layer[0]) and h[-1] == T - 1 for layer in kept for h in layer)
    # every policy's compressed state takes a question and decodes (its numbers: test_prompt_matrix, test_hostile)
    assert eng.continue_generate(eng.compress(prompted), tokens[:, :2], 2).shape == (1, 2)


def test_shares_prompt_needs_the_same_runs_of_layers(tiny_model):
    """pyramidkv's layers differ only in their budgets: their prompt phase is snapkv's dense phase,
    one run of layers (`kvpolicies.prompt.step_phase`: the prompt step compiles one stacked run,
    not a run per layer), so each engine compresses the other's prefill, and pyramidkv keeps the
    same tokens from snapkv's prefill as from its own. A stack of another layout (a dense first
    layer) shares with neither."""
    from models.engine import Engine

    n = tiny_model.cfg.n_layers
    pyr = Engine(tiny_model, kvpolicies.get("pyramidkv", budget=8, max_new=4), max_len=48)
    snap = Engine(tiny_model, kvpolicies.get("snapkv", budget=8, max_new=4), max_len=48)
    assert n > 1 and len(set(pyr.policies)) == n and len(pyr.init_cache(1, prompt=True)) == 1
    assert pyr.shares_prompt(snap) and snap.shares_prompt(pyr)
    tokens = np.random.default_rng(5).integers(0, 97, (1, T)).astype(np.int32)
    as_lists = lambda kept: [[h.tolist() for h in layer] for layer in kept]  # noqa: E731
    own = as_lists(pyr.kept_positions(pyr.compress(pyr.prompt(tokens))))
    assert own == as_lists(pyr.kept_positions(pyr.compress(snap.prompt(tokens))))
    assert len({len(layer[0]) for layer in own}) > 1  # the layers' budgets differ
    mixed = Engine(tiny_model, (kvpolicies.get("full"),) + (kvpolicies.get("snapkv", budget=8, max_new=4),) * (n - 1),
                   max_len=48)
    assert not mixed.shares_prompt(snap) and not snap.shares_prompt(mixed)
    assert snap.shares_prompt(Engine(tiny_model, kvpolicies.get("snapkv", budget=6, max_new=4), max_len=48))


DECODING = ("snapkv", "knorm", "random", "observed", "expected", "keydiff", "lagkv")  # the registered PromptScored policies


@pytest.mark.parametrize("name", DECODING)
def test_interval_compresses_back_to_target_every_interval_tokens(name, tiny_model):
    """kvpress's DecodingPress schedule on every prompt scorer: with `interval` and `target`, a
    token that makes a head hold target + interval tokens compresses it back to `target` (the
    count after each fed token follows that arithmetic), the newest token survives only by its
    rank, and the state has max(kept after the prompt, target + interval - 1) slots."""
    import dataclasses

    from kvpolicies.prompt_scored import PromptScored

    base = POLICIES[name][0]
    assert isinstance(base, PromptScored)
    pol = dataclasses.replace(base, interval=4, target=5)
    eng = Engine(tiny_model, pol, max_len=64)
    kept0 = base.kept()
    assert pol.capacity(64) == max(kept0, 5 + 4 - 1)
    rng = np.random.default_rng(5)
    state = eng.compress(eng.prompt(rng.integers(0, 97, (1, T)).astype(np.int32)))
    count = kept0
    assert all(len(h) == count for layer in eng.kept_positions(state) for h in layer)
    fed = rng.integers(0, 97, (1, 14)).astype(np.int32)
    for j in range(fed.shape[1]):
        state = eng.feed(state, fed[:, j:j + 1])
        count += 1
        if count >= 5 + 4:
            count = 5
        layers = eng.kept_positions(state)
        assert all(len(h) == count for layer in layers for h in layer), (j, count, [len(h) for h in layers[0]])
        assert all(h.max() < T + j + 1 for layer in layers for h in layer)


def test_kept_positions_reads_back_positions_not_keys_or_values(tiny_model, monkeypatch):
    """What `kept_positions` copies to the host is the cache's integer fields (positions), never
    its keys or values: every array it reads back is an integer array."""
    import models.engine.staged as staged

    eng = Engine(tiny_model, kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4), max_len=T + 4)
    state = eng.compress(eng.prompt(np.arange(T, dtype=np.int32)[None] % 90))
    read = []

    class Recording:  # numpy, with asarray recording the dtype of what it reads
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(x, *a, **k):
            read.append(np.dtype(x.dtype))
            return np.asarray(x, *a, **k)

    monkeypatch.setattr(staged, "np", Recording())
    kept = eng.kept_positions(state)
    assert read and all(np.issubdtype(d, np.integer) for d in read), read
    assert [len(p) for p in kept[-1]] == [8] * tiny_model.cfg.n_kv_heads
