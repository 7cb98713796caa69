"""A head pattern for `duo` (kvpolicies/duo.py) from one calibration text — OUR approximation.

DuoAttention (Xiao et al., ICLR 2025; mit-han-lab/duo-attention) *learns* a gate per kv head by
optimization (distilling full attention on synthetic multi-passkey data, ~2,000 steps); those
gates are not shipped with this library and cannot be trained offline here. This module does
something much cheaper that is NOT their method: run the model once over a calibration text with
a probe policy (full attention) and score each kv head by the attention mass its queries put
*beyond* the streaming pattern — on keys that are neither among the first `sink` tokens nor
among the newest `recent` — averaged over the queries that have such keys (positions >=
sink + recent) and over the kv head's G query heads. A score near 0 means the head would lose
almost nothing as a streaming head; a high score marks a retrieval head. The scores are in
[0, 1] like the authors' gates, so `Duo(pattern=file, sparsity=...)` binarizes them the same way.
Two calibration texts: `copy_task_tokens` (the CLI default: random ids repeated once, scoring the
second copy, so the heads that fetch the first copy from beyond the window score high — closer to
the passkey retrieval DuoAttention optimizes for, still not their method), or natural text (the
run's data: diffuse heads score high too, whether or not they retrieve). Measured on SmolLM2-135M,
passkey at 1,024 tokens, 6 prompts, sink 64 + recent 128: copy calibration with ~half the kv heads
streaming (threshold 0.412, 45 of 90 retrieval) 6/6 correct at 28.4 MB of cache (every head retrieval,
as full: 47.9 MB, 6/6); text calibration 0/6 with 43 of 90 retrieval heads, 1/6 with 65 of 90.

Shapes: B batch (1), T calibration tokens, L layers, K kv heads, G query heads per kv head,
S slots (= T), D head dim.

    tokens, start = copy_task_tokens(model.cfg.vocab_size, block=2048)
    scores = calibrate_duo(model, tokens, sink=128, recent=256, start=start)   # [L, K] float64
    save_pattern("pattern.json", scores, sink=128, recent=256)
    policy = kvpolicies.get("duo", pattern="pattern.json", sparsity=0.5)   # half the heads stream

CLI: python -m evals.duo_calibrate model=smollm2 --tokens 4096 [--calibration text] --out pattern.json
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvpolicies.base import Policy, SlotState, empty_slots
from kvpolicies.checks import check_int
from kvpolicies.slots import encode_new, view_of, write_at


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProbeState(SlotState):
    """Every token (as `full`), plus far: [B, K] float32, the attention mass put beyond
    sink + recent so far, summed over queries and over the G query heads of each kv head."""

    far: Float[Array, "B K"]


@dataclasses.dataclass(frozen=True)
class FarMassProbe(Policy):
    """Full attention that accumulates each kv head's attention mass on keys j with
    sink <= j <= p - recent (query p), i.e. outside DuoAttention's streaming pattern."""

    observes = ("scores",)

    sink: int = 128
    recent: int = 256
    start: int = 0  # only queries at positions >= start count

    def capacity(self, max_len):
        return max_len

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, max_len)
        return ProbeState(st.k, st.v, st.pos, far=jnp.zeros((batch, kv_heads), jnp.float32))

    def extend(self, state, k, v, pos):
        slots = SlotState(state.k, state.v, state.pos)
        written = write_at(slots, encode_new(self.codec, k, v, pos), pos[:, 0])
        return view_of(self.codec, written, pos, k.dtype, carry=(written, state.far, pos))

    def compact(self, view, seen):
        written, far, pos = view.carry
        kp = view.pos[:, :, None, :]  # [B, 1, 1, S]
        qp = pos[:, None, :, None]  # [B, 1, T, 1]
        beyond = (kp >= self.sink) & (kp <= qp - self.recent) & (qp >= self.start)  # [B, 1, T, S]
        mass = jnp.where(beyond, seen.scores, 0.0).sum(axis=(2, 3))  # [B, K]
        return ProbeState(written.k, written.v, written.pos, far=far + mass)


