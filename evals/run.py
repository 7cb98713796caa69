"""`python -m evals.run`: evaluate one model x policy x task (or a sweep of them) and append
one JSON line per run to a results file.

    python -m evals.run policy=sink window=4096     # perplexity over 12288 tokens of Pride & Prejudice
    python -m evals.run -m policy=full,window,sink window=1024,4096 task=perplexity tokens=8192
    python -m evals.run task=passkey policy=sink window=1024
    python -m evals.run model=hf model.path=/ckpt/folder data=mobydick
    python -m evals.run model=tiny_recall task=recall policy=window window=16
    python -m evals.table results/results.jsonl --out results/table
    python -m evals.plots results/results.jsonl --out results/plots

The default stream, tokens=12288, goes past SmolLM2's 8192-token training context (its time on
this project's machine: docs/results/speed.md, "The default command").

This module is the command line and one run; the configuration (Hydra groups, the policy
options derived from the registry, validation) is `evals.config`, the models `evals.zoo`.
Before anything runs, every job of the command line is composed and validated, so a wrong
group option, key, type or policy field stops the whole command with one error that names the
valid choices; so do missing or damaged model and data files, a text too short for `tokens`,
retrieval lengths past the model's trained context (unless `task.extrapolate=true`), a run that
obviously cannot fit in memory and an unwritable results location (`evals.config.validate`,
`check_text`), an HF config that disagrees with its tensors, a tokenizer larger than the model's
vocabulary. A run expected to take over a minute prints an estimate first (`estimate`). A run whose
config key is already in the results file is skipped (`force=true` redoes it; a row recorded as
failed, with NaN metrics, is redone); two processes on one key and file run it once
(`evals.results`). `distributed=auto` (or I/N@HOST:PORT) runs one model over several processes, one
evals.run each: the command calls `jax.distributed.initialize` before anything else, `mesh=` spans
every process's devices, process 0 decides whether a run is already done and writes the rows, the
others compute with it (`start_distributed`, docs/guide/scale.md). Ctrl-C ends the command with one
line (`interrupt_as_line`). Hydra's own output (logs, the composed config) goes to `outputs/`
(git-ignored); the job does not change directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import itertools
import signal
import sys
import threading
import time
import _thread
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import DictConfig
from tqdm.auto import tqdm

import kvpolicies
from models.stacks import model_stack
from evals import results as R
from evals import zoo
from evals.common import TaskContext, TaskResult
from evals.config import (CONFIG_DIR, ConfigError, check_text, compose, load_task, register_configs, resolve_policy,
                          task_cells, task_extent, task_later_keys, validate)
from evals.zoo import dtype
from kvpolicies.budgets import context_kept

# Top-level keys whose values determine a run's numbers (the resume key hashes these).
KEY_FIELDS = ("model", "data", "policy", "task", "chunk", "seed")
# Policy fields added after results were keyed, with their defaults (`run_key` leaves them out there).
LATER_FIELDS = {"ratio": 0.0, "pooling": "max", "safeguard_window": False, "interval": 0, "target": 0, "slots": 0,
                "spare": False}
POLICY_LATER_FIELDS = {"kvzip": {"scope": "layer", "keep_last": True, "prompts": "authors"}, "duo": {"appended": 0},
                       "kvzap": {"prefill": "dense"}}
# Top-level keys that say how to run, not what: left out of the row's "config".
NOT_IN_ROW = ("results", "progress", "force", "distributed")


# -- one run --------------------------------------------------------------------------------------


@dataclasses.dataclass
class RecordingContext(TaskContext):
    """A TaskContext that remembers the largest max_len of the engines the task built (the
    memory of the row is computed for it)."""

    max_len: int = 0
    mesh: list[int] | None = None  # [data, model]: each engine is sharded on that mesh (models.sharding)

    engines: list = dataclasses.field(default_factory=list)  # every engine built (their fit_records)

    def engine(self, max_len: int):
        self.max_len = max(self.max_len, max_len)
        eng = super().engine(max_len)
        self.engines.append(eng)
        return eng if self.mesh is None else eng.shard(self.mesh)


def fit_summary(records: list[dict], kv_heads: int) -> dict[str, Any]:
    """What `fit` stored (`Engine.fit_records`, one per compressed batch): the mean stored bytes of
    a prompt (a batch's bytes over its rows, each row stored at the batch's largest count) in all
    and per layer, the largest, and the achieved compression ratio (1 - kept / prompt tokens, over
    every layer and kv head), mean and range over the records."""
    if not records:
        return {"prompts": 0}
    ratio = [1 - sum(r["kept"]) / (len(r["kept"]) * kv_heads * r["tokens"]) for r in records]
    rows = [r.get("rows", 1) for r in records]
    return {"prompts": int(sum(rows)),
            "stored_bytes_mean": float(np.mean([r["stored_bytes"] / n for r, n in zip(records, rows)])),
            "stored_bytes_max": int(max(r["stored_bytes"] // n for r, n in zip(records, rows))),
            "layer_bytes_mean": [float(x) for x in np.mean([np.asarray(r["layer_bytes"]) / n
                                                            for r, n in zip(records, rows)], axis=0)],
            "achieved_ratio_mean": float(np.mean(ratio)), "achieved_ratio_min": float(min(ratio)),
            "achieved_ratio_max": float(max(ratio))}


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
    if conf.get("fit"):  # off (0): rows keyed before `fit` existed keep their keys
        keyed["fit"] = conf["fit"]
    # task.extrapolate only allows a run (retrieval past the trained length), it changes no number
    keyed["task"] = {k: v for k, v in conf["task"].items() if k != "extrapolate"}
    # task keys added after rows were keyed (the task's `later_keys`): at the default, left out of the key
    for field, default in task_later_keys(keyed["task"]).items():
        if keyed["task"].get(field, default) == default:
            keyed["task"].pop(field, None)
    keyed["policy"] = R.policy_record(policy)  # as built: defaults included, interpolations resolved
    # a user's own text or checkpoint: its contents are part of the key (size, mtime, head/tail hash),
    # so a rewritten file is run again, not skipped as "already in"; built-in data and models keep their keys
    for group in ("data", "model"):
        path = conf[group].get("path")
        if isinstance(path, str) and Path(path).exists():
            keyed[group] = {**keyed[group], "digest": R.file_digest(path)}
    later = {**LATER_FIELDS, **POLICY_LATER_FIELDS.get(keyed["policy"].get("name"), {})}
    for field, default in later.items():  # added after rows were keyed: at the default, the key is unchanged
        if keyed["policy"].get(field, default) == default:
            keyed["policy"].pop(field, None)
    return R.config_key(keyed)


SCORES = ("ppl", "nll", "accuracy")  # a run without a number for one of these it reports failed


def failure(metrics: dict[str, Any]) -> str | None:
    """Why a run's metrics mean it failed (a NaN or infinite metric, or a score reported as None:
    a NaN weight, an overflowing cache), or None."""
    import math

    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    bad += [k for k in SCORES if k in metrics and metrics[k] is None]
    return f"metric(s) {', '.join(bad)} not finite" if bad else None


def _short(v: Any) -> str:
    return "[" + ",".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)


def job_header(conf: dict[str, Any], record: dict[str, Any], key: str) -> str:
    """One line naming everything a sweep can vary: the task and its keys (tokens, lengths...), the
    model, the data, the policy and its fields, the codec, chunk and seed, and the run key."""
    task = " ".join([conf["task"]["name"]] + [f"{k}={_short(v)}" for k, v in conf["task"].items() if k != "name"])
    model = conf["model"]["name"] + (f" {conf['model']['path']}" if "path" in conf["model"] else "")
    data = conf["data"].get("spec") if conf["data"].get("name") == "path" else conf["data"].get("name")
    policy = f"{record['name']} {policy_params(record)}".strip()
    mesh = f" | mesh={conf['mesh'][0]}x{conf['mesh'][1]}" if conf.get("mesh") else ""
    return (f"[evals.run] {task} | model={model} | data={data} | {policy} | codec={conf['codec']} "
            f"| chunk={conf['chunk']} seed={conf['seed']}{mesh} | key {key}")


def _trained_length_note(conf: dict[str, Any], mc) -> str | None:
    """What to say about the model's trained context length (`max_position`), if the run passes it."""
    extent = task_extent(conf)
    if extent is None or extent[1] <= mc.max_position:
        return None
    field, length, gen, _ = extent
    if not gen:
        return (f"[evals.run] {field} streams past the trained context length of model={conf['model']['name']} "
                f"({mc.max_position} tokens): ppl_in / ppl_out are the perplexity before / after it")
    return (f"[evals.run] warning: task.extrapolate=true: {field} goes past the trained context length of "
            f"model={conf['model']['name']} ({mc.max_position} tokens)")


