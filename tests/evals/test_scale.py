"""Issue 60: grids beyond one process. Shards of many writers merge into the results file with
nothing lost or duplicated (a half-written line never merged, a merge idempotent, a key's newest row
kept whatever the order the shards are read in); force=true in the sharded mode redoes a job into
its shard and the merge appends it as the key's newest row; a Ray local
cluster of 2 workers runs an evals.compare grid whose merged rows equal the in-process grid's
(metrics and arrays); a worker killed mid-grid (after a row, halfway through the next line, before
reporting) leaves the grid complete after Ray's retry, and a rerun sends nothing; Hydra's joblib launcher runs a
4-job evals.run sweep into one merged results file; the default executor never imports Ray.
Timings measured on the 2 shared cores: docs/guide/scale.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from evals import compare, ray_grid, shards
from evals import run as evrun
from evals import results as R

ROOT = Path(__file__).resolve().parents[2]


def grid_args(text_file, results):
    return ["model=tiny_random", "data=path", f"data.path={text_file}", "tokens=32", "chunk=16", f"results={results}",
            "progress=false", "policies=[window,sink]", "budgets=[0.5]", f"out={Path(results).parent / 'out'}"]


def by_key(rows):
    return {r["key"]: r for r in rows}


def numbers(metrics):
    """A row's metrics without its timings (seconds, throughput)."""
    return {k: v for k, v in metrics.items() if not k.endswith("_s")}


