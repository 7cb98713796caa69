"""`python -m evals.plots RESULTS... --out DIR`: figures from saved results (PNG + PDF each).

    perplexity_vs_position   perplexity per segment along the stream, one line per run
                             (task perplexity), the model's training length dashed
    heatmap_<task>           accuracy over length x depth, one panel per policy (its runs at
                             several lengths merged into one panel; rows whose
                             `grid` records have length, depth and accuracy: passkey, niah,
                             ruler_niah_single with a list of depths, e.g. task=ruler_niah_heatmap);
                             the task's protocol in the name when it has one. `niah_heatmap` draws
                             the same for chosen rows (full first), each cell with its trials
    pareto_<task>            quality vs cache MB (exact state bytes), one point per run, the
                             Pareto front drawn (perplexity: lower is better; accuracy: higher);
                             labels nudged apart, a log byte axis with a tick at each run
    accuracy_per_turn_<task> accuracy per turn of a multi-turn conversation (task multiturn), one
                             line per run, its Wilson 95 % interval as error bars (`turn_series`)

A plot whose lines would each have one point says so in one warning line. Figures drawn from
other results files are not overwritten without --force (`check_outputs`: the output folder
records which files and row keys drew its figures in .plots-sources.json). A row that is not a
results row is skipped with one warning line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from matplotlib.ticker import FuncFormatter  # noqa: E402

from evals import results as R  # noqa: E402
from evals.table import MB, by_task, stored_bytes, usable  # noqa: E402


def label(row: dict[str, Any]) -> str:
    """'sink n_sink=4 window=4096' (+ codec, + model when not the default)."""
    pol = row.get("policy", {})
    params = " ".join(p for p in row.get("params", "").split() if not p.startswith("positions="))
    text = f"{pol.get('name', '?')} {params}".strip()
    codec = pol.get("codec", {}).get("name", "none")
    text += "" if codec == "none" else f" [{codec}]"
    model = row.get("model", {}).get("name")
    return text if model in (None, "smollm2") else f"{text} ({model})"


def _plain_log_ticks(axis) -> None:
    """Label a log axis 20, 30, 50 rather than 2x10^1 (minor ticks: leading digit 2, 3 or 5)."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 3, 5) else ""))


def ticks_at(axis, values: Sequence[float], fmt: str = "{:.3g}") -> None:
    """Major ticks of a (log) axis at `values` (the plotted points), labelled plainly; values within
    8 % of a kept one share its tick; no minor tick labels."""
    kept: list[float] = []
    for v in sorted(v for v in values if v > 0):
        if not kept or v > kept[-1] * 1.08:
            kept.append(v)
    axis.set_ticks(kept, [fmt.format(v) for v in kept])
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def nudge_labels(ax, texts: Sequence[Any], max_moves: int = 60) -> None:
    """Move annotation labels (offset in points) up, one label height at a time, until no two
    overlap: the lowest point's label is placed first. Each keeps a thin leader line to its point."""
    from matplotlib.text import Text

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box_of = lambda t: Text.get_window_extent(t, renderer)  # noqa: E731  the text alone, not its leader line
    placed = []
    for t in sorted(texts, key=lambda t: (t.xy[1], t.xy[0])):
        for _ in range(max_moves):
            box = box_of(t)
            if not any(box.overlaps(p) for p in placed):
                break
            dx, dy = t.xyann
            t.xyann = (dx, dy + (box.height + 1) * 72.0 / fig.dpi)
        placed.append(box_of(t))


def warn_single_points(what: str, lines: dict[str, int], hint: str) -> None:
    """One warning line when every line of a plot has a single point (no line to see)."""
    import warnings

    if lines and all(n <= 1 for n in lines.values()):
        names = list(lines)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(f"{what}: a single point per line ({shown}); {hint}", stacklevel=2)


def save_figure(fig, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=150)
    plt.close(fig)
    return paths


