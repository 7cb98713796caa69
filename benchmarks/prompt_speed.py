"""Prompt-phase speed: tokens/s of `Engine.prompt` (a fresh prompt through each policy's prompt
phase, not compressed yet) on SmolLM2-135M float32 and the default text, in chunks.

    python -m benchmarks.prompt_speed --contexts 4096 8192 --policies full snapkv knorm observed
    python -m benchmarks.prompt_speed --contexts 8192 --policies snapkv --no-buckets
    python -m benchmarks.prompt_speed --contexts 4096 16384 --policies full --chunk 0

Each row: the policy, the context, the first (cold: compiles) and the second (warm) prompt's
seconds, warm tokens/s, and the engine's trace counts. `--no-buckets` reads the whole cache at
every chunk (the path before the length buckets). `--chunk 0`: the whole prompt as one chunk
(`chunk=None`). `peak_rss_GB`: the process's peak resident memory so far (run one configuration
per process to read it as that configuration's). Wall-clock on a shared machine: compare rows of
one run. `--dry-run`: a tiny random model at 64 tokens (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import numpy as np

import kvpolicies
import models.engine.steps as engine_mod  # reach_of reads REACH_MIN here
from models.engine import Engine

POLICIES = {
    "full": lambda: kvpolicies.get("full"),
    "snapkv": lambda: kvpolicies.get("snapkv", budget=1024),
    "knorm": lambda: kvpolicies.get("knorm", budget=1024),
    "observed": lambda: kvpolicies.get("observed", budget=1024),
}


def prompt_seconds(eng: Engine, ids: np.ndarray, chunk: int | None) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(eng.prompt(ids, chunk=chunk).logits)
    return time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--chunk", type=int, default=512, help="tokens per chunk; 0: the whole prompt as one chunk")
    ap.add_argument("--no-buckets", action="store_true", help="every chunk reads the whole cache")
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model at 64 tokens")
    args = ap.parse_args(argv)
    if args.dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32))
        tokens = np.random.default_rng(0).integers(0, 97, 64).astype(np.int32)
        contexts, chunk = [64], 16 if args.chunk else 0
    else:
        from evals.data import default_text
        from models.loading import load_default_model

        model, tok = load_default_model()
        tokens = np.asarray(tok.encode(default_text()[:400_000]), np.int32)
        contexts, chunk = args.contexts, args.chunk
    saved = engine_mod.REACH_MIN
    if args.no_buckets:
        engine_mod.REACH_MIN = 10**9  # no bucket below max_len: the whole cache
    rows = []
    try:
        for ctx in contexts:
            if ctx > len(tokens):
                raise SystemExit(f"prompt_speed: context {ctx} is longer than the text ({len(tokens)} tokens)")
            ids = tokens[None, :ctx]
            for name in args.policies:
                eng = Engine(model, POLICIES[name](), max_len=ctx + 64)
                cold, warm = prompt_seconds(eng, ids, chunk or None), prompt_seconds(eng, ids, chunk or None)
                r = {"policy": name, "context": ctx, "chunk": chunk or ctx, "buckets": not args.no_buckets,
                     "cold_s": cold, "warm_s": warm, "prompt_tok_s": ctx / warm, "traces": dict(eng.traces),
                     "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
                print(json.dumps(r), flush=True)
                rows.append(r)
    finally:
        engine_mod.REACH_MIN = saved
    return rows


if __name__ == "__main__":
    main()
