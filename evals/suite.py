"""`python -m evals.suite`: a task set x policies x budgets -> one table per task (evals.compare's)
and one averaged table (RULER's average over tasks), every accuracy with its Wilson 95 % interval.

    python -m evals.suite tasks=ruler task.lengths=[8192] policies=[sink,snapkv,h2o] budgets=[0.25] extra=[quest,kivi]
    python -m evals.suite tasks=ruler task.protocol=query_agnostic task.trials=10 model=qwen

(SmolLM2's tokenizer writes each digit as a token: its common-words list of 10 words x 30 does not fit
in 4,096 tokens, hence task.lengths=[8192] above.)
    python -m evals.suite tasks=[ruler_niah_single,ruler_vt] policies=[snapkv] budgets=[256,512]

Keys of its own:

    tasks=ruler | [t1,t2,...]   `ruler` is configs/task/ruler.yaml: its `tasks` list, and its other
                                keys (lengths, trials, protocol) applied to every task as task.<key>
                                (a task.<key>= on the command line wins)
    extra=[quest,kivi]          policies without a token budget, run once each as configured
    out=DIR                     where the tables go (default <results folder>/suite)
    name=STEM                   the averaged table's file name (default suite-<model>-<protocol>)

Every other key is evals.compare's (policies=, budgets=, <policy>.<field>=) or evals.run's (model=,
task.<key>=, seed=, results=, ...). Each (task, policy, budget) is an ordinary evals.run row of the
results file (skipped when its key is there), so an interrupted suite resumes.

Average: per policy and budget, the mean of the task accuracies (RULER's average); its interval is
Wilson's on the pooled trials (successes summed over tasks, out of all trials): an approximation
(the tasks have different difficulty, and string_match_all gives partial credit).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evals.config import CONFIG_DIR, ConfigError

OWN = ("tasks", "extra", "out", "name")


@dataclasses.dataclass
class SuiteArgs:
    tasks: list[str]
    task_keys: dict[str, Any]  # the set's shared task keys (task.<key>=value for every task)
    extra: list[str]
    compare_argv: list[str]
    out: str | None
    name: str | None


def task_set(spec: str) -> tuple[list[str], dict[str, Any]]:
    """`ruler` (or any configs/task/<name>.yaml with a `tasks` list) -> (tasks, shared keys);
    '[a,b]' -> ([a, b], {})."""
    from omegaconf import OmegaConf

    from evals.compare import list_value
    from evals.config import TASKS

    names = list_value("tasks", spec)
    if len(names) == 1 and names[0] not in TASKS:
        path = CONFIG_DIR / "task" / f"{names[0]}.yaml"
        node = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None
        if not isinstance(node, dict) or not isinstance(node.get("tasks"), list):
            raise ConfigError(f"tasks={spec}: neither a task nor a task set (configs/task/<name>.yaml with `tasks`)")
        return list(node["tasks"]), {k: v for k, v in node.items() if k not in ("name", "tasks")}
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise ConfigError(f"tasks={spec}: {bad[0]!r} is not a task; choose from {sorted(TASKS)} or tasks=ruler")
    return names, {}


def parse_args(argv: Sequence[str]) -> SuiteArgs:
    from evals.compare import list_value

    own, rest = {}, []
    for item in argv:
        key = item.split("=", 1)[0]
        if key in OWN and "=" in item:
            own[key] = item.split("=", 1)[1]
        elif key == "task":
            raise ConfigError("task=...: the suite sets the task of each job; give tasks=ruler or tasks=[a,b]")
        else:
            rest.append(item)
    tasks, keys = task_set(own.get("tasks", "ruler"))
    given = {item.split("=", 1)[0].removeprefix("task.") for item in rest if item.startswith("task.")}
    keys = {k: v for k, v in keys.items() if k not in given}
    extra = list_value("extra", own["extra"]) if "extra" in own else []
    import kvpolicies

    for p in extra:
        if p not in kvpolicies.POLICIES:
            raise ConfigError(f"extra=[{','.join(extra)}]: {p!r} is not a registered policy")
    return SuiteArgs(tasks, keys, extra, rest, own.get("out"), own.get("name"))


def _override(k: str, v: Any) -> str:
    if isinstance(v, list):
        return f"task.{k}=[{','.join(map(str, v))}]"
    if isinstance(v, bool):
        return f"task.{k}={'true' if v else 'false'}"
    return f"task.{k}={v}"


def task_argv(a: SuiteArgs, task: str) -> list[str]:
    """The evals.compare command line of one task of the suite."""
    return [f"task={task}"] + [_override(k, v) for k, v in a.task_keys.items()] + a.compare_argv


def _accuracy(row: dict[str, Any]) -> tuple[float, int]:
    m = row.get("metrics", {})
    trials = sum(g.get("trials", 0) for g in row.get("grid", []) if "question" not in g) or \
        sum(g.get("trials", 0) for g in row.get("grid", []))
    return float(m["accuracy"]), int(trials)


def average(tables: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per (policy, budget) present in every task: the per-task accuracies, their mean
    and the pooled Wilson interval. `tables`: task -> records {policy, budget, score, trials}."""
    from evals.common import wilson

    keys = None
    for recs in tables.values():
        ks = [(r["policy"], r["budget"]) for r in recs]
        keys = ks if keys is None else [k for k in keys if k in ks]
    out = []
    for k in keys or []:
        per = {t: next(r for r in recs if (r["policy"], r["budget"]) == k) for t, recs in tables.items()}
        succ = sum(r["score"] * r["trials"] for r in per.values())
        n = sum(r["trials"] for r in per.values())
        lo, hi = wilson(succ, n)
        out.append({"policy": k[0], "budget": k[1], "scores": {t: r["score"] for t, r in per.items()},
                    "average": sum(r["score"] for r in per.values()) / len(per), "ci_low": lo, "ci_high": hi,
                    "trials": n, "state_bytes": {t: r.get("state_bytes") for t, r in per.items()}})
    return out


