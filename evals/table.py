r"""`python -m evals.table RESULTS... [--out PREFIX [--force]]`: compare runs as Markdown, LaTeX and CSV.

One table per task (their metrics differ): a row per run (the latest row of each config key),
`full` first, then by policy name and stored bytes. Columns (defined in docs/guide/evals.md):
model, data, policy, params, codec, budget (the run's `budget=`, "-" if none; "(not sized)" when
the policy has no token budget), `KV / full` (the stored cache bytes over the full cache's at the
same length and dtype: 1 - compression ratio), the task's metrics with human names (`perplexity`,
`tok/s`, `compile (s)`...), then the cache memory in MB (10^6 bytes): `KV cache (MB, 10^6 B)`
(exact state bytes, kv + meta), `fitted (MB, 10^6 B)` (runs with `fit`: the mean bytes stored
per prompt, each layer at what it kept; `KV / full` then uses it), `closed form (MB, 10^6 B)` (2 x layers x kv_heads x head_dim x
slots x bytes, where it applies), `read/step (MB, 10^6 B)` (policies that read less than they
store) and `peak device (MB, 10^6 B)` (GPU only); a memory column nobody filled is dropped. A row
recorded as failed (NaN metrics) is marked "(failed)". Markdown goes to stdout (and PREFIX.md);
PREFIX.tex holds one complete booktabs `table` per task (caption, label, `\resizebox` to the text
width: needs `\usepackage{booktabs,graphicx}`), PREFIX.csv one long table with every metric
unrounded and raw metric names. Existing PREFIX files are not overwritten without --force.

An accuracy with a binomial interval (metrics `accuracy<sfx>`, `ci_low<sfx>`, `ci_high<sfx>`, Wilson
95 %, from the retrieval and RULER-style tasks) is one cell, "0.80 [0.49, 0.94]"; the CSV keeps the
three columns. Runs of a task under the query-agnostic protocol (`task.protocol=query_agnostic`)
get their own table, "task [query_agnostic]"; query_aware, the default, is unlabelled.
A row that is not a results row (a foreign JSON object, wrong types) is skipped with one warning line.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evals import results as R

MB = 1e6
# Metrics shown first, in this order; the rest follow in first-seen order.
PREFERRED = ("ppl", "ppl_in", "ppl_out", "ppl_last", "accuracy", "tokens", "tokens_per_s", "compile_s")
HIDDEN = ("nll", "score_s")  # derivable from others; kept in the CSV
# Human column names (Markdown and LaTeX; the CSV keeps the raw metric names).
LABELS = {"ppl": "perplexity", "ppl_in": "perplexity (within trained length)",
          "ppl_out": "perplexity (past trained length)", "ppl_last": "perplexity (last segment)",
          "tokens_per_s": "tok/s", "compile_s": "compile (s)", "nll": "NLL (nats/token)", "tokens": "tokens",
          "agreement": "agreement with full's generation"}
MEMORY = (("KV cache (MB, 10^6 B)", "state_bytes"), ("fitted (MB, 10^6 B)", "fitted_bytes"),
          ("closed form (MB, 10^6 B)", "closed_form_bytes"),
          ("read/step (MB, 10^6 B)", "read_bytes_per_step"), ("peak device (MB, 10^6 B)", "peak_device_bytes"))
ID_COLUMNS = ("model", "data", "policy", "params", "codec", "budget", "KV / full")
N_TEXT = 5  # the first N_TEXT columns are text (left-aligned), the rest numbers


def label(metric: str) -> str:
    """A metric's column name for people ("perplexity", "tok/s"); unknown metrics as they are."""
    return LABELS.get(metric, metric)


def full_bytes(row: dict[str, Any]) -> int | None:
    """The stored bytes of a `full` cache for the row's model at its memory's length and dtype (all
    layers), or None when the row does not say."""
    from kvpolicies import Full
    from kvpolicies.memory import state_bytes

    model, mem = row.get("model") or {}, row.get("memory") or {}
    try:
        one = state_bytes(Full(), kv_heads=int(model["kv_heads"]), head_dim=int(model["head_dim"]),
                          max_len=int(mem["max_len"]), dtype=str(mem.get("dtype") or model.get("dtype"))).total
        return one * int(mem.get("layers") or model["layers"])
    except (KeyError, TypeError, ValueError):
        return None


