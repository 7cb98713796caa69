"""`python -m evals.run`: evaluate one model x policy x task (or a sweep of them) and append
one JSON line per run to a results file.

    python -m evals.run policy=sink window=4096     # perplexity over 12288 tokens of Pride & Prejudice
    python -m evals.run -m policy=full,window,sink window=1024,4096 task=perplexity tokens=8192
    python -m evals.run task=passkey policy=sink window=1024
    python -m evals.run model=hf model.path=/ckpt/folder data=mobydick
    python -m evals.run model=tiny_recall task=recall policy=window window=16
    python -m evals.table results/results.jsonl --out results/table
    python -m evals.plots results/results.jsonl --out results/plots

The default stream, tokens=12288, goes past SmolLM2's 8192-token training context; `sink` over
it took 332 s of CPU time (model load included) on a shared 2-core machine: about 3 minutes of
wall time on two idle cores (estimated from the CPU time, not measured on an idle machine).

This module is the command line and one run; the configuration (Hydra groups, the policy
options derived from the registry, validation) is `evals.config`, the models `evals.zoo`.
Before anything runs, every job of the command line is composed and validated, so a wrong
group option, key, type or policy field stops the whole command with one error that names the
valid choices. A run whose config key is already in the results file is skipped (`force=true`
redoes it). Hydra's own output (logs, the composed config) goes to `outputs/` (git-ignored);
the job does not change directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import sys
import time
from typing import Any

from omegaconf import DictConfig
from tqdm.auto import tqdm

import kvpolicies
from evals import results as R
from evals.common import TaskContext, TaskResult
from evals.config import CONFIG_DIR, ConfigError, build_policy, compose, load_task, register_configs, validate
from evals.zoo import dtype, load_model

# Top-level keys whose values determine a run's numbers (the resume key hashes these).
KEY_FIELDS = ("model", "data", "policy", "task", "chunk", "seed")


# -- one run --------------------------------------------------------------------------------------


@dataclasses.dataclass
class RecordingContext(TaskContext):
    """A TaskContext that remembers the largest max_len of the engines the task built (the
    memory of the row is computed for it)."""

    max_len: int = 0

    def engine(self, max_len: int):
        self.max_len = max(self.max_len, max_len)
        return super().engine(max_len)


def declared_max_len(task: dict[str, Any]) -> int | None:
    """The longest sequence a task config asks for (`tokens`, or the largest of `lengths`), for a
    task that built its engines without `ctx.engine`; None if it declares none."""
    if isinstance(task.get("tokens"), int):
        return task["tokens"]
    lengths = [n for n in task.get("lengths") or () if isinstance(n, int)]
    return max(lengths) if lengths else None


def policy_params(record: dict[str, Any]) -> str:
    """'n_sink=4 window=4096 positions=cache': a policy's fields except name and codec."""
    return " ".join(f"{k}={v}" for k, v in record.items() if k not in ("name", "codec"))


def run_key(conf: dict[str, Any], policy: kvpolicies.Policy) -> str:
    keyed = {k: conf[k] for k in KEY_FIELDS}
    keyed["policy"] = R.policy_record(policy)  # as built: defaults included, interpolations resolved
    return R.config_key(keyed)