def assert_same_rows(a, b):
    """Equal metrics (timings aside), memory and arrays, row by row."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert numbers(a[k]["metrics"]) == numbers(b[k]["metrics"]) and len(numbers(a[k]["metrics"])) >= 3, k
        assert a[k]["memory"] == b[k]["memory"], k
        assert sorted(a[k]["arrays"]) == sorted(b[k]["arrays"]) == ["nll"]
        np.testing.assert_array_equal(R.load_array(a[k], "nll"), R.load_array(b[k], "nll"))


# -- shards, without Ray --------------------------------------------------------------------------


def _row(key, value, tmp, worker, failed=None, second=1):
    shard = shards.shard_path(tmp / "r.jsonl", worker)
    rel = R.save_array(shard, key, "nll", np.full(3, value, np.float32))
    R.append(shard, {"key": key, "time": f"2026-12-05T20:00:{second:02d}+00:00", "task": "perplexity",
                     "policy": "full", "metrics": {"ppl": value}, "arrays": {"nll": rel},
                     **({"failed": failed} if failed else {})})


def test_shards_merge_once_skip_half_lines_and_read_like_a_results_file(tmp_path):
    res = tmp_path / "r.jsonl"
    _row("a", 1.0, tmp_path, "w1")
    _row("b", 2.0, tmp_path, "w2")
    _row("c", float("nan"), tmp_path, "w2", failed="metric(s) ppl not finite")  # failed: merged, not done
    _row("a", 1.5, tmp_path, "w2", second=0)  # an older successful row of a done key: left out
    assert not R.lock_path(shards.shard_path(res, "w1")).exists()  # a shard takes no lock
    R.append(shards.shard_path(res, "w4"), {"key": "e"})  # a line holding only a key is not a finished run
    with open(shards.shard_path(res, "w3"), "wb") as f:  # a worker killed mid-row
        f.write(b'{"key": "d", "metrics": {"pp')
    with pytest.warns(UserWarning, match="w3.jsonl, line 1: not valid JSON"):
        assert shards.done_keys(res) == {"a", "b"}
    with pytest.warns(UserWarning, match="w3.jsonl, line 1: not valid JSON"):
        m = shards.merge(res)
    assert (m.added, m.present, m.duplicates, m.shards) == (4, 0, 1, 4)
    rows = R.read(res)
    assert [r["key"] for r in rows] == ["a", "b", "c", "e"] and rows[0]["metrics"]["ppl"] == 1.0
    np.testing.assert_array_equal(R.load_array(rows[1], "nll"), np.full(3, 2.0, np.float32))
    assert all(r["arrays"]["nll"].startswith("r.jsonl.arrays/") for r in rows[:3]) and not rows[3]["arrays"]
    before = res.read_bytes()
    with pytest.warns(UserWarning, match="not valid JSON"):
        again = shards.merge(res)
    assert (again.added, again.present) == (0, 4) and res.read_bytes() == before  # idempotent
    with pytest.warns(UserWarning, match="not valid JSON"):  # tables and figures read shards alike
        assert sorted(r["key"] for r in R.read(shards.shard_dir(res))) == ["a", "a", "b", "c", "e"]
    _row("a", 1.75, tmp_path, "w5", second=2)  # a newer row (force=true): appended after the old one
    with pytest.warns(UserWarning, match="not valid JSON"):
        m = shards.merge(res)
    assert (m.added, m.duplicates) == (1, 1)
    assert [r["metrics"]["ppl"] for r in R.read(res) if r["key"] == "a"] == [1.0, 1.75]  # readers take the last
    assert shards.find(res, "a")["metrics"]["ppl"] == 1.75  # (a worker's look-up: no warning)


def test_rows_of_one_key_at_the_same_second_merge_the_same_whatever_the_order(tmp_path):
    _row("k", 1.0, tmp_path, "w1")
    _row("k", 2.0, tmp_path, "w2")
    files = shards.shard_files(tmp_path / "r.jsonl")
    merged = []
    for order in (files, files[::-1]):
        res = tmp_path / f"{len(merged)}" / "r.jsonl"
        merged.append(shards.merge(res, order))
        merged[-1] = (merged[-1].added, merged[-1].duplicates, [r["metrics"] for r in R.read(res)])
    assert merged[0] == merged[1] and merged[0][:2] == (1, 1)
    assert merged[0][2] == [shards.newest(R.read(files[0]) + R.read(files[1]))["metrics"]]


def test_force_in_the_sharded_mode_redoes_the_job_and_the_merge_keeps_its_row(local_grid, tmp_path):
    p, local, _ = local_grid
    job = next(j for j in p.jobs if j.policy == "window")
    res = tmp_path / "r.jsonl"
    conf = {**job.conf, "results": str(res)}
    evrun.run_config(conf)  # the single-file mode (its steps compiled by the grid above)
    old = json.loads(res.read_text())  # the row, as if run long ago
    res.write_text(json.dumps(old | {"time": "2000-01-01T00:00:00+00:00"}) + "\n")
    assert shards.run_in_shard(conf, job.key, evrun.run_config)[1] is False  # done: skipped
    again, ran = shards.run_in_shard({**conf, "force": True}, job.key, evrun.run_config)
    assert ran and again["time"] > "2000-01-01T00:00:00+00:00"
    assert [r["key"] for r in R.read(shards.shard_path(res))] == [job.key]  # into this process's shard
    m = shards.merge(res)
    rows = R.read(res)
    assert (m.added, m.duplicates, len(rows)) == (1, 0, 2) and rows[-1]["time"] == again["time"]
    assert shards.find(res, job.key)["time"] == again["time"] and shards.merge(res).added == 0
    assert_same_rows({job.key: rows[-1]}, {job.key: local[job.key]})  # the same run, redone


# -- Ray ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory, text_file):
    """The in-process grid: (plan, rows by key, whether running it imported Ray: None if Ray was
    imported before)."""
    d = tmp_path_factory.mktemp("local")
    had_ray = "ray" in sys.modules
    compare.main(grid_args(text_file, d / "r.jsonl"))
    p = compare.plan(grid_args(text_file, d / "r.jsonl"))
    return p, by_key(R.read(d / "r.jsonl")), None if had_ray else "ray" in sys.modules


def test_the_default_executor_imports_no_ray(local_grid, text_file, tmp_path):
    imported = local_grid[2]
    if imported is None:
        pytest.skip("Ray was imported before this file's first grid")
    assert not imported
    assert compare.parse_args(grid_args(text_file, tmp_path / "r.jsonl") + ["executor=ray"]).ray.workers is None
    assert "ray" not in sys.modules  # its options are parsed without Ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # DyingWorker, defined here
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_a_ray_grid_of_two_workers_merges_to_the_in_process_rows(local_grid, ray_cluster, text_file, tmp_path):
    p, local, _ = local_grid
    res = tmp_path / "r.jsonl"
    compare.main(grid_args(text_file, res) + ["executor=ray", "ray.workers=2"])
    rows = R.read(res)
    assert len(rows) == len(p.jobs) == 3 and len(shards.shard_files(res)) == 2  # both workers ran jobs
    assert not [f for f in shards.shard_dir(res).iterdir() if ".lock" in f.name]  # no lock taken, none left
    assert_same_rows(by_key(rows), local)


class DyingWorker(ray_grid.Worker):
    """Dies once, the worst moment: after its job's row is written, halfway through writing a next row
    and before reporting (Ray restarts the actor and retries the job, which must find its row)."""

    def run(self, conf):
        out = super().run(conf)
        if _first(Path(conf["results"]).parent / "died"):
            with open(shards.shard_path(conf["results"]), "ab") as f:
                f.write(b'{"key": "' + b"0" * 16 + b'", "metrics": {"pp')
            os._exit(1)
        return out


def _first(marker: Path) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def test_a_worker_killed_mid_grid_leaves_it_complete_once(local_grid, ray_cluster, tmp_path):
    p, local, _ = local_grid
    res = tmp_path / "r.jsonl"
    confs = [j.conf for j in p.jobs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the half-written line, skipped
        sent = ray_grid.run(confs, res, ray_grid.RayOptions(workers=2), progress=False, worker=DyingWorker)
        rows = R.read(res)
        again = ray_grid.run(confs, res, ray_grid.RayOptions(workers=2), progress=False)  # the rerun
    assert (tmp_path / "died").exists()
    # the retried job found its row in the dead worker's shard: not run twice
    assert sorted(x["ran"] for x in sent) == [False, True, True]
    assert again == []  # the rerun sends nothing: every key is in a shard
    assert [r["key"] for r in rows] == [r["key"] for r in R.read(res)]  # and merges nothing new
    assert sorted(r["key"] for r in rows) == sorted(j.key for j in p.jobs)  # none lost, none twice
    assert_same_rows(by_key(rows), local)


# -- Hydra's joblib launcher ----------------------------------------------------------------------


def test_a_joblib_sweep_of_four_jobs_merges_into_one_results_file(tmp_path, text_file):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    res = tmp_path / "r.jsonl"
    argv = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "model=tiny_random", "data=path", f"data.path={text_file}", "tokens=32", "chunk=16", "policy=window",
            "window=8,16", "seed=0,1", f"results={res}", "progress=false"]
    # in a subprocess: the launcher configures logging in the calling process (pytest's capture breaks)
    proc = subprocess.run([sys.executable, "-m", "evals.run", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = R.read(res)
    assert len(rows) == 4 and len({r["key"] for r in rows}) == 4
    assert sorted((r["policy"]["window"], r["config"]["seed"]) for r in rows) == [(8, 0), (8, 1), (16, 0), (16, 1)]
    assert len(shards.shard_files(res)) == 2  # two joblib workers, a shard each
    assert "merged 2 shard(s) into" in proc.stdout + proc.stderr
    with pytest.raises(SystemExit):  # a launcher's job is one process: distributed= is refused
        evrun.main(argv + ["distributed=auto"])  # (before Hydra launches anything)


@pytest.mark.parametrize("extra, says", [(["executor=foo"], "choose from"), (["ray.workers=2"], "give executor=ray"),
                                         (["executor=ray", "ray.workers=0"], "must be an int >= 1"),
                                         (["executor=ray", "force=true"], "force=true")])
def test_bad_executor_keys_are_config_errors_before_any_job(extra, says, text_file, tmp_path):
    from evals.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        compare.plan(grid_args(text_file, tmp_path / "r.jsonl") + extra)


# -- distributed= (the 2-process run: tests/evals/test_distributed_run.py) ----------------------------


@pytest.mark.parametrize("value, says", [("bogus", "must be off | auto"), ("2/2@host0:1234", "0 <= I < N"),
                                         ("auto", "only `python -m evals.run` starts")])
def test_distributed_is_checked_before_anything_runs(value, says, text_file, tmp_path):
    from evals.config import ConfigError, compose, validate

    with pytest.raises(ConfigError, match=says):  # (evals.compare and evals.suite validate the same way)
        validate(compose(["model=tiny_random", "data=path", f"data.path={text_file}", f"distributed={value}"]))


def test_distributed_values_and_the_command_s_refusals(capsys):
    from evals.config import distributed_args

    assert distributed_args("off") is None and distributed_args("auto") == {}
    assert distributed_args("1/4@host0:1234") == {"coordinator_address": "host0:1234", "num_processes": 4,
                                                  "process_id": 1}
    for argv, says in ((["-m", "distributed=0/2@a:1,1/2@a:1"], "one value for the whole command"),
                       (["-m", "hydra/launcher=joblib", "distributed=auto"], "each job is one process"),
                       (["distributed=auto"], "distributed=auto: jax.distributed.initialize failed: ")):
        with pytest.raises(SystemExit):
            evrun.main(argv)
        assert says in capsys.readouterr().err
