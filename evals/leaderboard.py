"""`python -m evals.leaderboard`: kvpress's leaderboard on our models, in one command. RULER's tasks
at 4,096 tokens (RULER's own task names, `evals.ruler.AVAILABLE`), every press of the compat
catalogue at kvpress's four ratios, query-agnostic, plus "(query-aware)" rows for the presses the
leaderboard also runs with the question in the compressed context; kvpress's protocol and scoring
(`evals.peer` runs each task; string_match_all, string_match_part for QA).

    python -m evals.leaderboard                                  # SmolLM2, every task, the catalogue, 1 sample a task
    python -m evals.leaderboard model=qwen samples=4
    python -m evals.leaderboard tasks=[niah_single_2,vt] presses=[SnapKVPress,KnormPress] kvpress=true
    python -m evals.leaderboard shard=0/2   # and shard=1/2 elsewhere (SLURM array, another host), then:
    python -m evals.leaderboard table_only=true

Keys (key=value):

    model=smollm2           smollm2, qwen (`bash scripts/setup.sh long`), tiny (tests: a random 3-layer
                            Llama, built by kvpress's worker), or hf with model_path=<an HF folder>
                            (Qwen3-8B, Llama-3.1-8B-Instruct... on a GPU: scripts/gpu_leaderboard.sh)
    dtype=float32           our side's dtype (bfloat16 on a GPU)
    tokens=4096             each prompt + answer (RULER's exact length)
    samples=1               prompts per task (seed `seed`); every (press, ratio) runs on the same prompts
    tasks=[...]             default: every task evals.ruler generates (AVAILABLE: qa_1 and qa_2 are
                            not: no registry package ships SQuAD or HotpotQA)
    presses=[...]           default: `default_presses` (the compat catalogue that `evals.peer` runs,
                            without DuoAttentionPress, whose head pattern here is random, not trained,
                            the catalogue rows of `evals.peer.CATALOGUE` and NOT_DEFAULT)
    ratios=[0.25,0.5,0.75,0.875]
    query_aware=[...]       presses also run query-aware (default: those of QUERY_AWARE that compat has;
                            [] for none)
    kvpress=false           true: kvpress 0.5.5 runs on every item too (its average in its own column;
                            `bash scripts/setup.sh test`): our side of every task first, then kvpress's
                            (at 4K both at once do not fit in 24 GB)
    eos_stop=true           both sides stop after an end-of-sequence id, as kvpress's pipeline does
                            (`evals.peer eos_stop=`: the same texts and scores)
    gen=<task's>            greedy tokens (default: RULER's tokens_to_generate per task)
    seed=0  chunk=512  compile_cache=<out>/.jax-cache  progress=true   as in evals.peer
    executor=ray            each task's presses on Ray actors (`evals.peer executor=ray`; ray.address=,
                            ray.workers=; the `scale` extra)
    shard=0/1               run the tasks i, i + n, ... of the grid only (lock-free: every task has its
                            own files); table_only=true then builds the tables from all shards' files
    out=results/leaderboard table_only=false
    qa_dir=<folder>         RULER's own squad.json / hotpotqa.json (its download_qa_dataset.sh): qa_1 / qa_2
                            join the tasks (no package ships them: without it the average covers 11)

Files: `<out>/<model>_<tokens>/` holds one `evals.peer` run per task and mode (`<task>` and
`<task>_query_aware` stems: resumable line files); `<out>/leaderboard_<model>_<tokens>.{md,csv,png,pdf}`:
the average over tasks per (press, ratio), the per-task table (kvpress=true: also the agreement table,
`agreement`), and the figure (average score against ratio, a line per press, the full cache a horizontal
line). A rerun computes only what is missing. Where a task keeps no lines, `table_only=true` reads its
`<stem>.csv` (`summary`): a page's runs are committed as those csv files (docs/results/runs/leaderboard/).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from evals import peer
from evals.config import ConfigError

KEYS = ("model", "model_path", "dtype", "tokens", "samples", "tasks", "presses", "ratios", "query_aware", "kvpress",
        "gen", "seed", "chunk", "compile_cache", "progress", "shard", "out", "table_only", "qa_dir", "executor",
        "ray.address", "ray.workers", "eos_stop")
# kvpress's evaluation/leaderboard.sh: the presses it also runs with --query_aware
QUERY_AWARE = ("SnapKVPress", "AdaKVPress", "FinchPress", "ChunkKVPress:SnapKVPress")
QA_FILES = {"qa_1": "squad.json", "qa_2": "hotpotqa.json"}  # RULER's scripts/data/synthetic/json/ names
PASS_THROUGH = ("model_path", "dtype", "samples", "gen", "seed", "chunk", "compile_cache", "progress", "executor",
                "ray.address", "ray.workers")


# presses evals.peer runs that the default leaves out: the catalogue rows (`peer.CATALOGUE`: arrays made per model,
# ThinKPress below ratio 0.5 only, ratio-less rows) and the presses compat took last, which kvpress fails to answer
# after (KVComposePress) or that need arrays per model (RestoreKVPress) or minutes a row on a CPU (KVgradPress);
# each runs by presses=[...]
NOT_DEFAULT = ("KVgradPress", "KVComposePress", "RestoreKVPress")


def default_presses() -> list[str]:
    """Every press `evals.peer` runs but DuoAttentionPress (its pattern here is random: a parity
    check, not DuoAttention's accuracy), the catalogue rows and NOT_DEFAULT; with RandomPress
    (kvpress's leaderboard floor)."""
    return [p for p in peer.PEER_PRESSES if p != "DuoAttentionPress"] + [
        p for p in peer.EXTRA_PRESSES if p not in peer.CATALOGUE and p not in NOT_DEFAULT]


@dataclasses.dataclass
class Board:
    """A checked command line: one `evals.peer` plan per (task, mode), nothing loaded."""

    model: str
    tokens: int
    tasks: list[str]
    presses: list[str]
    ratios: list[float]
    aware: list[str]
    out: pathlib.Path
    shard: tuple[int, int]
    table_only: bool
    plans: list[peer.Plan]
    argv: list[str]

    @property
    def stem(self) -> str:
        return f"leaderboard_{self.model}_{self.tokens}"

    def mine(self) -> list[peer.Plan]:
        """The plans this shard runs."""
        i, n = self.shard
        return [p for k, p in enumerate(self.plans) if k % n == i]


def _bool(key: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ConfigError(f"{key}={text}: expected true or false")
    return text.lower() == "true"


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"shard={text}: expected i/n, e.g. 0/2") from None
    if not 0 <= i < n:
        raise ConfigError(f"shard={text}: expected 0 <= i < n")
    return i, n


def parse(argv: Sequence[str]) -> Board:
    """Check the command line and every task's plan (ConfigError naming the key), before any compute."""
    from evals import ruler
    from evals.compare import list_value
    from evals.config import did_you_mean

    own: dict[str, str] = {}
    for item in argv:
        if "=" not in item or item.startswith("-"):
            raise ConfigError(f"{item}: expected key=value; the keys: {', '.join(KEYS)}")
        key, value = item.split("=", 1)
        if key not in KEYS:
            raise ConfigError(f"{key}: unknown key{did_you_mean(key, KEYS)}; the keys: {', '.join(KEYS)}")
        own[key] = value
    qa = {}  # qa_1 / qa_2 from RULER's own files in qa_dir
    if "qa_dir" in own:
        folder = pathlib.Path(own["qa_dir"]).expanduser()
        qa = {t: folder / f for t, f in QA_FILES.items() if (folder / f).is_file()}
        if not qa:
            raise ConfigError(f"qa_dir={own['qa_dir']}: holds neither of RULER's {sorted(QA_FILES.values())}")
    available = [t for t in ruler.LEADERBOARD_TASKS if t in ruler.AVAILABLE or t in qa]
    tasks = list_value("tasks", own["tasks"]) if "tasks" in own else available
    for t in tasks:
        if t in ruler.MISSING and t not in qa:
            raise ConfigError(f"tasks: {t}: {ruler.MISSING[t]}")
        if t not in available:
            raise ConfigError(f"tasks: {t!r} is not a task evals.ruler generates{did_you_mean(t, available)}; "
                              f"choose from {available}")
    presses = list_value("presses", own["presses"]) if "presses" in own else default_presses()
    supported = peer.PEER_PRESSES + peer.EXTRA_PRESSES
    if "query_aware" not in own:
        aware = [p for p in QUERY_AWARE if p in supported]
    else:  # [] or none: no query-aware rows
        aware = [] if own["query_aware"].strip() in ("[]", "none") else list_value("query_aware", own["query_aware"])
    for key, ps in (("presses", presses), ("query_aware", aware)):
        for p in ps:
            if p not in supported:
                raise ConfigError(f"{key}: {p!r} is not a press evals.peer runs{did_you_mean(p, supported)}; "
                                  f"choose from {list(supported)}")
    ratios = own.get("ratios", "[" + ",".join(f"{r:g}" for r in peer.DEFAULT_RATIOS) + "]")
    model, tokens = own.get("model", "smollm2"), own.get("tokens", "4096")
    out = pathlib.Path(own.get("out", "results/leaderboard"))
    name = pathlib.Path(own["model_path"]).name if model == "hf" and own.get("model_path") else model
    folder = out / f"{name}_{tokens}"
    common = [f"{k}={own[k]}" for k in PASS_THROUGH if k in own and k not in ("model", "tokens", "samples")]
    common += [f"model={model}", f"tokens={tokens}", f"samples={own.get('samples', '1')}", f"ratios={ratios}", f"out={folder}",
               f"kvpress={own.get('kvpress', 'false')}", f"eos_stop={own.get('eos_stop', 'true')}"]
    if "compile_cache" not in own:
        common.append(f"compile_cache={out / '.jax-cache'}")
    plans = []
    for t in tasks:
        for mode, ps in (("agnostic", presses), ("aware", aware)):
            if not ps:
                continue
            argv_t = common + [f"task={t}", f"presses=[{','.join(ps)}]"] + ([f"qa_file={qa[t]}"] if t in qa else [])
            argv_t += ["query_aware=true", f"name={t}_query_aware"] if mode == "aware" else [f"name={t}"]
            plans.append(peer.parse(argv_t))
    board = Board(name, plans[0].tokens if plans else int(tokens), tasks, presses, plans[0].ratios if plans else [],
                  aware, out, _shard(own.get("shard", "0/1")), _bool("table_only", own.get("table_only", "false")),
                  plans, list(argv))
    return board


def prepare(b: Board) -> Board:
    """Every plan's samples (tokenizer only), foreign files refused: all before any compute."""
    if any(p.kvpress for p in b.plans) or b.model == "tiny":
        peer.check_reference()
    for p in b.plans:
        peer.prepare(p)
        peer.check_outputs(p)
    return b


def run(b: Board) -> None:
    """This shard's plans, one `evals.peer` run each (our model loaded once). With kvpress=true, our side of
    every task first (kvpress=false runs), then kvpress's side of every task: never both at once, whose peaks
    at 4K do not fit together in 24 GB (SmolLM2's `niah_multiquery`: ours 14 GB, kvpress's worker 10 GB), and
    our table is whole before kvpress's long side starts."""
    from tqdm.auto import tqdm

    todo = [p for p in b.mine() if any(peer.pending(p, s) for s in p.sides)]
    print(f"[evals.leaderboard] {len(b.plans)} runs ({len(b.tasks)} tasks x modes), this shard "
          f"{b.shard[0]}/{b.shard[1]}: {len(b.mine())}, to do {len(todo)}; files under {b.plans[0].out if b.plans else b.out}")
    passes = [[dataclasses.replace(p, kvpress=False) for p in todo if p.kvpress and peer.pending(p, "ours")], todo]
    model = None
    bar = tqdm(total=sum(map(len, passes)), desc="leaderboard", unit="run", disable=not (b.plans and b.plans[0].progress))
    for k, runs in enumerate(passes):
        if k and runs and passes[0]:  # our side done: its peak heap back to the system before kvpress's worker
            from evals.compiles import release_memory

            print(f"[evals.leaderboard] our side done: {release_memory() / 2**30:.1f} GiB released before kvpress's side")
        for p in runs:
            if model is None and p.model != "tiny":  # the tiny model is built by each run's kvpress worker
                model, _ = peer.load_ours(p)
            peer.use_compile_cache(p)
            peer.run(p, model)
            bar.update()
    bar.close()


def label(press: str, aware: bool) -> str:
    return f"{press} (query-aware)" if aware else press


def summary(p: peer.Plan, tok) -> list[dict[str, Any]]:
    """A task's rows per (press, ratio): from its saved lines, or, where a folder keeps no lines, from the
    `<stem>.csv` its run wrote (a page's committed runs, docs/results/runs/leaderboard/; `prepare` refused
    one of another configuration)."""
    if not any(p.path(f".{s}.jsonl").is_file() for s in peer.SIDES) and p.path(".csv").is_file():
        return peer.csv_rows(p.path(".csv"))
    return peer.summarize(p, peer.records(p, tok))


def collect(b: Board) -> list[dict[str, Any]]:
    """One row per (task, press label, ratio) with each side's accuracy over the samples both
    sides (or ours alone) finished, from the saved lines of every shard (or their csv: `summary`)."""
    from evals import zoo

    tok = zoo.load_tokenizer(b.plans[0].mconf)
    rows = []
    for p in b.plans:
        for r in summary(p, tok):
            if p.query_aware and r["press"] == "full":
                continue  # the full cache keeps everything: one row, the query-agnostic run's
            n = r["compared"]
            rows.append({"task": p.task.get("ruler_name", p.task["name"]), "press": label(r["press"], p.query_aware),
                         "ratio": r["ratio"], "samples": n, "ours": r["ours_accuracy"],
                         "kvpress": r["kvpress_accuracy"],
                         # agreement (kvpress=true): items with the same ids / score, mean kept-set Jaccard
                         "same_ids": round(r["same_ids"] * n) if n and r["same_ids"] == r["same_ids"] else 0,
                         "same_score": round(r["same_score"] * n) if n and r["same_score"] == r["same_score"] else 0,
                         "both": n if r["same_ids"] == r["same_ids"] else 0, "jaccard": r["jaccard_mean"]})
    return rows


# presses whose kept sets come from a draw (ours is not torch's): they agree with kvpress by chance only
DRAWN = ("RandomPress", "CompactorPress", "LeverageScorePress")


def agreement(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per press label (over its tasks and ratios) and for the deterministic presses and all of them: the items both
    sides answered, how many with the same greedy ids and the same score, and the mean kept-set Jaccard of its
    cells (each cell's mean over its items, layers and kv heads, weighted by its items)."""
    def one(name: str, rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        both = [r for r in rs if r["both"]]
        js = [(r["jaccard"], r["both"]) for r in both if r["jaccard"] == r["jaccard"]]
        n = sum(r["both"] for r in both)
        return {"press": name, "items": n, "same_ids": sum(r["same_ids"] for r in both),
                "same_score": sum(r["same_score"] for r in both),
                "jaccard": sum(j * w for j, w in js) / sum(w for _, w in js) if js else float("nan")}

    pressed = [r for r in rows if r["press"] != "full"]
    out = [one(press, [r for r in pressed if r["press"] == press]) for press in dict.fromkeys(r["press"] for r in pressed)]
    determ = [r for r in pressed if r["press"].split(" ")[0].split(":")[0] not in DRAWN]
    return [x for x in out if x["items"]] + [one("deterministic presses", determ), one("all presses", pressed)]


def average(b: Board, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (press label, ratio): the mean over tasks of each side's accuracy (x 100, as kvpress's
    leaderboard), and how many tasks it covers (a cell short of a task has no average: nan)."""
    out = []
    cells = dict.fromkeys((r["press"], r["ratio"]) for r in rows)
    for press, ratio in cells:
        rs = [r for r in rows if r["press"] == press and r["ratio"] == ratio and r["samples"]]
        row = {"press": press, "ratio": ratio, "tasks": len(rs), "samples": sum(r["samples"] for r in rs)}
        for side in peer.SIDES:
            vals = [r[side] for r in rs if r[side] == r[side]]
            row[side] = 100 * float(np.mean(vals)) if rs and len(vals) == len(b.tasks) else float("nan")
        out.append(row)
    return out


def _pct(v: float) -> str:
    return "-" if v != v else f"{v:.1f}"


def markdown(b: Board, rows: Sequence[dict[str, Any]], avg: Sequence[dict[str, Any]]) -> str:
    """The average table (press x ratio, ours and kvpress side by side) and the per-task table."""
    n = b.plans[0].samples if b.plans else 0
    ratios = sorted({r["ratio"] for r in avg})
    presses = list(dict.fromkeys(r["press"] for r in avg))
    get = {(r["press"], r["ratio"]): r for r in avg}
    kv = b.plans and b.plans[0].kvpress
    head = ["press"] + [f"{x:g}" + (" ours / kvpress" if kv else "") for x in ratios]
    lines = [f"`python -m evals.leaderboard{''.join(' ' + a for a in b.argv)}`", "",
             f"**Average score over {len(b.tasks)} RULER tasks** ({', '.join(b.tasks)}), {b.model} at {b.tokens} "
             f"tokens, {n} sample(s) a task; score x 100 by compression ratio (kvpress's leaderboard's axes).", "",
             "| " + " | ".join(head) + " |", "|---|" + "---:|" * len(ratios)]
    for press in presses:
        cells = []
        for x in ratios:
            r = get.get((press, x))
            cells.append("" if r is None else _pct(r["ours"]) + (f" / {_pct(r['kvpress'])}" if kv else ""))
        lines.append("| " + " | ".join([press] + cells) + " |")
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by = {(r["task"], r["press"], r["ratio"]): r for r in rows}
    lines += ["", "**Per task** (our score x 100; samples in brackets where fewer than asked)", "",
              "| press | ratio | " + " | ".join(tasks) + " | average |", "|---|---:|" + "---:|" * (len(tasks) + 1)]
    for r in avg:
        cells = []
        for t in tasks:
            c = by.get((t, r["press"], r["ratio"]))
            cells.append("-" if c is None or not c["samples"] else
                         _pct(100 * c["ours"]) + ("" if c["samples"] >= n else f" ({c['samples']})"))
        lines.append("| " + " | ".join([r["press"], f"{r['ratio']:g}"] + cells + [_pct(r["ours"])]) + " |")
    agree = agreement(rows) if kv else []
    if agree and agree[-1]["items"]:
        lines += ["", "**Agreement with kvpress** (items both sides answered, over every task and ratio; kept-set "
                  f"Jaccard: mean over items, layers and kv heads; {', '.join(DRAWN)} draw their own sketches)", "",
                  "| press | items | same ids | same score | kept Jaccard |", "|---|---:|---:|---:|---:|"]
        for a in agree:
            name = f"**{a['press']}**" if a["press"].endswith(" presses") else a["press"]
            jac = "-" if a["jaccard"] != a["jaccard"] else f"{a['jaccard']:.4f}"
            lines.append(f"| {name} | {a['items']} | {a['same_ids']} | {a['same_score']} | {jac} |")
    lines += ["", "Protocol: kvpress's (`evals.peer`): the context compressed once and the question appended; "
              "(query-aware) rows compress the question with the context (kvpress's `--query_aware`). Scores: RULER's "
              "string_match_all (string_match_part for QA), cut at EOS. An average needs every task's cell."]
    return "\n".join(lines) + "\n"


def csv_text(avg: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["press", "ratio", "tasks", "samples", "ours", "kvpress"])
    for r in avg:
        w.writerow([r["press"], r["ratio"], r["tasks"], r["samples"], r["ours"], r["kvpress"]])
    return buf.getvalue()


def figure(b: Board, avg: Sequence[dict[str, Any]]) -> list[pathlib.Path]:
    """Average score against ratio, one line per press, the full cache a horizontal line."""
    from evals.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = [r["ours"] for r in avg if r["press"] == "full" and r["ours"] == r["ours"]]
    if full:
        ax.axhline(full[0], color="black", linestyle="--", linewidth=1, label="full cache")
    for press in dict.fromkeys(r["press"] for r in avg if r["press"] != "full"):
        pts = sorted((r["ratio"], r["ours"]) for r in avg if r["press"] == press and r["ours"] == r["ours"])
        if pts:
            ax.plot(*zip(*pts), marker="o", linewidth=1.2, label=press)
    ax.set_xlabel("compression ratio")
    ax.set_ylabel(f"average score over {len(b.tasks)} RULER tasks")
    ax.set_title(f"{b.model}, RULER at {b.tokens} tokens")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, b.out, b.stem)


def write(b: Board) -> list[dict[str, Any]]:
    """The tables and the figure from every shard's saved lines; returns the average rows."""
    rows = collect(b)
    avg = average(b, rows)
    b.out.mkdir(parents=True, exist_ok=True)
    (b.out / f"{b.stem}.md").write_text(markdown(b, rows, avg), encoding="utf-8")
    (b.out / f"{b.stem}.csv").write_text(csv_text(avg), encoding="utf-8")
    figure(b, avg)
    return avg


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the average rows."""
    from evals.progress import warnings_as_lines
    from evals.run import interrupt_as_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return []
    from evals.compiles import use_fast_compile

    use_fast_compile()
    with warnings_as_lines("evals.leaderboard"), interrupt_as_line("evals.leaderboard"):
        try:
            b = prepare(parse(argv))
        except ConfigError as e:
            print(f"evals.leaderboard: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if not b.table_only:
            try:
                run(b)
            except RuntimeError as e:
                print(f"evals.leaderboard: error: {e}", file=sys.stderr)
                raise SystemExit(1) from None
        avg = write(b)
    print((b.out / f"{b.stem}.md").read_text(encoding="utf-8"))
    print(f"wrote {b.out / b.stem}.md, .csv, .png, .pdf")
    return avg


def keeps_peak(argv: Sequence[str]) -> bool:
    """Whether the command re-executes itself with glibc's allocator reusing its blocks (keeping its peak
    until it ends): not with kvpress=true, whose worker runs after our side in the same process (`run`), so
    our process would hold its peak through kvpress's pass (SmolLM2 at 4K: ours 15.7 GB with the tunables,
    11.5-14 GB without, kvpress's worker 10 GB; a 24 GB machine killed ours when they met)."""
    return not any(a.strip().lower() == "kvpress=true" for a in argv)


if __name__ == "__main__":
    from evals.compiles import reuse_memory

    if keeps_peak(sys.argv[1:]):
        reuse_memory("evals.leaderboard", sys.argv[1:])  # glibc's allocator reusing its blocks: once, at the start
    main()
