"""M requests sharing one long prefix (one system prompt for many users): bytes stored and prefill
tokens through paged prefix sharing + copy-on-write, against M separate caches.

    python -m benchmarks.shared_prefix                          # SmolLM2-135M, a 2,048-token prefix
    python -m benchmarks.shared_prefix --model qwen --prefix 4096
    python -m benchmarks.shared_prefix --dry-run                # the tiny random model (tested)

Each request = the shared prefix (`--prefix` tokens of the Paul Graham essays) + its own suffix
(`--suffix` tokens of another passage). Shared: the prefix prefilled once (`benchmarks.paged.
prefill_shared`: `Engine.prompt` on the prefix, `kvpolicies.paged.fork` to M rows, every row's
suffix through `extend_prompt`), the prefix's full blocks held once, a partly filled last block
copied by each row when it first writes (copy-on-write); the pool holds exactly those blocks.
Separate: each request prefilled alone in its own paged cache (its bytes measured once, times M),
and dense `full` caches of M requests (closed form). For every M, the shared rows' last logits
are checked against the requests prefilled alone (largest difference reported; M <= 4 rows
compared). Wall times are of one run each on whatever machine this is: reported, not the point.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from benchmarks.paged import prefill_shared
from kvpolicies.memory import state_bytes
from kvpolicies.paged import Paged, check, occupancy


def requests(ids: np.ndarray, prefix: int, suffix: int, m: int) -> np.ndarray:
    """[m, prefix + suffix]: ids[:prefix] then, per request, a distinct later passage."""
    need = prefix + m * suffix
    if ids.size < need:
        raise SystemExit(f"shared_prefix: the text holds {ids.size} tokens, {need} needed")
    return np.stack([np.concatenate([ids[:prefix], ids[prefix + i * suffix: prefix + (i + 1) * suffix]])
                     for i in range(m)]).astype(np.int32)


def pool_for(prefix: int, suffix: int, m: int, block: int) -> int:
    """Blocks the shared run needs: the prefix's full blocks once, then per row its copy of the
    prefix's partial block (if any) and its suffix's blocks."""
    full = prefix // block
    return full + m * -(-(prefix + suffix - full * block) // block)


def measure(model, ids: np.ndarray, prefix: int, suffix: int, ms: list[int], block: int) -> list[dict]:
    from models.engine import Engine

    t = prefix + suffix
    cfg = model.cfg
    per_request = -(-t // block)
    alone = Engine(model, Paged(block=block, blocks=per_request), max_len=t)
    rows = []
    biggest = requests(ids, prefix, suffix, max(ms))
    logits_alone, time_alone, bytes_alone = [], None, None
    for i in range(min(max(ms), 4)):
        t0 = time.perf_counter()
        lg, c = alone.prefill(biggest[i:i + 1])
        jax.block_until_ready(lg)
        time_alone = time.perf_counter() - t0 if time_alone is None else min(time_alone, time.perf_counter() - t0)
        check(c)
        logits_alone.append(np.asarray(lg[0]))
        bytes_alone = occupancy(c)["used_bytes"]
    dense = state_bytes(model_policy(), kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_len=t,
                        dtype=model.dtype).total * cfg.n_layers
    for m in ms:
        prompts = biggest[:m]
        eng = Engine(model, Paged(block=block, blocks=pool_for(prefix, suffix, m, block)), max_len=t)
        t0 = time.perf_counter()
        lg, cache = prefill_shared(eng, prompts)
        jax.block_until_ready(lg)
        secs = time.perf_counter() - t0
        check(cache)
        occ = occupancy(cache)
        k = min(m, len(logits_alone))
        diff = float(np.abs(np.asarray(lg[:k]) - np.stack(logits_alone[:k])).max())
        rows.append({
            "requests": m, "prefix": prefix, "suffix": suffix, "block": block,
            "prefill_tokens_shared": eng.prefill_tokens, "prefill_tokens_separate": m * t,
            "prefill_tokens_saved": m * t - eng.prefill_tokens,
            "bytes_shared": occ["used_bytes"], "bytes_separate_paged": m * bytes_alone,
            "bytes_separate_full": m * dense, "blocks_shared": occ["used_blocks"] // cfg.n_layers,
            "blocks_separate": m * per_request, "pool_bytes_shared": _pool_bytes(cache),
            "bytes_ratio": m * bytes_alone / occ["used_bytes"],
            "max_logit_diff_vs_alone": diff, "rows_compared": k,
            "prefill_s_shared": secs, "prefill_s_one_alone": time_alone,
        })
    return rows


def model_policy():
    from kvpolicies.full import Full

    return Full()


def _pool_bytes(cache) -> int:
    return occupancy(cache)["used_bytes"] * occupancy(cache)["pool_blocks"] // max(occupancy(cache)["used_blocks"], 1)


def table(rows: list[dict]) -> str:
    out = ["| requests M | prefill tokens shared / separate (saved) | KV bytes shared | M separate paged caches "
           "| M dense full caches | saved x | max logit diff |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['requests']} | {r['prefill_tokens_shared']:,} / {r['prefill_tokens_separate']:,} "
                   f"({r['prefill_tokens_saved']:,}) | {r['bytes_shared'] / 1e6:.2f} MB "
                   f"| {r['bytes_separate_paged'] / 1e6:.2f} MB | {r['bytes_separate_full'] / 1e6:.2f} MB "
                   f"| {r['bytes_ratio']:.2f} | {r['max_logit_diff_vs_alone']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--requests", default="1,4,16", help="comma-separated M values")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dry-run", action="store_true", help="the tiny random model, a 100-token prefix")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    ms = [int(x) for x in a.requests.split(",")]
    if a.dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48))
        ids = np.random.default_rng(0).integers(0, 97, 2000).astype(np.int32)
        prefix, suffix = min(a.prefix, 100), min(a.suffix, 12)
    else:
        from evals import zoo
        from evals.data import paul_graham

        model, tok = zoo.load_model({"name": a.model, "dtype": "float32"})
        ids = np.asarray(tok.encode(paul_graham()), np.int32)
        prefix, suffix = a.prefix, a.suffix
    rows = measure(model, ids, prefix, suffix, ms, a.block)
    print(table(rows))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
