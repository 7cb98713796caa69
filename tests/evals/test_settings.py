"""Issue 38, item 2: every setting is used or refused. A budget on a policy that cannot be sized is
said (a note, `sized: false` in the row); an explicit value equal to the default still counts as
explicit; a budget too small for a policy's fixed part lowers snapkv's `max_new` (down to the run's
generation length) and records it, or names a field value that fits, in evals.run as in
evals.compare."""

from __future__ import annotations

import pytest

import kvpolicies
from evals import compare
from evals import config as C
from evals import run as evrun
from kvpolicies import budgets as B
from kvpolicies.memory import state_bytes

TINY = ["model=tiny_random", "tokens=400"]


def test_explicit_value_equal_to_default_is_not_dropped():
    # window=4096 is the run-level default: given on the command line it still sizes the cache
    with pytest.raises(C.ConfigError, match=r"budget=0.5 and policy.window=4096 both size the cache of window: give "
                       r"one of them \(policy.window also follows window=\)"):
        C.validate(C.compose(["policy=window", "budget=0.5", "window=4096", *TINY]))
    with pytest.raises(C.ConfigError, match="both size the cache"):
        C.validate(C.compose(["policy=h2o", "budget=0.5", "policy.heavy=512", *TINY]))  # h2o's default heavy
    # snapkv's max_new given at its default is held, not lowered by the sizing
    conf = C.validate(C.compose(["policy=snapkv", "budget=0.5", "policy.max_new=256", "model=tiny_random", "tokens=1024"]))
    assert conf["_explicit"] == ["max_new"]
    pol, sizing = C.resolve_policy(conf)
    assert pol.max_new == 256 and "shrunk" not in sizing


def test_budget_on_an_unsizable_policy_is_said_and_recorded(tmp_path, text_file, capsys):
    res = tmp_path / "r.jsonl"
    conf = C.validate(C.compose(["policy=quest", "budget=0.25", "model=tiny_random", "data=path",
                                 f"data.path={text_file}", "tokens=32", "chunk=16", f"results={res}", "progress=false"]))
    row, ran = evrun.run_config(conf)
    out = capsys.readouterr().out
    assert ran and "note: budget=0.25 is not used: quest has no token budget" in out
    assert row["budget"]["sized"] is False and "_explicit" not in row["config"]


@pytest.mark.parametrize("budget, expect_max_new", [(0.125, 64), (0.25, 128), (0.5, 256)])
def test_too_small_budget_lowers_max_new_and_records_it(budget, expect_max_new):
    """At 1024 tokens of SmolLM2 (3 kv heads x 64, float32), snapkv's 32 + 256 fixed slots exceed
    0.125 of the full cache: max_new is halved until it fits; the result is the one
    `budgets.sized` gives with that max_new, within the budget."""
    conf = C.validate(C.compose(["policy=snapkv", f"budget={budget}", "tokens=1024"]))
    pol, sizing = C.resolve_policy(conf)
    assert pol.max_new == expect_max_new
    dims = dict(max_len=1024, kv_heads=3, head_dim=64, dtype="float32")
    assert pol == B.sized("snapkv", budget, **dims, max_new=expect_max_new)
    if expect_max_new != 256:
        assert sizing["shrunk"] == {"max_new": [256, expect_max_new]}
        with pytest.raises(ValueError, match="too small"):  # the default does not fit: the shrink was needed
            B.sized("snapkv", budget, **dims)
    assert state_bytes(pol, **dims).total <= sizing["target_bytes"]


def test_shrink_stops_at_the_generation_length_and_names_a_field_that_fits():
    dims = dict(max_len=1024, kv_heads=3, head_dim=64, dtype="float32")
    # a run that generates 200 tokens keeps max_new >= 200: 0.125 cannot fit, the error names why
    with pytest.raises(ValueError, match=r"too small for snapkv.*raise the budget|too small for snapkv.*fits with"):
        C.size_policy("snapkv", 0.125, gen=200, fixed={}, **dims)
    # max_new held by the user: not lowered, the error names the value that fits, as evals.run spells it
    with pytest.raises(ValueError, match=r"it fits with policy.max_new=64 \(or a larger budget\)"):
        C.size_policy("snapkv", 0.125, gen=0, fixed={"max_new": 256}, prefix="policy.", **dims)
    with pytest.raises(ValueError, match=r"it fits with snapkv.max_new=64"):
        C.size_policy("snapkv", 0.125, gen=0, fixed={"max_new": 256}, **dims)


