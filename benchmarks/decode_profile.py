"""Where a decode step's time goes: SmolLM2-135M float32, one policy, a cache of N slots.

    python -m benchmarks.decode_profile --slots 4160 16448 --policy full

For each cache size: ms per decode step with RoPE's cos/sin tabulated once per engine (the
default) and computed in every step (`Engine(..., rope_tables=False)`), both in this process;
then the XLA operations of the tabulated step that took the most time, from a `jax.profiler`
trace (its Perfetto JSON), per step. The cache content does not change the work of these
policies (every slot is read, masked or not; at position N - 40 no length bucket is smaller than
the cache), so the cache is left empty and the step runs at position N - 40. Wall-clock on a shared machine: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax
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
    """(XLA op, ms per step, calls per step) of the `n` costliest ops in a profiler trace."""
    tok = np.zeros((1, 1), np.int32)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for i in range(steps):
                logits, cache = eng.step(cache, tok, pos + i)
            jax.block_until_ready(logits)
        trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith(("$", "ThunkExecutor", "PjitFunction", "CommonPjRt")):
            dur[name] += e.get("dur", 0)
            calls[name] += 1
    return [(name, us / steps / 1e3, calls[name] // steps) for name, us in dur.most_common(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, nargs="+", default=[4160, 16448])
    ap.add_argument("--policy", default="full", choices=["full", "sink", "int8"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    model, _ = load_default_model()
    pol = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=1020),
           "int8": kvpolicies.get("full", codec="int8")}[args.policy]
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