def _budget_cell(row: dict[str, Any]) -> str:
    b = row.get("budget")
    if not isinstance(b, dict) or b.get("budget") is None:
        return "-"
    return f"{b['budget']:g}" + ("" if b.get("sized", True) else " (not sized)")


def stored_bytes(row: dict[str, Any]) -> Any:
    """The row's stored cache bytes: measured per prompt when `fit` stored each layer at what it
    kept (`fitted_bytes`, the mean over prompts), else the state's exact bytes."""
    mem = row.get("memory") or {}
    return mem["fitted_bytes"] if mem.get("fitted_bytes") is not None else mem.get("state_bytes")


def _ratio_cell(row: dict[str, Any]) -> str:
    stored, full = stored_bytes(row), full_bytes(row)
    return "-" if not isinstance(stored, (int, float)) or not full else f"{stored / full:.3f}"


def order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`full` first, then by policy name, then by stored bytes (the budget), then params."""

    def key(r):
        name = str((r.get("policy") or {}).get("name", ""))
        stored = stored_bytes(r)
        return (name != "full", name, stored if isinstance(stored, (int, float)) else float("inf"),
                str(r.get("params", "")))

    return sorted(rows, key=key)


def _data_name(row: dict[str, Any]) -> str:
    config = row.get("config", {})
    hay = (config.get("task") or {}).get("haystack")
    if hay in ("pg", "filler"):  # a RULER-style task that reads its own haystack, not data=
        return hay
    data = config.get("data", {})
    if data.get("name") == "path":
        return Path(str(data.get("spec", ""))).name
    return str(data.get("name", ""))


def _codec_label(codec: dict[str, Any]) -> str:
    """A codec record's registry name: its format, `_after_rope` when it encodes after RoPE."""
    return str(codec.get("name", "none")) + ("_after_rope" if codec.get("after_rope") else "")


def _ids(row: dict[str, Any]) -> dict[str, Any]:
    policy = str(row.get("policy", {}).get("name", "")) + (" (failed)" if row.get("failed") else "")
    return {"model": row.get("model", {}).get("name", ""), "data": _data_name(row),
            "policy": policy, "params": row.get("params", ""),
            "codec": _codec_label(row.get("policy", {}).get("codec", {})), "budget": _budget_cell(row),
            "KV / full": _ratio_cell(row)}


