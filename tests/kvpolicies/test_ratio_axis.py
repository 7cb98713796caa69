"""`ratio=`: kvpress's compression ratio (the fraction of a prompt's tokens removed) as a policy
field of the prompt compressors and as the `evals.run` key that sizes every sizable policy."""

from __future__ import annotations

import numpy as np
import pytest

import kvpolicies
from evals import config as C
from evals import results as R
from evals.run import run_key
from kvpolicies.budgets import context_kept
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama


@pytest.fixture(scope="module")
def tiny_model():
    return Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))


@pytest.mark.parametrize("pol", [
    kvpolicies.get("snapkv", ratio=0.5, obs_window=4, kernel=3, max_new=8),
    kvpolicies.get("knorm", ratio=0.5, max_new=8, dense_layers=0),  # every layer compressed (kvpress)
    kvpolicies.get("adakv", ratio=0.5, obs_window=4, kernel=3, max_new=8),
])
def test_ratio_keeps_int_n_times_one_minus_ratio_of_every_prompt(pol, tiny_model):
    """One engine, prompts of 40 and 31 tokens: kvpress's n_kept = int(n (1 - ratio)) per kv head
    (adakv: per head on average), the window included."""
    eng = Engine(tiny_model, pol, max_len=48)
    for n in (40, 31):
        ids = np.random.default_rng(n).integers(0, 97, (1, n)).astype(np.int32)
        kept = eng.kept_positions(eng.compress(eng.prompt(ids)))
        for layer in kept:
            assert sum(map(len, layer)) == len(layer) * int(n * 0.5), (n, [len(h) for h in layer])
            assert all(len(h) == int(n * 0.5) for h in layer) or isinstance(pol, kvpolicies.AdaKV)
        assert context_kept(pol, n) == int(n * 0.5)


def test_ratio_key_sizes_prompt_compressors_and_streaming_policies():
    base = ["model=tiny_random", "tokens=400"]
    pol, sizing = C.resolve_policy(C.validate(C.compose(["policy=snapkv", "ratio=0.5", *base])))
    assert pol.ratio == 0.5 and pol.budget == 1024 and sizing["kept_per_head"] == 200  # the window included
    pol, sizing = C.resolve_policy(C.validate(C.compose(["policy=sink", "ratio=0.75", *base])))
    assert pol.n_sink + pol.window == 100 and sizing["kept_per_head"] == 100
    pol, sizing = C.resolve_policy(C.validate(C.compose(["policy=h2o", "ratio=0.5", *base])))
    assert pol.heavy + pol.recent == 200
    pol, sizing = C.resolve_policy(C.validate(C.compose(["policy=full", "ratio=0.5", *base])))
    assert pol == kvpolicies.get("full") and sizing["sized"] is False
    with pytest.raises(C.ConfigError, match="give one"):
        C.validate(C.compose(["policy=snapkv", "ratio=0.5", "budget=0.5", *base]))
    for bad in ("ratio=1", "ratio=-0.1", "ratio=abc"):
        with pytest.raises(C.ConfigError, match="ratio="):
            C.validate(C.compose(["policy=snapkv", bad, *base]))


def test_new_fields_at_their_defaults_keep_the_run_keys():
    """ratio / pooling / safeguard_window / interval / target / slots at their defaults leave a row's resume
    key as it was."""
    conf = C.validate(C.compose(["policy=snapkv", "model=tiny_random", "tokens=400"]))
    pol, _ = C.resolve_policy(conf)
    old = {k: v for k, v in R.policy_record(pol).items() if k not in ("ratio", "pooling", "interval", "target", "slots",
                                                                            "spare")}
    keyed = {k: conf[k] for k in ("model", "data", "policy", "task", "chunk", "seed")}
    keyed["task"] = {k: v for k, v in conf["task"].items() if k != "extrapolate"}
    assert run_key(conf, pol) == R.config_key({**keyed, "policy": old})
    assert run_key(conf, pol) != run_key(conf, kvpolicies.get("snapkv", ratio=0.5))
    assert run_key(conf, pol) != run_key(conf, kvpolicies.get("snapkv", interval=64, target=512))


@pytest.mark.parametrize("policy", [["policy=kvpress.SnapKVPress", "ratio=0.5"], ["policy=sink", "ratio=0.5"]])
def test_cli_ratio_row_records_context_kept_and_bytes(policy, tmp_path, text_file):
    """`python -m evals.run policy=kvpress.SnapKVPress ratio=0.5 ...`: the row says how ratio sized
    the policy and records context tokens kept per head (int(320 x 0.5) = 160) and stored bytes."""
    from evals import run as evrun

    args = ["model=tiny_random", "model.max_position=512", "data=path", f"data.path={text_file}", "chunk=32",
            f"results={tmp_path / 'res.jsonl'}", "progress=false", f"hydra.run.dir={tmp_path}/run",
            f"hydra.sweep.dir={tmp_path}/sweep", "task=passkey", "task.lengths=[320]", "task.depths=[0.5]",
            "task.trials=1", "task.batch=1", *policy]
    (row,) = evrun.main(args)
    assert row["budget"]["ratio"] == 0.5 and row["budget"]["sized"] and row["budget"]["kept_per_head"] == 160
    assert row["context_kept_per_head"] == [160] * row["model"]["layers"]
    assert row["memory"]["state_bytes"] > 0
