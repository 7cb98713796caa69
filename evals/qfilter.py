"""Produce Q-Filters (`kvpolicies.qfilter`) for one of our models, offline, by the authors' recipe.

    python -m evals.qfilter model=smollm2                  # $KVP_DATA/qfilters/smollm2.npz
    python -m evals.qfilter model=qwen sequences=19 length=2048 samples=3000 seed=0

Shapes: L layers, K kv heads, G query heads per kv head, N = K G query heads, T tokens, D head dim.

The authors' `make_filters.py` (NathanGodey/qfilters): the queries after RoPE of every layer and query
head on calibration sequences of `max_seq_len` = 2048 tokens (its loop keeps num_sequences - 1 = 19 of
its 20), `num_svd_samples` = 3000 token positions drawn at random (the same for every head), an SVD per
query head of those [3000, D] queries; with u_1, v_1 the first singular vectors, the filter is
-sign v_1 where sign = +1 if more than half of u_1's entries are positive (else -1); the filters of a
kv head's G query heads are averaged. Ours: the same on consecutive windows of the Paul Graham essays
(`evals.data.paul_graham`; the authors used fineweb samples of at least 2048 tokens), queries from our
model in float32 (theirs in bfloat16), the positions drawn with numpy (`default_rng(seed)`), the SVD
in float64. Output: `$KVP_DATA/qfilters/<model>.npz`, "q_filters" [L, K, D] float32 plus the recipe's
settings, what `kvpolicies.qfilter.QFilter(filters=<file>)` and
`kvpolicies.compat.kvpress("QFilterPress", r, q_filters=<file>)` read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

DEFAULTS = dict(model="smollm2", sequences=19, length=2048, samples=3000, seed=0, out="")


def parse(argv: list[str], defaults: dict = DEFAULTS, prog: str = "qfilter", doc: str | None = __doc__) -> dict:
    """The settings (`key=value` arguments over `defaults`); an unknown key or a bad value exits 2 (argparse)."""

    def setting(a: str) -> tuple[str, object]:
        k, eq, v = a.partition("=")
        if not eq or k not in defaults:
            raise argparse.ArgumentTypeError(f"{a!r}: arguments are key=value with a key among {sorted(defaults)}")
        try:
            return k, type(defaults[k])(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{a!r}: {k} takes a {type(defaults[k]).__name__}") from None

    p = argparse.ArgumentParser(prog=f"python -m evals.{prog}", description=(doc or "").split("\n")[0])
    p.add_argument("settings", nargs="*", type=setting, metavar="key=value",
                   help=f"defaults: {' '.join(f'{k}={v}' for k, v in defaults.items())}")
    cfg = {**defaults, **dict(p.parse_args(argv).settings)}
    for k in ("sequences", "length", "samples", "chars"):
        if k in cfg and cfg[k] < 1:
            p.error(f"{k}={cfg[k]}: must be >= 1")
    return cfg


BUCKET = 128  # windows are padded to a multiple of this many tokens: one compiled prefill per bucket


def window_queries(model, windows: list[np.ndarray]):
    """For each window (each [T], prefilled alone from position 0), every layer's queries before RoPE,
    [L, K, T, G, D] float32, and RoPE's frequencies [D/2]. A window is padded at its end to a multiple of
    BUCKET tokens (a causal prefill: the padding changes no earlier query), so windows of similar length
    share one compiled prefill."""
    from kvpolicies.compactor import QueryPhase
    from models.engine import Engine
    from models.llama import policy_runs

    phase, engines = QueryPhase(of=None, obs_window=0), {}
    for w in windows:
        t = len(w)
        m = -(-t // BUCKET) * BUCKET
        if m not in engines:
            engines[m] = Engine(model, (phase,) * model.cfg.n_layers, max_len=m)
        eng = engines[m]
        _, cache = eng.prefill(np.pad(np.asarray(w, np.int32), (0, m - t))[None])
        qs, inv = [], None
        for (a, b, _), st in zip(policy_runs(eng.policies, model.cfg.n_layers), cache.runs):
            qs.append(np.asarray(st.extra["q"][:, 0, :, :t]))  # [b - a, K, T, G, D]
            inv = np.asarray(st.extra["inv_freq"][0])
        yield np.concatenate(qs), inv


def rope_queries(q: Float[Array, "K T G D"], inv_freq: np.ndarray) -> np.ndarray:
    """Pre-RoPE queries of positions 0..T-1 rotated by RoPE (rotate-half pairs i, i + D/2): [N, T, D]."""
    from kvpolicies.expected import turn

    k, t, g, d = q.shape
    ang = np.arange(t, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)  # [T, D/2]
    rot = turn(jnp.asarray(q), jnp.cos(ang)[:, None], jnp.sin(ang)[:, None])  # [K, T, G, D]
    return np.asarray(rot).transpose(0, 2, 1, 3).reshape(k * g, t, d)  # query head n = k G + g


def layer_queries(model, windows: list[np.ndarray], samples: int, seed: int) -> list[np.ndarray]:
    """Per layer, every query head's queries after RoPE at `samples` positions drawn once among all the
    windows' tokens (numpy's default_rng(seed).permutation; each window prefilled alone from position 0):
    [N, samples, D] float32, in the windows' order (only the drawn positions are kept in memory)."""
    total = sum(len(w) for w in windows)
    drawn = np.zeros(total, bool)
    drawn[np.random.default_rng(seed).permutation(total)[:samples]] = True
    per, start = [[] for _ in range(model.cfg.n_layers)], 0
    for (q, inv), w in zip(window_queries(model, windows), windows):
        take = drawn[start:start + len(w)]
        start += len(w)
        for layer in range(len(per)):
            per[layer].append(rope_queries(q[layer], inv)[:, take])  # [N, drawn in this window, D]
    return [np.concatenate(x, axis=1) for x in per]


