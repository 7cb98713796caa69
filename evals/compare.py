"""`python -m evals.compare`: a set of policies x byte budgets on one task, every policy holding the
same stored bytes, and the table and plot a paper needs (kvpress's leaderboard picture, with the
bytes measured).

    python -m evals.compare task=perplexity tokens=4096
    python -m evals.compare policies=[sink,h2o] budgets=[0.25,0.5] tokens=1024 results=results/r.jsonl
    python -m evals.compare task=passkey task.lengths=[1024] budgets=[256,512] sink.n_sink=8

Keys of its own (key=value, as evals.run):

    policies=[window,sink,h2o,tova,snapkv]  registered policies with a token budget; `full` always
                                            runs once, as the reference
    budgets=[0.03125,0.0625,0.125,0.25,0.5,0.75]
                                            a float in (0, 1]: that fraction of the full cache's bytes
                                            at the run's length (compression ratio 1 - budget: the
                                            defaults run from 32:1 to 4:3); an int n: the bytes of n
                                            full-precision tokens per layer. A default budget that a
                                            policy cannot be sized to is left out (its cell '-', said
                                            before the run); a budget given here is sized or refused
    <policy>.<field>=value                  a field held fixed while that policy is sized
                                            (sink.n_sink=8, snapkv.max_new=64, h2o.recent=128)
    out=DIR                                 where the table and plot go (default <results folder>/compare)
    name=STEM                               their file name (default <task>-<model>-<length>[-<codec>])
    overwrite=true                          replace <out>/<stem>.* written by another comparison (other
                                            run keys); without it that is an error before any job runs
                                            (the same comparison again rewrites its own files)
    share_gb=4                              memory for prompt states shared between jobs (0: none)
    thresholds=[-7,-6,-5]                   kvzap at each log-score threshold (rule=threshold, DMS), each
                                            prompt's layers stored at what they kept (evals.run fit=64);
                                            placed on the same axes at the compression ratio it achieved
                                            (measured: 1 - its mean stored bytes / full's); kvzap.<field>
                                            sets its other fields (kvzap.kind=mlp)
    protocols=[query_agnostic,query_aware]  a RULER-style task under each protocol in one command
                                            (kvpress's leaderboard runs both): a comparison per
                                            protocol, every one planned before any job runs, files
                                            <stem>-<protocol>.*
    executor=ray                            every job a Ray task on worker actors (evals.ray_grid), rows
                                            in shards merged into results (evals.shards); default
                                            executor=local: every job in this process, Ray not imported
    ray.address=local|auto|<host:port>      local: a Ray cluster on this machine; auto: the cluster this
                                            node is in; host:port: a given one (docs/guide/scale.md)
    ray.workers=2                           worker actors (default: one per GPU, else one per node)

Shared prefill. The jobs run in this process inside `evals.prefills.sharing()`: a context is
prefilled once, by the first prompt compressor that meets it, and every later job whose engine
can compress that state (`Engine.shares_prompt`: the same compressor at another budget, one with
the same prompt phase, and `full`, which runs last for that reason) takes it from the store
instead of prefilling again (RULER tasks: `evals.ruler.answer`, multiquery). Answers are the same
as unshared (tested); each row records `prefills` and `prefills_shared`. Up to share_gb GiB of
uncompressed states are kept (least recently used dropped first).

Every other key is evals.run's (model=, model.*, data=, data.*, task=, task.*, tokens=, chunk=,
seed=, codec=, results=, progress=, force=). `policy`, `window`, `n_sink` and `budget` are what
compare sets for each job, so they are errors here.

Protocol. Each (policy, budget) is `kvpolicies.budgets.sized(policy, budget, ...)` with the model's
kv_heads and head_dim (`evals.zoo.describe`: no weights), the cache dtype (the model's dtype,
which `Engine` uses) and the run's length: `tokens` for perplexity, the longest prompt plus the
generated answer for passkey/niah/multikey, n_pairs + 2 for recall (the `max_len` of the task's
engine). Its stored bytes per layer, everything included, are at most the budget and within one
slot of it. The sized policy goes to evals.run as explicit fields (`policy=h2o policy.heavy=499
policy.recent=499`), so each job is an ordinary evals.run row of the same results file, skipped if
its key is already there: a re-run appends nothing, an interrupted one resumes. All jobs are
composed, sized and validated before any weights load; one error (exit 2) names the key.

Output: `<out>/<stem>.md|.tex|.csv` (rows = policy, columns = budget, cells = the task's score,
perplexity or accuracy, and the stored cache bytes measured in the row's memory record, all layers)
and `<out>/<stem>.png|.pdf` (score vs compression ratio and vs stored cache MB, one line per policy,
the full cache's score as a horizontal line). Numbers come from the results file, by run key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvpolicies
from evals.config import ConfigError

DEFAULT_POLICIES = ("window", "sink", "h2o", "tova", "snapkv")
# 32:1 and 16:1 (kvpress's leaderboard stops at 8:1; methods differ most past it) to 4:3. A default
# budget that a policy cannot be sized to at the run's length is left out ('-', said in a note);
# budgets given on the command line are sized or refused
DEFAULT_BUDGETS = (1 / 32, 1 / 16, 0.125, 0.25, 0.5, 0.75)
OWN_KEYS = ("policies", "budgets", "out", "name", "share_gb", "overwrite", "protocols", "thresholds", "executor",
            "ray.address", "ray.workers")
EXECUTORS = ("local", "ray")  # local: every job in this process; ray: evals.ray_grid
THRESHOLD_FIT = 64  # threshold jobs run with fit=64: each layer stored at what it kept, 64 tokens per head
SET_PER_JOB = ("policy", "window", "n_sink", "budget")  # evals.run keys the sizing sets for each job
MB = 1e6
THRESHOLD_POLICY = "kvzap (threshold)"  # the line of threshold jobs in the table and the plot


# -- the command line -------------------------------------------------------------------------------


def list_value(key: str, value: str) -> list[str]:
    """'[a, b]' or 'a,b' or 'a' -> ['a', 'b']."""
    inner = value.strip()
    if inner.startswith("[") != inner.endswith("]"):
        raise ConfigError(f"{key}={value}: unbalanced brackets; write {key}=[a,b]")
    items = [s.strip() for s in inner.strip("[]").split(",")]
    if not all(items):
        raise ConfigError(f"{key}={value}: give a non-empty list, e.g. {key}=[a,b]")
    return list(dict.fromkeys(items))  # duplicates once, order kept


def _budget(key: str, text: str) -> int | float:
    """An int (tokens) or a float in (0, 1] (a fraction of full), checked."""
    if re.fullmatch(r"[+-]?\d+", text):
        b: int | float = int(text)
        if b < 1:
            raise ConfigError(f"{key}: {text}: an int budget is tokens, must be >= 1")
        return b
    try:
        b = float(text)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not a number (a float in (0, 1] or an int of tokens)") from None
    if not 0 < b <= 1:
        raise ConfigError(f"{key}: {text}: a float budget is a fraction of the full cache's bytes, must be in "
                          f"(0, 1]; an int budget is tokens")
    return b


def _scalar(text: str) -> Any:
    """A command-line value as int, float, bool or str (as Hydra reads a plain value)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _own_keys() -> str:
    return ", ".join(OWN_KEYS) + ", <policy>.<field>"


