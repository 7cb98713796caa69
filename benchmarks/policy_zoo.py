"""Perplexity of every policy family on SmolLM2-135M, next to the bytes each stores and reads.

    python -m benchmarks.policy_zoo --tokens 1024 --out docs/results/policy_zoo.md
    python -m benchmarks.policy_zoo --only full      # full under every codec (the codec rows)

Streams the first `tokens` tokens of Pride and Prejudice through each policy (float32 cache for
the baseline; the chunk only batches the work: every policy's result is chunk-invariant) and reports
perplexity, state bytes (kv + meta, all layers) and bytes read per decode step at the end.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import kvpolicies
from evals.data import default_text
from kvpolicies.memory import bytes_read_per_step, state_bytes
from kvpolicies.presets import stack_of
from models.engine import Engine, perplexity
from models.loading import load_default_model

# The published settings (the tables of docs/results/quality.md). A registered policy without a row here is run once with
# its dataclass defaults (`rows()`), so a new policy appears without editing this file.
ROWS = [
    ("full", {}),
    ("full", dict(codec="int8")),
    ("full", dict(codec="int4")),
    ("full", dict(codec="fp8")),
    ("full", dict(codec="int8_after_rope")),
    ("full", dict(codec="int4_after_rope")),
    ("full", dict(codec="fp8_after_rope")),
    ("kivi", dict(bits=4)),
    ("kivi", dict(bits=2)),
    ("window", dict(window=256)),
    ("sink", dict(n_sink=4, window=252)),
    ("sink", dict(n_sink=4, window=252, codec="int8")),
    ("h2o", dict(heavy=128, recent=128)),
    ("tova", dict(budget=256)),
    ("snapkv", dict(budget=240, obs_window=16, max_new=0)),
    ("multires", dict(window=128, branch=4, slots_per_level=16, levels=2)),
    ("quest", dict(page=16, top_k=16)),
]


def rows() -> list[tuple[str, dict]]:
    """ROWS, then one row of dataclass defaults per registered policy that ROWS does not name."""
    named = {name for name, _ in ROWS}
    return ROWS + [(name, {}) for name in kvpolicies.POLICIES if name not in named]


def label(name, kw):
    return name + "".join(f" {k}={v}" for k, v in kw.items())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--only", nargs="+", default=None, metavar="POLICY",
                    help="only the rows of these policies, after full's first row (the baseline of Δ)")
    args = ap.parse_args(argv)
    model, tok = load_default_model()
    ids = np.asarray(tok.encode(default_text()[:50_000])[: args.tokens])
    cfg = model.cfg
    dims = dict(kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, n_layers=cfg.n_layers, dtype=jnp.float32)
    lines = ["| policy | perplexity | Δ vs full | stored MB (kv + meta) | read/step MB | s |",
             "|---|---:|---:|---:|---:|---:|"]
    base = None
    for i, (name, kw) in enumerate(rows()):
        if args.only is not None and name not in args.only and i > 0:  # row 0 (full): the baseline of Δ
            continue
        t0 = time.perf_counter()
        try:
            pol = kvpolicies.get(name, **kw)
            ppl = perplexity(Engine(model, pol, max_len=args.tokens).score(ids, chunk=args.chunk))
        except ValueError as e:  # a policy whose fields changed, or whose defaults do not run alone
            print(f"skip {label(name, kw)}: {e}")  # (duo needs its head pattern): say so, keep going
            continue
        dt = time.perf_counter() - t0
        base = ppl if base is None else base
        layers = stack_of(pol, cfg.n_layers)  # what the engine runs (a model-level preset's layers)
        one = dict(dims, n_layers=1)
        per = {p: (state_bytes(p, max_len=args.tokens, **one).total,
                   bytes_read_per_step(p, max_len=args.tokens, context=args.tokens - 1, **one).read.total)
               for p in set(layers)}
        stored, read = (sum(per[p][i] for p in layers) for i in (0, 1))
        line = (f"| {label(name, kw)} | {ppl:.3f} | {100 * (ppl / base - 1):+.1f} % | {stored / 1e6:.2f} "
                f"| {read / 1e6:.2f} | {dt:.0f} |")
        print(line, flush=True)
        lines.append(line)
    table = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"SmolLM2-135M, first {args.tokens} tokens of Pride and Prejudice, chunk {args.chunk}, "
                    "float32 cache.\n\n" + table + "\n")
    return table


if __name__ == "__main__":
    main()
