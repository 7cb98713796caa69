"""`python -m benchmarks.decode_inplace`: a shape class's layer-by-layer decoding with each token
written in place (`kvpolicies.slots.SpareSlot`) against the same decoding through the
concatenated view [stored S, new token] and its packing copy, timed alternately in one process.

    python -m benchmarks.decode_inplace                        # SnapKV, SmolLM2, a 2,048-token prompt
    python -m benchmarks.decode_inplace --press KnormPress --rounds 9

The engine is `evals.peer`'s: one shape class for the press at ratios 0.25 / 0.5 / 0.75 (the
largest state's slots), the prompt compressed at `--ratio`, then `--gen` greedy tokens decoded
from the compressed state (`continue_generate`'s decoding, `Engine._decode_layers`; `max_new` =
`--question` + `--gen`, as `evals.peer` sizes it). Each round
decodes once with the spare slot and once without (which first alternates), each from its own copy
of the compressed state; the medians over rounds and their ratio are the result (both variants
share the machine's load, a shared machine's noise shows as the spread). The ids of the two are
asserted equal. Printed: per variant, ms per decoded token (median, min, max); with `--out`, also
written as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure(press: str = "SnapKVPress", tokens: int = 2048, ratio: float = 0.25, gen: int = 12, rounds: int = 7,
            model=None, seed: int = 0, question: int = 38) -> dict:
    """Per variant ("in_place", "concatenated"): the ms per decoded token of each round, the
    slots per kv head of the shape class, and the ids both decoded."""
    import models.engine.layers as layers
    from kvpolicies.compat import kvpress
    from models.engine import Engine, grid_slots
    from models.loading import load_default_model

    model = model if model is not None else load_default_model()[0]
    n_layers = model.cfg.n_layers
    max_new = gen + question  # as evals.peer sizes it: the longest question and the answer
    pols = [kvpress(press, r, max_new=max_new, n_layers=n_layers) for r in (0.25, 0.5, 0.75)]
    slots = grid_slots(pols, n_layers, tokens + max_new)
    pol = kvpress(press, ratio, max_new=max_new, n_layers=n_layers)
    eng = Engine(model, pol, max_len=tokens + max_new, slots=slots)
    ids = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (1, tokens)).astype(np.int32)
    state = eng.compress(eng.prompt(ids, chunk=512))
    first = jnp.argmax(state.logits, axis=-1).astype(jnp.int32)
    pos = jnp.full((1,), tokens, jnp.int32)
    own = layers.spared

    def run(in_place: bool):
        layers.spared = own if in_place else (lambda policy: None)
        try:
            cache = jax.block_until_ready(jax.tree.map(jnp.copy, state.cache))
            t0 = time.perf_counter()
            out, _ = eng._decode_layers(cache, first, pos, gen - 1, None, cut=False)
            out = np.asarray(out)
            return out, (time.perf_counter() - t0) / (gen - 1) * 1e3
        finally:
            layers.spared = own

    names = {True: "in_place", False: "concatenated"}
    got = {name: run(flag)[0] for flag, name in names.items()}  # compile both
    if not np.array_equal(got["in_place"], got["concatenated"]):
        raise AssertionError(f"the two decodings differ: {got}")
    ms: dict[str, list[float]] = {name: [] for name in names.values()}
    for r in range(rounds):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            ms[names[flag]].append(run(flag)[1])
    return {"press": press, "tokens": tokens, "ratio": ratio, "gen": gen, "rounds": rounds, "slots": slots,
            "held": int((np.asarray(state.cache[0].pos[0]) >= 0).sum(axis=-1).max()), "ms_per_token": ms,
            "ids": got["in_place"].tolist()}


def summary(res: dict) -> str:
    med = {k: float(np.median(v)) for k, v in res["ms_per_token"].items()}
    lines = [f"{res['press']} ratio {res['ratio']}: shape class of {res['slots']} slots per kv head "
             f"({res['held']} held after the prompt), {res['gen'] - 1} tokens decoded, {res['rounds']} rounds"]
    for k, v in res["ms_per_token"].items():
        lines.append(f"  {k:13s} ms/token: median {med[k]:.1f} (min {min(v):.1f}, max {max(v):.1f})")
    lines.append(f"  in place / concatenated: {med['in_place'] / med['concatenated']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--press", default="SnapKVPress")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--gen", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--question", type=int, default=38, help="the question's room in max_new (evals.peer's longest)")
    ap.add_argument("--out", default=None, help="a JSON file for the result")
    a = ap.parse_args(argv)
    res = measure(a.press, a.tokens, a.ratio, a.gen, a.rounds, question=a.question)
    print(summary(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