@dataclasses.dataclass
class Args:
    """The command line split: compare's own keys, per-policy fields, evals.run's overrides."""

    policies: list[str]
    budgets: list[int | float]
    fields: dict[str, dict[str, Any]]
    passthrough: list[str]
    out: str | None = None
    name: str | None = None
    share_gb: float = 4.0
    overwrite: bool = False
    budgets_given: bool = True  # budgets=... on the command line (else DEFAULT_BUDGETS)
    thresholds: list[float] = dataclasses.field(default_factory=list)  # kvzap rule=threshold jobs
    ray: Any = None  # evals.ray_grid.RayOptions with executor=ray, else None (in this process)


def parse_args(argv: Sequence[str]) -> Args:
    """Split and check `argv` (key=value items); ConfigError naming the key on any problem."""
    own: dict[str, str] = {}
    fields: dict[str, dict[str, Any]] = {}
    passthrough: list[str] = []
    for item in argv:
        if item.startswith("-") or "=" not in item:
            raise ConfigError(f"{item}: expected key=value (compare runs its own sweep: no flags, no -m); "
                              f"its keys: {_own_keys()}, and evals.run's")
        key, value = item.split("=", 1)
        bare = key.lstrip("+~")
        head = bare.split(".", 1)[0]
        if bare in OWN_KEYS:
            own[bare] = value
        elif head in SET_PER_JOB:
            raise ConfigError(f"{key}: set by compare for each job (the sizing writes the policy and its fields); "
                              "choose policies with policies=[...], sizes with budgets=[...] and a policy's "
                              "other fields with <policy>.<field>=value (e.g. sink.n_sink=8)")
        elif head == "hydra":
            raise ConfigError(f"{key}: compare runs its jobs in this process, without Hydra's launcher")
        elif head in kvpolicies.POLICIES and "." in bare:
            fields.setdefault(head, {})[bare.split(".", 1)[1]] = _scalar(value)
        else:
            passthrough.append(item)
    policies = list_value("policies", own["policies"]) if "policies" in own else list(DEFAULT_POLICIES)
    for p in policies:
        if p not in kvpolicies.POLICIES:
            from evals.config import did_you_mean

            raise ConfigError(f"policies=[{','.join(policies)}]: {p!r} is not a registered policy"
                              f"{did_you_mean(p, kvpolicies.POLICIES)}; choose from "
                              f"{sorted(kvpolicies.POLICIES)}")
    policies = [p for p in policies if p != "full"]  # full is the reference, always run
    from kvpolicies.budgets import budgeted

    unsized = [p for p in policies if p not in budgeted()]
    if unsized:
        raise ConfigError(f"policies=[{','.join(policies)}]: {unsized[0]} cannot be sized (it has no token budget); "
                          f"compare sizes one of {sorted(budgeted())}")
    if not policies:
        raise ConfigError("policies: name at least one policy besides full (full always runs, as the reference)")
    budgets = ([_budget(f"budgets={own['budgets']}", b) for b in list_value("budgets", own["budgets"])]
               if "budgets" in own else list(DEFAULT_BUDGETS))
    budgets = list(dict.fromkeys(budgets))
    thresholds = []
    for t in list_value("thresholds", own["thresholds"]) if "thresholds" in own else []:
        v = _scalar(t)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"thresholds={own['thresholds']}: {t!r} is not a number (a kvzap log-score)")
        thresholds.append(float(v))
    for p in fields:
        if p == "kvzap" and thresholds:
            continue
        if p not in policies:
            raise ConfigError(f"{p}.{next(iter(fields[p]))}: {p} is not in policies=[{','.join(policies)}]")
    share = _scalar(own.get("share_gb", "4"))
    if isinstance(share, bool) or not isinstance(share, (int, float)) or share < 0:
        raise ConfigError(f"share_gb={own['share_gb']}: expected a number of GiB >= 0 (0: no shared prefill)")
    overwrite = _scalar(own.get("overwrite", "false"))
    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite={own['overwrite']}: expected true or false")
    return Args(policies, budgets, fields, passthrough, own.get("out"), own.get("name"), float(share), overwrite,
                "budgets" in own, thresholds, ray_options(own))


