"""Where a decode step's time goes: SmolLM2-135M float32, one policy, a cache of N slots.

    python -m benchmarks.decode_profile --slots 4160 16448 --policy full

For each cache size: ms per decode step with RoPE's cos/sin tabulated once per engine (the
default) and computed in every step (`Engine(..., rope_tables=False)`), both in this process;
then the XLA operations of the tabulated step that took the most time, from a `jax.profiler`
trace (its Perfetto JSON), per step. The cache content does not change the work of these
policies (every slot is read, masked or not; at position N - 40 no length bucket is smaller than
the cache), so the cache is left empty and the step runs at position N - 40. Wall-clock on a shared machine: read the ratios within one run.

    python -m benchmarks.decode_profile --sink-chunk 4096 --steps 3

instead profiles the default command's steady state: one 512-token chunk of `sink` (4 + 4,096)
at a full window, its costliest ops with their shapes (`sink_chunk`).

    python -m benchmarks.decode_profile --layers 4096 --policy full

instead profiles the layer-by-layer generation that docs/results/speed.md's table reports (`layer_steps`):
`continue_generate` after a C-token prompt, ms per decode step (median over rounds of the
difference of a long and a 2-token call), the step's fraction of its roofline with the read
bandwidth measured in this process, and its costliest ops per step with their compiled shapes.
Run it under `taskset -c 0` to see which ops use the second core: an op that takes as long on
one core ran on one thread.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from models.engine import Engine
from models.loading import load_default_model


def step_ms(eng: Engine, pos: int, steps: int) -> tuple[float, object]:
    cache = eng.init_cache(1)
    tok = np.zeros((1, 1), np.int32)
    logits, cache = eng.step(cache, tok, pos)  # compile
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for i in range(steps):
        logits, cache = eng.step(cache, tok, pos + 1 + i)
    jax.block_until_ready(logits)
    return (time.perf_counter() - t0) / steps * 1e3, cache


def top_ops(eng: Engine, cache, pos: int, steps: int, n: int) -> list[tuple[str, float, int]]:
    """(XLA op, ms per step, calls per step) of the `n` costliest ops in a profiler trace of
    `steps` decode steps from position `pos`."""
    tok = np.zeros((1, 1), np.int32)
    box = {"cache": cache, "pos": pos}

    def step():
        logits, box["cache"] = eng.step(box["cache"], tok, box["pos"])
        box["pos"] += 1
        return logits

    return profiled(step, steps, n)


def profiled(run, steps: int, n: int) -> list[tuple[str, float, int]]:
    """(XLA op, ms per call of `run`, calls per call of `run`) of the `n` costliest ops in a
    `jax.profiler` trace of `steps` calls of `run` (each returns an array to wait for). Ops that
    run at the same time (XLA:CPU runs independent ones side by side) each count their own time."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(run())
        trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith(("$", "ThunkExecutor", "PjitFunction", "CommonPjRt",
                                                        "SlinkyThreadPool")):
            dur[name] += e.get("dur", 0)
            calls[name] += 1
    return [(name, us / steps / 1e3, calls[name] // steps) for name, us in dur.most_common(n)]


def sink_chunk(model, window: int, chunk: int, steps: int, n: int) -> dict:
    """The default command's steady state: one `chunk`-token step of `sink` (4 + `window`) at
    position window + chunk, after a prefill of that many random ids; seconds per step (the
    median of `steps`, each on a fresh copy of the cache) and its costliest ops, with each
    op's shape from the compiled HLO (e.g. a block's logits f32[3,1536,512])."""
    start = window + chunk
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, (1, start + chunk)).astype(np.int32)
    eng = Engine(model, kvpolicies.get("sink", n_sink=4, window=window), max_len=start + chunk)
    _, cache = eng.prefill(ids[:, :start], chunk=chunk, cache=eng.init_cache(1))

    def run():
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
        return eng.step(fresh, ids[:, start:], start)[0]

    jax.block_until_ready(run())  # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    pos = jnp.broadcast_to(jnp.arange(start, start + chunk, dtype=jnp.int32), (1, chunk))
    hlo = eng._logits_step.lower(eng.params, cache, jnp.asarray(ids[:, start:]), pos, prompt=False,
                                 reach=eng._reach(start + chunk, chunk, False)).compile().as_text()
    shapes = dict(re.findall(r"^\s*%?([\w.-]+) = (\S+) fusion\(", hlo, flags=re.M))
    ops = [{"op": o, "shape": shapes.get(o, ""), "ms": ms, "calls": c} for o, ms, c in profiled(run, steps, n)]
    return {"policy": f"sink 4+{window}", "chunk": chunk, "position": start, "step_s": float(np.median(times)),
            "ops": ops}


def _shapes(hlo: str) -> dict[str, str]:
    """op name -> its result shape, for the fusions and dots of compiled HLO text."""
    return dict(re.findall(r"^\s*%?([\w.-]+) = (\S+) (?:fusion|dot)\(", hlo, flags=re.M))


def layer_steps(model, policy, context: int, steps: int, n: int, rounds: int = 5, clock=time.perf_counter) -> dict:
    """Layer-by-layer decode steps (`Engine.continue_generate`, the default loop) after a prompt
    of `context` random ids: ms per step, its roofline fraction, and the `n` costliest ops of a
    profiled `steps`-step call, each per step with its shape (a layer's ops from the layer step's
    HLO, the others from the step that picks the next token: the output head). A step's time is
    a `steps + 1`-token call minus a 2-token call, read from `clock` (tests pass a fake one)."""
    from benchmarks.decode_speed import read_bandwidth, step_read_bytes
    from models.engine import layer_weights, split_layers

    ids = np.random.default_rng(5).integers(0, model.cfg.vocab_size, (1, context)).astype(np.int32)
    eng = Engine(model, policy, max_len=context + steps + 2)
    state = eng.compress(eng.prompt(ids, chunk=min(512, context)))
    eng.continue_generate(state, [], steps + 1)  # compiles (the first token is the prompt's; then `steps` steps)
    eng.continue_generate(state, [], 2)
    ms = []
    for _ in range(rounds):
        t0 = clock()
        eng.continue_generate(state, [], steps + 1)
        t1 = clock()
        eng.continue_generate(state, [], 2)
        step = ((t1 - t0) - (clock() - t1)) / max(1, steps - 1)
        ms.append(1e3 * (step if step > 0 else (t1 - t0) / (steps + 1)))  # noise over the steps: the long call's mean
    step = float(np.median(ms))
    bw = read_bandwidth()
    read = step_read_bytes(model, state.cache, context)
    # the compiled layer step and next-token step, for the ops' shapes
    tables = {k: dataclasses.replace(t, cond_angles=True) for k, t in eng.params[1].items()}
    x = jnp.zeros((1, 1, model.cfg.d_model), model.dtype)
    pos = jnp.full((1,), context, jnp.int32)
    layer_hlo = eng._layer_step.lower(layer_weights(model)[0], split_layers(state.cache)[0], x, pos, tables,
                                      policy=eng.policies[0], local=bool(model.cfg.local_layers[0]),
                                      reach=eng._reach(context + steps + 1)).compile().as_text()
    head_hlo = eng._next_step.lower(eng.params, x, pos).compile().as_text()
    layer_shapes, head_shapes = _shapes(layer_hlo), _shapes(head_hlo)
    L = model.cfg.n_layers
    ops = []
    for o, t, c in profiled(lambda: eng.continue_generate(state, [], steps + 1), 3, n):
        per_layer = c % L == 0 and c >= L * steps
        shape = (layer_shapes if per_layer else head_shapes).get(o, "")
        ops.append({"op": o, "shape": shape, "ms": t / steps, "calls": c / steps})
    return {"policy": repr(policy), "context": context,
            "step_ms": step, "step_ms_rounds": ms, "read_bandwidth_GB_s": bw / 1e9,
            "roofline": (read["weight_bytes"] + read["kv_read_bytes"]) / bw * 1e3 / step, **read, "ops": ops}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, nargs="+", default=[4160, 16448])
    ap.add_argument("--policy", default="full", choices=["full", "sink", "int8"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--sink-chunk", type=int, default=0, metavar="WINDOW",
                    help="instead: a steady-state 512-token chunk of sink 4 + WINDOW (the default command: 4096)")
    ap.add_argument("--layers", type=int, nargs="+", default=[], metavar="CONTEXT",
                    help="instead: layer-by-layer generation after prompts of these lengths (docs/results/speed.md's decode rows)")
    ap.add_argument("--out", default=None, help="append the rows here, one JSON object per line")
    args = ap.parse_args(argv)
    model, _ = load_default_model()
    pol = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=1020),
           "int8": kvpolicies.get("full", codec="int8")}[args.policy]
    if args.sink_chunk or args.layers:
        rows = ([sink_chunk(model, args.sink_chunk, 512, args.steps, args.top)] if args.sink_chunk else
                [layer_steps(model, pol, c, args.steps, args.top) for c in args.layers])
        for row in rows:
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return rows
    rows = []
    for n in args.slots:
        pos = n - 40
        eng = Engine(model, pol, max_len=n)
        tab, cache = step_ms(eng, pos, args.steps)
        trig, _ = step_ms(Engine(model, pol, max_len=n, rope_tables=False), pos, args.steps)
        row = {"policy": args.policy, "slots": n, "step_ms": tab, "step_ms_rope_computed": trig,
               "ops": [{"op": o, "ms": ms, "calls": c} for o, ms, c in top_ops(eng, cache, pos + args.steps + 1,
                                                                              args.steps, args.top)]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
