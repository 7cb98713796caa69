"""evals.run / config / zoo / perplexity / results / table / plots: config composition and errors, the runner
end to end on a tiny random byte-level Llama, resume/force/interruption, tables and figures."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import threading

import numpy as np
import pytest

import kvpolicies
from evals import plots, results as R, table
from evals import config as C, zoo
from evals import run as evrun

TOKENS = 160


def base_args(text_file, results, hydra_dir):
    return ["model=tiny_random", "model.max_position=96", "data=path", f"data.path={text_file}", f"tokens={TOKENS}",
            "chunk=32", "task.segment=40", f"results={results}", "progress=false",
            f"hydra.run.dir={hydra_dir}/run", f"hydra.sweep.dir={hydra_dir}/sweep"]


@pytest.fixture(scope="module")
def sink_run(tmp_path_factory, text_file):
    """One CLI run of sink(n_sink=4, window=64) on the tiny model; (results path, rows, args)."""
    d = tmp_path_factory.mktemp("run")
    args = base_args(text_file, d / "res.jsonl", d) + ["policy=sink", "window=64"]
    rows = evrun.main(args)
    return d / "res.jsonl", rows, args


def test_evals_compute_float32_matmuls_at_full_precision(tmp_path, text_file, monkeypatch):
    """A run's matmuls of 32-bit inputs are float32 on every backend (JAX's default rounds them to
    TF32 on recent GPUs, bfloat16 on TPUs): _run is traced under jax_default_matmul_precision
    'highest', and the setting is restored after it."""
    import jax

    seen = []
    real = evrun._run
    monkeypatch.setattr(evrun, "_run", lambda *a, **k: (seen.append(jax.config.jax_default_matmul_precision),
                                                         real(*a, **k))[1])
    before = jax.config.jax_default_matmul_precision
    evrun.main(base_args(text_file, tmp_path / "res.jsonl", tmp_path) + ["policy=window", "window=32"])
    assert seen == ["highest"] and jax.config.jax_default_matmul_precision == before


# -- composition and errors -------------------------------------------------------------------------


def test_defaults_compose_to_smollm2_pride_and_prejudice_perplexity():
    conf = C.validate(C.compose([]))
    assert conf["model"] == {"name": "smollm2", "dtype": "float32"}
    assert conf["data"]["spec"] == "austen:Pride & Prejudice"
    assert conf["task"] == {"name": "perplexity", "tokens": 12288, "segment": 1024}
    assert conf["policy"] == {"name": "full", "codec": "none"}
    assert (conf["results"], conf["chunk"], conf["force"]) == ("results/results.jsonl", 512, False)


def test_top_level_keys_reach_the_policy_and_task():
    conf = C.validate(C.compose(["policy=sink", "window=1024", "n_sink=2", "codec=int8", "tokens=999"]))
    assert conf["policy"] == {"name": "sink", "n_sink": 2, "window": 1024, "positions": "cache", "codec": "int8"}
    assert conf["task"]["tokens"] == 999
    pol = C.build_policy(conf["policy"])
    assert pol == kvpolicies.get("sink", codec="int8", n_sink=2, window=1024)


def test_every_registered_policy_has_a_config_that_builds(tmp_path):
    assert set(kvpolicies.POLICIES) <= set(C.group_options("policy"))
    np.save(tmp_path / "heads.npy", np.tile([1.0, 0.0, 1.0], (30, 1)))  # duo needs a pattern: [layers, kv heads]
    needs = {"duo": [f"policy.pattern={tmp_path / 'heads.npy'}"]}
    for name, cls in kvpolicies.POLICIES.items():
        conf = C.validate(C.compose([f"policy={name}", "window=512", *needs.get(name, [])]))
        pol = C.build_policy(conf["policy"])
        assert type(pol) is cls and conf["policy"]["name"] == name
    follows = {"window": ("window", 512), "sink": ("window", 512), "multires": ("window", 512)}
    for name, (field, value) in follows.items():
        if name in kvpolicies.POLICIES:
            conf = C.validate(C.compose([f"policy={name}", "window=512"]))
            assert getattr(C.build_policy(conf["policy"]), field) == value


@dataclasses.dataclass(frozen=True)
class Wide(kvpolicies.Full):
    """A policy registered by a test: its `policy=wide` option comes from these fields alone."""

    width: int = 3
    depth: int = 5
    mode: str = "a"


def test_a_registered_policy_needs_no_config_file(monkeypatch):
    """Its option: each field at its default, its `RUN_KEYS` fields follow their run-level key, codec
    follows `codec`; `policy.<field>=` sets any field."""
    monkeypatch.setitem(kvpolicies.POLICIES, "wide", Wide)
    monkeypatch.setitem(C.RUN_KEYS, "wide", {"width": "window"})
    assert "wide" in C.group_options("policy")
    assert C.policy_config("wide") == {"name": "wide", "width": "${window}", "depth": 5, "mode": "a",
                                       "codec": "${codec}"}
    conf = C.validate(C.compose(["policy=wide", "codec=int8", "window=8", "policy.mode=b"]))
    assert list(conf["policy"].items()) == [("name", "wide"), ("width", 8), ("depth", 5), ("mode", "b"),
                                            ("codec", "int8")]
    assert C.build_policy(conf["policy"]) == Wide(codec=kvpolicies.get_codec("int8"), width=8, mode="b")


def test_policy_options_are_derived_from_the_registry():
    """configs/policy/ holds no files: every option is derived from a registered class (the YAML
    files it replaced gave exactly these configs)."""
    assert not list((C.CONFIG_DIR / "policy").glob("*.yaml"))
    conf = C.validate(C.compose(["policy=h2o"]))
    assert conf["policy"] == {"name": "h2o", "heavy": 256, "recent": 256, "prompt": "dense", "codec": "none"}
    conf = C.validate(C.compose(["policy=snapkv", "codec=int4"]))
    assert conf["policy"] == {"name": "snapkv", "budget": 1024, "obs_window": 32, "kernel": 7, "max_new": 256,
                              "ratio": 0.0, "interval": 0, "target": 0, "ties": "newer", "pooling": "max", "codec": "int4"}


@pytest.mark.parametrize("name", ["window", "sink", "h2o", "tova", "snapkv"])
@pytest.mark.parametrize("budget", [0.25, 100])
def test_budget_sizes_every_policy_to_the_same_stored_bytes(name, budget):
    """budget= means the same bytes for every policy: stored bytes (everything) at most the
    target and within one slot per kv head of it (closed form: a full-precision slot of the
    tiny model stores 2 x K x D x 4 bytes + 4 bytes of position)."""
    from kvpolicies.memory import state_bytes

    over = [f"policy={name}", f"budget={budget}", "model=tiny_random", "tokens=400"]
    over += ["policy.max_new=16", "policy.obs_window=8"] if name == "snapkv" else []  # fits 100 tokens
    conf = C.validate(C.compose(over))
    pol, sizing = C.resolve_policy(conf)
    import jax.numpy as jnp

    from evals.zoo import describe

    mc = describe(conf["model"])
    kv, d = mc.n_kv_heads, mc.head_dim
    full_slot = 2 * kv * d * 4 + 4
    target = int(budget * 400 * full_slot) if isinstance(budget, float) else budget * full_slot
    stored = state_bytes(pol, kv_heads=kv, head_dim=d, max_len=400, dtype=jnp.float32).total
    assert sizing["sized"] and sizing["target_bytes"] == target and sizing["stored_bytes"] == stored
    assert stored <= target < stored + full_slot + 8 * kv  # within one slot (plus per-head bookkeeping)


def test_budget_conflicts_and_unsized_policies():
    with pytest.raises(C.ConfigError, match="both size the cache"):
        C.resolve_policy(C.validate(C.compose(["policy=sink", "window=64", "budget=0.5", "model=tiny_random",
                                               "tokens=400"])))
    pol, sizing = C.resolve_policy(C.validate(C.compose(["policy=full", "budget=0.5", "model=tiny_random",
                                                         "tokens=400"])))
    assert pol == kvpolicies.get("full") and sizing["sized"] is False and "cannot be sized" in sizing["why"]
    for bad in ("budget=0", "budget=1.5", "budget=-3"):
        with pytest.raises(C.ConfigError, match="budget="):
            C.validate(C.compose(["policy=h2o", bad]))


@pytest.mark.parametrize("overrides, expected", [
    (["policy=sinc"], ["policy=sinc: no such policy (did you mean 'sink'?); choose one of:", *sorted(kvpolicies.POLICIES)]),
    (["task=foo"], ["task=foo: no such task; choose one of: cwe, fwe, longgen, multikey, multiquery, multiturn, niah, "
                    "niah_multikey_1,", "passkey, perplexity, qa_1, qa_2, recall, ruler,", "ruler_vt, vt"]),
    (["window=abc"], ["window=abc: window must be int"]),
    (["progress=maybe"], ["progress=maybe: progress must be bool"]),
    (["windw=5"], ["windw: unknown key (did you mean 'window'?); the config has keys: budget, chunk, codec, data, distributed, fit, "
                   "force, mesh, model, n_sink"]),
    (["mesh=[2]"], ["mesh=[2]: must be [data, model], two ints >= 1 (e.g. mesh=[2,4]), or null"]),
    (["mesh=[0,1]"], ["mesh=[0, 1]: must be [data, model], two ints >= 1"]),
    (["mesh=abc"], ["mesh=abc: must be [data, model]"]),
    (["mesh=[1,1024]"], ["mesh=[1, 1024]: mesh data=1 x model=1024 = 1024 devices, but there are ", "Device"]),
    (["policy=sink", "policy.windw=3"], ["policy.windw: unknown key (did you mean 'window'?); policy 'sink' has keys: codec, n_sink, name, "
                                         "positions, window"]),
    (["policy=sink", "policy.window=0"], ["sink.window=0: must be an int >= 1"]),
    (["codec=int3"], ["codec='int3': must be one of ['fp8', 'fp8_after_rope', 'int4', 'int4_after_rope', 'int8', "
                      "'int8_after_rope', 'none']"]),
    (["policy=h2o", "codec=int8_after_rope"], ["policy: h2o.codec=int8 with after_rope=True: this policy stores its "
                                               "keys un-rotated", "after_rope needs full, window, sink or duo"]),
    (["model=gguf"], ["model.path is required: pass model.path=..."]),
    (["chunk=0"], ["chunk=0: must be >= 1"]),
    (["task.segment=abc"], ["task.segment='abc': must be an int >= 1"]),
    (["data=path", "data.path=/nonexistent/x.txt"], ["data.path=/nonexistent/x.txt: no such file"]),
])
def test_config_errors_name_the_key_and_valid_choices(overrides, expected):
    with pytest.raises(C.ConfigError) as e:
        C.validate(C.compose(overrides))
    for text in expected:
        assert text in str(e.value)
    assert "hydra" not in str(e.value)


def test_sweep_with_one_bad_value_fails_before_any_job(tmp_path, capsys):
    res = tmp_path / "res.jsonl"
    with pytest.raises(SystemExit) as e:
        evrun.main(["-m", "policy=full,sinc", f"results={res}", f"hydra.sweep.dir={tmp_path}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evals.run: error: policy=sinc: no such policy (did you mean 'sink'?)")
    assert not res.exists()


def test_job_overrides_expands_sweeps_only_under_multirun():
    jobs = evrun.job_overrides(["-m", "policy=full,window,sink", "window=1024,4096", "task=perplexity",
                                "hydra.run.dir=x"])
    assert len(jobs) == 6
    assert jobs[0] == ["policy=full", "window=1024", "task=perplexity"]
    assert jobs[-1] == ["policy=sink", "window=4096", "task=perplexity"]
    assert evrun.job_overrides(["policy=sink", "window=8"]) == [["policy=sink", "window=8"]]
    assert evrun.job_overrides(["--help"]) is None


# -- the runner end to end ----------------------------------------------------------------------------


def test_run_appends_one_row_with_metrics_arrays_and_exact_memory(sink_run):
    res, rows, _ = sink_run
    (row,) = R.read(res)
    assert rows[0]["key"] == row["key"]
    assert row["task"] == "perplexity" and row["policy"]["name"] == "sink" and row["policy"]["window"] == 64
    nll = R.load_array(row, "nll")
    assert nll.shape == (TOKENS,) and np.all(np.isfinite(nll))
    m = row["metrics"]
    assert m["tokens"] == TOKENS
    assert m["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    assert m["ppl_in"] == pytest.approx(math.exp(nll[:96].mean()), rel=1e-6)  # model.max_position=96
    assert m["ppl_out"] == pytest.approx(math.exp(nll[96:].mean()), rel=1e-6)
    assert row["curves"]["position"] == [40, 80, 120, 160]
    assert row["curves"]["ppl"][1] == pytest.approx(math.exp(nll[40:80].mean()), rel=1e-6)
    # Memory: 2 layers x 2 kv heads x 8 dims x (4 + 64) slots x 4 bytes, keys and values.
    mem = row["memory"]
    closed = 2 * 2 * 2 * 8 * 68 * 4
    assert mem["closed_form_bytes"] == closed == mem["kv_bytes"]
    assert mem["meta_bytes"] == 2 * 68 * 4  # int32 slot positions per layer
    assert mem["state_bytes"] == closed + 2 * 68 * 4
    assert mem["max_len"] == TOKENS and mem["read_bytes_per_step"] is None and mem["peak_device_bytes"] is None
    assert mem["prompt_phase_bytes"] is None  # sink has no prompt phase
    assert row["max_visible"] == 4 + 64  # measured from the masks: sinks + window, in chunks of 32
    assert row["versions"]["jax"] and row["device"]["platform"] == "cpu"
    assert row["config"]["chunk"] == 32 and "results" not in row["config"]


def test_chunked_perplexity_equals_token_by_token(sink_run, text_file):
    res, _, _ = sink_run
    (row,) = R.read(res)
    model, tok = zoo.load_model(row["config"]["model"])
    ids = tok.encode(text_file.read_text())[: TOKENS + 1]
    one_by_one = evrun.RecordingContext(model=model, tokenizer=tok, policies=C.build_policy(row["config"]["policy"]),
                                        task={}).engine(TOKENS).score(np.asarray(ids), chunk=1)
    np.testing.assert_allclose(R.load_array(row, "nll"), one_by_one, atol=2e-5)


def test_mesh_option_shards_every_engine_and_keeps_the_run_key(sink_run, tmp_path, monkeypatch):
    """mesh=[1,1] (this process has one device; tests/models/test_sharding.py runs 8): each engine the task
    builds is sharded, the numbers are the unsharded run's, and the resume key ignores the mesh
    (a layout, not a result)."""
    from models.engine import Engine

    meshes = []
    shard = Engine.shard
    monkeypatch.setattr(Engine, "shard", lambda self, mesh: meshes.append(mesh) or shard(self, mesh))
    first, _, args = sink_run
    res = tmp_path / "mesh.jsonl"
    evrun.main([a for a in args if not a.startswith("results=")] + [f"results={res}", "mesh=[1,1]"])
    assert meshes == [[1, 1]]
    (row,), (unsharded,) = R.read(res), R.read(first)
    assert row["key"] == unsharded["key"] and row["config"]["mesh"] == [1, 1]
    np.testing.assert_allclose(R.load_array(row, "nll"), R.load_array(unsharded, "nll"), atol=1e-5, rtol=0)
    assert "chunk=32 seed=0 | mesh=1x1 | key " in evrun.job_header(row["config"], row["policy"], row["key"])


def test_resume_skips_done_config_and_force_redoes_it(sink_run):
    res, rows, args = sink_run
    before = res.read_bytes()
    again = evrun.main(args)
    assert again[0]["key"] == rows[0]["key"] and res.read_bytes() == before  # skipped: nothing appended
    forced = evrun.main(args + ["force=true"])
    lines = R.read(res)
    assert len(lines) == 2 and lines[0]["key"] == lines[1]["key"] == forced[0]["key"]
    assert res.read_bytes().startswith(before)  # the earlier row is untouched
    assert len(R.latest(lines)) == 1 and R.latest(lines)[0]["time"] == lines[1]["time"]


def test_sweep_runs_each_distinct_config_once(tmp_path, text_file):
    res = tmp_path / "res.jsonl"
    args = base_args(text_file, res, tmp_path) + ["tokens=64", "chunk=64"]
    rows = evrun.main(["-m", "policy=full,window", "window=16,32"] + args)
    assert len(rows) == 4
    lines = R.read(res)
    # full ignores `window`: both full jobs have one key, the second is skipped.
    assert [(r["policy"]["name"], r["policy"].get("window")) for r in lines] == [
        ("full", None), ("window", 16), ("window", 32)]
    assert [r["memory"]["closed_form_bytes"] for r in lines] == [2 * 2 * 2 * 8 * s * 4 for s in (64, 16, 32)]
    assert evrun.main(["-m", "policy=full,window", "window=16,32"] + args) and len(R.read(res)) == 3


def test_codec_after_rope_is_its_own_run_key_and_table_label(tmp_path, text_file):
    """codec=int8 and codec=int8_after_rope: two keys (the record has after_rope only when set, so
    rows recorded before the field keep theirs), the same stored bytes, each labelled by its name."""
    res = tmp_path / "res.jsonl"
    args = base_args(text_file, res, tmp_path) + ["tokens=64", "chunk=32", "policy=full"]
    rows = evrun.main(["-m", "codec=int8,int8_after_rope"] + args)
    assert len(rows) == 2 and len(R.read(res)) == 2
    plain, after = R.read(res)
    assert plain["policy"]["codec"] == {"name": "int8", "scale_dtype": "float32"}
    assert after["policy"]["codec"] == {"name": "int8", "scale_dtype": "float32", "after_rope": True}
    assert plain["key"] != after["key"] and plain["memory"]["state_bytes"] == after["memory"]["state_bytes"]
    assert plain["metrics"]["ppl"] != after["metrics"]["ppl"]
    md = table.markdown(R.latest(R.read(res)))
    assert "| int8 |" in md and "| int8_after_rope |" in md


def test_retrieval_task_row_has_grid_and_memory_of_its_longest_engine(tmp_path, text_file):
    res = tmp_path / "res.jsonl"
    args = [a for a in base_args(text_file, res, tmp_path) if not a.startswith("task.segment")]
    args += ["model.max_position=512", "task=passkey", "task.lengths=[320]",
                                                   "task.depths=[0.5]", "task.trials=1", "task.batch=1",
                                                   "policy=sink", "window=32"]
    (row,) = evrun.main(args)
    assert row["task"] == "passkey" and row["metrics"]["accuracy"] in (0.0, 1.0)
    assert [(g["length"], g["depth"]) for g in row["grid"]] == [(320, 0.5)]
    assert row["memory"]["max_len"] >= 320  # the prompt plus the generated answer
    assert row["memory"]["closed_form_bytes"] == row["memory"]["kv_bytes"] == 2 * 2 * 2 * 8 * 36 * 4
    paths = plots.plot_heatmaps(R.read(res), tmp_path / "fig")
    assert [p.name for p in paths] == ["heatmap_passkey.png", "heatmap_passkey.pdf"]


def test_interrupted_run_leaves_prior_rows_intact(sink_run, tmp_path, monkeypatch):
    res = tmp_path / "res.jsonl"
    res.write_bytes(sink_run[0].read_bytes())
    before = res.read_bytes()
    conf = C.validate(C.compose(sink_run[2][:-2] + ["policy=window", f"results={res}"]))

    def interrupted(ctx):
        ctx.engine(8)
        raise KeyboardInterrupt

    monkeypatch.setattr(evrun, "load_task", lambda name: interrupted)
    with pytest.raises(KeyboardInterrupt):
        evrun.run_config(conf)
    assert res.read_bytes() == before
    # A line cut short by a crash elsewhere is skipped, the complete rows are kept.
    with open(res, "ab") as f:
        f.write(b'{"key": "partial", "metr')
    with pytest.warns(UserWarning, match="not valid JSON"):
        assert [r["key"] for r in R.read(res)] == [r["key"] for r in R.read(sink_run[0])]


def test_concurrent_appends_never_interleave(tmp_path):
    res = tmp_path / "res.jsonl"
    payload = "x" * 20000

    def writer(w):
        for i in range(50):
            R.append(res, {"key": f"{w}-{i}", "pad": payload, "nan": float("nan")})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = R.read(res)
    assert len(rows) == 300 and {r["key"] for r in rows} == {f"{w}-{i}" for w in range(6) for i in range(50)}
    assert all(r["pad"] == payload and r["nan"] is None for r in rows)


def test_memory_columns_for_a_policy_that_reads_less_and_one_with_its_own_layout():
    import jax.numpy as jnp

    from kvpolicies import memory as km

    kw = dict(kv_heads=2, head_dim=32, max_len=256, dtype=jnp.float32)
    full = R.memory((kvpolicies.get("full"),) * 3, **kw)
    assert full["kv_bytes"] == full["closed_form_bytes"] == 2 * 3 * 2 * 32 * 256 * 4
    assert full["read_bytes_per_step"] is None and full["layers"] == 3
    if "quest" in kvpolicies.POLICIES:
        quest = kvpolicies.get("quest", page=16, top_k=2, window=16)
        m = R.memory((quest,) * 3, **kw)
        assert m["closed_form_bytes"] == full["closed_form_bytes"]
        read = km.bytes_read_per_step(quest, context=255, **kw).read.total
        assert m["read_bytes_per_step"] == 3 * read and 0 < read < m["state_bytes"] / 3
    if "kivi" in kvpolicies.POLICIES:
        m = R.memory((kvpolicies.get("kivi"),) * 3, **kw)
        assert m["closed_form_bytes"] is None and 0 < m["kv_bytes"] < full["kv_bytes"]  # 2-bit codes + a full-precision residual


# -- tables and plots -------------------------------------------------------------------------------------


def fake_rows():
    """Rows as the runner writes them, with made-up numbers: perplexity and passkey."""
    def row(key, task, name, params, metrics, state, closed=None, grid=(), curves=None):
        return {"key": key, "task": task, "policy": {"name": name, "codec": {"name": "none"}}, "params": params,
                "model": {"name": "smollm2", "max_position": 8192}, "config": {"data": {"name": "austen"}},
                "metrics": metrics, "memory": {"state_bytes": state, "closed_form_bytes": closed},
                "grid": list(grid), "curves": curves or {}}

    curve = lambda a: {"position": [4096, 8192, 12288], "ppl": [a, a + 1, a + 2]}  # noqa: E731
    grid = lambda acc: [{"length": n, "depth": d, "accuracy": acc} for n in (1024, 2048) for d in (0.0, 0.5, 1.0)]  # noqa: E731
    return [
        row("a", "perplexity", "full", "", {"ppl": 12.3456, "tokens": 12288}, 226_492_416, 226_492_416, curves=curve(12)),
        row("b", "perplexity", "sink", "n_sink=4 window=1024", {"ppl": 14.5, "tokens": 12288}, 18_972_000,
            18_923_520, curves=curve(14)),
        row("c", "perplexity", "window", "window=1024", {"ppl": 40.0, "tokens": 12288}, 18_956_000, 18_874_368,
            curves=curve(40)),
        row("d", "passkey", "sink", "n_sink=4 window=1024", {"accuracy": 0.25}, 18_972_000, grid=grid(0.25)),
        row("e", "passkey", "full", "", {"accuracy": 1.0}, 226_492_416, grid=grid(1.0)),
    ]


def test_markdown_latex_csv_tables():
    rows = fake_rows()
    md = table.markdown(rows)
    assert "**perplexity**" in md and "**passkey**" in md
    assert ("| model | data | policy | params | codec | budget | KV / full | perplexity | tokens | KV cache (MB, 10^6 B) "
            "| closed form (MB, 10^6 B) |") in md
    assert "| smollm2 | austen | sink | n_sink=4 window=1024 | none | - | - | 14.50 | 12288 | 18.97 | 18.92 |" in md
    assert "| smollm2 | austen | full |  | none | - | - | 12.35 | 12288 | 226.5 | 226.5 |" in md
    assert "| model | data | policy | params | codec | budget | KV / full | accuracy | KV cache (MB, 10^6 B) |" in md
    tex = table.latex(rows)
    assert tex.count("\\toprule") == 2 and tex.count("\\bottomrule") == 2 and tex.count("\\begin{table}") == 2
    assert "\\begin{tabular}{lllllrrrrrr}" in tex and "\\label{tab:perplexity}" in tex
    assert "smollm2 & austen & sink & n\\_sink=4 window=1024 & none & - & - & 14.50 & 12288 & 18.97 & 18.92 \\\\" in tex
    parsed = list(csv.DictReader(io.StringIO(table.csv_text(rows))))
    assert [r["key"] for r in parsed] == ["a", "b", "c", "d", "e"]
    assert float(parsed[0]["ppl"]) == 12.3456 and int(parsed[1]["state_bytes"]) == 18_972_000
    assert parsed[3]["ppl"] == "" and float(parsed[3]["accuracy"]) == 0.25


def test_table_cli_writes_files(sink_run, tmp_path, capsys):
    res, rows, _ = sink_run
    table.main([str(res), "--out", str(tmp_path / "t")])
    out = capsys.readouterr().out
    ppl = R.read(res)[-1]["metrics"]["ppl"]
    assert f"| tiny_random | tiny.txt | sink | n_sink=4 window=64 positions=cache | none | - | 0.425 | {table.fmt(ppl)} |" in out
    assert (tmp_path / "t.tex").read_text().startswith("% task: perplexity\n\\begin{table}[t]")
    (csv_row,) = list(csv.DictReader(io.StringIO((tmp_path / "t.csv").read_text())))
    assert float(csv_row["ppl"]) == pytest.approx(ppl) and int(csv_row["closed_form_bytes"]) == 2 * 2 * 2 * 8 * 68 * 4


def test_pareto_front():
    pts = [(10.0, 5.0), (1.0, 9.0), (5.0, 5.5), (20.0, 4.0), (6.0, 9.5)]
    assert plots.pareto_front(pts, lower=True) == [1, 2, 0, 3]
    assert plots.pareto_front([(1, 0.2), (2, 0.1), (3, 0.9)], lower=False) == [0, 2]


def test_plots_from_saved_results(sink_run, tmp_path):
    res = tmp_path / "all.jsonl"
    for r in fake_rows():
        R.append(res, r)
    paths = plots.plot_all(R.read([res, sink_run[0]]), tmp_path / "fig")
    names = sorted(p.name for p in paths)
    assert names == sorted(f"{s}.{e}" for s in ("perplexity_vs_position", "heatmap_passkey", "pareto_perplexity",
                                                 "pareto_passkey") for e in ("png", "pdf"))
    for p in paths:
        magic = b"\x89PNG\r\n\x1a\n" if p.suffix == ".png" else b"%PDF-"
        assert p.read_bytes().startswith(magic) and p.stat().st_size > 5000
    lengths, depths, acc = plots.accuracy_grid(fake_rows()[3])
    assert lengths == [1024, 2048] and depths == [0.0, 0.5, 1.0] and np.all(acc == 0.25)


# -- the real model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_sink_smoke(tmp_path):
    res = tmp_path / "res.jsonl"
    (row,) = evrun.main(["policy=sink", "window=60", "tokens=256", "chunk=128", "task.segment=128", f"results={res}",
                         "progress=false", f"hydra.run.dir={tmp_path}/h"])
    assert 2 < row["metrics"]["ppl"] < 60  # English prose, SmolLM2-135M
    assert row["memory"]["closed_form_bytes"] == row["memory"]["kv_bytes"] == 2 * 30 * 3 * 64 * 64 * 4
    assert json.loads(res.read_text())["key"] == row["key"]


def test_memory_reports_the_dense_prompt_phase_of_a_prompt_compressor():
    """snapkv holds a fresh prompt densely (max_len slots + obs_window attention rows per kv head)
    before compressing it; rows report those bytes next to the compressed state's."""
    from evals import results as R

    L, K, D, n, w = 2, 2, 8, 100, 4
    pol = kvpolicies.get("snapkv", budget=10, obs_window=w, max_new=6)
    mem = R.memory((pol,) * L, kv_heads=K, head_dim=D, max_len=n, dtype="float32")
    # per layer: keys + values, int32 positions (shared by kv heads), float32 rows [K, w, n], int32 row positions [w]
    dense = 2 * K * D * n * 4 + n * 4 + K * w * n * 4 + w * 4
    assert mem["prompt_phase_bytes"] == L * dense
    assert mem["state_bytes"] == L * (2 * K * D * 20 * 4 + K * 20 * 4 + K * 20 * 4)  # 20 slots, pos + mass per head