def ray_options(own: dict[str, str]) -> Any:
    """executor=ray's options (evals.ray_grid.RayOptions), or None for executor=local."""
    executor = own.get("executor", "local")
    if executor not in EXECUTORS:
        raise ConfigError(f"executor={executor}: choose from {list(EXECUTORS)}")
    given = [k for k in own if k.startswith("ray.")]
    if executor == "local":
        if given:
            raise ConfigError(f"{given[0]}: a Ray option; give executor=ray with it")
        return None
    from evals.ray_grid import RayOptions  # no Ray import: only its options

    workers = _scalar(own["ray.workers"]) if "ray.workers" in own else None
    try:
        return RayOptions(address=own.get("ray.address", "local"), workers=workers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# -- the plan: every job sized and validated, nothing loaded ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """One evals.run job: a policy at a budget (budget None: the full reference)."""

    policy: str
    budget: int | float | None
    policy_obj: kvpolicies.Policy
    overrides: tuple[str, ...]
    conf: dict[str, Any]
    key: str
    target_bytes: int  # the budget over all layers (full: its own stored bytes)
    compression: float  # 1 - target / full cache bytes (full: 0; a threshold: measured, in `cells`)
    threshold: float | None = None  # a kvzap threshold job (budget None)

    @property
    def label(self) -> str:
        return "full" if self.policy == "full" else f"threshold {self.threshold:g}" if self.threshold is not None \
            else str(self.budget)


@dataclasses.dataclass
class Plan:
    jobs: list[Job]  # full first, then policy by policy, budgets in column order
    policies: list[str]
    budgets: list[int | float]  # column order: most compressed first
    task: str
    model: str
    data: str
    max_len: int
    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    codec: str
    results: str
    out: Path
    stem: str
    progress: bool
    share_bytes: int = 0  # memory for shared prompt states (evals.prefills)
    notes: list[str] = dataclasses.field(default_factory=list)  # what the sizing changed, said before the run
    ray: Any = None  # evals.ray_grid.RayOptions: the jobs run on Ray actors (executor=ray), else in this process


def model_dims(mconf: dict[str, Any]):
    """The LlamaConfig of a model config, without weights (tiny_recall: from its TrainConfig)."""
    from evals import zoo

    try:
        mc = zoo.describe(mconf)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mc is None:  # tiny_recall: the dimensions its trainer uses
        from evals.recall_model import TrainConfig

        mc = TrainConfig(**{k: v for k, v in mconf.items() if k not in ("name", "cache_dir")}).model_config()
    return mc


def run_length(conf: dict[str, Any]) -> int:
    """The max_len of the task's engine: the length the cache is sized for."""
    from evals.config import task_extent

    extent = task_extent(conf)
    if extent is not None:
        _, length, gen, _ = extent
        return length + gen
    if conf["task"]["name"] == "recall":
        from evals import retrieval

        return max(retrieval.check(conf["task"])["n_pairs"]) + 2
    raise ConfigError(f"task={conf['task']['name']}: compare does not know its sequence length")


def _value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)


