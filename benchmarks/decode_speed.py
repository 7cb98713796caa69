"""Decode/prefill speed of SmolLM2-135M through kvpolicies, next to transformers on the same machine.

    python -m benchmarks.decode_speed --contexts 1024 4096 --steps 32

Reports, per policy and context: prefill tokens/s, decode-step compile time, decode tokens/s
(host loop of jitted steps, and the fused lax.scan generator), plus transformers' decode
tokens/s with its DynamicCache in float32. Timings are wall-clock on a shared machine: compare
the ratios measured in one run, not absolute numbers across runs.

Roofline: the process first measures its read bandwidth (a jitted sum over a 512 MB array, best
of 5); a decode step must read the weights and the keys/values it attends (the filled slots), so
its floor is (weight bytes + those cache bytes) / bandwidth. Each row reports that floor, the
fraction of it the host loop and the scan reach (`roofline`, `scan_roofline`: 1.0 = at the
bound), and `vs_transformers` (our scan decode tokens/s over transformers' at that context).

Scaling rows (`impl: scaling`): the ratio of two host-loop step times, `sink` after 64K tokens
over after 1K (flat = 1.0) and `full` at a 1K context with a 16K over a 1K `max_len`.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from models.engine import Engine
from models.loading import load_default_model


def _block(x):
    jax.tree.map(lambda a: a.block_until_ready(), x)
    return x


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a jitted float32 sum over `nbytes` (the best of `repeats`), measured here."""
    a = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x.sum())
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def step_read_bytes(model, cache, ctx: int) -> dict[str, int]:
    """What a decode step at context `ctx` must read: every weight, and the filled cache slots
    (a policy's whole state once it holds fewer slots than the context)."""
    from kvpolicies.base import tree_nbytes

    weights = tree_nbytes(nnx_state(model))
    slots = int(cache[0].pos.shape[-1])
    kv = tree_nbytes(cache) * min(1.0, (ctx + 1) / slots)
    return {"weight_bytes": int(weights), "kv_read_bytes": int(kv)}


def nnx_state(model):
    from flax import nnx

    return nnx.split(model)[1]


def bench_ours(model, tokens, policy, ctx, steps, chunk):
    eng = Engine(model, policy, max_len=ctx + steps + 1)
    t0 = time.perf_counter()
    logits, cache = _block(eng.prefill(tokens[None, :ctx], chunk=chunk))
    t_prefill_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, cache = _block(eng.prefill(tokens[None, :ctx], chunk=chunk))
    t_prefill = time.perf_counter() - t0
    nxt = np.asarray(jnp.argmax(logits, -1))[:, None]
    t0 = time.perf_counter()
    logits, cache = _block(eng.step(cache, nxt, ctx))
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        nxt = np.asarray(jnp.argmax(logits, -1))[:, None]
        logits, cache = eng.step(cache, nxt, ctx + 1 + i)
    _block(logits)
    t_decode = time.perf_counter() - t0
    # fused generator (one lax.scan over the steps), from a prompted state: compile once, then time
    state = eng.compress(eng.prompt(tokens[None, :ctx], chunk=chunk))
    eng.continue_generate(state, [], steps + 1)
    t0 = time.perf_counter()
    eng.continue_generate(state, [], steps + 1)  # the first token is the prompt's; then `steps` decode steps
    t_gen = time.perf_counter() - t0
    assert eng.traces["decode"] == 1 and eng.traces["decode_n"] == 1
    return step_read_bytes(model, cache, ctx) | dict(
        prefill_tok_s=ctx / t_prefill,
        prefill_cold_s=t_prefill_cold,
        decode_compile_s=t_compile,
        decode_tok_s=steps / t_decode,
        scan_decode_tok_s=steps / t_gen,
        cache_slots=int(cache[0].pos.shape[-1]),
    )


