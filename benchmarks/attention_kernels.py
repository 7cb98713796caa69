"""Library attention kernels against ours, measured before any is wired in: cuDNN's fused attention
(`jax.nn.dot_product_attention(..., implementation="cudnn")`) for a causal prefill and the Pallas
GPU decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`) for a decode step,
each against `kvpolicies.attend` with `full` on the same un-rotated projections, in one process.

    python -m benchmarks.attention_kernels [--contexts 4096 16384 32768] [--dtype bfloat16] [--out F]

Shapes are a layer's of SmolLM2-135M (9 query heads, 3 kv heads, head dim 64) and of
Qwen2.5-Coder-0.5B (14 / 2 / 64), batch 1. Each variant does a step's whole attention work:

  * prefill of C tokens into an empty `full` cache of C slots: rotate queries and keys (RoPE from
    tables, as an Engine passes them), write the keys/values, causal attention. `ours` is
    `attend`; `sdpa_xla` / `sdpa_cudnn` are `jax.nn.dot_product_attention(is_causal=True)` with
    XLA's and cuDNN's implementations (`sdpa_xla` writes the [N, C, C] logits: skipped above
    --xla-logits-bytes);
  * decode of the token at position C - 1 over a `full` cache of C slots holding C - 1 rotated
    keys: rotate, write the new key/value into its slot (the cache donated), attend over the C
    filled slots. `ours` is `attend`; `pallas` is `decode_attention.gqa` (`kv_seq_len` = C; on a
    CPU its interpreter: correct, not fast); `sdpa_xla` / `sdpa_cudnn` as above with one query
    and `key_value_seq_lengths`.

Every row: median ms over interleaved rounds, its ratio to `ours` (below 1: the kernel is faster),
and the largest |difference| of its outputs from ours. A variant that cannot run (cuDNN without a
GPU, an unsupported shape) is a row with "error"; the others still run. `--dry-run`: small
contexts in float32 on any backend (tests/benchmarks/test_benchmarks.py checks that every available kernel
computes our attention). Wall-clock on a shared machine: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange

from kvpolicies import Rope, attend
from kvpolicies.full import Full

SHAPES = {"smollm2": (9, 3, 64), "qwen": (14, 2, 64)}  # query heads N, kv heads K, head dim D
FULL = Full()


def _rotate(table, x, pos):
    """x [B, T, H, D] rotated at positions pos [B, T] (the table's RoPE)."""
    return rearrange(table.apply(rearrange(x, "B T H D -> B H T D"), pos[:, None, :]), "B H T D -> B T H D")


def _write(state, k, v, pos, at: int):
    """`state` with the rotated keys k and values v [B, T, K, D] in slots at.. and their positions."""
    put = lambda a, x: jax.lax.dynamic_update_slice(a, rearrange(x, "B T K D -> B K T D").astype(a.dtype),  # noqa: E731
                                                    (0, 0, at, 0))
    return type(state)(put(state.k, k), put(state.v, v),
                       jax.lax.dynamic_update_slice(state.pos, pos[:, None, :], (0, 0, at)))


# -- the variants: (q, k, v [B, T, ., D], pos [B, T], state, table) -> (out [B, T, N, D], state) ----

def ours(q, k, v, pos, state, table):
    return attend(FULL, state, q, k, v, pos, table)


def sdpa(impl: str, q, k, v, pos, state, table):
    """jax.nn.dot_product_attention over the rotated queries and the cache's keys/values."""
    kr = _rotate(table, k, pos)
    at = pos[0, 0] if q.shape[1] == 1 else 0  # a decode step writes its slot, a prefill from slot 0
    state = _write(state, kr, v, pos, at)
    qr = _rotate(table, q, pos).astype(state.k.dtype)
    keys, vals = (rearrange(x, "B K S D -> B S K D") for x in (state.k, state.v))
    if q.shape[1] == 1:  # one query over the filled slots 0..pos
        out = jax.nn.dot_product_attention(qr, keys, vals, key_value_seq_lengths=pos[:, 0] + 1,
                                           implementation=impl)
    else:
        out = jax.nn.dot_product_attention(qr, keys, vals, is_causal=True, implementation=impl)
    return out, state


def pallas(q, k, v, pos, state, table, interpret: bool = False):
    """Pallas' GPU decode kernel (one query per row) over the cache's filled slots 0..pos."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    kr = _rotate(table, k, pos)
    state = _write(state, kr, v, pos, pos[0, 0])
    s = state.k.shape[2]
    splits = 16 if s >= 16 * 128 else max(1, s // 64)  # the kernel's default, or what a small cache divides into
    qr = _rotate(table, q, pos).astype(state.k.dtype)[:, 0]  # [B, N, D]
    keys, vals = (rearrange(x, "B K S D -> B S K D") for x in (state.k, state.v))
    out = decode_attention.gqa(qr, keys, vals, kv_seq_len=pos[:, 0] + 1, k_splits=splits,
                               block_k=min(128, s // splits), interpret=interpret)
    return out[:, None], state


# -- inputs and timing ------------------------------------------------------------------------------

def inputs(phase: str, heads: tuple[int, int, int], context: int, dtype, seed: int = 0):
    """(q, k, v, pos, state): a prefill of `context` tokens into an empty cache of as many slots,
    or the decode step at position context - 1 over a cache whose first context - 1 slots hold
    random rotated keys and values."""
    n, kh, d = heads
    rng = np.random.default_rng(seed)
    t = context if phase == "prefill" else 1
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, d)), dtype) for h in (n, kh, kh))
    pos = jnp.broadcast_to(jnp.arange(context - t, context, dtype=jnp.int32), (1, t))
    state = FULL.init(1, kh, d, dtype, context)
    if phase == "decode":
        filled = context - 1
        kv = [jnp.asarray(rng.standard_normal((1, kh, context, d)), dtype) for _ in range(2)]
        keep = (jnp.arange(context) < filled)[None, None, :, None]
        state = type(state)(jnp.where(keep, kv[0], 0).astype(dtype), jnp.where(keep, kv[1], 0).astype(dtype),
                            jnp.where(jnp.arange(context) < filled, jnp.arange(context), -1).astype(jnp.int32)[None, None])
    return q, k, v, pos, state


def variants(phase: str, interpret: bool) -> dict:
    out = {"ours": ours, "sdpa_xla": functools.partial(sdpa, "xla"), "sdpa_cudnn": functools.partial(sdpa, "cudnn")}
    if phase == "decode":
        out["pallas"] = functools.partial(pallas, interpret=interpret)
    return out


def measure(phase: str, shape: str, context: int, dtype, rounds: int, steps: int,
            xla_logits_bytes: float, interpret: bool) -> list[dict]:
    """One row per variant: median ms per step, ratio to ours, max |out - ours|, or an error."""
    heads = SHAPES[shape]
    table = Rope(heads[2]).table(context)
    q, k, v, pos, state0 = inputs(phase, heads, context, dtype)
    base = {"section": "kernels", "phase": phase, "shape": shape, "heads": list(heads), "context": context,
            "dtype": jnp.dtype(dtype).name}
    rows, ready, outs = {}, {}, {}
    for name, fn in variants(phase, interpret).items():
        rows[name] = base | {"impl": name}
        if name == "sdpa_xla" and phase == "prefill" and heads[0] * context**2 * 4 > xla_logits_bytes:
            rows[name]["skipped"] = f"writes {heads[0] * context**2 * 4 / 1e9:.1f} GB of logits"
            continue
        try:
            step = jax.jit(fn, donate_argnums=(4,))
            state = jax.tree.map(jnp.copy, state0)
            out, state = step(q, k, v, pos, state, table)  # compile, and the output to compare
            outs[name] = np.asarray(jax.block_until_ready(out), np.float32)
            ready[name] = [step, state if phase == "decode" else None]
        except Exception as e:  # noqa: BLE001 (report and go on)
            rows[name]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    times = {name: [] for name in ready}
    for _ in range(rounds):  # interleaved: every variant once per round
        for name, box in ready.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                st = box[1] if phase == "decode" else jax.tree.map(jnp.copy, state0)
                out, box[1] = box[0](q, k, v, pos, st, table)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    mine = statistics.median(times["ours"]) if "ours" in times else float("nan")
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows[name] |= {"ms": ms, "vs_ours": ms / mine}
        if "ours" in outs:
            rows[name]["max_abs_diff"] = float(np.abs(outs[name] - outs["ours"]).max())
    return list(rows.values())


def run(contexts, dtype, shapes=tuple(SHAPES), rounds: int = 5, steps: int = 10,
        xla_logits_bytes: float = 8e9, interpret: bool | None = None, emit=None) -> list[dict]:
    """Every shape, context and phase; each row passed to `emit` as it is measured."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    rows = []
    for shape in shapes:
        for context in contexts:
            for phase in ("prefill", "decode"):
                try:
                    got = measure(phase, shape, context, dtype, rounds, steps, xla_logits_bytes, interpret)
                except Exception as e:  # noqa: BLE001
                    got = [{"section": "kernels", "phase": phase, "shape": shape, "context": context,
                            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}]
                for r in got:
                    if emit is not None:
                        emit(r)
                rows += got
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--xla-logits-bytes", type=float, default=8e9)
    ap.add_argument("--dry-run", action="store_true", help="contexts 256 and 512, float32, 1 round of 1 step")
    ap.add_argument("--out", default=None, help="append the rows here, one JSON object per line, as measured")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.contexts, args.dtype, args.rounds, args.steps = [256, 512], "float32", 1, 1

    def emit(r):
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    return run(args.contexts, jnp.dtype(args.dtype), tuple(args.shapes), args.rounds, args.steps,
               args.xla_logits_bytes, emit=emit)


if __name__ == "__main__":
    main()