def policy_overrides(name: str, policy: kvpolicies.Policy) -> list[str]:
    """evals.run overrides that build exactly `policy`: every scalar field explicit (codec: the run's)."""
    out = [f"policy={name}"]
    for f in dataclasses.fields(policy):
        if f.name == "codec" or not f.init or f.metadata.get("engine") and getattr(policy, f.name) == f.default:
            continue  # (an engine-set field at its default: not a command-line key)
        v = getattr(policy, f.name)
        if isinstance(v, (bool, int, float, str)):
            out.append(f"policy.{f.name}={_value(v)}")
        elif f.default is dataclasses.MISSING or v != f.default:
            raise ConfigError(f"{name}.{f.name}={v!r}: not a scalar, evals.run cannot set it")
    return out


def compose_run(overrides: list[str]) -> dict[str, Any]:
    from evals.config import compose, validate

    try:
        return validate(compose(overrides))
    except ConfigError as e:
        msg = str(e)
        if "unknown key" in msg and "; the config has keys" in msg:
            msg += f" (and evals.compare's: {_own_keys()})"
        raise ConfigError(msg) from None


def _data_name(conf: dict[str, Any]) -> str:
    hay = (conf.get("task") or {}).get("haystack")
    if hay in ("pg", "filler"):  # a RULER-style task that reads its own haystack, not data=
        return "the PG essays" if hay == "pg" else "filler text"
    data = conf["data"]
    return Path(str(data.get("spec", ""))).stem if data.get("name") == "path" else str(data.get("name", ""))


def plan(argv: Sequence[str]) -> Plan:
    """Parse, size and validate every job (configs composed, policies built and compared with the
    sized ones, the text's token count checked with the tokenizer); no weights load."""
    from evals import zoo
    from evals.config import build_policy, check_text, size_policy, task_extent
    from evals.run import run_key
    from kvpolicies import budgets as B

    if any(a.split("=", 1)[0] == "protocols" for a in argv):
        raise ConfigError("protocols: one plan per protocol; `plans` splits the command line")
    args = parse_args(argv)
    base = compose_run(args.passthrough + ["policy=full"])
    mc = model_dims(base["model"])
    max_len, dtype = run_length(base), zoo.dtype(base["model"])
    extent = task_extent(base)
    gen = extent[2] if extent is not None else 0
    notes: list[str] = []
    codec = base["codec"]
    dims = dict(max_len=max_len, kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, dtype=dtype)
    full_layer = B.target_bytes(1.0, **dims)
    targets = {b: B.target_bytes(b, **dims) for b in args.budgets}
    over = [b for b, t in targets.items() if t > full_layer]
    if over:
        raise ConfigError(f"budgets: {over[0]} tokens is more than the full cache at the run's length "
                          f"({max_len} tokens): nothing to compress")
    budgets = sorted(args.budgets, key=lambda b: (targets[b], isinstance(b, int)))
    ref = build_policy(base["policy"])
    jobs = [Job("full", None, ref, tuple(args.passthrough + ["policy=full"]), base, run_key(base, ref),
                full_layer * mc.n_layers, 0.0)]
    for name in args.policies:
        for b in budgets:
            try:
                pol, shrunk = size_policy(name, b, gen=gen, codec=codec, fixed=args.fields.get(name, {}),
                                          n_layers=mc.n_layers, **dims)
            except ValueError as e:
                where = " ".join(f"{name}.{k}={v}" for k, v in args.fields.get(name, {}).items())
                if isinstance(e, B.BudgetTooSmall) and not args.budgets_given:  # a default budget too small
                    notes.append(f"{name} at budget {b:g} left out: it cannot be sized to it at max_len={max_len} "
                                 f"({e}); its cell is '-' (budgets=[...] to choose the budgets)")
                    continue
                raise ConfigError(f"policies: {name} at budget {b}{' with ' + where if where else ''} "
                                  f"(max_len={max_len}): {e}") from None
            for field, (was, now) in (shrunk or {}).items():
                notes.append(f"{name} at budget {b}: {field} lowered from {was} to {now} to fit (the run generates "
                             f"{gen} tokens after its prompt; set {name}.{field}=... to hold it)")
            overrides = args.passthrough + policy_overrides(name, pol)
            conf = compose_run(overrides)
            built = build_policy(conf["policy"])
            if built != pol:
                raise ConfigError(f"{name} at budget {b}: evals.run builds {built} from {overrides}, not the sized "
                                  f"{pol}")
            jobs.append(Job(name, b, pol, tuple(overrides), conf, run_key(conf, built),
                            targets[b] * mc.n_layers, 1.0 - targets[b] / full_layer))
    for t in args.thresholds:  # kvzap by a threshold: capped at the whole run, stored at what it keeps
        try:
            pol = kvpolicies.get("kvzap", **{"max_new": gen, **args.fields.get("kvzap", {}), "budget": max_len,
                                             "rule": "threshold", "threshold": t})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"thresholds: kvzap at threshold {t:g}: {e}") from None
        overrides = args.passthrough + policy_overrides("kvzap", pol) + [f"fit={THRESHOLD_FIT}"]
        conf = compose_run(overrides)
        jobs.append(Job(THRESHOLD_POLICY, None, pol, tuple(overrides), conf, run_key(conf, build_policy(conf["policy"])),
                        full_layer * mc.n_layers, float("nan"), threshold=t))
    if zoo.has_tokenizer(base["model"]):  # the checks that need the tokenizer, still before the weights
        from evals.data import load_text

        check_text(base, zoo.load_tokenizer(base["model"]), load_text(base["data"]["spec"]))
    results = base["results"]
    out = Path(args.out) if args.out else Path(results).parent / "compare"
    stem = args.name or default_stem(base)
    check_outputs(out, stem, [j.key for j in jobs], args.overwrite or bool(base["force"]))
    if args.ray is not None and base["force"]:
        raise ConfigError("force=true: executor=ray merges shards, keeping the first row of a key; redo runs "
                          "in this process (executor=local)")
    return Plan(jobs, args.policies, budgets, base["task"]["name"], base["model"]["name"], _data_name(base),
                max_len, mc.n_layers, mc.n_kv_heads, mc.head_dim, dtype.name, codec, results, out, stem,
                bool(base["progress"]), int(args.share_gb * (1 << 30)), notes, ray=args.ray)