def row_problem(row: Any) -> str | None:
    """Why `row` is not a results row a table can show (a foreign JSON object, wrong types), or None."""
    if not isinstance(row, dict):
        return "not an object"
    for field, types in (("key", str), ("task", str), ("metrics", dict), ("policy", dict)):
        if not isinstance(row.get(field), types):
            return f"its {field!r} is {type(row.get(field)).__name__ if field in row else 'missing'}"
    for field in ("memory", "model", "config", "budget"):
        if row.get(field) is not None and not isinstance(row[field], dict):
            return f"its {field!r} is {type(row[field]).__name__}, not an object"
    bad = [k for k, v in row["metrics"].items() if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if bad:
        return f"its metric {bad[0]!r} is {row['metrics'][bad[0]]!r}, not a number"
    mem = row.get("memory") or {}
    bad = [k for k, v in mem.items() if k.endswith("bytes") and v is not None and not isinstance(v, (int, float))]
    if bad:
        return f"its memory {bad[0]!r} is {mem[bad[0]]!r}, not a number"
    return None


def usable(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The rows a table or plot can show; each other one is skipped with one warning line naming
    its file and line (`_file`, `_line` when `results.read` gave them)."""
    import warnings

    out = []
    for r in rows:
        why = row_problem(r)
        if why is None:
            out.append(r)
        else:
            where = f"{r.get('_file', '?')}, line {r.get('_line', '?')}" if isinstance(r, dict) else "a row"
            warnings.warn(f"{where}: not a results row ({why}), skipped", stacklevel=2)
    return out


def task_label(row: dict[str, Any]) -> str:
    """The row's task, with its protocol unless it is the default query_aware ("ruler_vt
    [query_agnostic]")."""
    protocol = (row.get("config", {}).get("task") or {}).get("protocol")
    task = str(row.get("task", "?"))
    return f"{task} [{protocol}]" if protocol not in (None, "query_aware") else task


def by_task(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Latest row per key, grouped by task and protocol (in first-seen order)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in R.latest(rows):
        out.setdefault(task_label(r), []).append(r)
    return {task: order(rs) for task, rs in out.items()}


def interval_metrics(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """accuracy<sfx> -> (ci_low<sfx>, ci_high<sfx>) for the metrics that have both bounds."""
    out = {}
    for m in names:
        if m.startswith("accuracy"):
            sfx = m[len("accuracy"):]
            if f"ci_low{sfx}" in names and f"ci_high{sfx}" in names:
                out[m] = (f"ci_low{sfx}", f"ci_high{sfx}")
    return out


def fmt_interval(acc: Any, lo: Any, hi: Any) -> str:
    """'0.80 [0.49, 0.94]' (an accuracy and its interval), or fmt(acc) without bounds."""
    if acc is None or lo is None or hi is None:
        return fmt(acc)
    return f"{acc:.2f} [{lo:.2f}, {hi:.2f}]"


def metric_names(rows: Sequence[dict[str, Any]], hidden: Sequence[str] = HIDDEN) -> list[str]:
    seen: list[str] = []
    for r in rows:
        seen += [k for k in r.get("metrics", {}) if k not in seen]
    first = [m for m in PREFERRED if m in seen]
    return first + [m for m in seen if m not in first and m not in hidden]


def memory_columns(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(label, f) for label, f in MEMORY if any((r.get("memory") or {}).get(f) is not None for r in rows)]


def fmt(v: Any) -> str:
    """Numbers for humans: ints as is, floats to 4-5 significant digits, None as '-'."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3f}"


def grid(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of one task's table."""
    metrics, memory = metric_names(rows), memory_columns(rows)
    ci = interval_metrics(metrics)
    bounds = {b for pair in ci.values() for b in pair}
    metrics = [m for m in metrics if m not in bounds]
    header = list(ID_COLUMNS) + [f"{label(m)} (95% CI)" if m in ci else label(m) for m in metrics] \
        + [name for name, _ in memory]
    body = []
    for r in rows:
        ids, m, mem = _ids(r), r.get("metrics", {}), r.get("memory") or {}
        cells = [fmt_interval(m.get(k), m.get(ci[k][0]), m.get(ci[k][1])) if k in ci else fmt(m.get(k))
                 for k in metrics]
        body.append([str(ids[c]) for c in ID_COLUMNS] + cells
                    + [fmt(None if mem.get(f) is None else mem[f] / MB) for _, f in memory])
    return header, body


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    parts = []
    for task, rs in by_task(rows).items():
        header, body = grid(rs)
        lines = [f"**{task}**", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < N_TEXT else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(s: str) -> str:
    """`s` as LaTeX text; the unit "10^6" as math."""
    return "".join(_TEX.get(c, c) for c in s).replace("10\\textasciicircum{}6", "$10^{6}$")


def tex_table(header: Sequence[str], body: Sequence[Sequence[str]], caption: str, label_: str, n_left: int = 1,
              rule_after: int | None = None) -> str:
    """A complete booktabs `table` (caption above, label, `\\resizebox` to the text width; needs
    `\\usepackage{booktabs,graphicx}`): `n_left` left-aligned columns, the rest right-aligned; a
    midrule after body row `rule_after` if given."""
    spec = "l" * n_left + "r" * (len(header) - n_left)
    lines = ["\\begin{table}[t]", "\\centering", f"\\caption{{{tex_escape(caption)}}}",
             f"\\label{{{label_}}}", "\\resizebox{\\linewidth}{!}{%", f"\\begin{{tabular}}{{{spec}}}", "\\toprule",
             " & ".join(tex_escape(h) for h in header) + " \\\\", "\\midrule"]
    for i, cells in enumerate(body):
        lines.append(" & ".join(tex_escape(c) for c in cells) + " \\\\")
        if rule_after is not None and i == rule_after and i < len(body) - 1:
            lines.append("\\midrule")
    lines += ["\\bottomrule", "\\end{tabular}}", "\\end{table}"]
    return "\n".join(lines)


def caption(task: str, rows: Sequence[dict[str, Any]]) -> str:
    """What a task's table shows, with its units."""
    models = ", ".join(dict.fromkeys(_ids(r)["model"] for r in rows))
    return (f"{task}, {models}: one row per run, full first. budget: the run's budget= (a float: that fraction of "
            "the full cache's bytes; an int: tokens per layer and kv head); KV / full: stored cache bytes over the "
            "full cache's at the same length (1 - compression ratio); KV cache: the stored bytes of all layers "
            "in MB (10^6 bytes); tok/s excludes compilation, reported apart as compile (s).")


def latex(rows: Sequence[dict[str, Any]]) -> str:
    """One complete booktabs `table` per task (`tex_table`)."""
    import re

    parts = []
    for task, rs in by_task(rows).items():
        header, body = grid(rs)
        label_ = "tab:" + re.sub(r"[^a-z0-9]+", "-", task.lower()).strip("-")
        parts.append(f"% task: {task}\n" + tex_table(header, body, caption(task, rs), label_, n_left=N_TEXT))
    return "\n\n".join(parts) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """Every run with raw numbers: ids, task, key, every metric, memory in bytes."""
    latest = R.latest(rows)
    metrics = metric_names(latest, hidden=())
    mem = [f for _, f in MEMORY]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["task", "key", *ID_COLUMNS, *metrics, *mem])
    for r in latest:
        ids, m, mm = _ids(r), r.get("metrics", {}), r.get("memory") or {}
        w.writerow([r.get("task"), r.get("key"), *(ids[c] for c in ID_COLUMNS),
                    *("" if m.get(k) is None else m[k] for k in metrics),
                    *("" if mm.get(f) is None else mm[f] for f in mem)])
    return out.getvalue()


def outputs(prefix: str | Path) -> list[Path]:
    """PREFIX.md, PREFIX.tex and PREFIX.csv."""
    prefix = Path(prefix)
    return [prefix.with_name(prefix.name + ext) for ext in (".md", ".tex", ".csv")]


def check_outputs(prefix: str | Path, force: bool) -> None:
    """FileExistsError naming the tables at `prefix` that exist already, unless `force`."""
    there = [str(p) for p in outputs(prefix) if p.exists()]
    if there and not force:
        raise FileExistsError(f"--out {prefix}: {', '.join(there)} exist; pass --force to overwrite them, or choose "
                              "another --out")


def write(rows: Sequence[dict[str, Any]], prefix: str | Path, force: bool = True) -> list[Path]:
    """Write PREFIX.md, PREFIX.tex and PREFIX.csv (not over existing ones unless `force`);
    returns their paths."""
    check_outputs(prefix, force)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = outputs(prefix)
    for path, text in zip(paths, (markdown(rows) + "\n", latex(rows), csv_text(rows))):
        path.write_text(text, encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evals.table", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results .jsonl files")
    ap.add_argument("--out", help="write OUT.md, OUT.tex and OUT.csv")
    ap.add_argument("--force", action="store_true", help="overwrite existing OUT.md, OUT.tex and OUT.csv")
    args = ap.parse_args(argv)
    from evals.progress import warnings_as_lines

    try:
        if args.out:
            check_outputs(args.out, args.force)
        with warnings_as_lines("evals.table"):  # a damaged line or row: one warning line naming it, then skipped
            rows = usable(R.read(args.results))
    except (FileNotFoundError, FileExistsError) as e:
        ap.error(str(e))
    if not rows:
        ap.error(f"no rows in {', '.join(args.results)}")
    print(markdown(rows))
    if args.out:
        for p in write(rows, args.out, force=True):  # (checked above)
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
