"""evals.compare: policies x byte budgets on the tiny random Llama. Every job is sized (its stored bytes,
read back from its row, at most the budget and within one slot of it), the table holds the results
file's numbers (one row per policy, one column per budget), the plot files exist, a second run appends
nothing, and bad arguments fail before any model loads, naming the key."""

from __future__ import annotations

import csv
import dataclasses
import io
import math

import numpy as np
import pytest

import kvpolicies
from evals import compare, zoo
from evals import results as R
from evals.table import fmt
from kvpolicies.memory import state_bytes

TOKENS = 128
POLICIES = ["sink", "h2o", "snapkv"]
BUDGETS = [0.25, 0.5]


def base_args(text_file, results, snapkv=True):
    # snapkv's default 32-token observation window and 256 decode slots do not fit a 128-token
    # stream's budgets: held smaller, as a compare run may hold any field of a policy
    return ["model=tiny_random", "data=path", f"data.path={text_file}", f"tokens={TOKENS}", "chunk=32",
            f"results={results}", "progress=false"] + (["snapkv.max_new=8", "snapkv.obs_window=4"] if snapkv else [])


@pytest.fixture(scope="module")
def compared(tmp_path_factory, text_file):
    """One compare run: (results path, output folder, argv, cells)."""
    d = tmp_path_factory.mktemp("compare")
    argv = base_args(text_file, d / "res.jsonl") + [f"policies=[{','.join(POLICIES)}]",
                                                    f"budgets=[{','.join(map(str, BUDGETS))}]", f"out={d / 'out'}"]
    cells = compare.main(argv)
    return d / "res.jsonl", d / "out", argv, cells


def _policy(row):
    rec = dict(row["policy"])
    name, codec = rec.pop("name"), rec.pop("codec")
    return kvpolicies.get(name, codec=codec["name"], **rec)


def test_every_job_stores_at_most_its_budget_and_within_one_slot(compared):
    res, _, _, cells = compared
    rows = {r["key"]: r for r in R.read(res)}
    assert len(rows) == 1 + len(POLICIES) * len(BUDGETS)
    mc = zoo.describe(_tiny())
    full_layer = state_bytes(kvpolicies.get("full"), kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=TOKENS,
                             dtype="float32").total
    seen = set()
    for c in cells:
        row = rows[c["key"]]
        mem = row["memory"]
        assert (mem["max_len"], mem["dtype"], mem["layers"]) == (TOKENS, "float32", mc.n_layers)
        if c["budget"] is None:
            assert row["policy"]["name"] == "full" and mem["state_bytes"] == full_layer * mc.n_layers
            continue
        seen.add((c["policy"], c["budget"]))
        target = math.floor(c["budget"] * full_layer)  # a float budget: that fraction of full's bytes, per layer
        assert c["target_bytes"] == target * mc.n_layers
        pol = _policy(row)
        assert row["policy"]["name"] == c["policy"]
        kw = dict(kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=TOKENS, dtype="float32")
        layer = state_bytes(pol, **kw).total
        assert mem["state_bytes"] == layer * mc.n_layers  # the row's measured bytes are the sized policy's
        assert layer <= target
        bigger = dataclasses.replace(pol, **{pol.budget_field: getattr(pol, pol.budget_field) + 1})
        assert pol.capacity(TOKENS) == TOKENS or state_bytes(bigger, **kw).total > target  # one more slot: over
        assert c["compression"] == pytest.approx(1 - c["budget"], abs=1e-3)
    assert seen == {(p, b) for p in POLICIES for b in BUDGETS}


def _tiny():
    from evals import config as C

    return C.to_plain(C.compose(["model=tiny_random"]))["model"]


