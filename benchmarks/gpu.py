"""The GPU check of the performance issue, for one accelerator (written for an NVIDIA H200; runs
wherever JAX has a device): `python -m benchmarks.gpu [--out results/gpu.jsonl]`.

1. the test subset that runs every registered policy and every codec through the model on the
   device (`tests/kvpolicies/test_policies.py tests/kvpolicies/test_codecs.py -m "not slow"`), in a subprocess (xdist
   workers over up to 8 host cores, GPU memory allocated on demand);
2. the device's read bandwidth, measured in this process (a jitted sum over 512 MB: HBM on a GPU);
3. for the default model (SmolLM2-135M) and `model=qwen`, in bfloat16 (where a model or its
   text is not installed, e.g. on a device that cannot install packages, or with
   `--random-weights`: its shapes with random weights and random ids, `"weights": "random"`;
   speed depends on the shapes only): prefill
   tokens/s and decode tokens/s (`continue_generate` layer by layer, the default, and as the fused
   scan; `benchmarks.decode_speed.bench_ours`) of `full`, `sink` (4 + 1,020), `quest` (pages of 16,
   top 16) and `full` with the int8 codec (keys encoded before RoPE, and after: `int8_after_rope`)
   at 4K / 16K / 32K tokens, each decode step as a fraction
   of its roofline ((weights + the filled cache) / bandwidth; `benchmarks.decode_speed`), and
   where docs/results/speed.md's CPU run has the same SmolLM2 row (4K: full, sink, int8, int8 after RoPE), its
   float32 tokens/s and the GPU's ratio to them (`vs_cpu_prefill`, `vs_cpu_layers_decode`).

4. Quest's gathered decode read and its host tier (`kvpolicies.offload`), rows with
   "section": "quest_gather" / "host_tier": `benchmarks.quest_gather`'s attention-level step at
   16K (quest's top_k pages against `full` over top_k x page tokens: the issue's <= 1.3x), and for
   SmolLM2 in bfloat16 at 16K / 32K the decode step of `quest` with its keys/values in device
   memory and in pinned host memory (prefilled on the device, then `offload.to_host`), with the
   bytes each step moves host -> device (recorded) next to their closed form. A failure here is a
   row with "error" (the rest of the script still runs): the host tier's gather runs on host-memory
   operands, which only the CPU backend has been seen to compile.

5. (run after the default model's section 3, before section 4 and Qwen's section 3: the order
   of the issue's list) cuDNN's fused attention for prefill and the Pallas GPU decode kernel
   against our attention
   (`benchmarks.attention_kernels`, rows with "section": "kernels"): SmolLM2's and Qwen's head
   shapes in bfloat16 at the same contexts, ms and the ratio to ours, and the largest difference
   of their outputs from ours. Neither kernel is wired into the library: this measures whether
   either beats XLA on the device.

`--dry-run` does the same on a tiny random model at 64 tokens (section 5: float32 at 256 tokens,
Pallas through its interpreter) and skips the test subset: it is what the CPU test suite runs
(`tests/benchmarks/test_benchmarks.py`). `--out` gets each row as it is measured (a run cut short keeps what
it measured); a measurement that raises is a row with "error", and the run goes on. Budget: about 8 minutes on an H200 (sections 1-3), about 1 more for section 4 and
1 for section 5, estimated, never run. `--budget-s` (default 480) bounds the whole run: the test
subset gets at most a third of it (then it is stopped, its row saying so), and each later
measurement starts only while time is left (a skipped one is a row with "skipped": "budget").
No result of it is in docs/results until a GPU has run it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
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
    "int8_after_rope": lambda: kvpolicies.get("full", codec="int8_after_rope"),
}
TEST_SUBSET = ["tests/kvpolicies/test_policies.py", "tests/kvpolicies/test_codecs.py", "-m", "not slow", "-q", "-p", "no:cacheprovider"]


# The two models' shapes, as our loader reads them from their GGUF files (tests check them against
# the files): on a device without the model packages (the H200 machines here install nothing and
# carry at most 64 MiB), the same shapes with random weights. A step's time depends on the shapes,
# not on the weights' values: every step has static shapes and no data-dependent work.
SHAPE_TWINS = {
    "smollm2": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
                    rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True, qkv_bias=False, max_position=8192),
    "qwen": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864,
                 rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False, qkv_bias=True, max_position=32768),
}


# The CPU speed table of docs/results/speed.md (run k: SmolLM2 float32 on the 2-core machine), for the GPU rows to be read against
CPU_RUN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "runs" / "decode_speed_run_2026-12-02k.jsonl"


def cpu_reference(model: str, policy: str, context: int) -> dict:
    """The CPU run's prefill and layer-by-layer decode tokens/s of the same model, policy and
    context ({} where it has none: other models, quest, 16K and 32K)."""
    if model != "smollm2" or not CPU_RUN.is_file():
        return {}
    for line in CPU_RUN.read_text().splitlines():
        r = json.loads(line)
        if (r.get("impl"), r.get("policy"), r.get("context")) == ("kvpolicies", policy, context):
            return {"cpu_run": CPU_RUN.name, "cpu_dtype": "float32", "cpu_prefill_tok_s": r["prefill_tok_s"],
                    "cpu_layers_decode_tok_s": r["layers_decode_tok_s"]}
    return {}


def shape_twin(name: str, seed: int = 0):
    """(model, token ids): `name`'s shapes in bfloat16 with random weights, and 40,000 random ids."""
    from models.config import LlamaConfig
    from models.llama import Llama

    cfg = LlamaConfig(**SHAPE_TWINS[name], name=f"{name} shapes, random weights")
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, 40_000).astype(np.int32)
    return Llama(cfg, dtype=jnp.bfloat16), ids


