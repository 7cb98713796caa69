"""The GPU check of the performance issue, for one accelerator (written for an NVIDIA H200; runs
wherever JAX has a device): `python -m benchmarks.gpu [--out results/gpu.jsonl]`.

1. the test subset that runs every registered policy and every codec through the model on the
   device (`tests/test_policies.py tests/test_codecs.py -m "not slow"`), in a subprocess;
2. the device's read bandwidth, measured in this process (a jitted sum over 512 MB: HBM on a GPU);
3. for the default model (SmolLM2-135M) and, when installed, `model=qwen`, in bfloat16: prefill
   tokens/s and decode tokens/s (fused scan) of `full`, `sink` (4 + 1,020), `quest` (pages of 16,
   top 16) and `full` with the int8 codec at 4K / 16K / 32K tokens, each decode step as a fraction
   of its roofline ((weights + the filled cache) / bandwidth; `benchmarks.decode_speed`).

`--dry-run` does the same on a tiny random model at 64 tokens and skips the test subset: it is
what the CPU test suite runs (`tests/test_benchmarks.py`). Budget: about 8 minutes on an H200.
No result of it is in README until a GPU has run it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from benchmarks.decode_speed import bench_ours, read_bandwidth

POLICIES = {
    "full": lambda: kvpolicies.get("full"),
    "sink": lambda: kvpolicies.get("sink", n_sink=4, window=1020),
    "quest": lambda: kvpolicies.get("quest", page=16, top_k=16),
    "int8": lambda: kvpolicies.get("full", codec="int8"),
}
TEST_SUBSET = ["tests/test_policies.py", "tests/test_codecs.py", "-m", "not slow", "-q", "-p", "no:cacheprovider"]


def models(dry_run: bool):
    """(name, model, token ids) to measure."""
    if dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
        yield "tiny", Llama(cfg, dtype=jnp.bfloat16), np.random.default_rng(0).integers(0, 256, 4096).astype(np.int32)
        return
    from evals import zoo
    from evals.data import load_text
    from models.loading import load_default_model

    model, tok = load_default_model("bfloat16")
    yield "smollm2", model, np.asarray(tok.encode(load_text("austen")[:400_000]), np.int32)
    try:
        conf = {"name": "qwen", "dtype": "bfloat16"}
        zoo.describe(conf)
    except Exception as e:  # not installed: say so, measure the rest
        print(json.dumps({"skipped": "qwen", "why": str(e)[:200]}), flush=True)
        return
    qwen, qtok = zoo.load_model(conf)
    yield "qwen", qwen, np.asarray(qtok.encode(load_text("pg")[:400_000]), np.int32)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dry-run", action="store_true", help="a tiny model at 64 tokens, no test subset (CPU)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--out", default=None, help="write the rows here, one JSON object per line")
    args = ap.parse_args(argv)
    contexts, steps = ([64], 2) if args.dry_run else (args.contexts, args.steps)
    dev = jax.devices()[0]
    rows = [{"device": str(dev), "platform": dev.platform, "kind": getattr(dev, "device_kind", ""),
             "date": time.strftime("%Y-%m-%d")}]
    if not (args.dry_run or args.skip_tests):
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", *TEST_SUBSET])
        rows.append({"tests": " ".join(TEST_SUBSET), "returncode": rc, "seconds": time.perf_counter() - t0})
    bw = read_bandwidth((64 << 20) if args.dry_run else (512 << 20))
    rows.append({"read_bandwidth_GB_s": bw / 1e9})
    for r in rows:
        print(json.dumps(r), flush=True)
    for name, model, tokens in models(args.dry_run):
        for ctx in contexts:
            if ctx + steps + 1 > len(tokens):
                continue
            for pol in args.policies:
                r = {"model": name, "policy": pol, "context": ctx, "dtype": "bfloat16"}
                r |= bench_ours(model, tokens, POLICIES[pol](), ctx, steps, chunk=min(512, ctx))
                floor = (r["weight_bytes"] + r["kv_read_bytes"]) / bw
                r |= {"roofline_ms": floor * 1e3, "scan_roofline": floor * r["scan_decode_tok_s"]}
                print(json.dumps(r), flush=True)
                rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