def test_equal_budget_means_equal_bytes_across_policies(compared):
    """The point of the table: in one column every policy holds the same bytes, to one slot."""
    res, _, _, cells = compared
    rows = {r["key"]: r for r in R.read(res)}
    mc = zoo.describe(_tiny())
    kw = dict(kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=TOKENS, dtype="float32")
    for b in BUDGETS:
        col = [c for c in cells if c["budget"] == b]
        assert len(col) == len(POLICIES) and len({c["target_bytes"] for c in col}) == 1
        slot = 0  # the largest one-slot step of the column's policies, all layers
        for c in col:
            pol = _policy(rows[c["key"]])
            bigger = dataclasses.replace(pol, **{pol.budget_field: getattr(pol, pol.budget_field) + 1})
            slot = max(slot, (state_bytes(bigger, **kw).total - state_bytes(pol, **kw).total) * mc.n_layers)
        stored = [c["state_bytes"] for c in col]
        assert max(stored) <= col[0]["target_bytes"] and max(stored) - min(stored) < slot


def test_table_has_a_row_per_policy_and_a_column_per_budget_from_the_results_file(compared):
    res, out, _, cells = compared
    rows = {r["key"]: r for r in R.read(res)}
    stem = f"perplexity-tiny_random-{TOKENS}"
    md = (out / f"{stem}.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ")]
    header = [h.strip() for h in table[0].strip("|").split("|")]
    assert header == ["policy \\ budget", "0.25 (CR 0.75)", "0.5 (CR 0.5)"]
    body = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in table[1:]}
    full = next(c for c in cells if c["budget"] is None)
    assert list(body) == [f"full ({full['state_bytes'] / 1e6:.4g} MB)"] + POLICIES
    for c in cells:
        if c["budget"] is None:
            continue
        row = rows[c["key"]]
        cell = body[c["policy"]][BUDGETS.index(c["budget"])]
        assert cell == f"{fmt(row['metrics']['ppl'])} ({row['memory']['state_bytes'] / 1e6:.4g} MB)"
    # the CSV holds the same numbers, unrounded
    recs = list(csv.DictReader(io.StringIO((out / f"{stem}.csv").read_text())))
    assert len(recs) == len(cells)
    for rec in recs:
        row = rows[rec["key"]]
        assert float(rec["score"]) == row["metrics"]["ppl"]
        assert int(rec["state_bytes"]) == row["memory"]["state_bytes"]
    tex = (out / f"{stem}.tex").read_text()
    assert "\\toprule" in tex and "\\bottomrule" in tex and tex.count("\\\\") == 1 + 1 + len(POLICIES)


def test_plot_files_exist(compared):
    _, out, _, _ = compared
    for ext in ("png", "pdf"):
        path = out / f"perplexity-tiny_random-{TOKENS}.{ext}"
        assert path.is_file() and path.stat().st_size > 1000


@pytest.mark.parametrize("sizes", [(34.72e6, 34.74e6), (2e6, 64e6)])
def test_the_byte_axis_draws_equal_bytes_together(tmp_path, monkeypatch, sizes):
    """Policies at (nearly) the same bytes sit together on the log byte axis, within MARGIN of
    each other, not spread over its whole width (matplotlib's own limits hug a 0.06 % span)."""
    from evals import plots

    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, out, stem: figs.append(fig) or [])
    full = {"policy": "full", "score": 1.0, "compression": 0.0, "state_bytes": 69.48e6, "lower": False,
            "metric": "agreement"}
    recs = [full] + [{**full, "policy": name, "score": 0.5, "compression": 0.5, "state_bytes": b}
                     for name, b in zip(("sink", "h2o"), sizes)]
    compare.plot(recs, tmp_path, "stem")
    lo, hi = figs[0].axes[1].get_xlim()
    assert (lo, hi) == pytest.approx((min(sizes) / 1e6 / compare.MARGIN, max(sizes) / 1e6 * compare.MARGIN))


def test_a_second_run_appends_nothing(compared, monkeypatch):
    res, _, argv, cells = compared
    before = res.read_bytes()
    monkeypatch.setattr(zoo, "load_model", _no_load)  # every job is skipped: nothing loads
    again = compare.main(argv)
    assert res.read_bytes() == before
    assert again == cells


def _no_load(*a, **k):
    raise AssertionError("the model was loaded")


