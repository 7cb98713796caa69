"""Compute query statistics for `ExpectedAttentionStatsPress` (`kvpolicies.expected_stats`), offline.

    python -m evals.expected_stats model=smollm2             # $KVP_DATA/expected_stats/smollm2.npz
    python -m evals.expected_stats model=qwen samples=100 chars=1000 n_sink=4

Shapes: L layers, K kv heads, G query heads per kv head, N = K G, D head dim.

kvpress's recipe (`expected_attention_with_stats.py`, `collect_queries`): `num_samples` = 100 texts (BookSum
chapters) each cut to its first `sample_seq_len` = 1,000 characters and tokenized alone, every layer's
queries before RoPE captured, each text's first n_sink = 4 dropped; the mean and covariance (N - 1
denominator) of all of them per layer and query head. Ours: the same on `samples` consecutive pieces of
`chars` characters of the Paul Graham essays (`evals.data.paul_graham`; BookSum is not packaged), the
queries from our model in float32 (kvpress's run: bfloat16; `evals.qfilter.window_queries`), summed in
float64. Output: `$KVP_DATA/expected_stats/<model>.npz`, "mu"
[L, N, D] and "cov" [L, N, D, D] float32, read by `kvpolicies.compat.kvpress("ExpectedAttentionStatsPress",
r, stats_folder=<file>)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from evals.qfilter import out_path, parse, window_queries

DEFAULTS = dict(model="smollm2", samples=100, chars=1000, n_sink=4, out="")


def compute(model, windows: list[np.ndarray], n_sink: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(mu [L, N, D], cov [L, N, D, D]) float64 of the pre-RoPE queries of every token window (each [T],
    prefilled alone from position 0) at positions >= n_sink (query head n = k G + g)."""
    s1 = s2 = 0.0
    n = 0
    for q, _ in window_queries(model, windows):  # [L, K, T, G, D]
        x = q[:, :, n_sink:].astype(np.float64)
        s1 = s1 + x.sum(axis=2)  # [L, K, G, D]
        s2 = s2 + np.einsum("lktgi,lktgj->lkgij", x, x)  # [L, K, G, D, D]
        n += x.shape[2]
    if n < 2:
        raise ValueError(f"expected_stats: {n} queries past n_sink={n_sink}: give longer or more windows")
    mu = s1 / n
    cov = (s2 - n * np.einsum("...i,...j->...ij", mu, mu)) / (n - 1)  # kvpress: centered, N - 1
    lay, k, g, d = mu.shape
    return mu.reshape(lay, k * g, d), cov.reshape(lay, k * g, d, d)


def windows_of(tok, samples: int, chars: int) -> list[np.ndarray]:
    """`samples` consecutive pieces of `chars` characters of the Paul Graham essays, each tokenized alone."""
    from evals.data import paul_graham

    text = paul_graham()
    if len(text) < samples * chars:
        raise SystemExit(f"the essays hold {len(text)} characters, {samples * chars} needed (samples x chars)")
    return [np.asarray(tok.encode(text[i * chars:(i + 1) * chars]), np.int32) for i in range(samples)]


def main(argv: list[str] | None = None) -> Path:
    cfg = parse(sys.argv[1:] if argv is None else argv, DEFAULTS, "expected_stats", __doc__)
    from evals import zoo

    model, tok = zoo.load_model({"name": cfg["model"], "dtype": "float32"})
    mu, cov = compute(model, windows_of(tok, cfg["samples"], cfg["chars"]), cfg["n_sink"])
    path = out_path(cfg, "expected_stats")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, mu=mu.astype(np.float32), cov=cov.astype(np.float32), **{k: v for k, v in cfg.items() if k != "out"})
    print(f"expected_stats: {cfg['model']}: mu {mu.shape}, cov {cov.shape} from {cfg['samples']} pieces of "
          f"{cfg['chars']} characters; wrote {path}")
    return path


if __name__ == "__main__":
    main()
