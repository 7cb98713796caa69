"""KVzap's prefill overhead next to a plain prefill and to KVzip's.

    python -m benchmarks.kvzap_overhead --model qwen --tokens 2048

One context of `--tokens` tokens of the Paul Graham essays, three ways, each run once to compile
and then `--repeats` times interleaved (best time kept; a shared machine's load hits them alike):
  full    a plain prefill (`Engine.prefill` through `full`);
  kvzap   its prompt phase (the dense prefill, the surrogate scoring every layer's tokens as they
          pass) and `compress` (the head-wise choice into the pool);
  kvzip   its prompt phase and `compress` (the reconstruction pass, then the same choice).
Reports seconds and the ratio of each to `full`. Wall-clock: read the ratios, measured together.
`--surrogate random`: seeded random surrogate weights of `--kind` (a model without a trained file:
the cost does not depend on the weights' values). `--out`: the result as JSON. `--dry-run`: the
tiny random model on 200 tokens (what the test runs).

    python -m benchmarks.kvzap_overhead --model smollm2 --tokens 2048 --thresholds=-8,-7,-6,-5

`--thresholds`: instead, one kvzap prompt phase over the context, then `rule=threshold` at each
threshold (the pool's capacity set to the whole context, so nothing caps it): the achieved
fraction of the context kept, all layers, and the least and most any layer and any head kept.

    python -m benchmarks.kvzap_overhead --model smollm2 --tokens 2048 --thresholds=-7,-6,-5 --fit

`--fit`: at each threshold, the stored bytes (measured: the states' array bytes) of three ways to
hold the same context with `--max-new` free slots per head: the threshold in a static pool sized
for the whole context (`rule=threshold`, budget = tokens), the same threshold with each layer
stored at what it kept (`Engine.fitted`, checked against the closed form), and a fixed ratio at
the achieved ratio (`rule=budget`, the same tokens per head on average in every layer); each
layer's fitted bytes; and the cache bytes alive at once while compressing (the dense prompt
phase plus what compression allocates: all static or uniform pools at once, or, fitted, one
layer's slice and the fitted pools; or, with DMS's sparse prefill, `prefill="sparse"`, each layer's pool
capped at 1.25x what it kept of a calibration context, the next `--tokens` of the text: its pools
and scores, and the fitted pools). These are array
sizes, not an allocator's peak.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import kvpolicies
from models.engine import Engine
from models.reconstruct import repeat_prompts


def timed(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out))
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen", "gemma3"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.5, help="kept fraction of the context")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kind", default="linear", choices=["linear", "mlp"])
    ap.add_argument("--thresholds", default=None, help="comma-separated log-score thresholds (kept fractions)")
    ap.add_argument("--fit", action="store_true", help="with --thresholds: stored bytes fitted / static / fixed ratio")
    ap.add_argument("--max-new", type=int, default=64, help="--fit: free slots per kv head for decoding")
    ap.add_argument("--window", type=int, default=128, help="--fit: kvzap.window (DMSPress's default 128)")
    ap.add_argument("--offset", type=int, default=0, help="first token of the context in the essays")
    ap.add_argument("--surrogate", default="auto", help="kvzap.surrogate: auto (the model's trained file) or random")
    ap.add_argument("--out", default=None, help="write the result here (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="the tiny random model, 200 tokens")
    a = ap.parse_args(argv)

    from evals import zoo
    from evals.data import paul_graham
    from models.stacks import model_stack

    mcfg = {"name": a.model, "dtype": "float32"}
    if a.dry_run:  # configs/model/tiny_random.yaml's model
        a.tokens, a.chunk, a.surrogate, a.window = 200, 64, "random", 16
        mcfg = dict(name="tiny_random", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, max_position=512, seed=0, dtype="float32")
    model, tok = zoo.load_model(mcfg)
    ids = np.asarray(tok.encode(paul_graham()), np.int32)[a.offset: a.offset + a.tokens][None]
    if a.thresholds and a.fit:
        calib = np.asarray(tok.encode(paul_graham()), np.int32)[a.offset + a.tokens: a.offset + 2 * a.tokens][None]
        res = fit_bytes(model, ids, calib, [float(x) for x in a.thresholds.split(",")], a.kind, a.chunk, a.max_new,
                        a.surrogate, a.window)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return res
    if a.thresholds:
        return kept_fractions(model, ids, [float(x) for x in a.thresholds.split(",")], a.kind, a.chunk)
    window = kvpolicies.get("kvzap").window
    budget = max(int(a.budget * a.tokens), window)
    stack = lambda p: model_stack(model.cfg, p)  # noqa: E731  (gemma3: local layers keep their window)
    zap = kvpolicies.get("kvzap", budget=budget, kind=a.kind, surrogate=a.surrogate)
    engines = {
        "full": Engine(model, stack(kvpolicies.get("full")), max_len=a.tokens + 64),
        "kvzap": Engine(model, stack(zap), max_len=a.tokens + 64),
        "kvzip": Engine(model, stack(kvpolicies.get("kvzip", budget=budget)), max_len=a.tokens + 64,
                        repeat=repeat_prompts(tok)),
    }
    runs = {"full": lambda: engines["full"].prefill(ids, chunk=a.chunk)[0],
            "kvzap": lambda: engines["kvzap"].compress(engines["kvzap"].prompt(ids, chunk=a.chunk)).cache,
            "kvzip": lambda: engines["kvzip"].compress(engines["kvzip"].prompt(ids, chunk=a.chunk)).cache}
    for f in runs.values():  # compile
        timed(f)
    secs = {k: float("inf") for k in runs}
    for _ in range(a.repeats):
        for k, f in runs.items():
            secs[k] = min(secs[k], timed(f))
    res = {"model": mcfg["name"], "tokens": a.tokens, "budget": budget, "kind": a.kind, "surrogate": a.surrogate,
           "chunk": a.chunk, "repeats": a.repeats, **{f"{k}_s": round(v, 3) for k, v in secs.items()},
           "kvzap_over_prefill": round(secs["kvzap"] / secs["full"], 3),
           "kvzip_over_prefill": round(secs["kvzip"] / secs["full"], 3)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def markdown_table(results: list[dict]) -> str:
    """The overhead table of saved runs (docs/guide/kvzap.md), one row per run."""
    rows = ["| model | tokens | surrogate | `full` prefill | kvzap prompt + compress | kvzip prompt + compress |",
            "|---|---:|---|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r['model']} | {r['tokens']:,} | {r['kind']}, {r['surrogate']} | {r['full_s']:.2f} s | "
                    f"{r['kvzap_s']:.2f} s ({r['kvzap_over_prefill']:.2f}x) | "
                    f"{r['kvzip_s']:.2f} s ({r['kvzip_over_prefill']:.2f}x) |")
    return "\n".join(rows)


def kept_fractions(model, ids: np.ndarray, thresholds: list[float], kind: str, chunk: int) -> dict:
    """Kept fraction per threshold (overall, per layer and per head: min and max) of one context."""
    from kvpolicies.kvzap import kept_counts

    t = ids.shape[1]
    base = kvpolicies.get("kvzap", budget=t, max_new=0, rule="threshold", kind=kind)
    eng = Engine(model, base, max_len=t)
    state = eng.prompt(ids, chunk=chunk)
    if len(state.cache) != 1:
        raise SystemExit("--thresholds: one run of kvzap layers expected (a model without local layers)")
    rows = []
    for thr in thresholds:
        pol = kvpolicies.get("kvzap", budget=t, max_new=0, rule="threshold", threshold=thr, kind=kind)
        counts = kept_counts(jax.vmap(pol.after_prompt)(state.cache[0]))[:, 0]  # [L, K]
        rows.append({"threshold": thr, "kept": round(float(counts.sum() / (counts.size * t)), 4),
                     "layer_min": round(float(counts.mean(axis=1).min() / t), 4),
                     "layer_max": round(float(counts.mean(axis=1).max() / t), 4),
                     "head_min": round(float(counts.min() / t), 4), "head_max": round(float(counts.max() / t), 4)})
    res = {"model": model.cfg.name, "tokens": t, "kind": kind, "rows": rows}
    print(json.dumps(res, indent=1))
    return res


def fit_bytes(model, ids: np.ndarray, calib_ids: np.ndarray, thresholds: list[float], kind: str, chunk: int,
              max_new: int, surrogate: str = "auto", window: int = 128) -> dict:
    """Stored bytes of one context at each threshold: static pool, fitted, fixed ratio (`--fit`)."""
    from kvpolicies.memory import tree_nbytes

    t = ids.shape[1]
    kh, n_layers = model.cfg.n_kv_heads, model.cfg.n_layers
    zap = lambda **kw: kvpolicies.get("kvzap", max_new=max_new, kind=kind, surrogate=surrogate, window=window,  # noqa: E731
                                      **kw)
    base = Engine(model, zap(budget=t, rule="threshold"), max_len=t + max_new)
    state = base.prompt(ids, chunk=chunk)
    calib_state = base.prompt(calib_ids, chunk=chunk)
    dense = tree_nbytes(state.cache)
    rows = []
    for thr in thresholds:
        eng = Engine(model, zap(budget=t, rule="threshold", threshold=thr), max_len=t + max_new)
        static = eng.compress(state)
        fe, fitted = eng.fitted(state)
        kept = [sum(len(h) for h in layer) for layer in fe.kept_positions(fitted)]  # [L] tokens, all heads
        per_slot = tree_nbytes(static.cache) // (n_layers * kh * eng.policies[0].capacity(eng.max_len))
        closed = sum(kh * (max(-(-n // kh), eng.policies[0].window) + max_new) * per_slot for n in kept)
        if tree_nbytes(fitted.cache) != closed:
            raise SystemExit(f"threshold {thr}: fitted bytes {tree_nbytes(fitted.cache)} != closed form {closed}")
        per_head = max(round(sum(kept) / (n_layers * kh)), eng.policies[0].window)  # the achieved ratio's budget
        fixed = Engine(model, zap(budget=per_head), max_len=t + max_new).compress(state)
        layer_bytes = [tree_nbytes(jax.tree.map(lambda x: x[i], run)) for run in fitted.cache
                       for i in range(jax.tree.leaves(run)[0].shape[0])]
        # the sparse prefill (DMS's): no dense phase; each layer's pool capped at 1.25x what the layer kept of
        # the calibration context (the next `tokens` of the text), in tokens per head, rounded up to 64
        eng.fitted(calib_state)
        cal_kept = eng.fit_records[-1]["kept"]
        caps = [min(-(-int(1.25 * -(-n // kh)) // 64) * 64, t) for n in cal_kept]
        caps = [max(c, eng.policies[0].window) for c in caps]
        sp = Engine(model, tuple(zap(budget=c, rule="threshold", threshold=thr, prefill="sparse") for c in caps),
                    max_len=t + max_new)
        sp_state = sp.prompt(ids, chunk=chunk)
        sp_fe, sp_fitted = sp.fitted(sp_state)
        sp_kept = sum(sum(len(h) for h in layer) for layer in sp_fe.kept_positions(sp_fitted))
        rows.append({"threshold": thr, "kept": round(sum(kept) / (n_layers * kh * t), 4),
                     "ratio": round(1 - sum(kept) / (n_layers * kh * t), 4),
                     "static_bytes": tree_nbytes(static.cache), "fitted_bytes": tree_nbytes(fitted.cache),
                     "fixed_ratio_bytes": tree_nbytes(fixed.cache), "fixed_ratio_budget": per_head,
                     "fitted_layer_bytes": layer_bytes,
                     "alive_static": dense + tree_nbytes(static.cache),
                     "alive_fitted": dense + dense // n_layers + tree_nbytes(fitted.cache),
                     "alive_fixed_ratio": dense + tree_nbytes(fixed.cache),
                     "sparse_budgets": caps, "sparse_ratio": round(1 - sp_kept / (n_layers * kh * t), 4),
                     "sparse_phase_bytes": tree_nbytes(sp_state.cache), "sparse_fitted_bytes": tree_nbytes(sp_fitted.cache),
                     "alive_sparse": tree_nbytes(sp_state.cache) + tree_nbytes(sp_fitted.cache)})
    res = {"model": model.cfg.name, "tokens": t, "kind": kind, "surrogate": surrogate, "max_new": max_new, "window": window,
           "prompt_phase_bytes": dense, "rows": rows}
    print(json.dumps(res, indent=1))
    return res


def fit_table(res: dict) -> str:
    """The `--fit` run as a markdown table (docs/guide/kvzap.md)."""
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    rows = ["| threshold | achieved ratio | static pool (MiB) | fitted (MiB) | fixed ratio (MiB) | "
            "least / most bytes of a fitted layer (MiB) | alive while compressing: fixed ratio / fitted / "
            "sparse prefill (MiB) | sparse prefill: achieved ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lb = r["fitted_layer_bytes"]
        rows.append(f"| {r['threshold']:g} | {r['ratio']:.3f} | {mb(r['static_bytes'])} | {mb(r['fitted_bytes'])} | "
                    f"{mb(r['fixed_ratio_bytes'])} | {mb(min(lb))} / {mb(max(lb))} | {mb(r['alive_fixed_ratio'])} / "
                    f"{mb(r['alive_fitted'])} / {mb(r['alive_sparse'])} | {r['sparse_ratio']:.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