def calibrate_duo(model, tokens, sink: int = 128, recent: int = 256, chunk: int = 512, start: int = 0) -> np.ndarray:
    """[L, K] scores in [0, 1]: each kv head's mean attention mass beyond sink + recent on
    `tokens` ([T] ids, T > sink + recent), per query (at positions >= max(start, sink + recent))
    and per query head. Our approximation of DuoAttention's learned gates (module docstring)."""
    from models.engine import Engine

    check_int("calibrate_duo", "sink", sink, 0)
    check_int("calibrate_duo", "recent", recent, 1)
    check_int("calibrate_duo", "start", start, 0)
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    t = tokens.shape[1]
    n_queries = t - max(start, sink + recent)  # queries at positions >= sink + recent have keys beyond
    if n_queries <= 0:
        raise ValueError(f"calibrate_duo: {t} tokens leave no query with keys beyond sink + recent = "
                         f"{sink + recent} at positions >= start = {start}; give more tokens")
    cfg = model.cfg
    eng = Engine(model, FarMassProbe(sink=sink, recent=recent, start=start), max_len=t)
    _, cache = eng.prefill(tokens, chunk=chunk)
    far = jnp.concatenate([st.far for st in cache], axis=0)[:, 0]  # [L, K] (runs are consecutive layers)
    g = cfg.n_heads // cfg.n_kv_heads
    return np.asarray(far, np.float64) / (g * n_queries)


def copy_task_tokens(vocab_size: int, block: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """(tokens [2 x block], start = block): a block of random ids repeated once. Predicting the
    second copy needs the first, `block` tokens back: heads that retrieve it (induction / copy
    heads) put their mass beyond the window there; score the second copy only (`start`)."""
    check_int("copy_task_tokens", "block", block, 1)
    ids = np.random.default_rng(seed).integers(0, vocab_size, block).astype(np.int32)
    return np.concatenate([ids, ids]), block


def save_pattern(path: str | pathlib.Path, scores: np.ndarray, sink: int, recent: int, **info) -> pathlib.Path:
    """Write scores as a `duo` pattern file (.json: {"scores": [[...]], "sink", "recent", ...})."""
    path = pathlib.Path(path)
    data = {"scores": np.asarray(scores, np.float64).tolist(), "sink": sink, "recent": recent,
            "method": "attention mass beyond sink + recent on a calibration text (evals.duo_calibrate; "
                      "an approximation, not DuoAttention's learned gates)", **info}
    path.write_text(json.dumps(data, indent=1))
    return path


def _main(argv=None) -> None:
    import argparse

    from evals import config as C
    from evals.zoo import load_model

    ap = argparse.ArgumentParser(prog="python -m evals.duo_calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model=smollm2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--calibration", choices=("copy", "text"), default="copy",
                    help="copy: random ids repeated once, scoring the copy (default); text: the run's data text")
    ap.add_argument("--out", default="duo_pattern.json")
    a = ap.parse_args(argv)
    conf = C.validate(C.compose(list(a.overrides)))
    model, tok = load_model(conf["model"])
    if a.calibration == "copy":
        ids, start = copy_task_tokens(model.cfg.vocab_size, a.tokens // 2)
    else:
        from evals.data import load_text

        ids, start = np.asarray(tok.encode(load_text(conf["data"]["spec"]))[: a.tokens], np.int32), 0
    scores = calibrate_duo(model, ids, a.sink, a.recent, start=start)
    path = save_pattern(a.out, scores, a.sink, a.recent, model=conf["model"].get("name"), tokens=int(ids.size),
                        calibration=a.calibration)
    print(f"wrote {path}: {scores.shape[0]} layers x {scores.shape[1]} kv heads, "
          f"mean {scores.mean():.3f}, max {scores.max():.3f}")


if __name__ == "__main__":
    _main()
