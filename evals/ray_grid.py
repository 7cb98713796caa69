"""A grid's evals.run jobs on a Ray cluster (`evals.compare executor=ray`, and evals.suite through it).

    python -m evals.compare executor=ray ray.address=local ray.workers=2 ...   # this machine
    python -m evals.compare executor=ray ray.address=auto ...                  # the cluster this node is in

Each job (an evals.run config) is one Ray task, a call of a `Worker` actor: an actor is one
process that keeps what evals.run keeps in a process across its jobs (the loaded model, the
tokenizer, the engines' compiled steps), and compiles through the persistent compilation cache
folder of the driver (evals.compiles; on a cluster, a folder every node can read). A worker
writes its rows to its own shard of the results file (`evals.shards`: no lock, so a network
filesystem serves); when every job is done the driver merges the shards into the results file.

What survives: a job whose key the results file or any shard already holds is not sent again (a
rerun resumes; `force=true` sends every job, and the merge keeps each key's newest row); an actor
that dies (a killed process, a lost node) is restarted and its job retried (`max_restarts`,
`max_task_retries`), and the retried job first looks for its key in the shards, so a worker that
died after writing its row and before reporting is not run twice; a half-written row is never
merged. Ray is imported only here: the default executor (in-process) never imports it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADDRESSES = "auto | local | <host:port> | ray://<host:port>"
RETRIES = 3  # restarts of a dead actor, and retries of the job it was running


@dataclass(frozen=True)
class RayOptions:
    """`ray.address`: local starts a cluster on this machine (and stops it at the end), auto joins
    the cluster this node belongs to, host:port (or ray://host:port, Ray Client) a given one.
    `ray.workers`: actors (default: one per GPU of the cluster, else one per node: JAX on a CPU
    uses every core of its machine)."""

    address: str = "local"
    workers: int | None = None

    def __post_init__(self):
        if not self.address:
            raise ValueError(f"ray.address={self.address!r}: give {ADDRESSES}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"ray.workers={self.workers!r}: must be an int >= 1")


class Worker:
    """One Ray actor: runs jobs in its process (model, tokenizer and compiled steps kept across them),
    each row into its own shard of the job's results file."""

    def __init__(self, cache_dir: str | None = None):
        from evals.compiles import use_fast_compile, use_persistent_cache

        use_fast_compile()
        if cache_dir:
            use_persistent_cache(cache_dir)

    def run(self, conf: dict[str, Any]) -> dict[str, Any]:
        """Run (or skip) one evals.run config; a summary of its row."""
        import logging

        from evals import run as evrun
        from evals import shards
        from evals.config import resolve_policy

        logging.getLogger("jax").setLevel(logging.WARNING)
        row, ran = shards.run_in_shard(conf, evrun.run_key(conf, resolve_policy(conf)[0]), evrun.run_config)
        return {"key": row.get("key"), "ran": ran, "failed": row.get("failed"), "pid": os.getpid(),
                "total_s": (row.get("timings") or {}).get("total_s")}

    def pid(self) -> int:
        return os.getpid()


def connect(options: RayOptions) -> bool:
    """ray.init for `options` unless Ray is already initialised; returns whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = dict(include_dashboard=False, configure_logging=False)
    with warnings.catch_warnings():  # Ray's processes start by fork + exec: JAX's warning about fork is moot
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        if options.address == "local":
            ray.init(num_cpus=max(os.cpu_count() or 1, options.workers or 1), **kw)
        else:
            ray.init(address=options.address, **kw)
    return True


def default_workers() -> int:
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    return gpus or max(1, sum(1 for n in ray.nodes() if n.get("Alive")))


def run(confs: Sequence[dict[str, Any]], results: str | os.PathLike, options: RayOptions = RayOptions(),
        progress: bool = True, worker: type = Worker, say=print) -> list[dict[str, Any]]:
    """Run every evals.run config of `confs` (all with `results` as their results file) on Ray
    actors, then merge the shards into `results`; returns the summaries of the jobs sent."""
    import ray
    from ray.util import ActorPool
    from tqdm.auto import tqdm

    from evals import run as evrun
    from evals import shards
    from evals.config import resolve_policy

    results = Path(results).resolve()
    confs = [{**c, "results": str(results), "progress": False} for c in confs]
    done = shards.done_keys(results)  # force=true: every job again (the merge keeps a key's newest row)
    todo = [c for c in confs if c.get("force") or evrun.run_key(c, resolve_policy(c)[0]) not in done]
    if len(todo) < len(confs):
        say(f"[ray] {len(confs) - len(todo)} of {len(confs)} jobs already in {results} or its shards: skipped")
    started = connect(options) if todo else False
    out: list[dict[str, Any]] = []
    try:
        if todo:
            import jax

            n = min(options.workers or default_workers(), len(todo))
            gpu = 1 if ray.cluster_resources().get("GPU", 0) >= n else 0
            actor = ray.remote(num_cpus=1, num_gpus=gpu, max_restarts=RETRIES, max_task_retries=RETRIES)(worker)
            pool = ActorPool([actor.remote(jax.config.jax_compilation_cache_dir) for _ in range(n)])
            say(f"[ray] {len(todo)} jobs on {n} worker(s) at {ray.get_runtime_context().gcs_address}; shards in "
                f"{shards.shard_dir(results)}")
            with tqdm(total=len(todo), desc="ray", unit="job", disable=not progress) as bar:
                for s in pool.map_unordered(lambda a, c: a.run.remote(c), todo):
                    out.append(s)
                    how = f"failed ({s['failed']})" if s["failed"] else "ran" if s["ran"] else "already in a shard"
                    tqdm.write(f"[ray] {s['key']}: {how} (worker pid {s['pid']})")
                    bar.update()
    finally:
        if started:
            ray.shutdown()
    merged = shards.merge(results)
    say(f"[ray] {merged.line(results)}")
    return out
