"""Issue 38, item 6 (the evals side): nothing lost, nothing silent. An array belongs to its row
(content hash in its name, one arrays folder per results file); the resume key follows the contents
of a user's data file; a run with NaN metrics is recorded as failed and redone; every file the
results need is checked before compute (FIFOs refused, no hang); a write error names the path;
throughput excludes compilation."""

from __future__ import annotations

import errno
import math
import os

import numpy as np
import pytest

from evals import common
from evals import config as C
from evals import perplexity
from evals import results as R
from evals import run as evrun
from evals.common import TaskResult


def _conf(text_file, res, *extra):
    return C.validate(C.compose(["model=tiny_random", "data=path", f"data.path={text_file}", "tokens=32", "chunk=16",
                                 f"results={res}", "progress=false", "policy=full", *extra]))


def test_force_never_changes_an_earlier_rows_array_and_files_do_not_share(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = R.save_array(a, "k", "nll", np.arange(4, dtype=np.float32))
    before = (tmp_path / first).read_bytes()
    second = R.save_array(a, "k", "nll", np.arange(4, dtype=np.float32) * 2)  # a forced re-run, other numbers
    assert first != second and (tmp_path / first).read_bytes() == before
    assert R.save_array(a, "k", "nll", np.arange(4, dtype=np.float32)) == first  # same contents, same file
    other = R.save_array(b, "k", "nll", np.arange(4, dtype=np.float32))
    assert other.split("/")[0] == "b.jsonl.arrays" and first.split("/")[0] == "a.jsonl.arrays"


def test_resume_key_follows_the_data_files_contents(tmp_path, text_file):
    text = tmp_path / "t.txt"
    text.write_text(text_file.read_text())
    conf = _conf(text, tmp_path / "r.jsonl")
    pol, _ = C.resolve_policy(conf)
    key = evrun.run_key(conf, pol)
    assert evrun.run_key(conf, pol) == key  # stable
    text.write_text(text_file.read_text()[::-1])  # same size, other contents
    assert evrun.run_key(conf, pol) != key
    # built-in data and models keep their keys: no path, no digest
    conf = C.validate(C.compose(["model=tiny_random", "tokens=32", "results=/tmp/unused.jsonl"]))
    assert "digest" not in str(conf["data"])


def test_nan_metrics_are_a_failed_row_that_a_rerun_redoes(tmp_path, text_file, monkeypatch, capsys):
    res = tmp_path / "r.jsonl"
    conf = _conf(text_file, res)
    monkeypatch.setattr(evrun, "load_task", lambda name: lambda ctx: TaskResult(metrics={"ppl": math.nan, "tokens": 32}))
    row, ran = evrun.run_config(conf)
    assert ran and row["failed"] == "metric(s) ppl not finite"
    assert "error: run" in capsys.readouterr().out
    row2, ran2 = evrun.run_config(conf)  # not skipped: redone
    assert ran2 and len(R.read(res)) == 2
    assert evrun.failure({"ppl": None, "tokens": 3}) and evrun.failure({"ppl": 3.0, "tokens": 3}) is None


def test_every_results_file_is_checked_and_fifos_refused(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):  # raised at once, no wait for a reader
        R.check_writable(fifo)
    res = tmp_path / "r.jsonl"
    R.lock_path(res).mkdir()
    with pytest.raises(OSError, match=r"lock file .*r.jsonl.lock: is a folder"):
        R.check_writable(res)
    R.lock_path(res).rmdir()
    (tmp_path / "r.jsonl.locks").write_text("")
    with pytest.raises(OSError, match="key locks folder .* is not a folder"):
        R.check_writable(res)
    (tmp_path / "r.jsonl.locks").unlink()
    (tmp_path / "r.jsonl.arrays").write_text("")
    with pytest.raises(OSError, match="arrays folder .* is not a folder"):
        R.check_writable(res)
    (tmp_path / "r.jsonl.arrays").unlink()
    R.check_writable(res)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.jsonl"]  # nothing left behind


def test_fifo_results_is_a_config_error_before_compute(tmp_path, text_file):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(C.ConfigError, match="not a regular file"):
        _conf(text_file, fifo)


def test_a_full_disk_names_the_path(tmp_path, monkeypatch):
    res = tmp_path / "r.jsonl"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(R.os, "write", full)
    with pytest.raises(OSError, match=r"results file .*r.jsonl: the row could not be written \(No space left"):
        R.append(res, {"key": "k"})
    monkeypatch.setattr(R.np, "save", full)
    with pytest.raises(OSError, match=r"array .*r.jsonl.arrays/k.nll.*No space left"):
        R.save_array(res, "k", "nll", np.zeros(3))


def test_compile_time_is_the_union_of_its_spans_and_throughput_excludes_it():
    import jax.monitoring as mon

    with common.compile_time() as c:
        mon.record_event_time_span(common.COMPILE_EVENTS[0], 10.0, 14.0)  # a trace...
        mon.record_event_time_span(common.COMPILE_EVENTS[2], 11.0, 12.0)  # ...with a compile inside it
        mon.record_event_time_span(common.COMPILE_EVENTS[2], 20.0, 21.5)
        mon.record_event_time_span("/jax/other", 0.0, 100.0)  # not a compile phase
    mon.record_event_time_span(common.COMPILE_EVENTS[2], 30.0, 40.0)  # after the block: not counted
    assert c.seconds == pytest.approx(5.5)
    t = perplexity.throughput(1000, 7.5, 5.5)
    assert t == {"tokens_per_s": pytest.approx(500.0), "compile_s": 5.5, "score_s": 7.5}


def test_a_perplexity_run_reports_its_compile_time_apart(tmp_path, text_file):
    row, _ = evrun.run_config(_conf(text_file, tmp_path / "r.jsonl"))
    m = row["metrics"]
    assert 0 < m["compile_s"] < m["score_s"]  # a fresh process compiles its score steps
    assert m["tokens_per_s"] == pytest.approx(32 / (m["score_s"] - m["compile_s"]))
    assert row["arrays"]["nll"].startswith("r.jsonl.arrays/") and "failed" not in row


def test_a_field_added_later_keeps_the_keys_of_rows_keyed_before_it():
    """`PromptScored.rotated` (metadata later=True) is left out of a policy's record at its default, so
    a snapkv row keyed before the field existed keeps its key (docs/results/compare_perplexity_1024.csv's
    snapkv rows: test_docs re-plans that comparison); set, it is recorded and the key changes."""
    import dataclasses

    import kvpolicies

    pol = kvpolicies.get("snapkv", budget=30, max_new=64)
    rec = R.policy_record(pol)
    assert "rotated" not in rec and rec["spare"] is False and rec["slots"] == 0  # older engine fields stay recorded
    turned = R.policy_record(dataclasses.replace(pol.shape_class(96), rotated=True))
    assert turned["rotated"] is True