def default_stem(conf: dict[str, Any]) -> str:
    """<task>-<model>-<length>[-<codec>] of a composed run config."""
    codec = conf["codec"]
    return "-".join([conf["task"]["name"], conf["model"]["name"], str(run_length(conf))]
                    + ([codec] if codec != "none" else []))


OUTPUTS = (".md", ".tex", ".csv", ".png", ".pdf")


def check_outputs(out: Path, stem: str, keys: Sequence[str], overwrite: bool) -> None:
    """Refuse (ConfigError, before any job runs) to overwrite `<out>/<stem>.*` written by another
    comparison (other run keys in its .csv) unless `overwrite`; the same comparison again rewrites
    its own files."""
    import csv

    existing = [out / f"{stem}{ext}" for ext in OUTPUTS if (out / f"{stem}{ext}").exists()]
    if not existing or overwrite:
        return
    table = out / f"{stem}.csv"
    try:
        with open(table, newline="", encoding="utf-8") as f:
            before = {r.get("key") for r in csv.DictReader(f)}
    except (OSError, ValueError):
        before = set()
    if before != set(keys):
        raise ConfigError(f"out={out} name={stem}: {existing[0]} holds another comparison (other runs); pass "
                          "name=<another stem> or out=<another folder>, or overwrite=true to replace it")


# -- the cells: numbers read back from the results file ----------------------------------------------


def score_of(row: dict[str, Any]) -> tuple[str, float, bool]:
    """(metric, value, lower is better): perplexity for perplexity, the agreement with full's own
    generation for longgen (its answers' accuracy stays in the rows), else accuracy."""
    m = row.get("metrics", {})
    for name, lower in (("ppl", True), ("agreement", False), ("accuracy", False)):
        if m.get(name) is not None:
            return name, float(m[name]), lower
    raise ValueError(f"row {row.get('key')}: no ppl, agreement or accuracy among its metrics {sorted(m)}")


