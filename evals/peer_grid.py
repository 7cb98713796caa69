"""`python -m evals.peer executor=ray`: our side's (sample, press, ratio) items on Ray actors.

    python -m evals.peer executor=ray ray.address=local ray.workers=2 presses=[SnapKVPress,TOVAPress]
    python -m evals.peer executor=ray ray.address=auto ...          # the cluster this node is in

Our side's items are grouped by press (the full cache's row is a group too), and each group is one
Ray task, a call of a `PeerWorker` actor: an actor is one process that loads the model once and
keeps its compiled steps across the groups it runs; a group's engines (its press at every ratio,
one shape class) are built once, and its samples run as `evals.peer.run_ours` runs them in one
process (the same engines, shapes and batches: the same lines). Actors compile through the
driver's persistent compilation cache (`compile_cache=`; on a cluster, a folder every node reads).
kvpress's side stays one subprocess per grid, on the driver's machine (`evals.peer.start_worker`).

Each actor appends its lines to its own shard of `<stem>.ours.jsonl`, in that file's schema, with
no lock (a shard has one writer, so a network filesystem serves):

    <out>/<stem>.ours.jsonl.shards/<host>-<pid>.jsonl

`evals.peer.saved` (and so the resume, the records and the table) reads the file and its shards
alike; when the grid ends the driver merges the shards into `<stem>.ours.jsonl` (`merge`: every
line of this configuration whose item the file does not hold yet, the first in shard order;
temp file then rename; a second merge adds nothing).

What survives: a task first drops the items that the file or any shard already holds, so Ray's
retry of a task whose actor died (`ray_grid.RETRIES` restarts and retries) and a rerun of the
command both do only the items missing: none twice. A half-written line (an actor killed
mid-line) is skipped when read and cut before that shard is appended to again. Ray is imported only
when executor=ray runs: parsing the keys and the in-process default import none of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

from evals import ray_grid, shards

KEYS = ("executor", "ray.address", "ray.workers")  # evals.peer's keys for this module
RETRIES = ray_grid.RETRIES  # restarts of a dead actor, and retries of the group it was running

Item = tuple[int, str, float]  # (sample index, press, ratio)


def options(argv: Sequence[str]) -> Any:
    """`executor=ray`'s options from evals.peer's command line (evals.ray_grid.RayOptions, parsed as
    evals.compare parses them: `ray.*` keys need executor=ray), or None for executor=local (the
    default: our side in this process). ConfigError naming the key; Ray is not imported."""
    from evals.compare import ray_options

    own = dict(a.split("=", 1) for a in argv if "=" in a and a.split("=", 1)[0] in KEYS)
    return ray_options(own)


def read_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; a partial or bad line (a writer killed) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "sample" in obj:
            out.append(obj)
    return out


def repair(path: pathlib.Path) -> None:
    """Cut a partial last line (a writer killed mid-line) so that the next line starts on its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def _item(line: dict[str, Any]) -> tuple[str, str, float]:
    return line["sample"], line["press"], float(line["ratio"])


def lines(path: pathlib.Path) -> list[dict[str, Any]]:
    """The lines of a side file (`evals.peer.read_lines`), then those of its shards (by name) whose
    item no earlier line holds: an item's first line, the one `merge` keeps."""
    out = read_lines(path)
    have = {_item(x) for x in out}
    for s in shards.shard_files(path):
        for x in read_lines(s):
            if _item(x) not in have:
                have.add(_item(x))
                out.append(x)
    return out


@dataclasses.dataclass
class ShardPlan:
    """A plan whose `.ours.jsonl` is this process's shard of it (what `evals.peer.run_ours` appends to);
    every other attribute is the plan's."""

    plan: Any
    shard: pathlib.Path

    def path(self, suffix: str) -> pathlib.Path:
        return self.shard if suffix == ".ours.jsonl" else self.plan.path(suffix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plan, name)

    def sample_id(self, i: int) -> str:
        return self.plan.sample_id(i)


class PeerWorker:
    """One Ray actor: our side's groups of items in its process (the model loaded once, compiled steps
    kept), each line into its own shard of `<stem>.ours.jsonl`."""

    def __init__(self, plan, cache_dir: str | None = None, side: dict[str, Any] | None = None):
        from evals.compiles import use_fast_compile, use_persistent_cache

        use_fast_compile()
        if cache_dir:
            use_persistent_cache(cache_dir)
        self.plan, self.model, self.side = plan, None, side  # side: evals.peer.ray_side()

    def run(self, press: str, items: Sequence[Item]) -> dict[str, Any]:
        """The items of `press` not yet in the file or a shard; a summary (items, ran, pid)."""
        import logging

        logging.getLogger("jax").setLevel(logging.WARNING)
        have = self.side["saved"](self.plan, "ours")
        todo = [(int(i), c, float(r)) for i, c, r in items if (int(i), c, float(r)) not in have]
        if todo:
            if self.model is None:
                self.model, _ = self.side["load"](self.plan)
            mine = ShardPlan(self.plan, shards.shard_path(self.plan.path(".ours.jsonl")))
            mine.shard.parent.mkdir(parents=True, exist_ok=True)
            repair(mine.shard)  # a line this pid's earlier process left half-written
            self.side["run"](mine, self.model, todo)
        return {"press": press, "items": len(items), "ran": len(todo), "pid": os.getpid()}