def run_config(conf: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Run one validated plain config; returns (row, ran). A config already in the results file
    is not run again unless conf["force"]: its stored row is returned with ran=False."""
    say = tqdm.write
    policy = build_policy(conf["policy"])
    key = run_key(conf, policy)
    results = conf["results"]
    if not conf["force"] and key in R.done_keys(results):
        row = next(r for r in reversed(R.read(results)) if r.get("key") == key)
        say(f"[evals.run] skip {key}: already in {results} (force=true redoes it)")
        return row, False
    record = R.policy_record(policy)
    task_name = conf["task"]["name"]
    say(f"[evals.run] {task_name} | {conf['model']['name']} | {record['name']} {policy_params(record)} "
        f"| codec={conf['codec']} | key {key}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model, tokenizer = load_model(conf["model"])
    timings["load_model_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    from evals.data import load_text

    text = load_text(conf["data"]["spec"]) if tokenizer is not None else None
    timings["load_text_s"] = time.perf_counter() - t1
    fn = load_task(task_name)
    ctx = RecordingContext(model=model, tokenizer=tokenizer, policies=policy, task=dict(conf["task"]), text=text,
                           seed=conf["seed"], chunk=conf["chunk"], progress=conf["progress"])
    t2 = time.perf_counter()
    res: TaskResult = fn(ctx)
    timings["task_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - t0

    from models.llama import policy_runs

    mc = model.cfg
    stack = tuple(p for a, b, p in policy_runs(policy, mc.n_layers) for _ in range(b - a))
    max_len = ctx.max_len or declared_max_len(conf["task"])
    memory = None
    if max_len:
        memory = R.memory(stack, kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=max_len, dtype=model.dtype)
    arrays = {name: R.save_array(results, key, name, a) for name, a in res.arrays.items()}
    row = {
        "key": key,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "task": task_name,
        "policy": record,
        "params": policy_params(record),
        "model": {"name": conf["model"]["name"], "arch": mc.name, "layers": mc.n_layers, "kv_heads": mc.n_kv_heads,
                  "head_dim": mc.head_dim, "max_position": mc.max_position, "dtype": dtype(conf["model"]).name},
        "config": {k: v for k, v in conf.items() if k not in ("results", "progress", "force")},
        **R.environment(),
        "metrics": res.metrics,
        "memory": memory,
        "timings": timings,
        "grid": res.grid,
        "curves": res.curves,
        "arrays": arrays,
    }
    R.append(results, row)
    return R._clean(row), True


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra job: validate, run (or skip), print the row's table."""
    import logging

    from evals.table import markdown

    logging.getLogger("jax").setLevel(logging.WARNING)  # Hydra's logging would show jax's INFO lines
    conf = validate(cfg)
    row, ran = run_config(conf)
    if ran:
        tqdm.write(markdown([row]))
        tqdm.write(f"[evals.run] appended to {conf['results']}")
    return row


# -- the command line -------------------------------------------------------------------------------

_SKIP_PREFLIGHT = {"--help", "-h", "--hydra-help", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                   "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p"}


def job_overrides(argv: list[str]) -> list[list[str]] | None:
    """The overrides of every job the command line launches (sweeps expanded under -m), or None
    when the command is not a plain run/sweep (help, another config...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    multirun = "-m" in argv or "--multirun" in argv
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _SKIP_PREFLIGHT or a.split("=", 1)[0] in _SKIP_PREFLIGHT:
            return None
        elif a in _VALUE_FLAGS:
            skip = True
        elif not a.startswith("-"):
            args.append(a)
    parsed = OverridesParser.create().parse_overrides(args)
    choices = []
    for o, text in zip(parsed, args):
        if o.key_or_group.startswith("hydra"):
            continue
        if multirun and o.is_sweep_override():
            if o.is_discrete_sweep() or o.is_range_sweep():
                choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
            else:
                return None  # glob/interval sweeps: leave them to Hydra
        else:
            choices.append([text])
    return [list(c) for c in itertools.product(*choices)]


def preflight(argv: list[str]) -> tuple[int, bool]:
    """Compose and validate every job first; returns (number of jobs, progress) or raises ConfigError."""
    jobs = job_overrides(argv)
    if jobs is None:
        return 1, True
    progress = True
    for overrides in jobs:
        conf = validate(compose(overrides))
        progress = conf["progress"]
    return len(jobs), progress


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the rows of its jobs."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        n_jobs, progress = preflight(argv)
    except ConfigError as e:
        print(f"evals.run: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    register_configs()
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=n_jobs, desc="sweep", unit="job", disable=n_jobs < 2 or not progress)

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        rows.append(run_job(cfg))
        bar.update()

    saved = sys.argv
    sys.argv = [saved[0] if saved else "evals.run"] + argv
    try:
        job()
    finally:
        sys.argv = saved
        bar.close()
    if len(rows) > 1:
        from evals.table import markdown

        print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