def cells(p: Plan, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per job, from the latest row of its key: policy, budget, compression, params,
    metric, score, lower, state_bytes (measured), target_bytes, max_len (the row's), key."""
    from evals import results as R

    import warnings

    from evals.table import usable

    by_key = {r.get("key"): r for r in R.latest(usable(rows))}
    out = []
    full_bytes = None
    for j in p.jobs:
        row = by_key.get(j.key)
        if row is None:
            raise ValueError(f"no row with key {j.key} ({j.policy} at {j.label}) in {p.results}")
        if row.get("failed") and j.policy != "full":
            warnings.warn(f"{j.policy} at budget {j.budget}: its run failed ({row['failed']}); its cell is '-'",
                          stacklevel=2)
            continue
        metric, value, lower = score_of(row)
        mem, m = row.get("memory") or {}, row.get("metrics", {})
        ci = (m.get("ci_low"), m.get("ci_high")) if metric == "accuracy" else (None, None)
        stored, compression = mem.get("state_bytes"), j.compression
        if j.policy == "full":
            full_bytes = stored
        if j.threshold is not None:  # measured: the mean bytes stored per prompt, each layer at what it kept
            stored = mem.get("fitted_bytes")
            if stored is None or not full_bytes:
                raise ValueError(f"row {j.key} (kvzap at threshold {j.threshold:g}) has no fitted bytes")
            compression = 1.0 - stored / full_bytes
        out.append({"policy": j.policy, "budget": j.budget, "threshold": j.threshold, "compression": compression,
                    "params": row.get("params", ""), "metric": metric, "score": value, "lower": lower,
                    "ci_low": ci[0], "ci_high": ci[1],
                    "state_bytes": stored, "target_bytes": j.target_bytes,
                    "max_len": mem.get("max_len"), "key": j.key})
    return out


# -- the table ----------------------------------------------------------------------------------------


def budget_label(b: int | float, compression: float) -> str:
    return f"{b:g} (CR {compression:.3g})" if isinstance(b, float) else f"{b} tok (CR {compression:.3g})"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / MB:.4g} MB"


def _score(r: dict[str, Any]) -> str:
    """'score' or, for an accuracy with its Wilson interval, 'score [low, high]'."""
    from evals.table import fmt, fmt_interval

    if r.get("ci_low") is None or r.get("ci_high") is None:
        return fmt(r["score"])
    return fmt_interval(r["score"], r["ci_low"], r["ci_high"])


def grid(recs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]], str]:
    """(header, rows of cells, caption) of the comparison: the full reference first (its score in
    every column), then one row per policy; a cell is 'score (stored MB)', an accuracy with its
    Wilson 95 % interval in square brackets."""

    full = next(r for r in recs if r["policy"] == "full")
    cols: list[tuple[Any, float]] = []
    for r in recs:
        if r["budget"] is not None and (r["budget"], r["compression"]) not in cols:
            cols.append((r["budget"], r["compression"]))
    header = ["policy \\ budget"] + [budget_label(b, c) for b, c in cols]
    body = [[f"full ({_mb(full['state_bytes'])})"] + [_score(full)] * len(cols)]
    for name in dict.fromkeys(r["policy"] for r in recs if r["budget"] is not None):
        at = {r["budget"]: r for r in recs if r["policy"] == name}
        body.append([name] + [f"{_score(at[b])} ({_mb(at[b]['state_bytes'])})" if b in at else "-"
                              for b, _ in cols])
    from evals.table import label

    for r in (r for r in recs if r.get("threshold") is not None):  # at its measured ratio, not a budget column
        body.append([f"{THRESHOLD_POLICY} {r['threshold']:g}: CR {r['compression']:.3g} measured, "
                     f"{_score(r)} ({_mb(r['state_bytes'])})"] + [""] * len(cols))
    better = "lower" if full["lower"] else "higher"
    caption = (f"{label(full['metric'])} ({better} is better) by policy and budget; a budget is the stored cache bytes "
               f"(a float: that fraction of the full cache's, CR = compression ratio = 1 - it; an int: that many "
               f"full-precision tokens), sinks, windows, scales and positions included; in brackets the stored "
               f"KV cache measured, all layers, in MB (10^6 bytes)"
               + ("; an accuracy's Wilson 95 % interval in square brackets" if full.get("ci_low") is not None else "")
               + ("; kvzap by a threshold keeps what passes it, each layer stored at what it kept: its compression "
                  "ratio is measured (1 - its mean stored bytes over the prompts / full's), its row holds its score"
                  if any(r.get("threshold") is not None for r in recs) else ""))
    return header, body, caption