def test_run_and_compare_give_the_same_hint(capsys):
    with pytest.raises(SystemExit):
        evrun.main(["policy=snapkv", "budget=0.125", "policy.max_new=256", "tokens=1024", "results=/tmp/unused.jsonl"])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "it fits with policy.max_new=64" in err
    with pytest.raises(C.ConfigError, match="it fits with snapkv.max_new=64"):
        compare.plan(["task=perplexity", "tokens=1024", "policies=[snapkv]", "budgets=[0.125]", "snapkv.max_new=256",
                      "results=/tmp/unused.jsonl"])


def test_readme_compare_command_plans():
    """`python -m evals.compare task=perplexity tokens=1024` plans every job of the default grid
    (32:1 to 4:3) it can size: snapkv at 1/16, 0.125 and 0.25 with max_new lowered, and left out at
    1/32 (its smallest sizing stores more), each said in a note; the four budgets of the committed
    table plan all 20 jobs; each job's policy is what evals.run builds from its overrides."""
    p = compare.plan(["task=perplexity", "tokens=1024", "results=/tmp/unused.jsonl"])
    assert p.budgets == [1 / 32, 1 / 16, 0.125, 0.25, 0.5, 0.75]
    cells = {(j.policy, j.budget) for j in p.jobs[1:]}
    assert cells == {(n, b) for n in compare.DEFAULT_POLICIES for b in p.budgets} - {("snapkv", 1 / 32)}
    snap = {j.budget: j.policy_obj for j in p.jobs if j.policy == "snapkv"}
    assert snap[1 / 16].max_new == 16 and snap[0.125].max_new == 64 and snap[0.25].max_new == 128
    assert snap[0.5].max_new == 256
    left_out = [n for n in p.notes if "left out" in n]
    assert len(left_out) == 1 and left_out[0].startswith("snapkv at budget 0.03125 left out")
    assert sum("max_new lowered" in n for n in p.notes) == 3
    assert all(C.build_policy(j.conf["policy"]) == j.policy_obj for j in p.jobs)
    assert isinstance(p.jobs[0].policy_obj, kvpolicies.Full)
    four = compare.plan(["task=perplexity", "tokens=1024", "budgets=[0.125,0.25,0.5,0.75]", "results=/tmp/unused.jsonl"])
    assert len(four.jobs) == 1 + 5 * 4 and not any("left out" in n for n in four.notes)
    # a budget given on the command line is sized or refused, not left out
    with pytest.raises(C.ConfigError, match="snapkv at budget 0.03125"):
        compare.plan(["task=perplexity", "tokens=1024", "budgets=[0.03125]", "results=/tmp/unused.jsonl"])


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_a_preset_with_dense_layers_is_sized_to_the_models_total(budget):
    """knorm keeps its first two layers dense (the authors'): sized for a model, its compressed
    layers take what the budget leaves after those layers, so the whole stack stores at most
    n_layers x the per-layer budget (and within a compressed layer's few slots of it)."""
    dims = dict(max_len=1036, kv_heads=3, head_dim=64, dtype="float32")
    target = B.target_bytes(budget, **dims)
    alone, _ = C.size_policy("knorm", budget, gen=16, fixed={"max_new": 16}, **dims)
    pol, _ = C.size_policy("knorm", budget, gen=16, fixed={"max_new": 16}, n_layers=30, **dims)
    stack = pol.stack(30)
    assert [type(p).__name__ for p in stack[:3]] == ["Full", "Full", "Knorm"]
    total = sum(state_bytes(p, **dims).total for p in stack)
    per_slot = state_bytes(pol, **dims).total // pol.capacity(1036)
    assert 30 * target - 28 * per_slot < total <= 30 * target
    assert pol.budget < alone.budget  # the layer-wise sizing alone would overshoot by the dense layers
    assert sum(state_bytes(p, **dims).total for p in alone.stack(30)) > 30 * target