# Every eval computes its 32-bit matmuls in float32 on every backend. JAX's default lets a GPU
# round their inputs to TF32 (H100/H200) and a TPU to bfloat16 passes, which would make a float32
# run's numbers depend on the device; bfloat16 inputs are not affected, and on the CPU float32 is
# what XLA computes anyway (bit-identical results, same speed: measured on the default model).
MATMUL_PRECISION = "highest"


def run_config(conf: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Run one validated plain config; returns (row, ran). A config already in the results file
    is not run again unless conf["force"]: its stored row is returned with ran=False.

    "Is the key in the file? run or skip; append" holds the key's lock (`results.key_lock`): a
    second process on the same key and file waits, then finds the row and skips."""
    say = tqdm.write
    policy, sizing = resolve_policy(conf)
    key = run_key(conf, policy)
    results = conf["results"]
    wait = lambda: say(f"[evals.run] waiting: another process is running key {key} on {results}")  # noqa: E731
    lead = jax.process_index() == 0  # distributed=: process 0 reads and writes the results, every process computes
    with R.key_lock(results, key, on_wait=wait) if lead else contextlib.nullcontext():
        done = [r for r in R.read(results) if r.get("key") == key and R.finished(r)] \
            if lead and Path(results).is_file() else []
        row = done[-1] if done and not conf["force"] else None
        if jax.process_count() > 1:  # every process runs or skips as process 0 decided
            row = broadcast_json(row)
        if row is not None:
            say(f"[evals.run] skip {key}: already in {results} (force=true redoes it)")
            return row, False
        with jax.default_matmul_precision(MATMUL_PRECISION):
            return _run(conf, policy, key, sizing, write=lead), True


def broadcast_json(obj: Any) -> Any:
    """Process 0's `obj` (JSON), in every process of a jax.distributed run (a collective: every process
    calls it at the same point)."""
    import json

    from jax.experimental import multihost_utils

    lead = jax.process_index() == 0
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8) if lead else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = data if lead else np.zeros(n, np.uint8)
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8).tobytes())


def start_distributed(argv: list[str]) -> None:
    """`distributed=` of the command line (evals.config.distributed_args): jax.distributed.initialize
    before anything else touches JAX's devices (once; not under a Hydra launcher, whose jobs are one
    process each: a ConfigError). CPU processes join through gloo collectives."""
    from evals import shards
    from evals.config import distributed_args

    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+~") == "distributed"]
    values = {v for a in given for v in a.split(",")} if "-m" in argv or "--multirun" in argv else set(given[-1:])
    args = [a for a in map(distributed_args, values) if a is not None]
    if not args or jax.distributed.is_initialized():
        return
    if len(values) > 1:
        raise ConfigError(f"distributed={','.join(sorted(values))}: one value for the whole command (its processes "
                          "join once)")
    if shards.launcher_of(argv) is not None:
        raise ConfigError(f"distributed={given[-1]}: under hydra/launcher={shards.launcher_of(argv)} each job is one "
                          "process; run a model over several processes with one evals.run per process")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**args[0])
    except (ValueError, RuntimeError) as e:  # no cluster found (auto), a coordinator never reached
        hint = " (auto: no cluster found in the environment; name it with I/N@HOST:PORT)" \
            if not args[0] and isinstance(e, ValueError) else ""
        raise ConfigError(f"distributed={given[-1]}: jax.distributed.initialize failed: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}{hint}") from None


def _run(conf: dict[str, Any], policy: kvpolicies.Policy, key: str, sizing: dict[str, Any] | None = None,
         write: bool = True) -> dict[str, Any]:
    say = tqdm.write
    results = conf["results"]
    record = R.policy_record(policy)
    task_name = conf["task"]["name"]
    say(job_header(conf, record, key))
    if sizing and not sizing["sized"]:
        say(f"[evals.run] note: budget={sizing['budget']} is not used: {sizing['why']}; the row records "
            "budget.sized=false")
    for field, (was, now) in ((sizing or {}).get("shrunk") or {}).items():
        say(f"[evals.run] note: {record['name']}.{field} lowered from {was} to {now} so that budget="
            f"{sizing['budget']} fits (the row records budget.shrunk)")
    timings: dict[str, float] = {}
    name = conf["model"]["name"]
    loading = not zoo.is_loaded(conf["model"])
    if loading:
        say(f"[evals.run] loading {name} …")
    t0 = time.perf_counter()
    tokenizer = zoo.load_tokenizer(conf["model"])
    t_tok = time.perf_counter() - t0
    t1 = time.perf_counter()
    from evals.data import load_text

    text = load_text(conf["data"]["spec"]) if tokenizer is not None else None
    timings["load_text_s"] = time.perf_counter() - t1
    check_text(conf, tokenizer, text)  # the text's token count, prompt templates: before the weights
    t2 = time.perf_counter()
    model, _ = zoo.load_model(conf["model"])
    timings["load_model_s"] = t_tok + time.perf_counter() - t2
    mc = model.cfg
    if loading:
        say(f"[evals.run] loaded {name} in {timings['load_model_s']:.1f} s (trained context length "
            f"{mc.max_position} tokens)")
    note = _trained_length_note(conf, mc)
    if note:
        say(note)
    fn = load_task(task_name)
    # model-level presets (quest: layers 0-1 dense; pyramidkv: budgets by depth); a hybrid model
    # (gemma3) keeps window(512) on its local layers, the policy acts on the global ones
    layers = model_stack(mc, policy)
    ctx = RecordingContext(model=model, tokenizer=tokenizer, policies=layers, task=dict(conf["task"]), text=text,
                           seed=conf["seed"], chunk=conf["chunk"], progress=conf["progress"], mesh=conf.get("mesh"),
                           fit=conf.get("fit", 0))
    t3 = time.perf_counter()
    with kvpolicies.record_visible() as seen:  # the most keys any query attended
        res: TaskResult = fn(ctx)
    timings["task_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0

    from models.llama import policy_runs

    stack = tuple(p for a, b, p in policy_runs(layers, mc.n_layers) for _ in range(b - a))
    max_len = ctx.max_len or declared_max_len(conf["task"])
    extent = task_extent(conf)
    memory = None
    if max_len:
        memory = R.memory(stack, kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=max_len, dtype=model.dtype)
    fitted = fit_summary([r for e in ctx.engines for r in e.fit_records], mc.n_kv_heads) if conf.get("fit") else None
    if fitted and memory and fitted["prompts"]:
        memory = {**memory, "fitted_bytes": fitted["stored_bytes_mean"]}
    arrays = {name: R.save_array(results, key, name, a) for name, a in res.arrays.items()} if write else {}
    failed = failure(res.metrics)
    if failed:
        say(f"[evals.run] error: run {key} failed: {failed}; recorded with `failed` (a re-run redoes it)")
    row = {
        "key": key,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "task": task_name,
        "policy": record,
        "params": policy_params(record),
        "model": {"name": conf["model"]["name"], "arch": mc.name, "layers": mc.n_layers, "kv_heads": mc.n_kv_heads,
                  "head_dim": mc.head_dim, "max_position": mc.max_position, "dtype": dtype(conf["model"]).name},
        "config": {k: v for k, v in conf.items() if k not in NOT_IN_ROW and not k.startswith("_")},
        **R.environment(),
        "metrics": res.metrics,
        "memory": memory,
        **({"fitted": fitted} if fitted else {}),
        "budget": sizing,  # None, or how `budget` sized the policy (per layer), or why it could not
        "slots_per_layer": [p.capacity(max_len) for p in stack] if max_len else None,
        # context tokens each layer keeps per kv head (on average) of the run's longest prompt
        "context_kept_per_head": [context_kept(p, extent[1]) for p in stack] if extent else None,
        "max_visible": seen["max_visible"] or None,  # None: no step was traced during the run
        "dense_layers": sum(type(p) is kvpolicies.Full and type(policy) is not kvpolicies.Full for p in stack),
        "timings": timings,
        "grid": res.grid,
        "curves": res.curves,
        "arrays": arrays,
        **({"failed": failed} if failed else {}),
    }
    if write:  # (not in processes 1.. of a distributed run: process 0 writes the row)
        R.append(results, row)
    return R.json_safe(row)


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra job: validate, run (or skip), print the row's table."""
    import logging

    from evals.table import markdown

    logging.getLogger("jax").setLevel(logging.WARNING)  # Hydra's logging would show jax's INFO lines
    conf = validate(cfg)
    from evals import shards

    # under a launcher that runs jobs in other processes (joblib, submitit), each writes its own shard
    sharded = shards.launched_elsewhere()
    row, ran = shards.run_in_shard(conf, run_key(conf, resolve_policy(conf)[0]), run_config) if sharded \
        else run_config(conf)
    if ran:
        tqdm.write(markdown([row]))
        tqdm.write(f"[evals.run] appended to {shards.shard_path(conf['results']) if sharded else conf['results']}"
                   if jax.process_index() == 0 else f"[evals.run] process {jax.process_index()} of a distributed run: "
                   "process 0 appended the row")
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