def test_plan_sizes_the_default_policies_and_budgets_without_loading(text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "load_model", _no_load)
    p = compare.plan(base_args(text_file, tmp_path / "r.jsonl"))
    assert p.policies == list(compare.DEFAULT_POLICIES) and p.budgets == list(compare.DEFAULT_BUDGETS)
    # the default grid less the cells a policy cannot be sized to at this length, each said in a note
    left_out = {(n.split(" at budget ")[0], float(n.split(" at budget ")[1].split()[0])) for n in p.notes
                if " left out: " in n}
    assert [(j.policy, j.budget) for j in p.jobs] == [("full", None)] + [
        (n, b) for n in compare.DEFAULT_POLICIES for b in compare.DEFAULT_BUDGETS if (n, b) not in left_out]
    assert len(p.jobs) > 1 + 3 * len(compare.DEFAULT_BUDGETS)
    assert p.out == tmp_path / "compare" and p.stem == f"perplexity-tiny_random-{TOKENS}"
    h2o = next(j for j in p.jobs if j.policy == "h2o" and j.budget == 0.25)
    assert "policy=h2o" in h2o.overrides and h2o.policy_obj.heavy + h2o.policy_obj.recent > 0
    assert len({j.key for j in p.jobs}) == len(p.jobs)


def test_int_budgets_are_tokens_and_a_codec_buys_more_of_them(text_file, tmp_path):
    args = base_args(text_file, tmp_path / "r.jsonl", snapkv=False)
    p = compare.plan(args + ["policies=[window]", "budgets=[32,16]"])
    assert p.budgets == [16, 32]  # most compressed first
    assert [j.policy_obj.window for j in p.jobs[1:]] == [16, 32]  # window stores what full does per token
    assert [j.compression for j in p.jobs[1:]] == [1 - 16 / TOKENS, 1 - 32 / TOKENS]
    q = compare.plan(args + ["policies=[window]", "budgets=[32]", "codec=int8"])
    assert q.jobs[1].policy_obj.window > 32 and q.stem.endswith("-int8")


@pytest.mark.parametrize("arg, expected", [
    ("foo=1", "foo: unknown key"),
    ("policy=sink", "policy: set by compare"),
    ("window=64", "window: set by compare"),
    ("budget=0.5", "budget: set by compare"),
    ("policies=[sink,nope]", "policies=[sink,nope]: 'nope' is not a registered policy"),
    ("policies=[full,quest]", "quest cannot be sized"),
    ("policies=[]", "policies=[]"),
    ("budgets=[0.5,1.5]", "budgets=[0.5,1.5]: 1.5"),
    ("budgets=[0.5,abc]", "budgets=[0.5,abc]: 'abc' is not a number"),
    ("budgets=[0]", "budgets=[0]: 0"),
    ("budgets=[100000]", "budgets: 100000 tokens"),
    ("sink.bogus=3", "sink.bogus=3"),
    ("sink.window=3", "sink.window=3 conflicts"),
    ("tova.scope=head", "tova.scope: tova is not in policies"),
    ("task=nope", "task=nope"),
    ("-m", "-m: expected key=value"),
])
def test_bad_args_fail_before_any_model_load_naming_the_key(arg, expected, text_file, tmp_path, monkeypatch,
                                                            capsys):
    monkeypatch.setattr(zoo, "load_model", _no_load)
    monkeypatch.setattr(zoo, "load_tokenizer", _no_load)
    argv = base_args(text_file, tmp_path / "r.jsonl") + ["policies=[sink,h2o,snapkv]"]
    argv = [a for a in argv if not (arg.startswith("policies") and a.startswith("policies"))] + [arg]
    with pytest.raises(SystemExit) as e:
        compare.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("evals.compare: error: ") and expected in err, err
    assert not (tmp_path / "r.jsonl").exists()


def test_parse_args_splits_own_keys_policy_fields_and_run_overrides():
    a = compare.parse_args(["policies=[sink, h2o ,sink,full]", "budgets=0.5,128", "sink.n_sink=8",
                            "sink.positions=original", "tokens=64", "model=tiny_random", "out=x", "name=y"])
    assert a.policies == ["sink", "h2o"] and a.budgets == [0.5, 128]
    assert a.fields == {"sink": {"n_sink": 8, "positions": "original"}}
    assert a.passthrough == ["tokens=64", "model=tiny_random"] and (a.out, a.name) == ("x", "y")
    d = compare.parse_args([])
    assert d.policies == list(compare.DEFAULT_POLICIES) and d.budgets == list(compare.DEFAULT_BUDGETS)


