"""`python -m benchmarks.peer_speed`: kvpress 0.5.5 against kvpolicies on kvpress's own protocol
(`evals.peer`'s: the context compressed once, the question appended, greedy tokens), each side
ALONE on the machine, one after the other, on the same prompts with the same threads (every core:
XLA's pool on our side, torch's on kvpress's), nothing resumed and no persistent compilation cache.

    python -m benchmarks.peer_speed                      # the grid of issue 57 on SmolLM2 (3 samples)
    python -m benchmarks.peer_speed model=qwen
    python -m benchmarks.peer_speed "presses=[SnapKVPress,PyramidKVPress]" "ratios=[0.25,0.5,0.75,0.875]" samples=2
    python -m benchmarks.peer_speed side=ours            # one side only (the other's columns: -)
    python -m benchmarks.peer_speed answer=shared        # our side's answers in one batch for every press
    python -m benchmarks.peer_speed alternate=4          # ours only: the answers, press and shared in turn

Keys: those of `evals.peer` (model, task, tokens, samples, ratios, presses, gen, seed, chunk, prefill),
plus side=both|ours|kvpress and out=results/peer_speed name=<stem>; `redraw=LABEL:RUN.json,...`
draws the phases of saved runs (<out>/<name>.png) and runs nothing. `answer=press|shared` is
evals.peer's (how our side batches its answers). `against=RUN.json`: the answer ids of this run
compared, item by item, with each side's lines of a saved run (`same_ids_as`). `alternate=N`: our
side only, in one process, the first sample's answers (every press with a canonical form, every
ratio, compressed once) answered with answer=press, answer=shared and pooled (every press's rows
as one batch) in turn: a compiling round, then N timed rounds (the order reversed every other
round); per mode the programs compiled, the question and decode seconds of each round, and the
ratios mode / press of the timed rounds' medians (the machine's load changes: a ratio, never an
absolute time). Defaults: presses SnapKV,
TOVA, Knorm, StreamingLLM, ExpectedAttention, AdaKV; ratios 0.25/0.5/0.75; gen 12; 3 samples.

Per side: the wall time of each sample (every (press, ratio) item of it and the full cache; our
side's compilation included, as it comes: the first sample compiles, later ones reuse), the
first sample, the steady state (the mean of the later samples), the whole grid, and each phase
summed over the grid: prefill, compress, kept (the kept positions read back to the host: the
only device-to-host transfer besides the answer ids), question, decode; compile (ours: tracing,
lowering and XLA's compile, from JAX's compilation events, inside the phases above) and the
programs compiled. The ratios ours / kvpress are the result. Model loading is left out on both
sides. Our side compiles as evals.peer does, with `evals.compiles.FAST_FLAGS` (KVP_FAST_COMPILE=0:
XLA's default flags); the run records $XLA_FLAGS. Written: <out>/<stem>.json (everything, the per-item lines included) and <stem>.md.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time
from typing import Any

import numpy as np

ISSUE_GRID = ["presses=[SnapKVPress,TOVAPress,KnormPress,StreamingLLMPress,ExpectedAttentionPress,AdaKVPress]",
              "ratios=[0.25,0.5,0.75]", "gen=12", "samples=3"]
PHASES = ("prefill", "compress", "kept", "question", "decode")
OWN = ("side", "out", "name", "redraw", "against", "alternate")


def parse(argv: list[str]):
    """(the evals.peer Plan, side, out folder, stem)."""
    from evals import peer

    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if "=" in a and a.split("=", 1)[0] in OWN}
    rest = [a for a in argv if not ("=" in a and a.split("=", 1)[0] in OWN)]
    keys = {a.split("=", 1)[0] for a in rest if "=" in a}
    rest = [a for a in ISSUE_GRID if a.split("=", 1)[0] not in keys] + rest
    side = own.get("side", "both")
    if side not in ("both", "ours", "kvpress"):
        raise peer.ConfigError(f"side={side}: must be both, ours or kvpress")
    out = pathlib.Path(own.get("out", "results/peer_speed"))
    work = out / ".work"
    p = peer.parse(rest + [f"out={work}", "compile_cache=none", "progress=false", "name=run"])
    stem = own.get("name") or f"peer_speed_{p.model}_{p.task['name']}_{p.tokens}"
    return p, side, out, stem, rest


def per_sample(p, lines: list[dict]) -> dict[str, Any]:
    """Seconds per sample (the sum of its items' seconds) and per phase over the grid."""
    ids = {p.sample_id(i): i for i in range(p.samples)}
    secs = [0.0] * p.samples
    phases: dict[str, float] = {}
    for x in lines:
        secs[ids[x["sample"]]] += x["seconds"]
        for k, v in x.get("phases", {}).items():
            phases[k] = phases.get(k, 0.0) + v
    return {"samples": [round(s, 2) for s in secs], "first": round(secs[0], 2),
            "steady": round(float(np.mean(secs[1:])), 2) if len(secs) > 1 else None,
            "total": round(sum(secs), 2), "items": len(lines),
            "phases": {k: round(v, 2) for k, v in phases.items()}}


def run_ours(p) -> list[dict]:
    from evals import peer

    model, _ = peer.load_ours(p)
    todo = peer.pending(p, "ours")
    peer.run_ours(p, model, todo)
    return peer.read_lines(p.path(".ours.jsonl"))


def run_kvpress(p) -> list[dict]:
    """The kvpress worker alone, with every core's threads (OMP_NUM_THREADS: the machine's cores)."""
    from evals import peer

    os.environ["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)  # the worker's torch threads; no ours-done switch
    try:
        worker = peer.start_worker(p, peer.pending(p, "kvpress"))
        worker.wait()
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
    if worker.returncode != 0:
        raise RuntimeError(p.path(".kvpress.log").read_text(encoding="utf-8", errors="replace")[-3000:])
    return peer.read_lines(p.path(".kvpress.jsonl"))


MODES = ("press", "shared", "pooled")  # alternate=: evals.peer's two answer modes, and every press in one batch


def alternate(p, rounds: int) -> dict[str, Any]:
    """Our side's answers of the first sample in one process, in MODES in turn on the same compressed
    states: every press with a canonical form (`evals.shared_answers`) at every ratio, compressed
    once (shape classes, one covering prefill, as `evals.peer.run_ours`); answer=press, answer=shared
    (the same batches through the canonical form's engine) and pooled (every press's rows as one
    batch through it). A round 0 that compiles (each mode's programs and compilation seconds), then
    `rounds` timed rounds, in MODES' order in even rounds and reversed in odd ones. Per mode and round
    the question and decode seconds; the ratios mode / press of their medians over the timed rounds;
    whether each mode gives press's ids in every round."""
    import jax

    from evals import peer
    from evals.compiles import CompileLog
    from kvpolicies.compat import kvpress
    from models.engine import Engine
    from evals.shared_answers import canonical_of

    model, _ = peer.load_ours(p)
    ctx, q = p.contexts[0], p.questions[0]
    max_len = max(len(c) + len(x) for c, x in zip(p.contexts, p.questions)) + p.gen  # as run_ours
    max_new = max(len(x) for x in p.questions) + p.gen
    slots = peer.engine_slots(p, model, max_len, max_new)
    groups: dict[str, list] = {}
    prompts: dict[int, Any] = {}
    memo: dict = {}
    with jax.default_matmul_precision("highest"):
        for c in p.presses:
            if not slots.get(c):
                continue
            engs = [Engine(model, kvpress(peer.press_name(c), r, n_layers=model.cfg.n_layers, max_new=max_new,
                                          **peer.press_fields(p.model, c)), max_len=max_len, slots=slots[c],
                           share_steps=True) for r in p.ratios]
            if canonical_of(engs[0]) is None:
                continue
            wide = peer.shared_phase(model, engs, max_len, peer.pieces(len(ctx), p.chunk), memo)
            src = wide if wide is not None and engs[0].shares_prompt(wide) else engs[0]
            if id(src) not in prompts:
                prompts[id(src)] = (src, peer.prompt_in_pieces(src, ctx, p.chunk))
            groups[c] = [(e, e.compress(prompts[id(src)][1])) for e in engs]
        runs: dict[str, list] = {m: [] for m in MODES}
        same = []
        for k in range(rounds + 1):
            got = {}
            for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                with CompileLog() as log:
                    ph = peer.Phases(log)
                    if mode == "pooled":  # every press's rows of one canonical form as one batch (answer=pooled)
                        by: dict = {}
                        for g in groups.values():
                            by.setdefault(canonical_of(g[0][0]), []).extend(g)
                        batches = list(by.values())
                    else:  # a press's ratios as one batch, as evals.peer answers them
                        batches = list(groups.values())
                    ids = [peer.answer_rows(g[0][0], [s for _, s in g], q, p.gen, ph,
                                            engines=None if mode == "press" else [e for e, _ in g]) for g in batches]
                    got[mode] = np.concatenate(ids)
                    runs[mode].append(ph.done() | {"round": k})
                print(f"[peer_speed] round {k} answer={mode}: {runs[mode][-1]}", flush=True)
            same.append({m: bool(np.array_equal(got["press"], got[m])) for m in MODES[1:]})
    med = lambda mode, ph: float(np.median([r.get(ph, 0.0) for r in runs[mode][1:]]))  # noqa: E731
    return {"presses": list(groups), "rows": sum(len(g) for g in groups.values()), "runs": runs,
            "compiled": {m: {k: runs[m][0].get(k) for k in ("compile", "programs")} for m in runs},
            "ratio_over_press": {m: {ph: ratio(med(m, ph), med("press", ph)) for ph in ("question", "decode")}
                                 for m in MODES[1:]},
            "same_ids_as_press_every_round": {m: all(x[m] for x in same) for m in MODES[1:]}, "rounds": rounds}


def against(p, res: dict, path: pathlib.Path) -> dict[str, str]:
    """Per side of the saved run at `path`: how many of this run's items (same sample, press, ratio)
    have the same answer ids as its lines."""
    saved = json.loads(path.read_text())
    out = {}
    for side in saved.get("lines", {}):
        theirs = {(x["sample"], x["press"], float(x["ratio"])): x.get("answer") for x in saved["lines"][side]}
        mine = {(x["sample"], x["press"], float(x["ratio"])): x.get("answer") for x in res["lines"].get("ours", [])}
        both = [k for k in mine.keys() & theirs.keys() if theirs[k] is not None]
        out[side] = f"{sum(mine[k] == theirs[k] for k in both)}/{len(both)}"
    return out


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def markdown(res: dict) -> str:
    s = res["sides"]
    get = lambda side, k: s.get(side, {}).get(k)  # noqa: E731
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    rows = [("first sample (s)", "first"), ("steady state, per sample (s)", "steady"), ("whole grid (s)", "total")]
    out = [f"`{res['command']}`", "", f"{res['model']}, {res['task']} at {res['tokens']} tokens, {res['samples']} samples, "
           f"{res['items_per_sample']} items a sample ({res['presses']} presses x ratios {res['ratios']} + full), "
           f"gen {res['gen']}; each side alone, {res['threads']} threads; {res['date']}.", "",
           "| | kvpress 0.5.5 | kvpolicies | ours / kvpress |", "|---|---:|---:|---:|"]
    for label, k in rows:
        out.append(f"| {label} | {f(get('kvpress', k))} | {f(get('ours', k))} | "
                   f"{'-' if (r := ratio(get('ours', k), get('kvpress', k))) is None else f'{r:.2f}'} |")
    for ph in PHASES:
        a, b = (s.get(x, {}).get("phases", {}).get(ph) for x in ("kvpress", "ours"))
        out.append(f"| {ph}, whole grid (s) | {f(a)} | {f(b)} | {'-' if (r := ratio(b, a)) is None else f'{r:.2f}'} |")
    ours = s.get("ours", {}).get("phases", {})
    if ours:
        out.append(f"| compilation, inside the above (s) | - | {f(ours.get('compile'))} | - |")
        out.append(f"| programs compiled | - | {int(ours.get('programs', 0))} | - |")
    return "\n".join(out) + "\n"


def figure(runs: list[tuple[str, dict]], path: pathlib.Path) -> None:
    """Seconds per phase over the whole grid, one stacked bar per (label, side): PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{label}\n{side}", res["sides"][side]["phases"]) for label, res in runs
            for side in ("kvpress", "ours") if res["sides"].get(side, {}).get("phases")]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(bars), 4))
    bottom = np.zeros(len(bars))
    for ph in PHASES:
        vals = np.array([b.get(ph, 0.0) for _, b in bars])
        ax.bar(range(len(bars)), vals, bottom=bottom, label=ph)
        bottom += vals
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("seconds, whole grid (each side alone)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    from evals import peer

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return {}
    redraw = [a.split("=", 1)[1] for a in argv if a.startswith("redraw=")]
    if redraw:  # redraw=LABEL:RUN.json,LABEL:RUN.json out=... name=...: the figure of saved runs, nothing run
        out = pathlib.Path(next((a.split("=", 1)[1] for a in argv if a.startswith("out=")), "results/peer_speed"))
        name = next((a.split("=", 1)[1] for a in argv if a.startswith("name=")), "peer_speed")
        runs = [(x.split(":", 1)[0], json.loads(pathlib.Path(x.split(":", 1)[1]).read_text())) for x in
                redraw[0].split(",")]
        out.mkdir(parents=True, exist_ok=True)
        figure(runs, out / f"{name}.png")
        print(f"wrote {out / name}.png")
        return {}
    from evals.compiles import use_fast_compile

    use_fast_compile()  # as evals.peer compiles
    try:
        p, side, out, stem, rest = parse(argv)
        peer.check_reference()
        peer.prepare(p)
    except peer.ConfigError as e:
        print(f"benchmarks.peer_speed: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    shutil.rmtree(p.out, ignore_errors=True)  # nothing resumed
    p.out.mkdir(parents=True, exist_ok=True)
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if "=" in a}
    if "alternate" in own:
        rounds = int(own["alternate"]) if own["alternate"].isdigit() else 0
        if rounds < 1:
            print(f"benchmarks.peer_speed: error: alternate={own['alternate']}: expected an integer >= 1",
                  file=sys.stderr)
            raise SystemExit(2)  # ours alone, answer=press and answer=shared in turn, in this process
        res = {"command": "python -m benchmarks.peer_speed " + " ".join(argv), "argv": rest, "model": p.model,
               "samples": p.samples, "date": time.strftime("%Y-%m-%d %H:%M"),
               "alternate": alternate(p, rounds)}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
        print(json.dumps({k: v for k, v in res["alternate"].items() if k != "runs"}, indent=1))
        print(f"wrote {out / stem}.json")
        return res
    res: dict[str, Any] = {"command": "python -m benchmarks.peer_speed " + " ".join(argv), "argv": rest,
                           "model": p.model, "task": p.task["name"], "tokens": p.tokens, "samples": p.samples,
                           "presses": len(p.presses), "ratios": "/".join(f"{r:g}" for r in p.ratios), "gen": p.gen,
                           "items_per_sample": len(p.cells), "threads": os.cpu_count(),
                           "xla_flags": os.environ.get("XLA_FLAGS", ""),
                           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "date": time.strftime("%Y-%m-%d %H:%M"), "sides": {}, "lines": {}}
    for s, fn in (("kvpress", run_kvpress), ("ours", run_ours)):  # (model=tiny: the worker builds the checkpoint)
        if side in (s, "both"):
            print(f"[peer_speed] {s} side alone ...", flush=True)
            lines = fn(p)
            res["sides"][s] = per_sample(p, lines)
            res["lines"][s] = [{k: v for k, v in x.items() if k != "kept"} for x in lines]
            print(f"[peer_speed] {s}: {res['sides'][s]}", flush=True)
    if side == "both":
        ours, kv = (peer.saved(p, x) for x in ("ours", "kvpress"))
        same = [ours[k]["answer"] == kv[k]["answer"] for k in ours.keys() & kv.keys() if "answer" in kv[k]]
        res["same_ids"] = f"{sum(same)}/{len(same)}"
    res["answer"] = p.answer
    if "against" in own:
        res["same_ids_as"] = {"run": own["against"]} | against(p, res, pathlib.Path(own["against"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    (out / f"{stem}.md").write_text(markdown(res), encoding="utf-8")
    print(markdown(res))
    print(f"wrote {out / stem}.json, .md")
    return res


if __name__ == "__main__":
    from evals.compiles import reuse_memory

    reuse_memory("benchmarks.peer_speed", sys.argv[1:])  # glibc's allocator reusing its blocks: once, at the start
    main()
