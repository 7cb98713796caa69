"""`evals.peer executor=ray` (evals.peer_grid): our side's items on Ray actors, a press's items per
task, each actor's lines in its own shard of `.ours.jsonl`. The shards read like the merged file and
merge once (a half line skipped, another configuration's lines left); on a Ray local cluster of 2
workers, one killed mid-press, a rerun of the command completes the grid with every item once and
our side's lines (answer ids, kept-position masks, stored bytes) equal to the in-process run's."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest

from evals import peer, peer_grid, shards
from evals.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
ARGS = ["model=tiny", "tokens=320", "samples=2", "presses=[SnapKVPress]", "ratios=[0.5]", "gen=4", "progress=false",
        "compile_cache=none"]
STEM = "peer_tiny_ruler_niah_single_320"


def _plan(out: pathlib.Path) -> peer.Plan:
    """A plan of two made-up samples (no tokenizer): what saved() and merge() read."""
    return peer.Plan("tiny", {"name": "ruler_niah_single"}, 320, 2, [0.5], ["SnapKVPress"], 4, 0, 512, "shared", out,
                     "s", False, False, contexts=[np.arange(9), np.arange(7)], questions=[np.arange(3)] * 2,
                     config="cfg")


def _line(p, i, press, ratio, answer):
    return {"sample": p.sample_id(i), "press": press, "ratio": ratio, "n": 9, "answer": answer, "kept": []}


def _append(path: pathlib.Path, *objs, tail: bytes = b""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps(o).encode() + b"\n" for o in objs) + tail)


def test_shards_read_like_the_file_and_merge_once(tmp_path):
    p = _plan(tmp_path)
    ours = p.path(".ours.jsonl")
    _append(ours, _line(p, 0, "full", 0.0, [1]))
    _append(shards.shard_path(ours, "w1"), _line(p, 1, "full", 0.0, [2]), _line(p, 0, "SnapKVPress", 0.5, [3]),
            tail=b'{"sample": "cfg/1/x", "press": "Snap')  # an actor killed mid-line
    _append(shards.shard_path(ours, "w2"), _line(p, 0, "full", 0.0, [9]),  # an item the file holds: not merged
            _line(p, 1, "SnapKVPress", 0.5, [4]), {**_line(p, 1, "SnapKVPress", 0.75, [5]), "sample": "other/1/x"})
    have = peer.saved(p, "ours")
    assert sorted(have) == [(0, "SnapKVPress", 0.5), (0, "full", 0.0), (1, "SnapKVPress", 0.5), (1, "full", 0.0)]
    assert peer.pending(p, "ours") == []  # a rerun runs nothing
    assert peer_grid.merge(p) == 3
    merged = [json.loads(x) for x in ours.read_text().splitlines()]
    assert [(x["sample"].split("/")[1], x["press"], x["answer"]) for x in merged] == [
        ("0", "full", [1]), ("1", "full", [2]), ("0", "SnapKVPress", [3]), ("1", "SnapKVPress", [4])]
    before = ours.read_bytes()
    assert peer_grid.merge(p) == 0 and ours.read_bytes() == before  # idempotent
    assert {k: v["answer"] for k, v in peer.saved(p, "ours").items()} == {
        (0, "full", 0.0): [1], (1, "full", 0.0): [2], (0, "SnapKVPress", 0.5): [3], (1, "SnapKVPress", 0.5): [4]}


def test_executor_keys_parse_without_ray_and_refuse_alone():
    had = "ray" in sys.modules
    opts = peer_grid.options(["executor=ray", "ray.address=auto", "ray.workers=3", "samples=2"])
    assert (opts.address, opts.workers) == ("auto", 3)
    assert peer_grid.options(["samples=2"]) is None
    if not had:
        assert "ray" not in sys.modules
    with pytest.raises(ConfigError, match="give executor=ray"):
        peer_grid.options(["ray.workers=2"])
    with pytest.raises(ConfigError, match="must be an int >= 1"):
        peer.parse(["executor=ray", "ray.workers=0"])
    with pytest.raises(ConfigError, match="choose from"):
        peer.parse(["executor=dask"])
    groups = peer_grid.groups([(0, "full", 0.0), (0, "A", 0.5), (1, "A", 0.5), (0, "A", 0.75), (1, "full", 0.0)])
    assert [(c, len(g)) for c, g in groups] == [("A", 3), ("full", 2)]


# -- on a Ray local cluster ------------------------------------------------------------------------------


class DyingWorker(peer_grid.PeerWorker):
    """Dies once, mid-press: after the first item of its group is written, halfway through the next line."""

    def run(self, press, items):
        marker = pathlib.Path(self.plan.out) / "died"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return super().run(press, items)
        super().run(press, items[:1])
        with open(shards.shard_path(self.plan.path(".ours.jsonl")), "ab") as f:
            f.write(b'{"sample": "' + self.plan.config.encode() + b'/1/')
        os._exit(1)


@pytest.mark.slow  # a Ray cluster, 3 worker processes and the in-process grid, each compiling the tiny model
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
def test_a_ray_grid_with_a_worker_killed_equals_the_in_process_lines_after_a_rerun(tmp_path, monkeypatch):
    had_ray = "ray" in sys.modules
    local = tmp_path / "local"
    peer.main(ARGS + [f"out={local}"])  # in this process, both sides
    assert had_ray or "ray" not in sys.modules  # the default executor imports no Ray
    ray = pytest.importorskip("ray")
    ours_local = {(x["sample"], x["press"], x["ratio"]): x for x in peer.read_lines(local / f"{STEM}.ours.jsonl")}
    assert len(ours_local) == 4

    out = tmp_path / "ray"
    out.mkdir()
    for f in (f"{STEM}.kvpress.jsonl", peer.tiny_dir(peer.parse(ARGS)).name):  # kvpress's side, the tiny model: done
        (shutil.copytree if (local / f).is_dir() else shutil.copy)(local / f, out / f)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # DyingWorker, defined here
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        p = peer.prepare(peer.parse(ARGS + [f"out={out}", "executor=ray", "ray.workers=2"]))
        monkeypatch.setattr(peer_grid, "RETRIES", 0)  # no restart: the rerun does what the dead worker left
        with pytest.raises(RuntimeError, match="lines written are kept"):
            peer_grid.run_ours(p, peer.pending(p, "ours"), worker=DyingWorker, side=peer.ray_side())
        assert len(peer.saved(p, "ours")) == 3  # one item lost with the dead worker, its half line skipped
        assert len(shards.shard_files(p.path(".ours.jsonl"))) == 2  # both workers wrote
        rows = peer.main(ARGS + [f"out={out}", "executor=ray", "ray.workers=2"])  # the rerun: the command
    finally:
        ray.shutdown()
    assert [r["compared"] for r in rows] == [2, 2]
    shard_lines = [x for s in shards.shard_files(p.path(".ours.jsonl")) for x in peer.read_lines(s)]
    assert len(shard_lines) == 4 and len(shards.shard_files(p.path(".ours.jsonl"))) == 3  # none run twice
    merged = peer.read_lines(out / f"{STEM}.ours.jsonl")
    ours_ray = {(x["sample"], x["press"], x["ratio"]): x for x in merged}
    assert len(merged) == len(ours_ray) == 4 and sorted(ours_ray) == sorted(ours_local)
    for k, x in ours_local.items():
        assert ours_ray[k]["answer"] == x["answer"], k
        assert ours_ray[k]["kept"] == x["kept"], k
        assert ours_ray[k]["bytes"] == x["bytes"], k
