"""`python -m benchmarks.first_call`: the first call of a press (compilation included) against its
second, each press in a fresh process, with its exact per-layer policies and as a shape class
(`Engine(slots=)`): issue 57's PyramidKV measure (a per-layer budget compiled a step per layer).

    python -m benchmarks.first_call                       # SnapKVPress, PyramidKVPress on SmolLM2 at 1,024 tokens
    python -m benchmarks.first_call presses=SnapKVPress,PyramidKVPress,AdaKVPress tokens=2048

A call: the context (a slice of the default text) prompted in 512-token chunks, compressed at ratio
0.5, a 32-token question fed, 12 greedy tokens (`Engine.prompt`, `compress`, `continue_generate`).
Prints one line per (press, mode) and writes <out>/first_call.json (out=results/first_call).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

MODES = ("exact", "slots")


def one(press: str, mode: str, tokens: int) -> dict:
    """In this process: the first and the second call of `press` (the engine built fresh)."""
    import jax
    import numpy as np

    from evals.data import default_text
    from kvpolicies.compat import kvpress
    from models.engine import Engine, grid_slots
    from models.loading import load_default_model

    model, tok = load_default_model()
    ids = np.asarray(tok.encode(default_text())[:tokens + 32], np.int32)
    ctx, q = ids[None, :tokens], ids[None, tokens:]
    max_len = tokens + 32 + 12
    pol = kvpress(press, 0.5, max_new=44, n_layers=model.cfg.n_layers)
    slots = grid_slots([pol], model.cfg.n_layers, max_len) if mode == "slots" else 0
    out = {}
    with jax.default_matmul_precision("highest"):
        eng = Engine(model, pol, max_len=max_len, slots=slots)
        for k in ("first", "second"):
            t0 = time.time()
            st = eng.compress(eng.prompt(ctx, chunk=512))
            eng.continue_generate(st, q, 12)
            out[k] = round(time.time() - t0, 2)
    return {"press": press, "mode": mode, "tokens": tokens, "layers_policies": len(set(eng.policies))} | out


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return []
    kw = dict(a.split("=", 1) for a in argv if "=" in a)
    if kw.get("_one"):
        press, mode = kw["_one"].split(":")
        print(json.dumps(one(press, mode, int(kw.get("tokens", 1024)))))
        return []
    presses = kw.get("presses", "SnapKVPress,PyramidKVPress").split(",")
    rows = []
    for press in presses:
        for mode in MODES:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.first_call", f"_one={press}:{mode}",
                                   f"tokens={kw.get('tokens', 1024)}"], capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    out = pathlib.Path(kw.get("out", "results/first_call"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