def _real(name: str):
    """(model, token ids) of the installed model and text, in bfloat16."""
    from evals import zoo
    from evals.data import load_text

    if name == "smollm2":
        from models.loading import load_default_model

        model, tok = load_default_model("bfloat16")
        return model, np.asarray(tok.encode(load_text("austen")[:400_000]), np.int32)
    conf = {"name": name, "dtype": "bfloat16"}
    zoo.describe(conf)
    model, tok = zoo.load_model(conf)
    return model, np.asarray(tok.encode(load_text("pg")[:400_000]), np.int32)


def models(dry_run: bool, random_weights: bool = False, emit=print):
    """(name, model, token ids, weights) to measure: the installed models and texts, or where they
    are not installed (or `random_weights`), their shape twins (a row says why)."""
    if dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        cfg = LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
        ids = np.random.default_rng(0).integers(0, 256, 4096).astype(np.int32)
        yield "tiny", Llama(cfg, dtype=jnp.bfloat16), ids, "random"
        return
    for name in SHAPE_TWINS:
        if not random_weights:
            try:
                yield (name, *_real(name), "gguf")
                continue
            except Exception as e:  # noqa: BLE001 (not installed here: its shapes instead)
                emit({"model": name, "weights": "random", "why": f"{type(e).__name__}: {str(e)[:200]}"})
        yield (name, *shape_twin(name), "random")