def test_accuracy_cells_carry_their_wilson_interval():
    """An accuracy row's interval (its ci_low / ci_high metrics) is printed in every cell and in
    the CSV; a perplexity cell has none."""
    from evals.ruler import wilson

    lo, hi = wilson(9, 10)
    rec = dict(compression=0.5, params="", metric="accuracy", lower=False, target_bytes=0, max_len=64, key="k")
    recs = [rec | dict(policy="full", budget=None, compression=0.0, score=1.0, ci_low=wilson(10, 10)[0],
                       ci_high=1.0, state_bytes=2_000_000),
            rec | dict(policy="kvzip", budget=0.5, score=0.9, ci_low=lo, ci_high=hi, state_bytes=1_000_000)]
    header, body, caption = compare.grid(recs)
    assert body[1] == ["kvzip", f"0.90 [{lo:.2f}, {hi:.2f}] (1 MB)"]
    assert body[0][1].startswith("1.00 [0.72, 1.00]") and "Wilson" in caption
    assert f"{lo}" in compare.csv_text(recs)
    ppl = [r | dict(metric="ppl", lower=True, ci_low=None, ci_high=None, score=18.5) for r in recs]
    assert compare.grid(ppl)[1][1] == ["kvzip", "18.50 (1 MB)"]


def test_jobs_share_one_prefill_per_context_with_the_answers_of_unshared_runs(tmp_path):
    """A RULER compare prefills each context once: the snapkv job prefills, full (run last)
    compresses that state; rows, answers and scores equal those of a run with share_gb=0, where
    every job prefills its own. (Which engines can share: tests/evals/test_ruler.py.)"""
    def run(share, folder):
        argv = ["model=tiny_random", "model.max_position=1024", "task=ruler_niah_single", "task.lengths=[420]",
                "task.trials=2", "task.gen=4", "task.protocol=query_agnostic", "policies=[snapkv]",
                "budgets=[0.5]", "snapkv.max_new=8", "snapkv.obs_window=4", "chunk=512", f"share_gb={share}",
                f"results={folder / 'r.jsonl'}", f"out={folder / 'out'}", "progress=false"]
        compare.main(argv)
        return {r["params"]: r for r in R.read(folder / "r.jsonl")}

    shared, alone = run(4, tmp_path / "shared"), run(0, tmp_path / "alone")
    work = lambda rows: sorted((r["metrics"]["prefills"], r["metrics"]["prefills_shared"])  # noqa: E731
                               for r in rows.values())
    assert work(shared) == [(0, 2), (2, 0)]  # one job prefilled both contexts for both
    assert work(alone) == [(2, 0)] * 2
    assert shared.keys() == alone.keys() and len(shared) == 2
    for params, r in shared.items():
        mine = alone[params]
        assert r["key"] == mine["key"] and r["metrics"]["accuracy"] == mine["metrics"]["accuracy"]
        for name in ("outputs", "score"):
            a = np.load(tmp_path / "shared" / r["arrays"][name])
            b = np.load(tmp_path / "alone" / mine["arrays"][name])
            np.testing.assert_array_equal(a, b)


PASSKEY = ["model.max_position=512", "task=passkey", "task.lengths=[320]", "task.depths=[0.5]", "task.trials=1",
           "task.batch=1", "policies=[snapkv]", "budgets=[0.5]", "snapkv.max_new=16", "snapkv.obs_window=4"]


