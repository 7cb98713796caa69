"""`python -m evals.table RESULTS... [--out PREFIX]`: compare runs as Markdown, LaTeX and CSV.

One table per task (their metrics differ): a row per run (the latest row of each config key),
columns model, data, policy, params, codec, the task's metrics, then the cache memory in MB
(10^6 bytes): `cache MB` (exact state bytes, kv + meta), `closed-form MB` (2 x layers x
kv_heads x head_dim x slots x bytes, where it applies), `read/step MB` (policies that read less
than they store) and `peak MB` (device peak, GPU only); a memory column nobody filled is
dropped. Markdown goes to stdout (and PREFIX.md); PREFIX.tex holds booktabs tabulars, PREFIX.csv
one long table with every metric unrounded.

An accuracy with a binomial interval (metrics `accuracy<sfx>`, `ci_low<sfx>`, `ci_high<sfx>`, Wilson
95 %, from the retrieval and RULER-style tasks) is one cell, "0.80 [0.49, 0.94]"; the CSV keeps the
three columns. Runs of a task under the query-agnostic protocol (`task.protocol=query_agnostic`)
get their own table, "task [query_agnostic]"; query_aware, the default, is unlabelled.
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
PREFERRED = ("ppl", "ppl_in", "ppl_out", "ppl_last", "accuracy", "tokens", "tokens_per_s")
HIDDEN = ("nll", "score_s")  # derivable from others; kept in the CSV
MEMORY = (("cache MB", "state_bytes"), ("closed-form MB", "closed_form_bytes"),
          ("read/step MB", "read_bytes_per_step"), ("peak MB", "peak_device_bytes"))
ID_COLUMNS = ("model", "data", "policy", "params", "codec")


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
    return {"model": row.get("model", {}).get("name", ""), "data": _data_name(row),
            "policy": row.get("policy", {}).get("name", ""), "params": row.get("params", ""),
            "codec": _codec_label(row.get("policy", {}).get("codec", {}))}


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
    return out


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
    header = list(ID_COLUMNS) + [f"{m} (95% CI)" if m in ci else m for m in metrics] + [label for label, _ in memory]
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
                 "|" + "|".join("---" if i < len(ID_COLUMNS) else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(c, c) for c in s)


def latex(rows: Sequence[dict[str, Any]]) -> str:
    """booktabs tabulars, one per task (\\usepackage{booktabs})."""
    parts = []
    for task, rs in by_task(rows).items():
        header, body = grid(rs)
        spec = "l" * len(ID_COLUMNS) + "r" * (len(header) - len(ID_COLUMNS))
        lines = [f"% task: {task}", f"\\begin{{tabular}}{{{spec}}}", "\\toprule",
                 " & ".join(tex_escape(h) for h in header) + " \\\\", "\\midrule"]
        lines += [" & ".join(tex_escape(c) for c in cells) + " \\\\" for cells in body]
        lines += ["\\bottomrule", "\\end{tabular}"]
        parts.append("\n".join(lines))
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


def write(rows: Sequence[dict[str, Any]], prefix: str | Path) -> list[Path]:
    """Write PREFIX.md, PREFIX.tex and PREFIX.csv; returns their paths."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [prefix.with_name(prefix.name + ext) for ext in (".md", ".tex", ".csv")]
    for path, text in zip(paths, (markdown(rows) + "\n", latex(rows), csv_text(rows))):
        path.write_text(text, encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evals.table", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results .jsonl files")
    ap.add_argument("--out", help="write OUT.md, OUT.tex and OUT.csv")
    args = ap.parse_args(argv)
    from evals.progress import warnings_as_lines

    try:
        with warnings_as_lines("evals.table"):  # a damaged line: one warning line naming it, then skipped
            rows = R.read(args.results)
    except FileNotFoundError as e:
        ap.error(str(e))
    if not rows:
        ap.error(f"no rows in {', '.join(args.results)}")
    print(markdown(rows))
    if args.out:
        for p in write(rows, args.out):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