def markdown(avg: Sequence[dict[str, Any]], tasks: Sequence[str], title: str = "") -> str:
    header = ["policy", "budget"] + list(tasks) + ["average (95% CI)"]
    lines = ([f"**{title}**", ""] if title else []) + ["| " + " | ".join(header) + " |",
                                                      "|---|---|" + "---:|" * (len(header) - 2)]
    for r in avg:
        b = "-" if r["budget"] is None else f"{r['budget']:g}"
        cells = [f"{r['scores'][t]:.2f}" for t in tasks]
        lines.append("| " + " | ".join([r["policy"], b] + cells + [
            f"{r['average']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"]) + " |")
    return "\n".join(lines + ["", "Cells: accuracy (RULER's string_match_all); average: the mean over tasks, "
                                  "interval Wilson 95 % on the pooled trials."])


def csv_text(avg: Sequence[dict[str, Any]], tasks: Sequence[str]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "budget", *tasks, "average", "ci_low", "ci_high", "trials"])
    for r in avg:
        w.writerow([r["policy"], "" if r["budget"] is None else r["budget"], *(r["scores"][t] for t in tasks),
                    r["average"], r["ci_low"], r["ci_high"], r["trials"]])
    return buf.getvalue()


def run(argv: Sequence[str]) -> tuple[list[dict[str, Any]], list[Path]]:
    """Plan every task's comparison first (all jobs validated before any weights load), run them,
    write each task's table (evals.compare) and the averaged one; returns (average, paths)."""
    from evals import compare
    from evals import results as R
    from evals.compare import compose_run
    from evals.run import run_config, run_key
    from evals.config import build_policy

    a = parse_args(argv)
    plans = {t: compare.plan(task_argv(a, t)) for t in a.tasks}
    extras = {t: [(p, compose_run([f"task={t}"] + [_override(k, v) for k, v in a.task_keys.items()]
                               + [x for x in a.compare_argv if not x.startswith(("policies=", "budgets="))]
                               + [f"policy={p}"])) for p in a.extra] for t in a.tasks}
    tables: dict[str, list[dict[str, Any]]] = {}
    paths: list[Path] = []
    for t, p in plans.items():
        recs = compare.run(p)
        paths += compare.write(p, recs)
        for pname, conf in extras[t]:
            run_config(conf)
        rows = {r.get("key"): r for r in R.latest(R.read(p.results))}
        table = []
        for r in recs:
            acc, trials = _accuracy(rows[r["key"]])
            table.append(r | {"trials": trials, "score": acc})
        for pname, conf in extras[t]:
            row = rows[run_key(conf, build_policy(conf["policy"]))]
            acc, trials = _accuracy(row)
            table.append({"policy": pname, "budget": None, "score": acc, "trials": trials,
                          "state_bytes": (row.get("memory") or {}).get("state_bytes")})
        tables[t] = table
    avg = average(tables)
    first = next(iter(plans.values()))
    protocol = a.task_keys.get("protocol") or next(
        (x.split("=", 1)[1] for x in a.compare_argv if x.startswith("task.protocol=")), "query_aware")
    out = Path(a.out) if a.out else Path(first.results).parent / "suite"
    stem = a.name or f"suite-{first.model}-{protocol}"
    out.mkdir(parents=True, exist_ok=True)
    title = f"{', '.join(a.tasks)}: {first.model}, {protocol}"
    for ext, text in ((".md", markdown(avg, a.tasks, title) + "\n"), (".csv", csv_text(avg, a.tasks))):
        (out / f"{stem}{ext}").write_text(text, encoding="utf-8")
        paths.append(out / f"{stem}{ext}")
    print(markdown(avg, a.tasks, title))
    return avg, paths


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(x in ("-h", "--help") for x in argv):
        print(__doc__)
        return []
    from evals.compiles import CompileLog, use_fast_compile, use_persistent_cache
    from evals.run import interrupt_as_line

    use_fast_compile()
    use_persistent_cache()

    with interrupt_as_line("evals.suite"), CompileLog() as log:
        try:
            avg, paths = run(argv)
        except ConfigError as e:
            print(f"evals.suite: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    for p in paths:
        print(f"wrote {p}")
    print(f"[evals.suite] {log.line()}")
    return avg


if __name__ == "__main__":
    main()
