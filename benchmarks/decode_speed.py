"""Decode/prefill speed of SmolLM2-135M through kvpolicies, next to transformers on the same machine.

    python -m benchmarks.decode_speed --contexts 1024 4096 --steps 32

Reports, per policy and context: prefill tokens/s, decode-step compile time, decode tokens/s
(host loop of jitted steps, and the fused lax.scan generator), plus transformers' decode
tokens/s with its DynamicCache in float32. Timings are wall-clock on a shared machine: compare
the ratios measured in one run, not absolute numbers across runs.
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
    # fused generator (one lax.scan): compile once, then time
    eng.generate(tokens[:ctx], steps, chunk=chunk)
    t0 = time.perf_counter()
    eng.generate(tokens[:ctx], steps, chunk=chunk)
    t_gen = time.perf_counter() - t0 - t_prefill
    assert eng.traces["decode"] == 1
    return dict(
        prefill_tok_s=ctx / t_prefill,
        prefill_cold_s=t_prefill_cold,
        decode_compile_s=t_compile,
        decode_tok_s=steps / t_decode,
        scan_decode_tok_s=steps / max(t_gen, 1e-9),
        cache_slots=int(cache[0].pos.shape[-1]),
    )


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
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from evals.data import default_text

    model, tok = load_default_model()
    tokens = np.asarray(tok.encode(default_text()[:200_000]), np.int32)
    policies = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=args.sink_window)}
    rows = []
    for ctx in args.contexts:
        for name, pol in policies.items():
            r = dict(impl="kvpolicies", policy=name, context=ctx, **bench_ours(model, tokens, pol, ctx, args.steps, args.chunk))
            print(json.dumps(r), flush=True)
            rows.append(r)
        if not args.no_transformers:
            r = dict(impl="transformers", policy="full", context=ctx, **bench_transformers(tokens, ctx, args.steps))
            print(json.dumps(r), flush=True)
            rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