def svd_filters(queries: list[np.ndarray], kv_heads: int) -> np.ndarray:
    """The authors' recipe on per-layer sampled queries [N, samples, D]: per query head -sign v_1 (sign: +1 if
    most of u_1 is positive), averaged over each kv head's G heads: [L, K, D] float32."""
    out = []
    for q in queries:
        u, _, vh = np.linalg.svd(q.astype(np.float64), full_matrices=False)  # u [N, S, D], vh [N, D, D]
        sign = np.where((u[..., 0] > 0).mean(-1) > 0.5, 1.0, -1.0)  # [N]
        f = -sign[:, None] * vh[:, 0, :]  # [N, D]
        out.append(f.reshape(kv_heads, -1, f.shape[-1]).mean(1))  # [K, D]
    return np.stack(out).astype(np.float32)


def compute(model, windows: list[np.ndarray], samples: int = 3000, seed: int = 0) -> np.ndarray:
    """Q-Filters [L, K, D] of `model` on calibration token windows (each [T])."""
    return svd_filters(layer_queries(model, windows, samples, seed), model.cfg.n_kv_heads)


def windows_of(tok, sequences: int, length: int) -> list[np.ndarray]:
    """`sequences` consecutive windows of `length` tokens of the Paul Graham essays."""
    from evals.data import paul_graham

    ids = np.asarray(tok.encode(paul_graham()), np.int32)
    if ids.size < sequences * length:
        raise SystemExit(f"the essays hold {ids.size} tokens, {sequences * length} needed (sequences x length)")
    return [ids[i * length:(i + 1) * length] for i in range(sequences)]


def out_path(cfg: dict, folder: str) -> Path:
    from evals.data import data_dir

    return Path(cfg["out"]) if cfg["out"] else data_dir() / folder / f"{cfg['model']}.npz"


def main(argv: list[str] | None = None) -> Path:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    from evals import zoo

    model, tok = zoo.load_model({"name": cfg["model"], "dtype": "float32"})
    filters = compute(model, windows_of(tok, cfg["sequences"], cfg["length"]), cfg["samples"], cfg["seed"])
    path = out_path(cfg, "qfilters")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, q_filters=filters, **{k: v for k, v in cfg.items() if k != "out"})
    print(f"qfilter: {cfg['model']}: filters {filters.shape} from {cfg['sequences']} x {cfg['length']} tokens, "
          f"{cfg['samples']} samples; wrote {path}")
    return path


if __name__ == "__main__":
    main()