ESTIMATE_OVER_S = 60.0  # runs expected to take longer get an estimate before they start


def model_flops(mc, tokens: int, capacity: int) -> float:
    """FLOPs of streaming `tokens` tokens through a model (config `mc`): 2 x the weights each token
    multiplies (attention and MLP projections, the logits) plus attention over the slots it sees (4 x
    heads x head_dim per slot and layer), a cache of `capacity` slots holding at most every earlier
    token. A lower bound: eviction and compression work come on top."""
    d, L = mc.d_model, mc.n_layers
    weights = L * (d * mc.head_dim * 2 * (mc.n_heads + mc.n_kv_heads) + 3 * d * mc.d_ff) + mc.vocab_size * d
    c = min(capacity, tokens)
    visible = (c * c / 2 + c * (tokens - c)) / tokens  # mean slots a query sees: ramp up to c, then c
    return tokens * (2.0 * weights + 4.0 * L * mc.n_heads * mc.head_dim * visible)


@functools.lru_cache(maxsize=8)
def matmul_flops_per_s(d: int, f: int, dtype: str) -> float:
    """FLOP/s this device reaches on a [512, d] x [d, f] matmul in `dtype` (best of 3 after a warm-up,
    about 0.1 s): the rate an estimate divides by."""
    import jax.numpy as jnp

    a, b = jnp.ones((512, d), dtype), jnp.ones((d, f), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * 512 * d * f / max(best, 1e-9)


def estimate(conf: dict[str, Any]) -> tuple[float, str] | None:
    """(seconds, how): an estimate of the run's compute (`model_flops` over the rate of a
    matmul of the model's shape measured here), or None when the task declares no length or the model
    has no config. Retrieval tasks: the longest prompt, once per (length, depth, trial) cell."""
    from evals.config import resolve_policy, task_extent

    extent = task_extent(conf)
    try:
        mc = zoo.describe(conf["model"])
    except ValueError:
        return None
    if extent is None or mc is None:
        return None
    field, length, gen, batch = extent
    policy, _ = resolve_policy(conf)
    layers = model_stack(mc, policy)
    from models.llama import policy_runs

    stack = [p for a, b, p in policy_runs(layers, mc.n_layers) for _ in range(b - a)]
    capacity = max(p.capacity(length + gen) for p in stack)
    flops = task_cells(conf["task"]) * batch * model_flops(mc, length + gen, capacity)
    rate = matmul_flops_per_s(mc.d_model, mc.d_ff, zoo.dtype(conf["model"]).name)
    return flops / rate, (f"{field}: ~{flops / 1e12:.3g} TFLOP of model and attention math at the {rate / 1e9:.3g} "
                          "GFLOP/s a matmul of this model's shape reached here; compilation and eviction work add "
                          "to it")


def preflight(argv: list[str]) -> tuple[int, bool]:
    """Compose and validate every job first (config, files, lengths, memory, results location; then,
    with the tokenizer, the text's token count and the prompt templates), before any weights
    load; returns (number of jobs, progress) or raises ConfigError."""
    from hydra.errors import OverrideParseException

    try:
        jobs = job_overrides(argv)
    except OverrideParseException as e:  # Hydra's grammar: one line naming the override
        msg = " ".join(str(e).replace("See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details",
                                      "").split())
        raise ConfigError(f"{msg} (see python -m evals.run --help; override grammar: "
                          "https://hydra.cc/docs/1.2/advanced/override_grammar/basic)") from None
    if jobs is None:
        return 1, True
    progress = True
    total = 0.0
    for overrides in jobs:
        conf = validate(compose(overrides))
        progress = conf["progress"]
        est = None if {"--cfg", "-c"} & set(argv) else estimate(conf)  # --cfg only prints the config
        if est is not None and est[0] > ESTIMATE_OVER_S:
            total += est[0]
            tqdm.write(f"[evals.run] estimate: ~{_duration(est[0])} for {' '.join(overrides) or 'this run'} "
                       f"({est[1]})")
        if zoo.has_tokenizer(conf["model"]):  # what needs the tokenizer, before any weights load
            from evals.data import load_text

            if not zoo.is_loaded(conf["model"], "tokenizer") and conf["model"]["name"] != "tiny_random":
                tqdm.write(f"[evals.run] loading the tokenizer of {conf['model']['name']} to check the inputs …")
            try:
                tokenizer = zoo.load_tokenizer(conf["model"])
            except (OSError, ValueError) as e:
                raise ConfigError(f"model={conf['model']['name']}: its tokenizer does not load: {e}") from None
            try:
                zoo.check_vocab(conf["model"], tokenizer)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            check_text(conf, tokenizer, load_text(conf["data"]["spec"]))
    if total and len(jobs) > 1:
        tqdm.write(f"[evals.run] estimate: ~{_duration(total)} for the long jobs of this sweep")
    return len(jobs), progress


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 90 else \
        f"{seconds:.0f} s"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the rows of its jobs. Warnings
    (e.g. a damaged line skipped in the results file) print as one "evals.run: warning:" line."""
    from evals.progress import warnings_as_lines

    from evals.compiles import CompileLog, use_fast_compile, use_persistent_cache

    use_fast_compile()
    use_persistent_cache()

    with warnings_as_lines("evals.run"), interrupt_as_line("evals.run"), CompileLog() as log:
        rows = _main(argv)
    if len(rows) > 1:  # a sweep (-m): its compilation against the whole run
        print(f"[evals.run] {log.line()}")
    return rows


@contextlib.contextmanager
def interrupt_as_line(prog: str):
    """Ctrl-C (SIGINT) ends the command with one line (exit 130), not a traceback: rows already
    appended are kept and a re-run resumes after them; the run in flight is not recorded."""
    lock, state = threading.Lock(), {"pending": False, "done": False, "thread": None}

    def again() -> None:  # the interrupt was swallowed (by a gc callback, say): simulate it again
        while True:
            time.sleep(0.5)
            with lock:
                if state["done"]:
                    return
                _thread.interrupt_main(signal.SIGINT)

    def on_sigint(signum, frame):
        with lock:
            if state["done"]:
                return
            if not state["pending"]:
                state["pending"] = True
                state["thread"] = threading.Thread(target=again, daemon=True)
                state["thread"].start()
        raise KeyboardInterrupt

    def stop() -> None:
        with lock:
            state["done"] = True
        if state["thread"] is not None:
            state["thread"].join()

    # Python raises KeyboardInterrupt wherever the main thread is; inside a gc callback (XLA registers
    # one) the exception is ignored and the run would go on to its end as if no Ctrl-C came: the
    # handler raises it again every 0.5 s until this block ends the command
    ours = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, on_sigint) if ours else None
    try:
        yield
    except KeyboardInterrupt:
        stop()
        print(f"{prog}: interrupted: the rows already written are kept; the run in flight was not recorded "
              "(run the same command again to resume)", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        stop()
        if ours:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> list[dict[str, Any]]:
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        start_distributed(argv)
        n_jobs, progress = preflight(argv)
    except ConfigError as e:
        print(f"evals.run: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from evals import shards

    launcher = shards.launcher_of(argv)  # jobs in other processes (joblib, submitit): each writes a shard
    confs = [validate(compose(o)) for o in job_overrides(argv) or []] if launcher is not None else []
    if launcher is not None:
        try:
            shards.check_sweep(confs, launcher)
        except ConfigError as e:
            print(f"evals.run: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    register_configs()
    rows: list[dict[str, Any]] = []
    # Progress bars, one line per level: sweep (here, line 0), task (retrieval cells) and tokens
    # (Engine.score) below it; tqdm places each new bar on the first free line and messages go
    # through tqdm.write (Hydra's log lines too: configs/config.yaml), so nothing overwrites a bar.
    bar = tqdm(total=n_jobs, desc="sweep", unit="job", position=0, disable=n_jobs < 2 or not progress)

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
    if launcher is not None:  # the jobs ran in other processes: merge their shards, read their rows back
        rows = shards.merge_sweep(confs, [run_key(c, resolve_policy(c)[0]) for c in confs], say=tqdm.write)
    if len(rows) > 1:
        from evals.table import markdown

        print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
