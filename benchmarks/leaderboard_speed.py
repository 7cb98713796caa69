"""What kvpress's leaderboard costs on one accelerator, press by press: `python -m benchmarks.leaderboard_speed`.

Our side of `evals.leaderboard` (kvpress's protocol through `evals.peer.run_ours`: the context
prefilled and compressed, the question appended, greedy tokens) on a random-weight model of a
leaderboard model's real shape (`models.config.shape_config`: Llama-3.1-8B-Instruct, Qwen3-8B) in
bfloat16, on random ids of RULER's 4,096-token prompts. A step's time depends on the shapes only
(static shapes, no data-dependent work but the top-k selections), so these times are the real
model's on the same device. For each press, `samples` prompts at the leaderboard's four ratios:
the first sample holds the compilation, the later ones give the steady seconds per item and per
phase. The projection: RULER's 13 tasks x `--per-task` prompts x 4 ratios x the steady seconds per
item, in hours per press (decoding `--gen` tokens an item: RULER's tokens_to_generate averaged over
the 13 tasks is about 100).

    python -m benchmarks.leaderboard_speed --out results/leaderboard_speed.jsonl        # on a GPU
    python -m benchmarks.leaderboard_speed --dry-run                                     # tiny, CPU: what tests run

Rows (one JSON line each, written as measured; a press that raises is a row with "error"):
{"shape", "press", "ratios", "first_s", "steady_s_per_item", "phases" (steady, per item),
"compile_s", "programs", "hours_per_press", "device"}. `--budget-s` bounds the run, shared out among
the shapes: a press starts only while its shape's share is left (a skipped one is a row with
"skipped": "budget").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

RULER_TASKS = 13
PER_TASK = 500  # RULER's default samples per task (kvpress's leaderboard dataset at 4K)
TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)


def plan(out: pathlib.Path, presses: list[str], ratios: list[float], tokens: int, question: int, gen: int,
         samples: int, vocab: int, seed: int = 0):
    """An `evals.peer.Plan` of random prompts: context [tokens - question - gen], question [question]."""
    from evals import peer

    rng = np.random.default_rng(seed)
    n = tokens - question - gen
    p = peer.Plan(model="shape", task={"name": "random"}, tokens=tokens, samples=samples, ratios=ratios,
                  presses=presses, gen=gen, seed=seed, chunk=512, prefill="shared", out=out, stem="speed",
                  overwrite=True, progress=False, kvpress=False)
    p.contexts = [rng.integers(0, vocab, n).astype(np.int32) for _ in range(samples)]
    p.questions = [rng.integers(0, vocab, question).astype(np.int32) for _ in range(samples)]
    p.refs = [("",)] * samples
    p.config = f"speed-{seed}"
    return p


def measure(model, press: str, ratios: list[float], tokens: int, question: int, gen: int, samples: int,
            per_task: int) -> dict:
    """One press's row: first-sample and steady seconds per item, steady phases, the projection."""
    from evals import peer

    with tempfile.TemporaryDirectory() as tmp:
        p = plan(pathlib.Path(tmp), [press], ratios, tokens, question, gen, samples, model.cfg.vocab_size)
        t0 = time.time()
        peer.run_ours(p, model, [(i, press, r) for i in range(samples) for r in ratios])
        wall = time.time() - t0
        lines = peer.read_lines(p.path(".ours.jsonl"))
    first = [x for x in lines if x["sample"].split("/")[1] == "0"]  # '<config>/<index>/<hash>'
    steady = [x for x in lines if x not in first]
    per_item = float(np.mean([x["seconds"] for x in steady])) if steady else float("nan")
    phases = {}
    for k in ("prefill", "compress", "kept", "question", "decode"):
        vals = [x["phases"].get(k, 0.0) for x in steady]
        phases[k] = round(float(np.mean(vals)), 4) if vals else float("nan")
    return {"press": press, "ratios": ratios, "samples": samples, "wall_s": round(wall, 2),
            "first_s": round(sum(x["seconds"] for x in first), 2), "steady_s_per_item": round(per_item, 4),
            "phases": phases, "compile_s": round(sum(x["phases"].get("compile", 0.0) for x in lines), 2),
            "programs": int(sum(x["phases"].get("programs", 0) for x in lines)),
            "hours_per_press": round(RULER_TASKS * per_task * len(ratios) * per_item / 3600, 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from evals.leaderboard import default_presses
    from models.config import LlamaConfig, shape_config
    from models.llama import Llama, device_params
    from models.tokenizer import ByteTokenizer, attach

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.1-8b,qwen3-8b", help="models.config.SHAPES names")
    ap.add_argument("--presses", default=None, help="comma-separated kvpress names (default: the leaderboard's)")
    ap.add_argument("--ratios", default="0.25,0.5,0.75,0.875")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--question", type=int, default=40, help="question tokens (chat tail and answer prefix included)")
    ap.add_argument("--gen", type=int, default=100)
    ap.add_argument("--samples", type=int, default=2, help="prompts per press (the first compiles)")
    ap.add_argument("--per-task", type=int, default=PER_TASK)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model at 256 tokens, two presses")
    a = ap.parse_args(argv)
    t_start = time.time()
    presses = a.presses.split(",") if a.presses else default_presses()
    ratios = [float(x) for x in a.ratios.split(",")]
    shapes = ["tiny"] if a.dry_run else a.shapes.split(",")
    if a.dry_run:
        presses, a.tokens, a.question, a.gen = (presses if a.presses else ["SnapKVPress", "KnormPress"]), 256, 8, 4
    device = str(jax.devices()[0].device_kind)
    rows = []
    sink = open(a.out, "a", encoding="utf-8") if a.out else None

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    for shape in shapes:
        cfg = LlamaConfig(**TINY, max_position=a.tokens) if shape == "tiny" else shape_config(shape)
        t0 = time.time()
        dtype = jnp.float32 if shape == "tiny" else jnp.bfloat16
        # weights drawn on the device; kvzip's repeat prompts in bytes (a random model has no tokenizer)
        model = attach(Llama(cfg, device_params(cfg, dtype=dtype), dtype=dtype), ByteTokenizer())
        jax.block_until_ready(model.embed[...])
        emit({"shape": shape, "device": device, "event": "model built", "seconds": round(time.time() - t0, 2)})
        share = (a.budget_s - (time.time() - t_start)) / (len(shapes) - shapes.index(shape))  # the time left, shared
        t_shape = time.time()
        for press in presses:
            if time.time() - t_shape > share:
                emit({"shape": shape, "press": press, "skipped": "budget", "device": device})
                continue
            try:
                row = measure(model, press, ratios, a.tokens, a.question, a.gen, a.samples, a.per_task)
            except Exception as e:  # noqa: BLE001 (a row says what failed; the run goes on)
                row = {"press": press, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            emit({"shape": shape, "device": device, "tokens": a.tokens, "gen": a.gen} | row)
        del model
    if sink:
        sink.close()
    return rows


if __name__ == "__main__":
    main()
