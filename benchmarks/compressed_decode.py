"""Decoding after a compressed prompt (kvpress's protocol: the context compressed once, then the
question appended and greedy tokens decoded) next to the full cache's, on SmolLM2-135M float32
and the default text.

    python -m benchmarks.compressed_decode --context 2048 --ratio 0.25
    python -m benchmarks.compressed_decode --presses SnapKVPress AdaKVPress --ratio 0.5

Each press runs through `kvpolicies.compat.kvpress(press, ratio)`: `Engine.prompt` of the
context, `compress`, then two timings of `continue_generate` from that state (each the best of
`--repeats` warm calls after a compiling one): `question_s`, a `--question`-token question fed in
chunks of 4 (as `evals.peer` feeds it) and one greedy token; `generate_s`, `--gen` greedy tokens
with no question. `full` runs the same calls, and each row reports its times over full's
(`question_vs_full`, `generate_vs_full`: 1.0 = as fast as the full cache, which holds more).
A compressed cache decodes through a policy that evicts per token (`per_token`: a scan over
the chunk's tokens, and on every token the choice of what stays); the full cache appends.
Wall-clock on a shared machine: read the ratios of one run, not absolute numbers across runs.
`--dry-run`: a tiny random model at 64 tokens (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import kvpolicies
from kvpolicies.compat import PRESSES, WRAPPERS, kvpress
from models.engine import Engine
from models.reconstruct import RepeatPrompts

QUESTION_CHUNK = 4  # as evals.peer feeds a question into a compressed state
# PerLayerCompressionPress needs per-layer ratios; KeyDiff, LagKV and Random decode as KnormPress (the same
# PromptScored state, appended alike): timing them again adds nothing; the wrappers (Chunk, Block, Composed)
# decode as the press they wrap (AdaKVPress, over SnapKVPress by default, has its own head pool); CUR and the
# Compactor family decode as a PromptScored state too; FinchPress needs the question's length (window_size)
DEFAULT_PRESSES = [p for p in PRESSES if (p not in WRAPPERS or p == "AdaKVPress") and p not in (
    "DuoAttentionPress", "PyramidKVPress", "KeyDiffPress", "LagKVPress", "RandomPress", "ComposedPress", "FinchPress",
    "CURPress", "NonCausalAttnPress", "LeverageScorePress", "CompactorPress")]


def best_of(fn, repeats: int) -> float:
    """The best wall-clock seconds of `repeats` calls of fn (after one call that compiles)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def timings(eng: Engine, ctx: np.ndarray, question: np.ndarray, gen: int, repeats: int) -> dict:
    st = eng.compress(eng.prompt(ctx[None], chunk=512))
    q = best_of(lambda: eng.continue_generate(st, question[None], 1, chunk=QUESTION_CHUNK), repeats)
    g = best_of(lambda: eng.continue_generate(st, question[None, :0], gen), repeats)
    return {"question_s": q, "generate_s": g}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.25, help="kvpress's compression ratio")
    ap.add_argument("--presses", nargs="+", default=DEFAULT_PRESSES, choices=[p for p in PRESSES
                                                                              if p not in ("DuoAttentionPress", "PerLayerCompressionPress",
                                                                                           "ChunkPress", "BlockPress",
                                                                                           "ComposedPress")])
    ap.add_argument("--question", type=int, default=64, help="question tokens after the context")
    ap.add_argument("--gen", type=int, default=30, help="greedy tokens of generate_s")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model at 64 tokens")
    args = ap.parse_args(argv)
    if args.dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32))
        tokens = np.random.default_rng(0).integers(0, 97, 96).astype(np.int32)
        n_ctx, n_q, gen, repeats = 64, 8, 4, 1
        repeat = RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11))  # kvzip's, any ids
    else:
        from evals.data import default_text
        from models.loading import load_default_model

        model, tok = load_default_model()
        tokens = np.asarray(tok.encode(default_text()[:200_000]), np.int32)
        n_ctx, n_q, gen, repeats = args.context, args.question, args.gen, args.repeats
        repeat = None  # kvzip's from the model's tokenizer
    if n_ctx + n_q > len(tokens):
        raise SystemExit(f"compressed_decode: context + question ({n_ctx + n_q}) is longer than the text")
    ctx, question = tokens[:n_ctx], tokens[n_ctx:n_ctx + n_q]
    max_len = n_ctx + n_q + gen
    rows = []
    with jax.default_matmul_precision("highest"):
        full = timings(Engine(model, kvpolicies.get("full"), max_len=max_len), ctx, question, gen, repeats)
        rows.append({"press": "full", "ratio": 0.0, "context": n_ctx, **full})
        print(json.dumps(rows[-1]), flush=True)
        for press in args.presses:
            pol = kvpress(press, args.ratio, max_new=n_q + gen, n_layers=model.cfg.n_layers)
            t = timings(Engine(model, pol, max_len=max_len, repeat=repeat), ctx, question, gen, repeats)
            rows.append({"press": press, "ratio": args.ratio, "context": n_ctx, **t,
                         "question_vs_full": t["question_s"] / full["question_s"],
                         "generate_vs_full": t["generate_s"] / full["generate_s"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