def test_protocols_run_both_loops_in_one_command(text_file, tmp_path):
    """protocols=[query_agnostic,query_aware]: a comparison per protocol (kvpress's leaderboard
    runs both), each its own rows (the protocol is part of the run key) and files <stem>-<protocol>.*"""
    argv = [a for a in base_args(text_file, tmp_path / "r.jsonl", snapkv=False) if not a.startswith("tokens=")]
    argv += PASSKEY + [f"out={tmp_path / 'out'}", "protocols=[query_agnostic,query_aware]"]
    ps = compare.plans(argv)
    assert [p.stem for p in ps] == ["passkey-tiny_random-332-query_agnostic", "passkey-tiny_random-332-query_aware"]
    assert [{j.conf["task"]["protocol"] for j in p.jobs} for p in ps] == [{"query_agnostic"}, {"query_aware"}]
    assert not {j.key for j in ps[0].jobs} & {j.key for j in ps[1].jobs}
    cells = compare.main(argv)
    assert [(c["protocol"], c["policy"]) for c in cells] == [
        ("query_agnostic", "full"), ("query_agnostic", "snapkv"), ("query_aware", "full"), ("query_aware", "snapkv")]
    assert all(c["score"] in (0.0, 1.0) for c in cells)
    for p in ps:
        assert (tmp_path / "out" / f"{p.stem}.md").is_file() and (tmp_path / "out" / f"{p.stem}.csv").is_file()
    named = compare.plans(argv + ["name=mine"])
    assert [p.stem for p in named] == ["mine-query_agnostic", "mine-query_aware"]


@pytest.mark.parametrize("extra, says", [
    (["protocols=[query_aware,nope]"], "'nope' is not a protocol"),
    (["protocols=[query_aware]", "task.protocol=query_agnostic"], "task.protocol: set by protocols"),
])
def test_protocols_errors_name_the_key(extra, says, text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "load_model", _no_load)
    argv = [a for a in base_args(text_file, tmp_path / "r.jsonl", snapkv=False) if not a.startswith("tokens=")]
    with pytest.raises(SystemExit) as e:
        compare.main(argv + PASSKEY + extra)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_protocols_need_a_task_that_has_one(text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "load_model", _no_load)
    with pytest.raises(SystemExit):
        compare.main(base_args(text_file, tmp_path / "r.jsonl") + ["protocols=[query_aware]"])
    assert "task=perplexity has no protocol" in capsys.readouterr().err


def test_thresholds_sit_at_the_ratio_they_achieved(text_file, tmp_path):
    """thresholds=[0,1]: kvzap jobs by a threshold, fit=64 (each layer stored at what it kept), placed
    at their measured compression ratio (1 - the row's mean stored bytes / full's) beside the budgets;
    a higher threshold keeps less; the table, csv and plot carry them."""
    argv = [a for a in base_args(text_file, tmp_path / "r.jsonl", snapkv=False) if not a.startswith("tokens=")]
    argv += PASSKEY + [f"out={tmp_path / 'out'}", "thresholds=[0,1]", "kvzap.surrogate=random", "kvzap.window=16"]
    (p,) = compare.plans(argv)
    assert [(j.policy, j.threshold) for j in p.jobs][-2:] == [(compare.THRESHOLD_POLICY, 0.0),
                                                               (compare.THRESHOLD_POLICY, 1.0)]
    assert all(j.conf["fit"] == compare.THRESHOLD_FIT and j.policy_obj.rule == "threshold" for j in p.jobs[-2:])
    cells = compare.main(argv)
    rows = {r["key"]: r for r in R.read(tmp_path / "r.jsonl")}
    full = next(c for c in cells if c["policy"] == "full")
    thr = [c for c in cells if c.get("threshold") is not None]
    for c in thr:
        fitted = rows[c["key"]]["memory"]["fitted_bytes"]
        assert c["state_bytes"] == fitted and c["compression"] == pytest.approx(1 - fitted / full["state_bytes"])
    assert 0 < thr[0]["compression"] < thr[1]["compression"] < 1
    md = (tmp_path / "out" / f"{p.stem}.md").read_text()
    assert f"{compare.THRESHOLD_POLICY} 1: CR {thr[1]['compression']:.3g} measured" in md
    table = list(csv.DictReader(io.StringIO((tmp_path / "out" / f"{p.stem}.csv").read_text())))
    assert [r["threshold"] for r in table] == ["", "", "0.0", "1.0"]
    assert (tmp_path / "out" / f"{p.stem}.png").is_file()
