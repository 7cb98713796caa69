"""`python -m evals.peer` on a tiny random Llama (SmolLM2's tokenizer): the table's numbers recomputed
independently from the saved per-sample lines (Wilson from its formula, Jaccard from Python sets,
agreement counted by hand), resuming, refusing another configuration's files, the command line's
errors, and the worker's shared prefill against kvpress's own pipeline (one prefill per press)."""

from __future__ import annotations

import base64
import csv
import json
import math
import os
import pathlib
import sys

import numpy as np
import pytest

from evals import peer
from evals.compiles import CompileLog

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
needs_kvpress = [pytest.mark.ref, pytest.mark.kvpress, pytest.mark.skipif(
    not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")]

ARGS = ["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress,ObservedAttentionPress]", "ratios=[0.5]",
        "gen=4", "progress=false"]
STEM = "peer_tiny_ruler_niah_single_320"


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _positions(b64: str, heads: int, n: int) -> list[set[int]]:
    """The kept positions of each head from a packed [heads, n] bit mask (bit by bit, MSB first)."""
    raw = base64.b64decode(b64)
    bits = [(byte >> (7 - j)) & 1 for byte in raw for j in range(8)]
    return [{t for t in range(n) if bits[h * n + t]} for h in range(heads)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peer")
    rows = peer.main(ARGS + [f"out={out}", "compile_cache=none"])  # no process-wide JAX cache in the tests
    return out, rows


class TestTable:
    pytestmark = needs_kvpress

    def test_rows_and_the_full_sanity_row(self, tiny_run):
        out, rows = tiny_run
        assert [(r["press"], r["ratio"]) for r in rows] == [("full", 0.0), ("SnapKVPress", 0.5),
                                                           ("ObservedAttentionPress", 0.5)]
        assert rows[0]["same_text"] == 1 and rows[0]["jaccard_min"] == 1
        for f in (".md", ".csv", ".jsonl", ".kvpress.jsonl", ".ours.jsonl"):
            assert (out / f"{STEM}{f}").is_file()
        assert (out / f"{STEM}.md").read_text().startswith("`python -m evals.peer model=tiny")

    def test_numbers_recomputed_from_the_saved_lines(self, tiny_run):
        out, _ = tiny_run
        recs = _lines(out / f"{STEM}.jsonl")
        kv = {(x["sample"].split("/")[1], x["press"], x["ratio"]): x for x in _lines(out / f"{STEM}.kvpress.jsonl")}
        ours = {(x["sample"].split("/")[1], x["press"], x["ratio"]): x for x in _lines(out / f"{STEM}.ours.jsonl")}
        assert len(kv) == len(ours) == len(recs) == 6
        with open(out / f"{STEM}.csv", newline="") as f:
            table = {(r["press"], float(r["ratio"])): r for r in csv.DictReader(f)}
        z = 1.959963984540054
        for (press, ratio), row in table.items():
            cell = [x for x in recs if x["press"] == press and x["ratio"] == ratio]
            assert int(row["samples"]) == len(cell) == 2
            for side in ("kvpress", "ours"):
                s = sum(x[side]["score"] for x in cell)
                n = len(cell)
                p = s / n
                centre = (p + z * z / (2 * n)) / (1 + z * z / n)
                half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
                assert float(row[f"{side}_accuracy"]) == pytest.approx(p)
                assert float(row[f"{side}_ci_low"]) == pytest.approx(max(0.0, centre - half), abs=1e-12)
                assert float(row[f"{side}_ci_high"]) == pytest.approx(min(1.0, centre + half), abs=1e-12)
            same = 0
            js = []
            for x in cell:
                a, b = kv[(str(x["sample"]), press, ratio)], ours[(str(x["sample"]), press, ratio)]
                assert x["kvpress"]["ids"] == a["answer"] and x["ours"]["ids"] == b["answer"]
                same += x["kvpress"]["text"] == x["ours"]["text"]
                n = a["n"]
                for la, lb in zip(a["kept"], b["kept"], strict=True):
                    for sa, sb in zip(_positions(la, 2, n), _positions(lb, 2, n), strict=True):
                        assert sa and sb
                        js.append(len(sa & sb) / len(sa | sb))
                        if press == "full":
                            assert sa == sb == set(range(n))
                        else:  # kvpress's n_kept per head
                            assert len(sa) == len(sb) == int(n * (1 - ratio))
            assert float(row["same_text"]) == same / len(cell)
            assert len(js) == 2 * 3 * 2  # samples x layers x kv heads
            assert float(row["jaccard_mean"]) == pytest.approx(sum(js) / len(js))
            assert float(row["jaccard_min"]) == pytest.approx(min(js))

    def test_each_line_has_its_seconds_and_our_phases(self, tiny_run):
        out, rows = tiny_run
        ours = _lines(out / f"{STEM}.ours.jsonl")
        kv = _lines(out / f"{STEM}.kvpress.jsonl")
        for x in ours + kv:
            assert set(x["phases"]) >= {"compress", "kept", "question", "decode"}
        for lines in (ours, kv):  # every sample's prefill is some item's
            assert {x["sample"] for x in lines if "prefill" in x["phases"]} == {x["sample"] for x in lines}
        for x in ours:  # phases add up to the item's wall time; compilation is counted inside them
            ph = x["phases"]
            assert sum(ph.get(k, 0) for k in ("prefill", "compress", "kept", "question", "decode")) == \
                pytest.approx(x["seconds"], abs=0.05)
            assert ph["programs"] >= 0 and ph["compile"] >= 0
        assert sum(x["phases"]["programs"] for x in ours) > 0  # the first sample compiled
        for r in rows:
            for side, lines in (("ours", ours), ("kvpress", kv)):
                secs = [x["seconds"] for x in lines if x["press"] == r["press"] and x["ratio"] == r["ratio"]]
                assert r[f"{side}_seconds"] == pytest.approx(sum(secs) / len(secs), abs=0.006)
        assert "s/item kvpress | s/item ours" in (out / f"{STEM}.md").read_text()

    def test_rerun_resumes(self, tiny_run, capsys):
        out, rows = tiny_run
        side = out / f"{STEM}.ours.jsonl"
        lines = side.read_text().splitlines(keepends=True)
        side.write_text("".join(lines[:-1]) + lines[-1][:20])  # the last item lost, a partial line left
        again = peer.main(ARGS + [f"out={out}"])
        said = capsys.readouterr().out
        assert "to run: kvpress 0, ours 1 of 6" in said
        timeless = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rs]  # noqa: E731
        assert timeless(again) == timeless(rows)  # the re-run item's own seconds differ
        assert len([x for x in side.read_text().splitlines() if x.startswith("{") and x.endswith("}")]) == 6
        peer.main(ARGS + [f"out={out}"])
        assert "to run: kvpress 0, ours 0 of 6" in capsys.readouterr().out

    def test_the_progress_counts_the_plans_items_only(self, tiny_run):
        """A run of other ratios over the same files counts its own items: the full rows only here."""
        out, _ = tiny_run
        other = peer.prepare(peer.parse([a for a in ARGS if not a.startswith("ratios=")] + ["ratios=[0.25]",
                                                                                          f"out={out}"]))
        assert len(peer.saved(other, "kvpress")) == 6 and peer._count(other, "kvpress") == 2
        assert peer._count(other, "ours") == 2 and len(peer.pending(other, "ours")) == 4

    def test_table_only_computes_nothing(self, tiny_run, capsys):
        out, rows = tiny_run
        (out / f"{STEM}.md").unlink()
        before = (out / f"{STEM}.ours.jsonl").read_text()
        assert peer.main(ARGS + [f"out={out}", "table_only=true", "samples=3"])[1]["samples"] == 2
        assert "to run" not in capsys.readouterr().out
        assert (out / f"{STEM}.md").is_file() and (out / f"{STEM}.ours.jsonl").read_text() == before
        assert "| SnapKVPress | 0.5 | 2 |" in (out / f"{STEM}.md").read_text()

    def test_another_configuration_is_refused(self, tiny_run, capsys):
        out, _ = tiny_run
        with pytest.raises(SystemExit) as e:
            peer.main(ARGS + [f"out={out}", "seed=1"])
        assert e.value.code == 2
        assert "holds another configuration" in capsys.readouterr().err
        assert len(_lines(out / f"{STEM}.ours.jsonl")) == 6  # nothing removed

    def test_shared_prefill_equals_the_pipeline(self, tiny_run, tmp_path, kvpress_ref):
        """The worker's default (one prefill per sample, each press's hook on its own cache copy)
        keeps the same positions and gives the same ids as one prefill per press under press(model)."""
        out, _ = tiny_run
        job = json.loads((out / f"{STEM}.kvpress-job.json").read_text())
        job |= {"prefill": "per_press", "save_to": str(tmp_path / "ckpt")}
        kvpress_ref.job(job, tmp_path, out="out.jsonl")  # evals/kvpress_worker.py job.json out.jsonl
        key = lambda x: (x["sample"], x["press"], x["ratio"])  # noqa: E731
        pipeline = {key(x): x for x in _lines(tmp_path / "out.jsonl")}
        shared = {key(x): x for x in _lines(out / f"{STEM}.kvpress.jsonl")}
        assert pipeline.keys() == shared.keys() and len(pipeline) == 6
        for k, x in pipeline.items():
            assert x["kept"] == shared[k]["kept"] and x["answer"] == shared[k]["answer"], k


    def test_our_side_shares_duo_prefills_and_kvzip_passes(self, tiny_run, tmp_path, monkeypatch):
        """Our side, a sample with DuoAttentionPress and KVzipPress at two ratios and the full row:
        two prefills (Duo's ratios share one dense prompt, full adopts one) and one kvzip
        reconstruction pass; every line is what a fresh engine of that press and ratio gives
        (prompt, compress, kept positions, continue_generate)."""
        import collections

        import numpy as np

        from kvpolicies.compat import kvpress
        from models.engine import Engine

        out, _ = tiny_run
        p = peer.prepare(peer.parse([a for a in ARGS if not a.startswith(("presses=", "ratios=", "samples="))] + [
            "samples=1", "presses=[KVzipPress,DuoAttentionPress]", "ratios=[0.25,0.5]", f"out={tmp_path}"]))
        peer.tiny_dir(p).symlink_to(out / peer.tiny_dir(p).name)  # the checkpoint the worker wrote
        model, _ = peer.load_ours(p)
        calls = collections.Counter()
        for name in ("prompt", "_reconstruct"):
            def counted(self, *a, _orig=getattr(Engine, name), _name=name, **k):
                calls[_name] += 1
                return _orig(self, *a, **k)
            monkeypatch.setattr(Engine, name, counted)
        peer.run_ours(p, model, peer.pending(p, "ours"))
        assert calls == {"prompt": 1, "_reconstruct": 1}, calls
        monkeypatch.undo()
        lines = _lines(tmp_path / f"{STEM}.ours.jsonl")
        assert sorted((x["press"], x["ratio"]) for x in lines) == [
            ("DuoAttentionPress", 0.25), ("DuoAttentionPress", 0.5), ("KVzipPress", 0.25), ("KVzipPress", 0.5),
            ("full", 0.0)]
        ctx, q = p.contexts[0], p.questions[0]
        max_new = len(q) + p.gen
        for x in lines:
            press = "SnapKVPress" if x["press"] == "full" else x["press"]
            pol = kvpress(press, x["ratio"], n_layers=model.cfg.n_layers, max_new=max_new,
                          **peer.press_fields("tiny", press))
            eng = Engine(model, pol, max_len=len(ctx) + max_new)
            st = eng.prompt(ctx[None])
            st = eng.compress(st) if x["press"] != "full" else st
            want = []
            for layer in (eng.kept_positions(st) if x["press"] != "full" else [[np.arange(len(ctx))] * 2] * 3):
                m = np.zeros((2, len(ctx)), bool)
                for h, pos in enumerate(layer):
                    m[h, np.asarray(pos)] = True
                want.append(peer.pack(m))
            assert x["kept"] == want, (x["press"], x["ratio"])
            if x["press"] != "full":
                assert x["answer"] == eng.continue_generate(st, q[None], p.gen).tolist()[0], (x["press"], x["ratio"])

    def test_kvzip_ratios_share_one_pass_as_the_pipeline_would(self, tiny_run, tmp_path, kvpress_ref):
        """KVzipPress at three ratios from one prefill and reconstruction pass per sample (the
        worker's default, `run_kvzip`): the same kept positions and ids as kvpress's pipeline, a
        prefill and a pass per ratio; the ratios keep fewer and fewer tokens."""
        out, _ = tiny_run
        job = json.loads((out / f"{STEM}.kvpress-job.json").read_text())
        job["samples"] = job["samples"][:1]
        job["samples"][0]["presses"] = [["KVzipPress", r, {}] for r in (0.25, 0.5, 0.75)]
        # one question token: with the tiny heads (dim 16), kvpress's masking of AdaKV-style pruned
        # slots finds no key that all of a long question's queries ignore (its attention_patch raises)
        job["samples"][0]["question"] = job["samples"][0]["question"][-1:]
        got = {}
        for how in ("shared", "per_press"):
            (tmp_path / f"{how}.json").write_text(json.dumps(job | {"prefill": how, "save_to": str(tmp_path / how)}))
            kvpress_ref.run([tmp_path / f"{how}.json", tmp_path / f"{how}.jsonl"])  # evals/kvpress_worker.py
            got[how] = {x["ratio"]: x for x in _lines(tmp_path / f"{how}.jsonl")}
        assert sorted(got["shared"]) == sorted(got["per_press"]) == [0.25, 0.5, 0.75]
        for r, x in got["per_press"].items():
            assert "error" not in x, x
            assert x["kept"] == got["shared"][r]["kept"] and x["answer"] == got["shared"][r]["answer"], r
        n, heads = job["samples"][0]["context"], 2
        kept = [sum(len(h) for layer in x["kept"] for h in _positions(layer, heads, len(n)))
                for _, x in sorted(got["shared"].items())]
        assert kept[0] > kept[1] > kept[2], kept


@pytest.mark.parametrize(("args", "says"), [
    (["presses=[SnapKV]"], "did you mean 'SnapKVPress'"),
    (["presses=[KVzip]"], "did you mean 'KVzipPress'"),
    (["task=ruler_nih_single"], "did you mean 'ruler_niah_single'"),
    (["task=passkey"], "must be a RULER task"),
    (["model=llama"], "must be one of"),
    (["ratios=[1.0]"], "compression ratio is in (0, 1)"),
    (["ratios=[half]"], "not a number"),
    (["samples=0"], "samples=0: expected an integer >= 1"),
    (["prefill=once"], "prefill=once"),
    (["budget=0.5"], "budget: unknown key"),
    (["--fast"], "expected key=value"),
])
def test_command_line_errors(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        peer.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("evals.peer: error:") and says in err, err


def test_kvpress_missing_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(peer, "REF", tmp_path / "nothing")
    with pytest.raises(SystemExit) as e:
        peer.main(["samples=1"])
    assert e.value.code == 2 and "bash scripts/setup.sh test" in capsys.readouterr().err


def test_help(capsys):
    assert peer.main(["--help"]) == []
    assert "python -m evals.peer" in capsys.readouterr().out


def test_kvzip_and_duo_reach_both_sides_alike(tmp_path):
    """The worker's job and our side get the same Duo head pattern (numpy's default_rng(0) values,
    [layers][kv heads], rounded to 3 digits: the parity tests' SmolLM2 pattern), KVzip the
    tokenizer of the ids (a tiny model's: SmolLM2's GGUF), and the worker runs KVzipPress through
    kvpress's pipeline (its compression is its context manager's exit), the others as before."""
    import numpy as np

    p = peer.parse(["model=tiny", "tokens=320", "samples=1", "presses=[KVzipPress,DuoAttentionPress,SnapKVPress]",
                    "ratios=[0.5]", f"out={tmp_path}"])
    p = peer.prepare(p)
    job = peer.worker_job(p, peer.pending(p, "kvpress"))
    fields = {c: f for c, _, f in job["samples"][0]["presses"]}
    want = np.random.default_rng(0).random((3, 2)).round(3).tolist()
    assert fields["DuoAttentionPress"] == {"head_scores": want, "sink_size": 16, "recent_size": 64}
    assert fields["DuoAttentionPress"] == peer.press_fields("tiny", "DuoAttentionPress")
    assert fields["KVzipPress"] == fields["SnapKVPress"] == fields["full"] == {}
    assert job["tokenizer_from"]["gguf_file"].endswith(".gguf")
    assert len(peer.duo_pattern("smollm2")) == 30 and len(peer.duo_pattern("smollm2")[0]) == 3
    # the worker's routing rule, read in this process: kvpress itself (imported by the worker at its
    # top, used only inside its functions) replaced by an empty module
    import importlib.util
    import types

    saved = sys.modules.get("kvpress")
    sys.modules["kvpress"] = types.ModuleType("kvpress")
    try:
        spec = importlib.util.spec_from_file_location("kvpress_worker_rule", ROOT / "evals" / "kvpress_worker.py")
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
    finally:
        if saved is None:
            del sys.modules["kvpress"]
        else:
            sys.modules["kvpress"] = saved
    assert [worker.group_of(c) for c in ("KVzipPress", "ObservedAttentionPress", "SnapKVPress")] == [
        ("sdpa", "kvzip"), ("eager", "shared"), ("sdpa", "shared")]
    assert worker.group_of("SnapKVPress", shared=False) == ("sdpa", "pipeline")
    assert worker.group_of("KVzipPress", shared=False) == ("sdpa", "pipeline")


@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_peer_speed_times_each_side_alone(tmp_path):
    from benchmarks import peer_speed

    res = peer_speed.main(["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress]", "ratios=[0.5,0.75]",
                           "gen=4", f"out={tmp_path}", "name=speed"])
    assert set(res["sides"]) == {"ours", "kvpress"} and res["same_ids"] == "6/6"
    for side, got in res["sides"].items():
        lines = res["lines"][side]
        assert got["items"] == len(lines) == 6 and len(got["samples"]) == 2
        assert got["total"] == pytest.approx(sum(x["seconds"] for x in lines), abs=0.02)
        assert got["steady"] == got["samples"][1] and got["first"] == got["samples"][0]
        assert set(got["phases"]) >= {"prefill", "compress", "kept", "question", "decode"}
    md = (tmp_path / "speed.md").read_text()
    assert "| whole grid (s) |" in md and "| programs compiled |" in md
    assert json.loads((tmp_path / "speed.json").read_text())["items_per_sample"] == 3


def test_pieces_cover_the_context_in_recurring_shapes():
    """Chunks of `chunk`, then decreasing powers of two: every length is fed exactly once, and the
    shapes come from a set of log2(chunk) + 1 whatever the length."""
    assert peer.pieces(1994, 512) == [512, 512, 512, 256, 128, 64, 8, 2]
    shapes = set()
    for n in range(1, 2000, 7):
        got = peer.pieces(n, 512)
        assert sum(got) == n and got == sorted(got, reverse=True)
        shapes |= set(got)
    assert shapes <= {512} | {2 ** i for i in range(9)}


def test_a_low_map_count_is_said_before_the_run(tmp_path, monkeypatch):
    """XLA maps memory per compiled step: a limit below MAP_COUNT_MIN gets a note naming the
    sysctl that raises it; a high or unreadable one, none."""
    limit = tmp_path / "max_map_count"
    monkeypatch.setattr(peer, "MAP_COUNT", limit)
    limit.write_text("65530\n")
    assert "vm.max_map_count is 65530" in peer.map_count_note() and "sysctl -w" in peer.map_count_note()
    limit.write_text(str(peer.MAP_COUNT_MIN))
    assert peer.map_count_note() == ""
    limit.unlink()
    assert peer.map_count_note() == ""


def test_compile_cache_defaults_under_out_and_is_set_once(tmp_path):
    """compile_cache: `<out>/.jax-cache` by default, `none` turns it off; `use_compile_cache` sets
    JAX's persistent cache directory only where none is set already."""
    from types import SimpleNamespace

    p = peer.parse(ARGS + [f"out={tmp_path}"])
    assert p.compile_cache == tmp_path / ".jax-cache"
    assert peer.parse(ARGS + ["compile_cache=none"]).compile_cache is None
    assert peer.parse(ARGS + [f"compile_cache={tmp_path / 'c'}"]).compile_cache == tmp_path / "c"
    calls = []
    config = SimpleNamespace(jax_compilation_cache_dir=None, update=lambda k, v: calls.append((k, v)))
    peer.use_compile_cache(p, config)
    assert calls == [("jax_compilation_cache_dir", str(tmp_path / ".jax-cache"))]
    config.jax_compilation_cache_dir = "/elsewhere"  # JAX_COMPILATION_CACHE_DIR set: left alone
    peer.use_compile_cache(p, config)
    assert len(calls) == 1


def test_the_worker_gets_half_of_the_cores_threads(tmp_path, monkeypatch):
    """The kvpress worker runs beside our side: OMP_NUM_THREADS = half of the cores (at least 1),
    unless the environment sets it; glibc's allocator as the caller had it (not our re-execution's)."""
    p = peer.prepare(peer.parse(ARGS + [f"out={tmp_path}"]))
    started = []
    monkeypatch.setattr(peer.subprocess, "Popen", lambda cmd, env, **kw: started.append(env) or None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, want in ((2, "1"), (16, "8"), (1, "1"), (None, "1")):
        monkeypatch.setattr(peer.os, "cpu_count", lambda: cores)
        peer.start_worker(p, [(0, "full", 0.0)])
        assert started[-1]["OMP_NUM_THREADS"] == want, cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    peer.start_worker(p, [(0, "full", 0.0)])
    assert started[-1]["OMP_NUM_THREADS"] == "3"
    from evals import compiles  # our process re-executed with glibc's tunables: the worker runs as the caller's

    monkeypatch.setenv("GLIBC_TUNABLES", compiles.MALLOC_TUNABLES)
    monkeypatch.setenv(compiles._BEFORE, "")
    peer.start_worker(p, [(0, "full", 0.0)])
    assert "GLIBC_TUNABLES" not in started[-1] and compiles._BEFORE not in started[-1]


@pytest.mark.parametrize("omp", [None, "1"])
def test_the_worker_takes_every_core_when_our_side_is_done(tmp_path, monkeypatch, omp):
    """The worker's job names a file (`every_core_when`) that the run writes once our side's last
    item is done, while the worker still runs (it then gives torch every core), and removes after;
    with OMP_NUM_THREADS set, no file is named."""
    import dataclasses

    from evals import zoo

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    p = peer.prepare(peer.parse(ARGS + [f"out={tmp_path}"]))
    p = dataclasses.replace(p, model="smollm2")  # a tiny model's worker runs before our side, alone
    flag = p.path(".ours-done")
    job = peer.worker_job(dataclasses.replace(p, model="tiny"), peer.pending(p, "kvpress"))
    assert job["every_core_when"] == (str(flag) if omp is None else None)
    seen = []

    class Worker:
        returncode = 0

        def poll(self):  # what the worker would find between its items
            seen.append(("ours done" in seen, flag.exists()))
            return 0

    flag.touch()  # a killed run's: removed before the worker starts
    monkeypatch.setattr(peer, "start_worker", lambda plan, todo: seen.append(flag.exists()) or Worker())
    monkeypatch.setattr(peer, "load_ours", lambda plan: (None, None))
    monkeypatch.setattr(peer, "run_ours", lambda plan, model, todo, tick: seen.append("ours done"))
    monkeypatch.setattr(peer, "write", lambda plan, tok: [{"compared": 0, "same_text": 1.0}])
    monkeypatch.setattr(zoo, "load_tokenizer", lambda cfg: None)
    peer.run(p)
    assert seen[:2] == [False, "ours done"] and seen[2:] and all(x == (True, True) for x in seen[2:]), seen
    assert not flag.exists()


@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_the_worker_takes_every_core_once_the_file_exists(tmp_path, kvpress_ref):
    """The worker's check between items (in kvpress's environment): torch keeps its one thread while
    the file is absent, and has os.cpu_count() once it exists."""
    flag = tmp_path / "done"
    code = ("import os, sys, torch; sys.path.insert(0, 'evals'); import kvpress_worker as w; "
            f"torch.set_num_threads(1); w.every_core_once({str(flag)!r}); a = torch.get_num_threads(); "
            f"open({str(flag)!r}, 'w').close(); w.every_core_once({str(flag)!r}); w.every_core_once(None); "
            "print(a, torch.get_num_threads(), os.cpu_count())")
    out = kvpress_ref.run([], script=code, timeout=300).split()  # python -c code, OMP_NUM_THREADS=1
    assert out[0] == "1" and out[1] == out[2], out


def test_query_aware_splits_after_the_question(tmp_path):
    """query_aware=true (kvpress's --query_aware): the same prompt ids, split where the chat
    template's tail begins: the context ends with the question's text, and the part after the
    compression is the tail (end of turn, assistant header) and the answer prefix only; the
    files and the config hash are another run's."""
    from evals import zoo

    args = ["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress]", "ratios=[0.5]", f"out={tmp_path}"]
    plain = peer.prepare(peer.parse(args))
    aware = peer.prepare(peer.parse(args + ["query_aware=true"]))
    tok = zoo.load_tokenizer(peer.model_config("tiny"))
    assert aware.stem == plain.stem + "_query_aware" and aware.config != plain.config
    for i in range(2):
        whole = np.concatenate([plain.contexts[i], plain.questions[i]])
        assert np.array_equal(whole, np.concatenate([aware.contexts[i], aware.questions[i]]))
        assert len(aware.contexts[i]) > len(plain.contexts[i])
        question = tok.decode(aware.contexts[i][len(plain.contexts[i]):].tolist())
        assert question.strip().startswith("What is the special magic") and question.rstrip().endswith("?")
        after = tok.decode(aware.questions[i].tolist())
        assert after.startswith("<|im_end|>\n<|im_start|>assistant\n") and after.endswith("mentioned in the provided text is")


def test_ties_names_its_files_and_refuses_what_is_not_a_prompt_scorer(tmp_path):
    """ties=torch_cpu (torch.topk's choice among exact ties, `kvpolicies.ties`): another stem and config hash,
    the policy our side builds carries it (ChunkKV's and EntropyGatedChunkKV's own top-k calls too); a press
    that is no prompt scorer, a catalogue row, a wrapper whose own choice breaks ties its way (CriticalKV) or an
    unknown rule is refused before anything runs."""
    from kvpolicies.compat import kvpress

    args = ["model=tiny", "tokens=320", "samples=1", "presses=[LagKVPress,ChunkKVPress:SnapKVPress]", "ratios=[0.5]",
            f"out={tmp_path}"]
    plain = peer.prepare(peer.parse(args))
    tied = peer.prepare(peer.parse(args + ["ties=torch_cpu"]))
    assert tied.stem == plain.stem + "_ties_torch_cpu" and tied.config != plain.config and tied.ties == "torch_cpu"
    assert kvpress("LagKVPress", 0.5, ties=tied.ties).ties == "torch_cpu"
    peer.parse(ARGS + ["presses=[EntropyGatedChunkKVPress:SnapKVPress]", "ties=torch_cpu"])
    for bad, says in (("presses=[KVzipPress]", "prompt scorer"), ("presses=[FinchPress]", "not FinchPress"),
                      ("presses=[DuoAttentionPress]", "not DuoAttentionPress"),
                      ("presses=[CriticalKVPress:SnapKVPress]", "breaks the ties of its prompt compression its own way")):
        with pytest.raises(peer.ConfigError, match=says):
            peer.parse(ARGS + [bad, "ties=torch_cpu"])
    with pytest.raises(peer.ConfigError, match="must be one of"):
        peer.parse(ARGS + ["ties=oldest"])


def test_kvpress_false_runs_ours_alone_and_hf_needs_a_folder(tmp_path):
    """kvpress=false: only our side is pending and tabled; model=hf wants model_path= (and only it)."""
    p = peer.parse(ARGS + [f"out={tmp_path}", "kvpress=false"])
    assert p.sides == ("ours",) and peer.parse(ARGS).sides == peer.SIDES
    for bad, says in ((["model=hf"], "needs model_path="), (["model_path=/x"], "is for model=hf"),
                      (["model=hf", "model_path=/x", "presses=[DuoAttentionPress]"], "DuoAttentionPress needs a head"),
                      (["dtype=float16"], "dtype=float16")):
        with pytest.raises(peer.ConfigError, match=says):
            peer.parse([a for a in ARGS if not a.startswith(("model=", "presses="))] + bad)
    hf = peer.parse(["model=hf", f"model_path={tmp_path}", "dtype=bfloat16", "samples=1"])
    assert hf.mconf == {"name": "hf", "path": str(tmp_path), "dtype": "bfloat16"}
    assert peer.parse(["samples=1"]).mconf == {"name": "smollm2", "dtype": "float32"}  # the peer tables' hash: unchanged


def test_a_wrapper_over_an_inner_press_by_name(tmp_path):
    """"Wrapper:Inner" rows (kvpress's leaderboard chunkkv = ChunkKVPress over SnapKVPress): our side
    builds kvpress("ChunkKVPress", r, press="SnapKVPress"), the worker's job carries the same name and
    inner press (kvpress_worker.make_press splits it)."""
    from kvpolicies.compat import kvpress

    p = peer.prepare(peer.parse(["model=tiny", "tokens=320", "samples=1", "presses=[ChunkKVPress:SnapKVPress]",
                                 "ratios=[0.5]", f"out={tmp_path}"]))
    assert peer.press_name("ChunkKVPress:SnapKVPress") == "ChunkKVPress"
    assert peer.press_fields("tiny", "ChunkKVPress:SnapKVPress") == {"press": "SnapKVPress"}
    job = peer.worker_job(p, peer.pending(p, "kvpress"))
    assert ["ChunkKVPress:SnapKVPress", 0.5, {"press": "SnapKVPress"}] in job["samples"][0]["presses"]
    assert kvpress(peer.press_name("ChunkKVPress:SnapKVPress"), 0.5, press="SnapKVPress") is not None


def test_answer_shared_answers_through_one_canonical_engine_as_press_mode(tmp_path, monkeypatch):
    """answer=shared (evals.shared_answers): each prompt scorer's ratios answer as one batch through
    one canonical form's engine (the full cache through its own form's). The lines keep the same kept
    positions and answer ids as answer=press, and the same batches; answer=pooled (the default) one batch
    per form and sample: on this grid the same ids."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    args = ["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress,TOVAPress]", "ratios=[0.5]", "gen=3",
            "kvpress=false", "progress=false"]
    with pytest.raises(peer.ConfigError, match="answer=both"):
        peer.parse(args + ["answer=both"])
    got, feeds = {}, {}
    model = None
    real_feed = Engine.feed

    def feed(self, state, tokens, chunk=None, fork=True):  # the question's pieces, per mode
        feeds.setdefault(mode, set()).add((np.shape(tokens)[1], None if chunk is None else tuple(chunk)))
        return real_feed(self, state, tokens, chunk, fork)

    monkeypatch.setattr(Engine, "feed", feed)
    for mode in ("press", "shared", "pooled"):
        p = peer.prepare(peer.parse(args + [f"answer={mode}", f"out={tmp_path / mode}"]))
        assert p.answer == mode and peer.parse(args).answer == "pooled"  # the default
        if model is None:  # a random Llama of the tokenizer's vocabulary (no checkpoint needed)
            model = Llama(LlamaConfig(vocab_size=49152, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                      d_ff=48))
        (tmp_path / mode).mkdir()
        peer.run_ours(p, model, peer.pending(p, "ours"))
        got[mode] = {(x["sample"], x["press"], x["ratio"]): x for x in _lines(tmp_path / mode / f"{STEM}.ours.jsonl")}
    assert got["press"].keys() == got["shared"].keys() == got["pooled"].keys() and len(got["press"]) == 6
    for k, x in got["press"].items():  # 2 samples x 3 rows
        y, z = got["shared"][k], got["pooled"][k]
        assert y["answer"] == x["answer"] and y["kept"] == x["kept"], k
        # pooled: another batch shape, so not the same floats; on this grid the same ids
        assert z["answer"] == x["answer"] and z["kept"] == x["kept"], k
        assert y.get("answer_mode") == "shared" and "answer_mode" not in x, k  # the full cache's form too
        assert y["phases"]["batch"] == x["phases"]["batch"] == 1, k
        # the two presses' rows of a sample answer as one batch; the full cache's row (its form: max_len
        # slots per head) as another
        assert z.get("answer_mode") == "pooled" and z["phases"]["batch"] == (1 if k[1] == "full" else 2), k
    # a press's own steps take the question in power-of-two pieces; a canonical form in one step, as kvpress
    n = {len(q) for q in p.questions}
    assert feeds["press"] == {(t, tuple(peer.question_pieces(t))) for t in n} and len(peer.question_pieces(min(n))) > 1
    assert feeds["shared"] == feeds["pooled"] == {(t, None) for t in n}


def test_answer_pooled_splits_a_sample_into_batches_of_at_most_pool_rows(tmp_path, monkeypatch):
    """answer=pooled holds a sample's compressed states until POOL_ROWS rows of one canonical form are
    ready (or the sample ends), so the batches are at most POOL_ROWS rows, in press order."""
    from models.config import LlamaConfig
    from models.llama import Llama

    monkeypatch.setattr(peer, "POOL_ROWS", 2)
    p = peer.prepare(peer.parse(["model=tiny", "tokens=320", "samples=1", "presses=[SnapKVPress,TOVAPress,KnormPress]",
                                 "ratios=[0.5]", "gen=2", "kvpress=false", "progress=false", "answer=pooled",
                                 f"out={tmp_path}"]))
    model = Llama(LlamaConfig(vocab_size=49152, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48))
    peer.run_ours(p, model, peer.pending(p, "ours"))
    lines = _lines(tmp_path / f"{STEM}.ours.jsonl")
    assert {x["press"]: x["phases"]["batch"] for x in lines} == {"SnapKVPress": 2, "TOVAPress": 2, "KnormPress": 1,
                                                                 "full": 1} and len(lines) == 4


# -- the rest of compat's catalogue (issue 58): evals.peer.CATALOGUE ---------------------------------------------


def test_catalogue_rows_reach_both_sides_alike(tmp_path, monkeypatch):
    """Every CATALOGUE row: the worker's job carries `catalogue_args`' JSON fields, our side builds the press
    from the same fields (`kvpolicies.compat.kvpress`), ratio-less presses run one row at ratio 0, ComposedPress's
    two ratios compose to the row's, PerLayerCompressionPress's per-layer ratios average to it; model=tiny's
    arrays are drawn once (the same bytes on a second call); a missing hub file and ThinKPress past its ratio
    are errors before anything runs."""
    from kvpolicies.compat import PRESSES, kvpress

    covered = {peer.press_name(c) for c in peer.PEER_PRESSES + peer.EXTRA_PRESSES}
    assert set(PRESSES) - covered <= {"CAMPress"}, set(PRESSES) - covered  # CaM's draw is torch.bernoulli's
    p = peer.prepare(peer.parse(["model=tiny", "tokens=320", "samples=1", "ratios=[0.25,0.4]", f"out={tmp_path}",
                                 "presses=[" + ",".join(peer.CATALOGUE) + "]"]))
    cells = [(c, r) for c, r in p.cells if c != "full"]
    assert [c for c, r in cells if r == 0] == list(peer.RATIOLESS) and len(cells) == 3 + 2 * (len(peer.CATALOGUE) - 3)
    job = peer.worker_job(p, peer.pending(p, "kvpress"))
    sent = {(c, r): f for c, r, f in job["samples"][0]["presses"]}
    for c, r in cells:
        name, kr, ours, theirs = peer.catalogue_args(p, c, r)
        assert sent[(c, r)] == theirs and json.loads(json.dumps(theirs)) == theirs, c
        assert kvpress(name, kr, n_layers=3, max_new=64, **ours) is not None, c
        if c == "ComposedPress":
            (_, a), (_, b) = theirs["presses"]
            assert 1 - (1 - a) * (1 - b) == pytest.approx(r, abs=1e-12)
        if c.startswith("PerLayerCompressionPress"):
            ratios = theirs["compression_ratios"]
            assert len(ratios) == 3 and len(set(ratios)) == 3 and sum(ratios) / 3 == pytest.approx(r, abs=1e-12)
        if c.startswith("PrefillDecodingPress"):
            assert theirs["decoding_press"][2]["target_size"] == int(len(p.contexts[0]) * (1 - r)) // 2
    files = peer.tiny_arrays(p)
    before = {k: f.read_bytes() for k, f in files.items()}
    for f in files.values():
        f.unlink()
    assert {k: f.read_bytes() for k, f in peer.tiny_arrays(p).items()} == before  # seeded: the same arrays
    with np.load(files["expected_stats"]) as z:  # [L, N, D], [L, N, D, D] positive semi-definite
        assert z["mu"].shape == (3, 4, 16) and np.linalg.eigvalsh(z["cov"].astype(np.float64)).min() > -1e-5
    with pytest.raises(peer.ConfigError, match="below 0.5, got 0.5"):
        peer.prepare(peer.parse(["model=tiny", "tokens=320", "samples=1", "ratios=[0.5]", "presses=[ThinKPress]",
                                 f"out={tmp_path}"]))
    import evals.data

    monkeypatch.setattr(evals.data, "data_dir", lambda: tmp_path / "nothing")
    q = peer.parse(["model=tiny", "tokens=320", "samples=1", "presses=[QFilterPress]", f"out={tmp_path}"])
    q.model = "smollm2"  # the check alone: the file it names is missing
    with pytest.raises(peer.ConfigError, match="python -m evals.qfilter model=smollm2"):
        peer.check_catalogue(q)


def _catalogue_run(tiny_run, tmp_path, presses: str):
    """evals.peer beside kvpress on the module run's tiny checkpoint and full rows (copied: sample 0's full row is
    not run again) for `presses` at ratio 0.25: (table rows, kvpress's lines, our lines, context length, args)."""
    import shutil

    out, _ = tiny_run
    for f in out.iterdir():
        if f.name.endswith((".jsonl", ".model")) and not f.name.endswith(f"{STEM}.jsonl"):
            (shutil.copytree if f.is_dir() else shutil.copy)(f, tmp_path / f.name)
    args = [a for a in ARGS if not a.startswith(("presses=", "ratios=", "samples="))] + [
        f"presses=[{presses}]", "ratios=[0.25]", "samples=1", f"out={tmp_path}", "compile_cache=none"]
    rows = {(r["press"], r["ratio"]): r for r in peer.main(args)}
    sample = peer.prepare(peer.parse(args)).sample_id(0)
    kv, ours = ({x["press"]: x for x in _lines(tmp_path / f"{STEM}.{side}.jsonl") if x["sample"] == sample}
                for side in ("kvpress", "ours"))
    return rows, kv, ours, ours["full"]["n"], args


def test_a_row_sets_its_press_fields_on_both_sides(tiny_run, tmp_path):
    """"Press+field=value" rows (`peer.variant`): the fields reach our policy and kvpress's press alike, on a
    wrapper's inner press (ChunkKV over SnapKV with a 16-token window) and on a catalogue row (FastKVzipPress
    layerwise, its gates file beside): the same kept sets per (layer, kv head) on both sides; a malformed or
    unknown field is refused before anything runs."""
    from kvpolicies.compat import kvpress

    chunk, fast = "ChunkKVPress:SnapKVPress+window_size=16", "FastKVzipPress+layerwise=true"
    assert peer.variant(chunk) == ("ChunkKVPress:SnapKVPress", {"window_size": 16})
    assert peer.variant("KVComposePress+structured=false+agg_task=max") == ("KVComposePress",
                                                                            {"structured": False, "agg_task": "max"})
    assert peer.press_name(chunk) == "ChunkKVPress" and peer.base_row(fast) == "FastKVzipPress"
    assert peer.press_fields("tiny", chunk) == {"press": "SnapKVPress", "window_size": 16}
    assert kvpress(peer.press_name(chunk), 0.25, **peer.press_fields("tiny", chunk)).press.obs_window == 16
    rows, kv, ours, n, args = _catalogue_run(tiny_run, tmp_path, f"{chunk},{fast}")
    p = peer.prepare(peer.parse(args))
    theirs = peer.catalogue_args(p, fast, 0.25)[3]
    assert theirs["layerwise"] is True and "gates" in theirs
    ids = p.contexts[0]
    for press in (chunk, fast):
        for layer, (a, b) in enumerate(zip(kv[press]["kept"], ours[press]["kept"], strict=True)):
            sa, sb = _positions(a, 2, n), _positions(b, 2, n)
            if layer == 0 and press == fast:  # gates of each token's embedding alone: repeated ids tie (the
                sa, sb = ([sorted(ids[sorted(h)]) for h in x] for x in (sa, sb))  # catalogue test's rule)
            assert sa == sb, (press, layer)
    assert rows[(chunk, 0.25)]["same_ids"] == 1.0
    for bad, says in (("presses=[KnormPress+window_size=3]", "unknown field"),
                      ("presses=[KnormPress+window_size]", r"\+field=value"),
                      ("presses=[NopePress+a=1]", "not a kvpress press")):
        with pytest.raises(peer.ConfigError, match=says):
            peer.prepare(peer.parse([a for a in args if not a.startswith("presses=")] + [bad]))


# the worker's greedy answer with and without eos_stop on the tiny model, whose generation config is given two
# "end-of-sequence" ids: the first id it answers (never a stop, as in kvpress's pipeline) and its 6th
EOS_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
from transformers import DynamicCache

job = json.load(open(sys.argv[1]))
model = w.load(w.build_tiny(job["tiny"], job["save_to"]), "sdpa", None)
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])

def answer():
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
        return w.greedy(model, cache, question, ctx.shape[1], 12)

full = answer()
w.EOS_STOP[0] = True
model.generation_config.eos_token_id = [full[0], full[5]]
json.dump({"full": full, "stopped": answer()}, open(sys.argv[2], "w"))
"""


@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_eos_stop_ends_kvpress_answers_as_its_pipeline_and_compares_up_to_there(tmp_path, kvpress_ref):
    """eos_stop=true: the worker's answer ends after the first id past the first that is one of the generation
    config's eos ids (kvpress's `generate_answer`), the ids before it unchanged; `same_ids` compares ours up to
    there; the plan sends it to the worker and leaves the configuration (and so the saved lines) alone."""
    rng = np.random.default_rng(0)
    job = {"tiny": {"kind": "llama", "seed": 0, "config": {**peer.TINY, "vocab_size": 64, "max_position_embeddings": 128}},
           "save_to": str(tmp_path / "ckpt"), "context": rng.integers(0, 64, 40).tolist(),
           "question": rng.integers(0, 64, 6).tolist()}
    out = kvpress_ref.job(job, tmp_path, script=EOS_SCRIPT)
    full, stopped = out["full"], out["stopped"]
    end = next(i for i in range(1, 12) if full[i] in (full[0], full[5]))
    assert len(full) == 12 and stopped == full[:end + 1] and len(stopped) <= 6
    assert peer.same_ids(stopped, full) and peer.same_ids(full, full) and not peer.same_ids(full[:-1] + [-1], full)
    assert not peer.same_ids(stopped[:-1] + [-1], full)
    args = ["model=tiny", "tokens=320", "samples=1", "presses=[SnapKVPress]", "ratios=[0.5]", f"out={tmp_path}"]
    plain, stop = (peer.prepare(peer.parse(args + extra)) for extra in ([], ["eos_stop=true"]))
    assert stop.eos_stop and not plain.eos_stop and stop.config == plain.config and stop.stem == plain.stem
    assert peer.worker_job(stop, [(0, "SnapKVPress", 0.5)])["eos_stop"] is True


# the CATALOGUE rows whose presses have kept tables: our side runs each press's ratios and layers as one shape class
SHAPED = ("QFilterPress", "ExpectedAttentionStatsPress", "KVzapPress", "FinchPress", "MergingPress:KeyDiffPress",
          "ChunkPress:KeyDiffPress", "BlockPress:KeyDiffPress", "ComposedPress", "PerLayerCompressionPress:KeyDiffPress",
          "LUKVPress")


def test_catalogue_shape_classes_keep_and_answer_as_the_exact_presses(tmp_path):
    """`catalogue_slots`: the CATALOGUE presses with kept tables get one shape class for all their ratios and
    layers (and only they; a plan's presses outside CATALOGUE are not its: a query-aware leaderboard run has
    both, and their fields are not `catalogue_args`'); on a
    model of the tiny run's shapes, a shape class keeps exactly the positions of the exact press (per layer and
    kv head) and decodes the same ids, for QFilterPress (a filter per layer), PerLayerCompressionPress (a
    ratio per layer: 3 policies, one shape-class policy) and LUKVPress (a count per layer and kv head: one
    shape-class policy); its second ratio compiles no program."""
    from kvpolicies.compat import kvpress
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    p = peer.prepare(peer.parse(["model=tiny", "tokens=320", "samples=1", "ratios=[0.25,0.4]", f"out={tmp_path}",
                                 "presses=[" + ",".join(peer.CATALOGUE + ("ChunkKVPress:SnapKVPress",)) + "]"]))
    t = peer.TINY
    cfg = LlamaConfig(vocab_size=97, d_model=t["hidden_size"], n_layers=t["num_hidden_layers"], n_heads=t["num_attention_heads"],
                      n_kv_heads=t["num_key_value_heads"], head_dim=t["hidden_size"] // t["num_attention_heads"],
                      d_ff=t["intermediate_size"])
    model = Llama(cfg)
    rng = np.random.default_rng(0)
    ctx, q = rng.integers(0, 97, (1, 120)).astype(np.int32), rng.integers(0, 97, (1, 9)).astype(np.int32)
    max_len, max_new = 120 + 9 + 6, 9 + 6
    slots = peer.catalogue_slots(p, model, max_len, max_new)
    assert {c for c, s in slots.items() if s} == set(SHAPED)
    for press in ("QFilterPress", "PerLayerCompressionPress:KeyDiffPress", "LUKVPress"):
        shaped = []
        for r in p.ratios:
            name, kr, fields, _ = peer.catalogue_args(p, press, r)
            pol = kvpress(name, kr, n_layers=cfg.n_layers, max_new=max_new, **fields)
            shaped.append(Engine(model, pol, max_len=max_len, slots=slots[press], share_steps=True))
            with CompileLog() as log:
                st = shaped[-1].compress(shaped[-1].prompt(ctx))
                got = shaped[-1].kept_positions(st), shaped[-1].continue_generate(st, q, 6)
            if r == p.ratios[0]:
                assert len(set(shaped[0].policies)) == (cfg.n_layers if press == "QFilterPress" else 1), press
                exact = Engine(model, pol, max_len=max_len)
                st = exact.compress(exact.prompt(ctx))
                want = exact.kept_positions(st), exact.continue_generate(st, q, 6)
                for la, lb in zip(want[0], got[0], strict=True):
                    for a, b in zip(la, lb, strict=True):
                        np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(want[1], got[1])
            else:
                assert log.programs == 0, press


def test_catalogue_items_of_a_sample_share_their_prefill(tmp_path, monkeypatch):
    """`run_catalogue` through `shared_prefill`: a sample's items whose engines share the prompt phase (a press's
    ratios, and presses whose phases are the same: ChunkPress and BlockPress over KeyDiffPress, and LUKVPress over
    ExpectedAttentionPress, whose prompt phase also sums the first queries) prefill once; every line (answer, kept positions per layer and kv head, bytes) is the line of the
    item prefilled alone."""
    from models.config import LlamaConfig
    from models.llama import Llama

    t = peer.TINY
    model = Llama(LlamaConfig(vocab_size=49152, d_model=t["hidden_size"], n_layers=t["num_hidden_layers"],
                              n_heads=t["num_attention_heads"], n_kv_heads=t["num_key_value_heads"],
                              head_dim=t["hidden_size"] // t["num_attention_heads"], d_ff=t["intermediate_size"]))
    args = ["model=tiny", "tokens=320", "samples=1", "presses=[ChunkPress:KeyDiffPress,BlockPress:KeyDiffPress,LUKVPress]",
            "ratios=[0.25,0.5]", "gen=3", "kvpress=false", "progress=false", "compile_cache=none"]

    def run(sub: str) -> list[dict]:
        p = peer.prepare(peer.parse(args + [f"out={tmp_path / sub}"]))
        p.out.mkdir(parents=True)
        peer.run_catalogue(p, model, [x for x in peer.pending(p, "ours") if x[1] in peer.CATALOGUE])
        return _lines(tmp_path / sub / f"{STEM}.ours.jsonl")

    shared = run("shared")
    monkeypatch.setattr(peer, "shared_prefill", lambda eng, states, ctx, chunk, ph, keep=4:
                        ph("prefill", peer.prompt_in_pieces(eng, ctx, chunk)))
    alone = run("alone")
    assert len(shared) == len(alone) == 6 and all("error" not in x for x in shared + alone)
    assert [x["press"] for x in shared if "prefill" in x["phases"]] == ["ChunkPress:KeyDiffPress"]
    assert sum("prefill" in x["phases"] for x in alone) == 6
    fields = ("press", "ratio", "answer", "kept", "bytes")
    assert [{k: x[k] for k in fields} for x in shared] == [{k: x[k] for k in fields} for x in alone]


@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_catalogue_channel_and_decoding_presses_beside_kvpress(tiny_run, tmp_path):
    """A channel press and a decoding press beside kvpress on the tiny model, their numbers recomputed from the
    saved lines: ThinKPress (ratio 0.25: key_channel_compression_ratio 0.5) keeps every token on both sides and
    the same 8 of 16 key channels per (layer, kv head); PrefillDecodingPress (SnapKVPress, then KeyDiffPress at
    the 4th step back to half) keeps the same positions after the prefill and after the last id fed; both give
    the same ids."""
    think, dec = "ThinKPress", "PrefillDecodingPress:SnapKVPress"
    rows, kv, ours, n, _ = _catalogue_run(tiny_run, tmp_path, f"{think},{dec}")
    for press in (think, dec):
        assert kv[press]["answer"] == ours[press]["answer"] and len(ours[press]["answer"]) == 4, press
        assert rows[(press, 0.25)]["same_ids"] == 1.0 and rows[(press, 0.25)]["jaccard_min"] == 1.0, press
    for a, b in zip(kv[think]["channels"], ours[think]["channels"], strict=True):  # [K, D] per layer
        ca, cb = _positions(a, 2, 16), _positions(b, 2, 16)
        assert ca == cb and all(len(h) == 8 for h in ca)
    for x in (kv[think], ours[think]):
        assert all(h == set(range(n)) for layer in x["kept"] for h in _positions(layer, 2, n))
    for key in ("kept_prefill", "kept"):
        for a, b in zip(kv[dec][key], ours[dec][key], strict=True):
            sa, sb = _positions(a, 2, n), _positions(b, 2, n)
            assert sa == sb, key
            if key == "kept_prefill":  # SnapKVPress's n_kept of the context
                assert all(len(h) == int(n * 0.75) for h in sa)
            else:  # at the 4th step (the question, then 3 ids) back to half of it, question tokens included
                assert all(len(h) <= int(n * 0.75) // 2 for h in sa)
    assert "1.0000 (1.0000) channels" in (tmp_path / f"{STEM}.md").read_text()


# kvpress's masking of evicted slots at the tiny model's head dim 16 raises on its questions ("Could not find fake
# keys"), after the compression: these presses' rows compare the kept sets made before the error
RAISE_ON_TINY = ("FastKVzipPress", "PerLayerCompressionPress:KeyDiffPress", "LUKVPress", "DMSPress")


@pytest.mark.slow
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
@pytest.mark.skipif(os.environ.get("KVP_KVPRESS_FULL") != "1", reason="minutes (17 presses): KVP_KVPRESS_FULL=1")
def test_every_catalogue_press_beside_kvpress(tiny_run, tmp_path):
    """Every CATALOGUE row at ratio 0.25 (ratio-less rows at 0) beside kvpress on the tiny model: the same ids and
    kept sets (Jaccard 1.0 per (layer, kv head), recomputed here from the lines; in layer 0 the surrogate and
    gate presses keep the same token ids: their scores read each token's embedding alone, so repeated ids tie
    exactly and torch.topk breaks the tie its way, ours the newer), ComposedPress's kvpress n_kept of what each of
    its presses is handed; the presses kvpress raises on after compressing keep the same sets before the error
    (PerLayerCompressionPress: int(n (1 - r_layer)) per head)."""
    rows, kv, ours, n, args = _catalogue_run(tiny_run, tmp_path, ",".join(peer.CATALOGUE))
    ids = peer.prepare(peer.parse(args)).contexts[0]
    assert {"full", *peer.CATALOGUE} <= set(ours) and {"full", *peer.CATALOGUE} <= set(kv)
    for press in peer.CATALOGUE:
        a, b = kv[press], ours[press]
        assert "error" not in b, (press, b.get("error"))
        assert ("error" in a) == (press in RAISE_ON_TINY), (press, a.get("error"))
        if "error" not in a:
            assert a["answer"] == b["answer"], press
        what = "channels" if press == "ThinKPress" else "kept"
        size = 16 if what == "channels" else n
        for layer, (x, y) in enumerate(zip(a[what], b[what], strict=True)):
            sx, sy = _positions(x, 2, size), _positions(y, 2, size)
            if layer == 0 and press in ("FastKVzipPress", "KVzapPress", "DMSPress"):  # scores of the embedding alone:
                sx, sy = ([sorted(ids[sorted(h)]) for h in s] for s in (sx, sy))  # repeated ids tie, the same ids kept
            assert sx == sy, (press, layer)
    each = 1 - float(np.sqrt(0.75))
    assert all(len(h) == int(int(n * (1 - each)) * (1 - each)) for layer in ours["ComposedPress"]["kept"]
               for h in _positions(layer, 2, n))
    per = "PerLayerCompressionPress:KeyDiffPress"
    ratios = peer.catalogue_args(peer.prepare(peer.parse(args)), per, 0.25)[3]["compression_ratios"]
    for layer, x in enumerate(kv[per]["kept"]):
        assert all(len(h) == int(n * (1 - ratios[layer])) for h in _positions(x, 2, n)), layer
    assert all(rows[(c, 0.0 if c in peer.RATIOLESS else 0.25)]["compared"] == (c not in RAISE_ON_TINY)
               for c in peer.CATALOGUE)


@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_key_rerotation_beside_kvpress(tiny_run, tmp_path):
    """KeyRerotationPress re-rotates kvpress's kept keys, so the worker's key matching cannot find them: it records
    the indices `rerotate_keys` receives and asks the question at the compressed length, as kvpress's pipeline
    does. Beside ours on the tiny model: no error, the same kept positions per (layer, kv head) and the same ids."""
    press = "KeyRerotationPress:ExpectedAttentionPress"
    rows, kv, ours, n, _ = _catalogue_run(tiny_run, tmp_path, press)
    a, b = kv[press], ours[press]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["answer"] == b["answer"]
    for layer, (x, y) in enumerate(zip(a["kept"], b["kept"], strict=True)):
        kept = _positions(x, 2, n)
        assert kept == _positions(y, 2, n) and 0 < len(kept[0]) < n, layer
    assert rows[(press, 0.25)]["compared"]


def test_eos_stop_ends_our_batches_once_every_row_has_ended_and_saves_each_answer_through_its_end(tmp_path, monkeypatch):
    """eos_stop=true on our side: a row has ended after its first end-of-sequence id past the first id
    (`answer_end`); a batch decodes until every row has ended (`until_answered`, read every UNTIL_EVERY
    steps), and each line keeps its answer through its own end, the ids of the full decode (the same kept
    sets and bytes). The tiny random model's answers all begin with the same six ids, so the test names one
    of them the end-of-sequence id (every row ends: the batches stop early) and then an id some rows never
    produce (they keep every id, and their batches decode all of them)."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.engine.layers import UNTIL_EVERY
    from models.llama import Llama

    assert peer.answer_end([7, 3, 7, 7], 7) == 3 and peer.answer_end([7, 3], 7) is None  # never the first id
    assert peer.answer_end([1, 2], None) is None
    assert peer.same_ids([1, 2, 3], [1, 2]) and not peer.same_ids([1, 2, 3], [1, 4]) and not peer.same_ids([1, 5], [1, 2, 3])
    args = ["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress,TOVAPress]", "ratios=[0.25,0.5]", "gen=20",
            "kvpress=false", "progress=false"]
    model = Llama(LlamaConfig(vocab_size=49152, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48))
    widths = []
    real = Engine.continue_generate

    def generate(self, state, tokens, n, chunk=None, until=None):
        ids = real(self, state, tokens, n, chunk, until)
        widths.append(ids.shape[1])
        return ids

    monkeypatch.setattr(Engine, "continue_generate", generate)

    def run(name: str, eos: int | None = None) -> dict:
        p = peer.prepare(peer.parse(args + [f"out={tmp_path / name}"] + (["eos_stop=true"] if eos is not None else [])))
        if eos is not None:
            p.eos_id = eos  # the tokenizer's, as prepare sets it, replaced by an id this model answers
        (tmp_path / name).mkdir()
        widths.clear()
        peer.run_ours(p, model, peer.pending(p, "ours"))
        return {(x["sample"], x["press"], x["ratio"]): x for x in _lines(tmp_path / name / f"{STEM}.ours.jsonl")}

    full = run("full")
    assert set(widths) == {20} and len(full) == 10
    first = [x["answer"][:6] for x in full.values()]
    assert all(a == first[0] for a in first)  # (the premise above)
    some = next(i for i in full[next(iter(full))]["answer"][6:] if any(i not in x["answer"][1:] for x in full.values()))
    for eos, stopped in ((first[0][4], True), (some, False)):
        got = run(f"eos_{eos}", eos)
        assert got.keys() == full.keys()
        for k, x in full.items():
            end = peer.answer_end(x["answer"], eos)
            assert got[k]["answer"] == x["answer"][:end], k
            assert got[k]["kept"] == x["kept"] and got[k]["bytes"] == x["bytes"], k
        if stopped:  # every batch ended at the first read of its ids
            assert set(widths) == {1 + UNTIL_EVERY} and all(len(x["answer"]) == 5 for x in got.values())
        else:
            assert 20 in widths and any(len(x["answer"]) == 20 for x in got.values())
            assert any(len(x["answer"]) < 20 for x in got.values())