def test_heatmap_merges_one_policys_runs_at_several_lengths():
    """A 4K run and an 8K run of the same policy draw one panel with both columns; another
    policy keeps its own panel; a repeated cell takes the later run's value."""
    def row(policy, length, acc, params=""):
        return {"policy": {"name": policy, "codec": {"name": "none"}}, "params": params, "model": {"name": "qwen"},
                "grid": [{"length": length, "depth": d, "accuracy": acc, "trials": 1, "protocol": "query_aware"}
                         for d in (0.0, 0.5)]}

    rows = [row("full", 4096, 1.0), row("full", 8192, 0.5), row("snapkv", 4096, 0.0, "budget=64"),
            row("full", 8192, 0.0)]
    merged = plots.merged_runs(rows)
    assert [r["policy"]["name"] for r in merged] == ["full", "snapkv"]
    lengths, depths, acc = plots.accuracy_grid(merged[0])
    assert lengths == [4096, 8192] and depths == [0.0, 0.5]
    np.testing.assert_array_equal(acc, [[1.0, 0.0], [1.0, 0.0]])
    assert plots.accuracy_grid(merged[1])[0] == [4096]


def test_fit_stores_each_prompt_at_what_kvzap_kept_and_reports_it(tmp_path, text_file):
    """fit=1 (kvzap, rule=threshold): the same answers as the static pool, the row's `fitted`
    record (stored bytes per layer, the achieved ratio) below the static pool's bytes, its own
    run key (fit=0 keeps the key it had before `fit` existed); a policy that cannot fit: an
    error before anything runs."""
    res = tmp_path / "res.jsonl"
    args = [a for a in base_args(text_file, res, tmp_path) if not a.startswith("task.segment")]
    args += ["model.max_position=512", "task=passkey", "task.lengths=[320]", "task.depths=[0.5]", "task.trials=2",
             "task.batch=1", "policy=kvzap", "policy.rule=threshold", "policy.threshold=0.0", "policy.budget=320",
             "policy.window=16", "policy.max_new=16", "policy.surrogate=random"]
    evrun.main(args)
    evrun.main(args + ["fit=1"])
    static, fitted = R.read(res)
    assert fitted["key"] != static["key"] and "fitted" not in static
    np.testing.assert_array_equal(R.load_array(fitted, "outputs"), R.load_array(static, "outputs"))
    f = fitted["fitted"]
    assert f["prompts"] == 2 and 0 < f["achieved_ratio_min"] <= f["achieved_ratio_max"] < 1
    assert len(f["layer_bytes_mean"]) == 2 and abs(sum(f["layer_bytes_mean"]) - f["stored_bytes_mean"]) < 1e-6
    assert f["stored_bytes_max"] < static["memory"]["state_bytes"] == fitted["memory"]["state_bytes"]
    assert fitted["memory"]["fitted_bytes"] == f["stored_bytes_mean"]  # the table's `fitted` column and KV / full
    md = table.markdown([static, fitted])
    assert "fitted (MB, 10^6 B)" in md and f"{f['stored_bytes_mean'] / table.full_bytes(fitted):.3f}" in md
    with pytest.raises(C.ConfigError, match="fit=1: policy Sink"):
        C.validate(C.compose([a for a in args if not a.startswith("policy")] + ["policy=sink", "fit=1"]))