def plot_perplexity(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    rows = [r for r in rows if r.get("curves", {}).get("ppl")]
    if not rows:
        return []
    segments = sorted({(r.get("config", {}).get("task") or {}).get("segment") for r in rows} - {None})
    warn_single_points("perplexity_vs_position", {label(r): len(r["curves"]["ppl"]) for r in rows},
                       f"the segment ({', '.join(map(str, segments)) or '?'} tokens) covers the whole stream: pass "
                       "task.segment=<a fraction of tokens> (e.g. tokens/8) for a curve")
    fig, ax = plt.subplots(figsize=(7, 4))
    train = set()
    for r in rows:
        ax.plot(r["curves"]["position"], r["curves"]["ppl"], marker=".", label=label(r))
        if r.get("model", {}).get("max_position"):
            train.add(r["model"]["max_position"])
    end = max(max(r["curves"]["position"]) for r in rows)
    for t in sorted(train):
        if t < end:
            ax.axvline(t, color="gray", linestyle="--", linewidth=1)
            ax.text(t, 1.0, f" training length {t}", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                    color="gray")
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("position in the stream (tokens, segment end)")
    ax.set_ylabel("perplexity of the segment")
    data = sorted({r.get("config", {}).get("data", {}).get("name", "") for r in rows})
    ax.set_title(f"Perplexity vs position ({', '.join(d for d in data if d)})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out, "perplexity_vs_position")


def accuracy_grid(row: dict[str, Any]) -> tuple[list[int], list[float], np.ndarray] | None:
    """(lengths, depths, mean accuracy [depth, length]) of a row's grid, or None if it has none."""
    cells = [g for g in row.get("grid", []) if {"length", "depth", "accuracy"} <= set(g)]
    if not cells:
        return None
    lengths = sorted({int(g["length"]) for g in cells})
    depths = sorted({float(g["depth"]) for g in cells})
    acc = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            vals = [g["accuracy"] for g in cells if int(g["length"]) == n and float(g["depth"]) == d]
            if vals:
                acc[i, j] = float(np.mean(vals))
    return lengths, depths, acc


def _stem(task: str) -> str:
    """A file-name stem for a task label ('ruler_vt [query_agnostic]' -> 'ruler_vt-query_agnostic')."""
    return "-".join(task.replace("[", " ").replace("]", " ").split())


def merged_runs(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one policy (same label, model and protocol) run at different lengths, as one row
    whose grid holds all their cells (a later row's cell replaces an earlier one's): the 4K and
    8K columns of a heatmap may come from two runs."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        protocols = tuple(sorted({str(g.get("protocol")) for g in r.get("grid", [])}))
        key = (label(r), r.get("model", {}).get("name"), protocols)
        if key not in out:
            out[key] = dict(r, grid=list(r.get("grid", [])))
            continue
        cell = lambda g: (g.get("length"), g.get("depth"), g.get("question"))  # noqa: E731
        new = {cell(g) for g in r.get("grid", [])}
        out[key]["grid"] = [g for g in out[key]["grid"] if cell(g) not in new] + list(r.get("grid", []))
    return list(out.values())


def niah_heatmap(rows: Sequence[dict[str, Any]], out: str | Path, stem: str = "niah_heatmap",
                 title: str = "NIAH: accuracy by depth and length") -> list[Path]:
    """The NIAH depth x length heatmap of `rows` (each with a grid of length, depth, accuracy
    cells), one panel per policy (its runs at several lengths merged: `merged_runs`), `full`
    first; returns the PNG and PDF paths ([] if no row has one)."""
    rows = sorted(merged_runs(rows), key=lambda r: r.get("policy", {}).get("name") != "full")
    panels = [(r, g) for r in rows if (g := accuracy_grid(r)) is not None]
    return _heatmap_figure(panels, Path(out), stem, title)


def _heatmap_figure(panels, out: Path, stem: str, title: str) -> list[Path]:
    if not panels:
        return []
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (r, (lengths, depths, acc)) in zip(axes.flat, panels):
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(acc[i, j]):
                    ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=7)
        trials = sorted({g.get("trials") for g in r.get("grid", []) if g.get("trials")})
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("depth")
        ax.set_title(label(r) + (f" (n={trials[0]}/cell)" if len(trials) == 1 else ""), fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    fig.suptitle(title)
    return save_figure(fig, out, stem)


def plot_heatmaps(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    paths = []
    for task, rs in by_task(rows).items():
        panels = [(r, g) for r in merged_runs(rs) if (g := accuracy_grid(r)) is not None]
        if not panels:
            continue
        paths += _heatmap_figure(panels, out, f"heatmap_{_stem(task)}", f"{task}: accuracy by length and depth")
    return paths


def quality(row: dict[str, Any]) -> tuple[str, float, bool] | None:
    """(metric, value, lower is better) used as a row's quality, or None."""
    m = row.get("metrics", {})
    for name, lower in (("ppl", True), ("accuracy", False)):
        if m.get(name) is not None:
            return name, float(m[name]), lower
    return None


def pareto_front(points: Sequence[tuple[float, float]], lower: bool) -> list[int]:
    """Indices of the points no other point beats on both cost (x, lower is better) and quality
    (y), sorted by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1] if lower else -points[i][1]))
    front, best = [], math.inf
    for i in order:
        y = points[i][1] if lower else -points[i][1]
        if y < best:
            front.append(i)
            best = y
    return front


def plot_pareto(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    paths = []
    for task, rs in by_task(rows).items():
        pts = [(r, q) for r in rs if (q := quality(r)) and (r.get("memory") or {}).get("state_bytes")]
        if not pts:
            continue
        metric, lower = pts[0][1][0], pts[0][1][2]
        pts = [(r, q) for r, q in pts if q[0] == metric]
        fig, _ = pareto_figure(task, pts, metric, lower)
        paths += save_figure(fig, out, f"pareto_{_stem(task)}")
    return paths


def pareto_figure(task: str, pts: Sequence[tuple[dict[str, Any], tuple]], metric: str, lower: bool):
    """(figure, labels) of quality vs stored cache MB: one labelled point per run, labels nudged
    apart (`nudge_labels`), a log byte axis with a tick at each point, the Pareto front."""
    xy = [(r["memory"]["state_bytes"] / MB, q[1]) for r, q in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([x for x, _ in xy], [y for _, y in xy], zorder=3)
    front = pareto_front(xy, lower)
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], color="C3", drawstyle="steps-post",
            label="Pareto front", zorder=2)
    ax.set_xscale("log")
    ticks_at(ax.xaxis, [x for x, _ in xy])
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_xlabel("KV cache, all layers (MB, 10^6 B; log scale, a tick at each run)")
    from evals.table import label as metric_label

    ax.set_ylabel(f"{metric_label(metric)} ({'lower' if lower else 'higher'} is better)")
    ax.set_title(f"{task}: quality vs cache memory")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    texts = [ax.annotate(label(r), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points",
                         arrowprops=dict(arrowstyle="-", lw=0.4, color="gray", shrinkA=0, shrinkB=2))
             for (r, _), (x, y) in zip(pts, xy)]
    nudge_labels(ax, texts)
    return fig, texts


def turn_series(row: dict[str, Any]) -> tuple[list[int], np.ndarray] | None:
    """(turns, [3, turns] accuracy, Wilson low, high) of a multiturn row's accuracy_t<i>, or None."""
    m = row.get("metrics", {})
    turns = sorted(int(k[len("accuracy_t"):]) for k in m if k.startswith("accuracy_t") and k[10:].isdigit())
    if not turns:
        return None
    return turns, np.array([[m[f"{k}_t{i}"] for i in turns] for k in ("accuracy", "ci_low", "ci_high")], float)


def turn_label(row: dict[str, Any]) -> str:
    """'snapkv, 35.9 MB (once)': the policy, its stored bytes and the multi-turn mode (a legend
    that fits beside the lines; the full parameters are in the results file)."""
    name = row.get("policy", {}).get("name", "?")
    codec = row.get("policy", {}).get("codec", {}).get("name", "none")
    stored = stored_bytes(row)
    mode = (row.get("config", {}).get("task") or {}).get("mode")
    return (name + ("" if codec == "none" else f" [{codec}]")
            + (f", {stored / MB:.1f} MB" if isinstance(stored, (int, float)) else "") + (f" ({mode})" if mode else ""))


def plot_turns(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy per turn, one line per run of each multi-turn task (and protocol, mode)."""
    paths = []
    for task, rs in by_task(rows).items():
        series = [(r, s) for r in rs if (s := turn_series(r))]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k, (r, (turns, (acc, lo, hi))) in enumerate(series):
            x = np.asarray(turns) + (k - (len(series) - 1) / 2) * 0.04  # a small offset: bars apart
            ax.errorbar(x, acc, yerr=[acc - lo, hi - acc], marker="o", capsize=3, label=turn_label(r))
        ax.set_xticks(sorted({t for _, (ts, _) in series for t in ts}))
        ax.set_xlabel("turn (0: the first question after the context)")
        ax.set_ylabel("accuracy (Wilson 95 % interval)")
        ax.set_ylim(-0.05, 1.05)
        models = sorted({str(r.get("model", {}).get("name")) for r, _ in series})
        ax.set_title(f"{task} ({', '.join(models)}): accuracy per turn")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        paths += save_figure(fig, out, f"accuracy_per_turn_{_stem(task)}")
    return paths


SOURCES = ".plots-sources.json"  # in the output folder: which results (row keys) drew which figures


def check_outputs(rows: Sequence[dict[str, Any]], out: str | Path, force: bool) -> None:
    """Refuse (FileExistsError) to overwrite figures in `out` drawn from other rows unless `force`;
    records the rows' keys for the next call. Redrawing from the same results (or more rows of the
    same files) is allowed."""
    import json

    out = Path(out)
    keys = sorted({str(r.get("key")) for r in rows})
    files = sorted({str(Path(r.get("_file", "?")).resolve()) for r in rows})
    side = out / SOURCES
    if side.is_file() and not force:
        try:
            before = json.loads(side.read_text())
        except (OSError, ValueError):
            before = {}
        if before.get("files") and before["files"] != files and not set(before.get("keys", ())) <= set(keys):
            raise FileExistsError(f"--out {out}: holds figures drawn from {', '.join(before['files'])}; pass --force to "
                                  "overwrite them, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    side.write_text(json.dumps({"files": files, "keys": keys}) + "\n")


def plot_all(rows: Sequence[dict[str, Any]], out: str | Path) -> list[Path]:
    rows, out = R.latest(rows), Path(out)
    return plot_perplexity(rows, out) + plot_heatmaps(rows, out) + plot_pareto(rows, out) + plot_turns(rows, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evals.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results .jsonl files")
    ap.add_argument("--out", required=True, help="folder for the figures")
    ap.add_argument("--force", action="store_true", help="overwrite figures drawn from other results")
    args = ap.parse_args(argv)
    from evals.progress import warnings_as_lines

    try:
        with warnings_as_lines("evals.plots"):  # a damaged line or row: one warning line naming it, then skipped
            rows = usable(R.read(args.results))
            check_outputs(rows, args.out, args.force)
            paths = plot_all(rows, args.out)
    except FileNotFoundError as e:
        ap.error(str(e))
    except FileExistsError as e:
        ap.error(str(e))
    if not paths:
        ap.error("nothing to plot: no perplexity curves, accuracy grids or memory in these results")
    for p in paths:
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