def quest_sections(model, tokens, contexts, steps: int, dry_run: bool) -> list[dict]:
    """Section 4: Quest's gathered read at the attention level, then its host tier in the model."""
    from benchmarks import quest_gather
    from kvpolicies import offload
    from models.engine import Engine

    rows = []
    try:
        ctx, page, top_k = (256, 4, 4) if dry_run else (16384, 16, 64)
        att = quest_gather.attention_level(ctx, page, top_k, rounds=1 if dry_run else 5, steps=1 if dry_run else 20)
        ratio = quest_gather.ratios(att)["attention"]
        rows += [{"section": "quest_gather"} | r for r in att] + [{"section": "quest_gather", "ratios": ratio}]
    except Exception as e:  # noqa: BLE001 (report and go on)
        rows.append({"section": "quest_gather", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    for ctx in contexts:
        if ctx + steps + 1 > len(tokens):
            continue
        pol = POLICIES["quest"]()
        row = {"section": "host_tier", "quest_page": pol.page, "quest_top_k": pol.top_k, "context": ctx,
               "memory_kind": offload.host_kind(), "simulated": jax.default_backend() == "cpu"}
        try:
            eng = Engine(model, pol, max_len=ctx + steps + 1)
            logits, cache = eng.prefill(tokens[None, :ctx], chunk=min(512, ctx))
            nxt = jnp.argmax(logits, -1)[:, None].astype(jnp.int32)
            caches = {"device": cache, "host": offload.to_host(jax.tree.map(jnp.copy, cache))}
            row["host_bytes_stored"] = offload.host_bytes(caches["host"])
            with offload.record_moves() as rec:  # one step of another engine (its own trace) counts the bytes
                counter = Engine(model, pol, max_len=ctx + steps + 1)
                jax.block_until_ready(counter.step(jax.tree.map(jnp.copy, caches["host"]), nxt, ctx)[0])
            row["bytes_moved_per_step"] = rec["bytes"]
            for where in caches:  # compile (the host cache is another input type: its own step)
                out, caches[where] = eng.step(caches[where], nxt, ctx)
                jax.block_until_ready(out)
            times = {w: [] for w in caches}
            for _ in range(3):  # interleaved rounds
                for where in caches:
                    t0 = time.perf_counter()
                    for i in range(steps):
                        out, caches[where] = eng.step(caches[where], nxt, ctx + 1 + i)
                    jax.block_until_ready(out)
                    times[where].append((time.perf_counter() - t0) / steps * 1e3)
            cfg = model.cfg
            row |= {f"{w}_ms_per_step": float(np.median(t)) for w, t in times.items()}
            row["bytes_moved_closed_form"] = offload.gathered_bytes(
                pol, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_len=ctx + steps + 1, n_layers=cfg.n_layers,
                dtype=jax.tree.leaves(cache[0].k)[0].dtype)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def test_subset(timeout_s: float) -> dict:
    """Section 1: TEST_SUBSET in a pytest subprocess, stopped after timeout_s. Compiling its many
    small steps is CPU work: xdist workers over up to 8 host cores, each allocating GPU memory as it
    goes (this process already holds JAX's preallocation). Their matmuls are float32: the tests
    compare float32 results with float64 numpy oracles, and JAX's default on an H100/H200 rounds
    float32 matmul inputs to TF32 (evals.run.MATMUL_PRECISION)."""
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_DEFAULT_MATMUL_PRECISION="highest")
    t0 = time.perf_counter()
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", *TEST_SUBSET, *workers], env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = f"stopped after {timeout_s:.0f} s"
    return {"tests": " ".join(TEST_SUBSET + workers), "returncode": rc, "seconds": time.perf_counter() - t0}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dry-run", action="store_true", help="a tiny model at 64 tokens, no test subset (CPU)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-quest", action="store_true", help="no section 4 (quest gather, host tier)")
    ap.add_argument("--skip-kernels", action="store_true", help="no section 5 (cuDNN and Pallas attention)")
    ap.add_argument("--out", default=None, help="write the rows here, one JSON object per line, as measured")
    ap.add_argument("--random-weights", action="store_true",
                    help="the models' shapes with random weights, installed or not (speed only)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start no measurement after this many seconds (the test subset: a third of it)")
    args = ap.parse_args(argv)
    contexts, steps = ([64], 2) if args.dry_run else (args.contexts, args.steps)
    rows = []
    start = time.perf_counter()
    if args.out:
        open(args.out, "w").close()

    def emit(r: dict) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    def time_left(what: dict) -> bool:
        """Whether the budget allows starting `what`; if not, a row says it was skipped."""
        if time.perf_counter() - start < args.budget_s:
            return True
        emit(what | {"skipped": "budget", "budget_s": args.budget_s})
        return False

    dev = jax.devices()[0]
    emit({"device": str(dev), "platform": dev.platform, "kind": getattr(dev, "device_kind", ""),
          "date": time.strftime("%Y-%m-%d")})
    if not (args.dry_run or args.skip_tests):
        emit(test_subset(args.budget_s / 3))
    bw = read_bandwidth((64 << 20) if args.dry_run else (512 << 20))
    emit({"read_bandwidth_GB_s": bw / 1e9})
    for i, (name, model, tokens, weights) in enumerate(models(args.dry_run, args.random_weights, emit)):
        for ctx in contexts:
            if ctx + steps + 1 > len(tokens):
                continue
            for pol in args.policies:
                r = {"model": name, "weights": weights, "policy": pol, "context": ctx, "dtype": "bfloat16"}
                if not time_left(r):
                    continue
                try:
                    r |= bench_ours(model, tokens, POLICIES[pol](), ctx, steps, chunk=min(512, ctx))
                except Exception as e:  # noqa: BLE001 (an error row; the other rows still run)
                    emit(r | {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
                    continue
                floor = (r["weight_bytes"] + r["kv_read_bytes"]) / bw
                r |= {"roofline_ms": floor * 1e3, "scan_roofline": floor * r["scan_decode_tok_s"],
                      "layers_roofline": floor * r["layers_decode_tok_s"]}
                cpu = cpu_reference(name, pol, ctx)
                if cpu:
                    r |= cpu | {"vs_cpu_prefill": r["prefill_tok_s"] / cpu["cpu_prefill_tok_s"],
                                "vs_cpu_layers_decode": r["layers_decode_tok_s"] / cpu["cpu_layers_decode_tok_s"]}
                emit(r)
        # the order of importance: the default model, the kernels, then the rest
        if i == 0 and not args.skip_kernels and time_left({"section": "kernels"}):
            from benchmarks import attention_kernels

            if args.dry_run:
                attention_kernels.run([256], jnp.float32, rounds=1, steps=1, emit=emit)
            else:
                attention_kernels.run(contexts, jnp.bfloat16, rounds=3, steps=5, emit=emit)
        if not args.skip_quest and (name == "smollm2" or args.dry_run) and time_left({"section": "quest_gather"}):
            host_contexts = contexts if args.dry_run else [c for c in contexts if c >= 16384]
            for r in quest_sections(model, tokens, host_contexts, steps, args.dry_run):
                emit(r)
    return rows


if __name__ == "__main__":
    main()