def groups(todo: Sequence[Item]) -> list[tuple[str, list[Item]]]:
    """The items by press, the largest groups first (then by press name): one Ray task each."""
    by: dict[str, list[Item]] = {}
    for i, c, r in todo:
        by.setdefault(c, []).append((i, c, r))
    return sorted(by.items(), key=lambda g: (-len(g[1]), g[0]))


def run_ours(p, todo: Sequence[Item], tick: Callable[[], None] = lambda: None, worker: type = PeerWorker,
             say=print, side: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Our side of the items `todo` on Ray actors (`p.ray`: evals.ray_grid.RayOptions), a group per
    press handed to the next idle actor, then the shards merged into `<stem>.ours.jsonl`. An actor
    dead past its retries takes no more groups (the others run them); its group's lines written are
    kept, and when every group has ended a RuntimeError says so (a rerun does what is missing).
    `tick` once per item done; `side`: what an actor runs (`evals.peer.ray_side()`: saved, load, run;
    handed in, so that this module imports no evals.peer). Returns the groups' summaries."""
    import jax
    import ray

    work = groups(todo)
    started = ray_grid.connect(p.ray)
    out: list[dict[str, Any]] = []
    failed: list[str] = []
    try:
        n = min(p.ray.workers or ray_grid.default_workers(), len(work))
        gpu = 1 if ray.cluster_resources().get("GPU", 0) >= n else 0
        actor = ray.remote(num_cpus=1, num_gpus=gpu, max_restarts=RETRIES, max_task_retries=RETRIES)(worker)
        idle = [actor.remote(p, jax.config.jax_compilation_cache_dir, side) for _ in range(n)]
        say(f"[evals.peer] ours: {len(todo)} items in {len(work)} press groups on {n} Ray worker(s) at "
            f"{ray.get_runtime_context().gcs_address}; shards in {shards.shard_dir(p.path('.ours.jsonl'))}")
        busy: dict[Any, tuple[Any, str]] = {}  # task -> (actor, press)
        while work and idle or busy:
            while work and idle:
                a, (press, items) = idle.pop(), work.pop(0)
                busy[a.run.remote(press, items)] = (a, press)
            (done,), _ = ray.wait(list(busy), num_returns=1)
            a, press = busy.pop(done)
            try:
                s = ray.get(done)
            except ray.exceptions.RayError as e:  # the actor died past its restarts: not used again
                first = str(e).strip().splitlines()
                failed.append(f"{press}: {type(e).__name__}{': ' + first[0] if first else ''}")
                continue
            out.append(s)
            idle.append(a)
            for _ in range(s["items"]):
                tick()
    finally:
        if started:
            ray.shutdown()
        added = merge(p)
        say(f"[evals.peer] merged {added} line(s) of {len(shards.shard_files(p.path('.ours.jsonl')))} shard(s) "
            f"into {p.path('.ours.jsonl')}")
    if failed or work:
        raise RuntimeError(f"Ray workers of our side failed ({'; '.join(failed) or 'none left'}); "
                           f"{len(work)} press group(s) not started; the lines written are kept in "
                           f"{shards.shard_dir(p.path('.ours.jsonl'))} (run again to do the rest)")
    return out


def merge(p) -> int:
    """Append to `<stem>.ours.jsonl` every line of this configuration (`p.config`) in its shards whose
    (sample, press, ratio) item the file does not hold (the first such line, in shard order); the file
    replaced atomically (temp then rename), a half-written last line of it cut. Returns the lines added."""
    path = p.path(".ours.jsonl")
    have = {_item(x) for x in read_lines(path)}
    new = []
    for s in shards.shard_files(path):
        for x in read_lines(s):
            if x["sample"].startswith(p.config + "/") and _item(x) not in have:
                have.add(_item(x))
                new.append(json.dumps(x) + "\n")
    if not new:
        return 0
    old = path.read_bytes() if path.is_file() else b""
    old = old[:old.rfind(b"\n") + 1]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        tmp.write_bytes(old + "".join(new).encode("utf-8"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(new)