def step_ms(model, policy, max_len: int, pos: int, steps: int) -> float:
    """ms per host-loop decode step at positions pos, pos+1, ... of an engine of `max_len` (the
    cache's content does not change these policies' work: `full` reads the length bucket of its
    positions, `sink` its ring, filled or not)."""
    eng = Engine(model, policy, max_len=max_len)
    tok = np.zeros((1, 1), np.int32)
    logits, cache = _block(eng.step(eng.init_cache(1), tok, pos))  # compile
    best = float("inf")
    for r in range(3):  # the best of 3 runs of `steps` steps
        t0 = time.perf_counter()
        for i in range(steps):
            logits, cache = eng.step(cache, tok, pos + 1 + r * steps + i)
        _block(logits)
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def bench_scaling(model, steps: int, sink_window: int) -> list[dict]:
    """Does a step cost what it reads? `sink` after 64K tokens vs after 1K (the same slots: flat
    is 1.0), and `full` at a 1K context inside a 16K max_len vs a 1K max_len (1.0: the step
    reads only the filled slots; with length buckets it reads 1,280 of the 16,384)."""
    sink = kvpolicies.get("sink", n_sink=4, window=sink_window)
    full = kvpolicies.get("full")
    room = 4 * steps  # positions the timed steps take
    near, far = (step_ms(model, sink, p + room, p, steps) for p in (1024, 65536))
    small, big = (step_ms(model, full, n, 1000, steps) for n in (1000 + room, 16384))
    return [dict(impl="scaling", check="sink step after 64K / after 1K", ms=[near, far], ratio=far / near),
            dict(impl="scaling", check="full step at 1K context: max_len 16K / max_len 1K", ms=[small, big],
                 ratio=big / small)]


def bench_transformers(tokens, ctx, steps):
    import torch
    from transformers import AutoModelForCausalLM

    from models.loading import smollm2_gguf_path

    path = smollm2_gguf_path()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    m.eval()
    ids = torch.tensor(tokens[None, :ctx], dtype=torch.long)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = m(ids, use_cache=True)
        t_prefill = time.perf_counter() - t0
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t_decode = time.perf_counter() - t0
    return dict(prefill_tok_s=ctx / t_prefill, decode_tok_s=steps / t_decode)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--sink-window", type=int, default=1020)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--policies", nargs="+", default=["full", "sink", "int8"], choices=["full", "sink", "int8"])
    ap.add_argument("--out", default=None, help="write the rows here, one JSON object per line")
    ap.add_argument("--no-scaling", action="store_true", help="skip the step-cost-vs-position/max_len rows")
    args = ap.parse_args(argv)

    from evals.data import default_text

    model, tok = load_default_model()
    tokens = np.asarray(tok.encode(default_text()[:200_000]), np.int32)
    policies = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=args.sink_window),
                "int8": kvpolicies.get("full", codec="int8")}
    policies = {k: policies[k] for k in args.policies}
    bw = read_bandwidth()
    print(json.dumps({"read_bandwidth_GB_s": bw / 1e9}), flush=True)
    rows = []
    for ctx in args.contexts:
        ours = []
        for name, pol in policies.items():
            r = dict(impl="kvpolicies", policy=name, context=ctx, **bench_ours(model, tokens, pol, ctx, args.steps, args.chunk))
            floor = (r["weight_bytes"] + r["kv_read_bytes"]) / bw
            r |= {"roofline_ms": floor * 1e3, "roofline": floor * r["decode_tok_s"],
                  "scan_roofline": floor * r["scan_decode_tok_s"], "read_bandwidth_GB_s": bw / 1e9}
            ours.append(r)
            rows.append(r)
        if not args.no_transformers:
            t = dict(impl="transformers", policy="full", context=ctx, **bench_transformers(tokens, ctx, args.steps))
            for r in ours:
                r["vs_transformers"] = r["scan_decode_tok_s"] / t["decode_tok_s"]
            rows.append(t)
        for r in rows[-len(ours) - (0 if args.no_transformers else 1):]:
            print(json.dumps(r), flush=True)
    if not args.no_scaling:
        for r in bench_scaling(model, args.steps, args.sink_window):
            print(json.dumps(r), flush=True)
            rows.append(r)
    if args.out:  # one JSON object per line, as printed
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
