"""The tiny associative-recall model: it trains to high accuracy with the full cache, fails when
a window hides the pairs, trains deterministically and survives the .npz cache exactly."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import kvpolicies
from evals import recall_model as T


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # shared with tests/evals/test_retrieval.py (the session's base temp dir), so a session trains once
    return tmp_path_factory.getbasetemp() / "recall-cache"


@pytest.fixture(scope="module")
def trained(cache_dir):
    return T.load_or_train(cache_dir=cache_dir, seed=0)


@pytest.fixture(scope="module")
def accuracies(trained):
    model, meta = trained
    task = T.RecallTask(**meta["config"]["task"])
    pols = {"window4": kvpolicies.get("window", window=4), "sink4+4": kvpolicies.get("sink", n_sink=4, window=4)}
    return {name: T.recall_accuracy(model, pol, task, trials=512, seed=1) for name, pol in pols.items()}


def test_task_sequences_are_consistent():
    """Every masked target is the value paired with the query key earlier in the sequence."""
    task = T.RecallTask(n_keys=8, n_values=5, n_pairs=6, n_queries=4)
    seq, targets, mask = map(np.asarray, jax.jit(task.sample, static_argnums=1)(jax.random.key(3), 16))
    assert seq.shape == (16, task.seq_len) and mask.sum() > 16
    base = 1 + task.n_keys + task.n_values
    for row, tgt, m in zip(seq, targets, mask):
        pairs = {}
        for tok in row[1:]:
            if tok >= base:
                k, v = divmod(int(tok) - base, task.n_values)
                assert k not in pairs  # distinct keys
                pairs[k] = v
        for t in np.flatnonzero(m):
            assert 1 <= row[t] <= task.n_keys
            assert tgt[t] == task.value_id(pairs[int(row[t]) - 1])
    tokens, answers, which = task.prompts(0, 32, n_pairs=6)
    assert tokens.shape == (32, 8)
    k, v = np.divmod(tokens[np.arange(32), 1 + which] - base, task.n_values)
    np.testing.assert_array_equal(tokens[:, -1], task.query_id(k))
    np.testing.assert_array_equal(answers, task.value_id(v))


def test_training_reaches_high_recall(trained):
    """meta["accuracy"]: full cache, 512 held-out prompts of 32 pairs, measured after training
    (tests/evals/test_retrieval.py measures it again through the recall task)."""
    model, meta = trained
    assert meta["accuracy"] >= 0.9
    assert meta["final_train_accuracy"] >= 0.9


def test_window_and_sink_fail(accuracies, trained):
    """Query at position N+1 with window 4 sees 3 of the 32 pairs (sink adds 3 more): near chance
    (1/16) on the rest."""
    chance = 1 / trained[1]["config"]["task"]["n_values"]
    for name, visible in (("window4", range(29, 32)), ("sink4+4", [0, 1, 2, 29, 30, 31])):
        acc, correct, which = accuracies[name]
        assert acc <= 0.3, name
        hidden = ~np.isin(which, list(visible))
        assert correct[hidden].mean() <= chance + 0.08, name


def test_cached_load_equals_trained(trained, cache_dir):
    model, meta = trained
    again, meta2 = T.load_or_train(cache_dir=cache_dir, seed=0)
    assert meta2["cached"] and meta2["key"] == meta["key"]
    jax.tree.map(np.testing.assert_array_equal, T.params_of(model), T.params_of(again))
    assert list(cache_dir.glob("recall-*.npz")) == [cache_dir / f"recall-{meta['key']}.npz"]


def test_cache_key_tracks_the_config():
    a = T.TrainConfig()
    assert a.key() == T.TrainConfig().key()
    assert a.key() != dataclasses.replace(a, seed=1).key()
    assert a.key() != dataclasses.replace(a, task=T.RecallTask(n_values=8)).key()


def test_training_is_deterministic_given_seed():
    """Two short runs with one seed are bitwise equal. (Steps, warmup, lr and seed are traced
    arguments, so these reuse the compiled step of the default config.)"""
    cfg = T.TrainConfig(steps=50, warmup=10)
    a, _ = T.train(cfg, evaluate=False)
    b, _ = T.train(cfg, evaluate=False)
    pa, pb = T.params_of(a), T.params_of(b)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)
    init = T.params_of(T.Llama(cfg.model_config(), T.init_params(cfg.model_config(), seed=0, std=cfg.init_std)))
    assert np.abs(pa["layers"]["wq"] - init["layers"]["wq"]).max() > 1e-3  # it trained
    other = T.init_params(cfg.model_config(), seed=1, std=cfg.init_std)
    assert not np.array_equal(other["embed"], init["embed"])


def test_bad_config_raises():
    with pytest.raises(ValueError, match="n_pairs"):
        T.RecallTask(n_keys=4, n_pairs=8)
    with pytest.raises(ValueError, match="warmup"):
        T.TrainConfig(steps=50, warmup=50)


def test_recall_task_full_retrieves_window_fails(trained):
    """evals.retrieval's `recall` task on the trained model (here, beside the training fixture, so
    that a session trains once whichever pytest worker runs it)."""
    from evals import retrieval as R
    from evals import ruler
    from evals.common import TaskContext

    model, _ = trained
    task = {"name": "recall", "n_pairs": 32, "trials": 256}
    full = R.recall(TaskContext(model, None, kvpolicies.get("full"), task, progress=False))
    win = R.recall(TaskContext(model, None, kvpolicies.get("window", window=4), task, progress=False))
    assert full.metrics["accuracy"] >= 0.9
    assert win.metrics["accuracy"] <= 0.25
    # window=4 at query position N+1 sees only the last 3 pairs: those are still retrieved,
    # and pairs farther back are at chance level
    by_pair = np.array(win.curves["by_pair@32"])
    far = np.concatenate([win.arrays["correct@32"][win.arrays["pair@32"] == i] for i in range(29)])
    assert far.mean() <= full.metrics["chance"] + 0.1
    assert np.nanmean(by_pair[29:]) >= 0.6
    lo, hi = ruler.wilson(round(full.metrics["accuracy"] * 256), 256)
    assert full.grid == [{"n_pairs": 32, "accuracy": full.metrics["accuracy"], "trials": 256, "ci_low": lo,
                          "ci_high": hi}]
