"""A million-token stream through a bounded policy: constant memory and flat step time.

    python -m benchmarks.long_stream --tokens 1048576 --chunk 512
    python -m benchmarks.long_stream --tokens 262144 --default-model --score   # SmolLM2, Engine.score's step

A tiny random Llama (byte vocabulary; `--default-model`: SmolLM2-135M) streams `tokens` random
ids through `sink` (4 sinks + 1,020 recent, positions=cache) in chunks with `Engine.step` (`--score`:
the NLL step of `Engine.score`), one compiled step for every chunk. It
reports the policy state's bytes (constant by construction, checked at the end), the process's
resident memory (VmRSS) after the first and the last 10 % of the stream, the mean chunk time of
the first and last 10 % after warm-up (the ratio is the flatness: 1.0 = flat), and the largest
position stored. Positions are int32: an `Engine` refuses max_len past `MAX_LEN` (2^31 - 2^16)
before anything runs.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from kvpolicies.memory import tree_nbytes
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def stream(tokens: int, chunk: int, policy: kvpolicies.Policy, seed: int = 0, model=None, score: bool = False) -> dict:
    """`model`: None for the tiny random Llama; `score`: each chunk through the NLL step that
    `Engine.score` runs (logits of every token, log-softmax, the targets' NLL) instead of
    `Engine.step` (the last token's logits)."""
    if model is None:
        model = Llama(LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                  d_ff=128))
    eng = Engine(model, policy, max_len=tokens + 1)
    ids = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (1, tokens + 1)).astype(np.int32)
    cache = eng.init_cache(1).runs  # the states (the NLL step below takes the model's cache, as Engine.score)
    state0 = tree_nbytes(cache)
    n_chunks = tokens // chunk
    tenth = max(1, n_chunks // 10)
    times, rss = [], {}
    for i in range(n_chunks):
        s = i * chunk
        t0 = time.perf_counter()
        if score:  # as Engine.score feeds a chunk (its NLL step; every chunk here is whole)
            pos = jnp.arange(s, s + chunk, dtype=jnp.int32)[None]
            out, cache = eng._nll_step(eng.params, cache, jnp.asarray(ids[:, s:s + chunk]), pos,
                                       jnp.asarray(ids[:, s + 1:s + chunk + 1]), reach=eng._reach(s + chunk, chunk))
        else:
            out, cache = eng.step(cache, ids[:, s:s + chunk], s)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        if i == tenth:
            rss["first_10pct"] = rss_bytes()
    rss["end"] = rss_bytes()
    first, last = np.mean(times[1:tenth + 1]), np.mean(times[-tenth:])  # chunk 0 compiles
    return {"policy": repr(policy), "model": f"{model.cfg.n_layers} layers, d_model {model.cfg.d_model}",
            "score": score, "tokens": n_chunks * chunk, "chunk": chunk, "state_bytes": state0,
            "tok_s_first_10pct": chunk / first, "tok_s_last_10pct": chunk / last,
            "state_bytes_end": tree_nbytes(getattr(cache, "runs", cache)), "rss_first_10pct_MB": rss["first_10pct"] / 1e6,
            "rss_end_MB": rss["end"] / 1e6, "chunk_ms_first_10pct": first * 1e3, "chunk_ms_last_10pct": last * 1e3,
            "last_over_first": last / first, "max_position": int(np.asarray(cache[0].pos).max()),
            "traces": dict(eng.traces)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--default-model", action="store_true", help="SmolLM2-135M float32 instead of the tiny Llama")
    ap.add_argument("--score", action="store_true", help="chunks through Engine.score's NLL step")
    args = ap.parse_args(argv)
    model = None
    if args.default_model:
        from models.loading import load_default_model

        model, _ = load_default_model()
    row = stream(args.tokens, args.chunk, kvpolicies.get("sink", n_sink=4, window=1020), model=model, score=args.score)
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