def markdown(recs: Sequence[dict[str, Any]], title: str = "") -> str:
    header, body, caption = grid(recs)
    lines = ([f"**{title}**", ""] if title else []) + [
        "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(c) + " |" for c in body]
    return "\n".join(lines + ["", caption])


def latex(recs: Sequence[dict[str, Any]], title: str = "", label: str = "tab:compare") -> str:
    """A complete booktabs `table` (`evals.table.tex_table`: caption = title + what the cells are,
    `label`; needs `\\usepackage{booktabs,graphicx}`); the full reference above a midrule."""
    from evals.table import tex_table

    header, body, caption = grid(recs)
    return tex_table(header, body, (f"{title}. " if title else "") + caption, label, rule_after=0) + "\n"


CSV_COLUMNS = ("policy", "budget", "compression", "params", "metric", "score", "ci_low", "ci_high", "state_bytes",
               "target_bytes", "max_len", "key", "threshold")


def csv_text(recs: Sequence[dict[str, Any]]) -> str:
    """One line per job, numbers unrounded (full: budget empty, compression 0)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in recs:
        w.writerow(["" if r.get(c) is None else r[c] for c in CSV_COLUMNS])
    return buf.getvalue()


# -- the plot -----------------------------------------------------------------------------------------


CLIP = 1.35  # perplexity axes end at CLIP x the full cache's; higher points sit on the edge, labelled
MARGIN = 1.25  # the byte axis spans the measured sizes times 1 / MARGIN to MARGIN


def plot(recs: Sequence[dict[str, Any]], out: Path, stem: str, title: str = "") -> list[Path]:
    """`<stem>.png` and `.pdf`: score vs compression ratio (left) and vs stored cache MB (right),
    one line per policy, the full cache's score as a horizontal line. A perplexity axis ends at
    CLIP x the full cache's (so the policies near it stay readable); a point above is drawn on the
    edge as a triangle with its value written beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from evals.plots import ticks_at, warn_single_points
    from evals.table import label

    full = next(r for r in recs if r["policy"] == "full")
    top = CLIP * full["score"] if full["lower"] and max(r["score"] for r in recs) > CLIP * full["score"] else None
    warn_single_points("evals.compare plot", {n: sum(r["policy"] == n for r in recs) for n in
                                              dict.fromkeys(r["policy"] for r in recs if r["policy"] != "full")},
                       "give two or more budgets (budgets=[0.25,0.5]) to draw lines")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, x, xlabel in ((axes[0], "compression", "compression ratio (1 - stored bytes / full cache's)"),
                          (axes[1], "mb", "stored KV cache, all layers (MB, 10^6 B, measured; log scale)")):
        ax.axhline(full["score"], color="black", linestyle="--", linewidth=1,
                   label=f"full ({full['score']:.4g}, {_mb(full['state_bytes'])})")
        for i, name in enumerate(dict.fromkeys(r["policy"] for r in recs if r["policy"] != "full")):
            pts = sorted((r for r in recs if r["policy"] == name and r["state_bytes"] is not None),
                         key=lambda r: r["compression"])
            xs = [r["compression"] if x == "compression" else r["state_bytes"] / MB for r in pts]
            ys = [r["score"] if top is None else min(r["score"], top) for r in pts]
            ax.plot(xs, ys, marker="o", color=f"C{i}", label=name)
            if all(r.get("ci_low") is not None for r in pts):  # accuracy: Wilson 95 % intervals
                # clipped at 0: a 0 or 1 accuracy sits on its interval's end up to rounding
                ax.errorbar(xs, ys, yerr=[[max(0.0, y - r["ci_low"]) for y, r in zip(ys, pts)],
                                          [max(0.0, r["ci_high"] - y) for y, r in zip(ys, pts)]],
                            fmt="none", ecolor=f"C{i}", alpha=0.5, capsize=3)
            for xi, r in zip(xs, pts):
                if top is not None and r["score"] > top:
                    ax.plot([xi], [top], marker="^", markersize=9, color=f"C{i}", clip_on=False)
                    ax.annotate(f"{r['score']:.3g}", (xi, top), xytext=(5, -10), textcoords="offset points",
                                fontsize=7, color=f"C{i}")
        if x == "mb":  # a log byte axis, a tick at each measured size (and at the full cache's)
            ax.set_xscale("log")
            sizes = [r["state_bytes"] / MB for r in recs if r["state_bytes"] and r["policy"] != "full"]
            ticks_at(ax.xaxis, sizes)
            if sizes:  # a margin of MARGIN x each side: equal bytes drawn together, not spread over a 0.1 % span
                ax.set_xlim(min(sizes) / MARGIN, max(sizes) * MARGIN)
            ax.tick_params(axis="x", labelsize=7)
        if top is not None:
            ax.set_ylim(top=top)
        elif not full["lower"]:
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{label(full['metric'])} ({'lower' if full['lower'] else 'higher'} is better)")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title or "quality vs cache bytes", fontsize=10)
    from evals import plots

    return plots.save_figure(fig, out, stem)


def title(p: Plan) -> str:
    codec = "" if p.codec == "none" else f", codec {p.codec}"
    return (f"{p.task}: {p.model} on {p.data}, {p.max_len} tokens{codec} ({p.n_layers} layers x {p.kv_heads} kv "
            f"heads x head_dim {p.head_dim}, {p.dtype})")


def write(p: Plan, recs: Sequence[dict[str, Any]]) -> list[Path]:
    """The table (.md, .tex, .csv) and the plot (.png, .pdf) under p.out."""
    p.out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext, text in ((".md", markdown(recs, title(p)) + "\n"), (".tex", latex(recs, title(p), f"tab:{p.stem}")),
                      (".csv", csv_text(recs))):
        path = p.out / f"{p.stem}{ext}"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths + plot(recs, p.out, p.stem, title(p))


# -- running ------------------------------------------------------------------------------------------


def run(p: Plan) -> list[dict[str, Any]]:
    """Run (or skip, if their rows are there) every job in this process, one progress bar over the
    jobs; then read the rows back and write the table and plot. Returns the cells."""
    import logging

    from tqdm.auto import tqdm

    from evals import prefills
    from evals import results as R
    from evals.run import run_config

    logging.getLogger("jax").setLevel(logging.WARNING)
    if p.ray is not None:  # every job a Ray task, rows in shards merged into p.results
        from evals import ray_grid

        ray_grid.run([j.conf for j in p.jobs], p.results, p.ray, progress=p.progress, say=tqdm.write)
        return _read_cells(p)
    bar = tqdm(total=len(p.jobs), desc="compare", unit="job", position=0, disable=not p.progress)
    order = sorted(p.jobs, key=lambda j: j.policy == "full")  # full last: it can compress any dense prompt state
    try:
        with prefills.sharing(p.share_bytes) as store:
            for j in order:
                bar.set_postfix_str(f"{j.policy} @ {j.label}")
                row, ran = run_config(j.conf)
                if row.get("failed"):
                    tqdm.write(f"[evals.compare] {j.policy} @ {j.label}: the run failed ({row['failed']})")
                    bar.update()
                    continue
                metric, value, _ = score_of(row)
                mem = (row.get("memory") or {}).get("state_bytes")
                secs = (row.get("timings") or {}).get("total_s")
                how = f"ran in {secs:.0f} s" if ran and secs is not None else "ran" if ran else "already there"
                fitted = (row.get("memory") or {}).get("fitted_bytes")
                tqdm.write(f"[evals.compare] {j.policy} {row.get('params', '')} @ {j.label}: {metric} {value:.4g}, "
                           + (f"{_mb(fitted)} stored on average ({how})" if j.threshold is not None
                              else f"{_mb(mem)} (budget {_mb(j.target_bytes)}; {how})"))
                if j.threshold is None and mem is not None and mem > j.target_bytes:
                    tqdm.write(f"[evals.compare] warning: {j.policy} at {j.budget} stores {mem} bytes, over its "
                               f"budget of {j.target_bytes}")
                bar.update()
        if store.hits:
            tqdm.write(f"[evals.compare] shared prefill: {store.prefills} prompt prefills ran, {store.hits} were "
                       "taken from an earlier job's state")
    finally:
        bar.close()
    return _read_cells(p)


def _read_cells(p: Plan) -> list[dict[str, Any]]:
    """The cells of every job, from the results file (one line on a missing row, no traceback)."""
    from tqdm.auto import tqdm

    from evals import results as R

    try:
        recs = cells(p, R.read(p.results))
    except ValueError as e:  # a row missing or without a score: one line, not a traceback
        print(f"evals.compare: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    for r in recs:
        if r["max_len"] != p.max_len:
            tqdm.write(f"[evals.compare] warning: row {r['key']} measured memory at max_len={r['max_len']}, "
                       f"sized for {p.max_len}")
    return recs


def plans(argv: Sequence[str]) -> list[Plan]:
    """One `Plan` per protocol of `protocols=[...]` (the task's `task.protocol` set, the stem
    suffixed with it), or the one plan of `argv`; all planned before any job runs."""
    rest = [a for a in argv if a.split("=", 1)[0] != "protocols"]
    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == "protocols"]
    if not given:
        return [plan(rest)]
    from evals.ruler import PROTOCOLS

    protocols = list_value("protocols", given[-1])
    bad = [x for x in protocols if x not in PROTOCOLS]
    if bad:
        raise ConfigError(f"protocols={given[-1]}: {bad[0]!r} is not a protocol; choose from {list(PROTOCOLS)}")
    if any(a.lstrip("+~").startswith("task.protocol=") for a in rest):
        raise ConfigError("task.protocol: set by protocols=[...] for each comparison; give one or the other")
    passthrough = parse_args(rest).passthrough
    base = compose_run(passthrough + ["policy=full"])
    if "protocol" not in base["task"]:
        raise ConfigError(f"protocols={given[-1]}: task={base['task']['name']} has no protocol "
                          "(a RULER-style task has: passkey, niah, multikey, ruler_*, multiquery)")
    named = [a for a in rest if a.split("=", 1)[0] == "name"]
    stem = named[-1].split("=", 1)[1] if named else default_stem(base)
    rest = [a for a in rest if a.split("=", 1)[0] != "name"]
    return [plan(rest + [f"task.protocol={x}", f"name={stem}-{x}"]) for x in protocols]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the cells of the table."""
    from evals.progress import warnings_as_lines

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return []
    from evals.run import interrupt_as_line

    from evals.compiles import CompileLog, use_fast_compile, use_persistent_cache

    use_fast_compile()
    use_persistent_cache()

    with warnings_as_lines("evals.compare"), interrupt_as_line("evals.compare"), CompileLog() as log:
        try:
            ps = plans(argv)
        except ConfigError as e:
            print(f"evals.compare: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        out = []
        for p in ps:
            thr = [f"{j.threshold:g}" for j in p.jobs if j.threshold is not None]
            print(f"[evals.compare] {len(p.jobs)} jobs: full + {', '.join(p.policies)} x budgets "
                  f"{', '.join(map(str, p.budgets))}" + (f" + kvzap at thresholds {', '.join(thr)}" if thr else "")
                  + f"; {title(p)}; results {p.results}")
            for note in p.notes:
                print(f"[evals.compare] note: {note}")
            recs = run(p)
            try:
                paths = write(p, recs)
            except ValueError as e:
                print(f"evals.compare: error: {e}", file=sys.stderr)
                raise SystemExit(1) from None
            print(markdown(recs, title(p)))
            for path in paths:
                print(f"wrote {path}")
            protocol = p.jobs[0].conf["task"].get("protocol")
            out += [r | {"protocol": protocol} for r in recs] if len(ps) > 1 else recs
        print(f"[evals.compare] {log.line()}")
    return out


if __name__ == "__main__":
    main()
