"""Decode/prefill speed of SmolLM2-135M through kvpolicies, next to transformers on the same machine.

    python -m benchmarks.decode_speed --contexts 1024 4096 --steps 32

Reports, per policy and context: prefill tokens/s, decode-step compile time, decode tokens/s
(a host loop of jitted `Engine.step`s; and `Engine.continue_generate` layer by layer, the default,
and as one fused lax.scan, each with the time of its first, compiling call), plus transformers'
decode tokens/s with its DynamicCache in float32. A generate call's per-step rate is the
difference of a `steps`-step and a 1-step call over steps - 1 (best of 2 each): its fixed cost
per call (one copy of the prompt's cache, the first token) is reported apart (`*_call_fixed_s`),
and so is its compile: the first call less `steps` steps and the fixed cost (`*_compile_s`). Timings are wall-clock on a shared machine: compare
the ratios measured in one run, not absolute numbers across runs.

Roofline: the process first measures its read bandwidth (a jitted sum over a 512 MB array, best
of 5); a decode step must read the weights and the keys/values it attends (the filled slots), so
its floor is (weight bytes + those cache bytes) / bandwidth. Each row reports that floor, the
fraction of it the host loop, the layer-by-layer generator and the scan reach (`roofline`,
`layers_roofline`, `scan_roofline`: 1.0 = at the bound), and `vs_transformers` (our
layer-by-layer decode tokens/s over transformers' at that context; `scan_vs_transformers`).

Prefill is compute-bound: the process also measures its matmul rate (`matmul_rate`: jitted float32
matmuls of the model's projection and MLP shapes at 512 rows, best of 5) and counts the FLOPs a
prefill of `ctx` tokens needs (`prefill_flops`: 2 x the layers' weights per token, the causal
attention's QK and PV, 4 x heads x head_dim per (query, visible key) pair, a sink query seeing at
most n_sink + window keys, and the output head
for the last token), so each row reports `prefill_gflop_s`, `prefill_of_matmul` (that rate over the
matmul rate; the target is 0.5) and `prefill_vs_transformers` (our prefill tokens/s over
transformers' single forward of the same tokens). Both rates are measured at the start and again
at the end of the run; the rows written to `--out` divide by the better of the two (the rows
printed during the run use the start's).

Ceilings of the targets, from the same run: each of our rows also reports `roofline_needed`,
the fraction of its roofline a decode 3x transformers' tokens/s would reach (above 1.0 no
implementation reaches it on this machine), and `matmul_needed`, the fraction of the matmul rate a
prefill 2x transformers' would need (its FLOP count as ours; above 1.0 it is faster than the
measured matmul rate). transformers' row reports the same matmul shapes' rate through PyTorch
(`torch_matmul_GFLOP_s`, measured right after it) and its prefill's fraction of it
(`prefill_of_torch_matmul`).

A codec row (`impl: codec`, with both `full` and int8): the layer-by-layer steps of `full` with
int8 and int4, each with keys encoded before RoPE (the default) and after RoPE (`_after_rope`:
keys stored rotated), over `full`'s at the largest context, the five engines alternated over 6
rounds (`--rounds`; medians; the per-policy rows above are measured one policy after the other, so
the machine's drift enters their ratio). `--codec-only` runs only this row.

At its end the run prints docs/results/speed.md's table from its rows (`markdown_table`; the rows of a
saved run: `markdown_table([json.loads(line) for line in open(path)])`).

Scaling rows (`impl: scaling`): the ratio of two host-loop step times (the best of 5 rounds, the
two engines alternated), `sink` after 64K tokens
over after 1K (flat = 1.0) and `full` at a 1K context with a 16K over a 1K `max_len`.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from models.engine import Engine
from models.loading import load_default_model


def _block(x):
    jax.tree.map(lambda a: a.block_until_ready(), x)
    return x


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a jitted float32 sum over `nbytes` (the best of `repeats`), measured here."""
    a = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x.sum())
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


MATMUL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # SmolLM2's projections and MLP


def matmul_rate(rows: int = 512, shapes=None, repeats: int = 5) -> float:
    """FLOP/s of jitted float32 matmuls [rows, a] @ [a, b] over `shapes` (default: SmolLM2's
    projection and MLP shapes), the best of `repeats` runs of all of them, measured here."""
    shapes = shapes or MATMUL_SHAPES
    key = jax.random.PRNGKey(0)
    xs = [(jax.random.normal(key, (rows, a), jnp.float32), jax.random.normal(key, (a, b), jnp.float32))
          for a, b in shapes]
    f = jax.jit(lambda pairs: [x @ w for x, w in pairs])
    _block(f(xs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _block(f(xs))
        best = min(best, time.perf_counter() - t0)
    return sum(2 * rows * a * b for a, b in shapes) / best


def torch_matmul_rate(rows: int = 512, shapes=None, repeats: int = 5) -> float:
    """FLOP/s of the same float32 matmuls as `matmul_rate`, through PyTorch (what transformers'
    prefill runs on), measured here: the rate a PyTorch prefill can at best reach on this machine."""
    import torch

    shapes = shapes or MATMUL_SHAPES
    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(rows, a, generator=gen), torch.randn(a, b, generator=gen)) for a, b in shapes]
    best = float("inf")
    with torch.no_grad():
        [x @ w for x, w in xs]
        for _ in range(repeats):
            t0 = time.perf_counter()
            [x @ w for x, w in xs]
            best = min(best, time.perf_counter() - t0)
    return sum(2 * rows * a * b for a, b in shapes) / best


def prefill_flops(cfg, ctx: int, span: int | None = None) -> int:
    """FLOPs a prefill of `ctx` tokens needs (multiply-adds count 2): every layer weight matrix
    once per token, attention over the keys each query may see (query i sees keys 0..i, at most
    `span` of them for a policy that keeps `span` slots: QK and PV, 2 x 2 x n_heads x head_dim per
    pair), and the output head for the last token (prefill returns only its logits)."""
    d, f, h, k, hd, n = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    per_token = n * (d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * f)  # q, k, v, o; gate, up, down
    w = ctx if span is None else min(span, ctx)
    pairs = w * (w + 1) // 2 + (ctx - w) * w  # sum over i of min(i + 1, w)
    return 2 * per_token * ctx + 4 * n * h * hd * pairs + 2 * d * cfg.vocab_size


def step_read_bytes(model, cache, ctx: int) -> dict[str, int]:
    """What a decode step at context `ctx` must read: every weight, and the filled cache slots
    (a policy's whole state once it holds fewer slots than the context)."""
    from kvpolicies.memory import tree_nbytes

    weights = tree_nbytes(nnx_state(model))
    slots = int(cache[0].pos.shape[-1])
    kv = tree_nbytes(getattr(cache, "runs", cache)) * min(1.0, (ctx + 1) / slots)  # the states, not the carried length
    return {"weight_bytes": int(weights), "kv_read_bytes": int(kv)}


def nnx_state(model):
    from flax import nnx

    return nnx.split(model)[1]


def bench_ours(model, tokens, policy, ctx, steps, chunk):
    eng = Engine(model, policy, max_len=ctx + steps + 1)
    t0 = time.perf_counter()
    logits, cache = _block(eng.prefill(tokens[None, :ctx], chunk=chunk))
    t_prefill_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, cache = _block(eng.prefill(tokens[None, :ctx], chunk=chunk))
    t_prefill = time.perf_counter() - t0
    nxt = np.asarray(jnp.argmax(logits, -1))[:, None]
    t0 = time.perf_counter()
    logits, cache = _block(eng.step(cache, nxt, ctx))
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        nxt = np.asarray(jnp.argmax(logits, -1))[:, None]
        logits, cache = eng.step(cache, nxt, ctx + 1 + i)
    _block(logits)
    t_decode = time.perf_counter() - t0
    # generation from a prompted state, layer by layer (the default) and as one fused lax.scan. The
    # first call of each compiles. Then calls of `steps` and of 1 decode step (best of 2 each): the
    # per-step time is their difference over steps - 1, and what is left of the short call is the
    # call's fixed cost (its one copy of the prompt's cache, the first token, dispatch)
    state = eng.compress(eng.prompt(tokens[None, :ctx], chunk=chunk))
    _block(state.cache)
    gen = {}
    for loop in ("layers", "scan"):
        eng.decode_loop = loop
        t0 = time.perf_counter()
        eng.continue_generate(state, [], steps + 1)  # the first token is the prompt's; then `steps` decode steps
        gen[loop + "_first_s"] = time.perf_counter() - t0
        eng.continue_generate(state, [], 2)  # the scan compiles per n
        best = {}
        for _ in range(2):
            for n in (steps + 1, 2):
                t0 = time.perf_counter()
                eng.continue_generate(state, [], n)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
        step = (best[steps + 1] - best[2]) / max(1, steps - 1)
        if step <= 0:  # noise larger than the steps (a tiny model, a dry run): the long call's mean
            step = best[steps + 1] / steps
        gen[loop], gen[loop + "_call_s"] = 1 / step, max(0.0, best[2] - step)
        gen[loop + "_compile_s"] = gen[loop + "_first_s"] - steps * step - gen[loop + "_call_s"]
    eng.decode_loop = "layers"
    assert eng.traces["decode"] == 1 and eng.traces["decode_n"] == 2 and eng.traces["decode_layer"] == 1
    return step_read_bytes(model, cache, ctx) | dict(
        prefill_tok_s=ctx / t_prefill,
        prefill_cold_s=t_prefill_cold,
        decode_compile_s=t_compile,
        decode_tok_s=steps / t_decode,
        layers_decode_tok_s=gen["layers"],
        scan_decode_tok_s=gen["scan"],
        layers_first_call_s=gen["layers_first_s"],
        scan_first_call_s=gen["scan_first_s"],
        layers_call_fixed_s=gen["layers_call_s"],
        scan_call_fixed_s=gen["scan_call_s"],
        layers_compile_s=gen["layers_compile_s"],
        scan_compile_s=gen["scan_compile_s"],
        cache_slots=int(cache[0].pos.shape[-1]),
    )


def step_ms(model, configs, steps: int, rounds: int = 5) -> list[float]:
    """ms per host-loop decode step of each engine (policy, max_len, pos) of `configs`, at positions
    pos, pos+1, ...: the best of `rounds` runs of `steps` steps, the engines alternated round by
    round, so that the machine's drift weighs on each alike (the cache's content does not change
    these policies' work: `full` reads the length bucket of its positions, `sink` its ring, filled
    or not)."""
    tok = np.zeros((1, 1), np.int32)
    runs = []
    for policy, max_len, pos in configs:
        eng = Engine(model, policy, max_len=max_len)
        runs.append([eng, pos, _block(eng.step(eng.init_cache(1), tok, pos))[1]])  # compiled
    best = [float("inf")] * len(runs)
    for r in range(rounds):
        for i, (eng, pos, cache) in enumerate(runs):
            t0 = time.perf_counter()
            for j in range(steps):
                logits, cache = eng.step(cache, tok, pos + 1 + r * steps + j)
            _block(logits)
            best[i] = min(best[i], (time.perf_counter() - t0) / steps * 1e3)
            runs[i][2] = cache
    return best


def bench_scaling(model, steps: int, sink_window: int) -> list[dict]:
    """Does a step cost what it reads? `sink` after 64K tokens vs after 1K (the same slots: flat
    is 1.0), and `full` at a 1K context inside a 16K max_len vs a 1K max_len (1.0: the step
    reads only the filled slots; with length buckets it reads 1,280 of the 16,384)."""
    sink = kvpolicies.get("sink", n_sink=4, window=sink_window)
    full = kvpolicies.get("full")
    room = 6 * steps  # positions the timed steps take
    near, far = step_ms(model, [(sink, p + room, p) for p in (1024, 65536)], steps)
    small, big = step_ms(model, [(full, n, 1000) for n in (1000 + room, 16384)], steps)
    return [dict(impl="scaling", check="sink step after 64K / after 1K", ms=[near, far], ratio=far / near),
            dict(impl="scaling", check="full step at 1K context: max_len 16K / max_len 1K", ms=[small, big],
                 ratio=big / small)]


CODEC_AB = ("int8", "int8_after_rope", "int4", "int4_after_rope")  # the codec row's codecs, each against `full`


def bench_codec(model, tokens, ctx: int, steps: int, chunk: int, rounds: int = 6, codecs=CODEC_AB) -> dict:
    """Each codec's layer-by-layer decode step (`full` with that codec) over `full`'s at context
    `ctx`, the engines alternated round by round (each round: a `steps`-step and a 1-step
    `continue_generate`, their difference over steps - 1), so that the machine's drift weighs on
    all alike: the medians' ratios (`ratio`: the first codec's, int8 before RoPE; `ratios`: each),
    and the bytes of keys/values/positions each step reads."""
    runs = {}
    for name in ("none", *codecs):
        eng = Engine(model, kvpolicies.get("full", codec=name), max_len=ctx + steps + 1)
        state = eng.compress(eng.prompt(tokens[None, :ctx], chunk=chunk))
        eng.continue_generate(state, [], steps + 1)  # compiled
        eng.continue_generate(state, [], 2)
        runs[name] = (eng, state, [])
    for _ in range(rounds):
        for eng, state, ms in runs.values():
            t0 = time.perf_counter()
            eng.continue_generate(state, [], steps + 1)
            t1 = time.perf_counter()
            eng.continue_generate(state, [], 2)
            step = ((t1 - t0) - (time.perf_counter() - t1)) / max(1, steps - 1)
            ms.append(1e3 * (step if step > 0 else (t1 - t0) / steps))  # (noise over the steps: the long call's mean)
    med = {name: float(np.median(ms)) for name, (_, _, ms) in runs.items()}
    read = {name: step_read_bytes(model, state.cache, ctx)["kv_read_bytes"] for name, (_, state, _) in runs.items()}
    return dict(impl="codec", check=f"{' and '.join(codecs)} step / full step, layer by layer, alternated",
                context=ctx, codecs=["none", *codecs], ms=list(med.values()), ratio=med[codecs[0]] / med["none"],
                ratios={c: med[c] / med["none"] for c in codecs}, kv_read_bytes=list(read.values()))


def bench_transformers(tokens, ctx, steps):
    import torch
    from transformers import AutoModelForCausalLM

    from models.loading import smollm2_gguf_path

    path = smollm2_gguf_path()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    m.eval()
    ids = torch.tensor(tokens[None, :ctx], dtype=torch.long)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = m(ids, use_cache=True)
        t_prefill = time.perf_counter() - t0
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t_decode = time.perf_counter() - t0
    return dict(prefill_tok_s=ctx / t_prefill, decode_tok_s=steps / t_decode)


def _fractions(r: dict, bw: float, mm: float) -> dict:
    """A row's roofline fractions (read bandwidth `bw`, bytes/s) and prefill's fraction of the
    matmul rate `mm` (FLOP/s), in place; with transformers' rates of the same run in the row, the
    ceilings of the targets: the fraction of the roofline a decode `DECODE_X` x transformers' would
    need (`roofline_needed`: above 1 it is beyond the bandwidth bound), and the fraction of the
    matmul rate a prefill `PREFILL_X` x transformers' would need (`matmul_needed`)."""
    floor = (r["weight_bytes"] + r["kv_read_bytes"]) / bw
    r |= {"roofline_ms": floor * 1e3, "roofline": floor * r["decode_tok_s"], "scan_roofline": floor * r["scan_decode_tok_s"],
          "layers_roofline": floor * r["layers_decode_tok_s"],
          "read_bandwidth_GB_s": bw / 1e9, "prefill_of_matmul": r["prefill_gflop_s"] / (mm / 1e9), "matmul_GFLOP_s": mm / 1e9}
    if "transformers_decode_tok_s" in r:
        r["roofline_needed"] = DECODE_X * r["transformers_decode_tok_s"] * floor
        per_token = r["prefill_gflop_s"] / r["prefill_tok_s"]  # GFLOP a prefill token needs
        r["matmul_needed"] = PREFILL_X * r["transformers_prefill_tok_s"] * per_token / (mm / 1e9)
    return r


DECODE_X, PREFILL_X = 3, 2  # issue 12's targets: decode 3x, prefill 2x transformers'


def markdown_table(rows: list[dict], sink_window: int = 1020) -> str:
    """docs/results/speed.md's table from a run's rows (`--out` or `main`'s return): per policy, decode
    tokens/s (host loop / layers / scan) and roofline fractions per context, the transformers
    ratios and ceilings at the largest context, cache bytes, prefill rates and compile times."""
    ours = {(r["policy"], r["context"]): r for r in rows if r["impl"] == "kvpolicies"}
    theirs = {r["context"]: r for r in rows if r["impl"] == "transformers"}
    names = [p for p in ("full", "sink", "int8", "int8_after_rope") if any(k[0] == p for k in ours)]
    ctxs = sorted({k[1] for k in ours})
    top, kb = ctxs[-1], lambda c: f"{c // 1024}K"  # noqa: E731
    label = {"full": "kvpolicies full", "sink": f"kvpolicies sink (4+{sink_window})", "int8": "kvpolicies full int8",
             "int8_after_rope": "kvpolicies full int8 after RoPE"}
    pct = lambda x: f"{100 * x:.0f} %"  # noqa: E731

    def line(measure, cell, tf=""):
        return f"| {measure} | " + " | ".join(cell(p) for p in names) + (f" | {tf} |" if tf else " | |")

    out = ["| measure | " + " | ".join(label[p] for p in names) + " | transformers full |",
           "|---|" + "---:|" * (len(names) + 1)]
    for c in ctxs:
        r = lambda p: ours[p, c]  # noqa: E731
        what = " (host loop / layers / scan)" if c == ctxs[0] else ""
        out.append(line(f"decode tok/s, {kb(c)} context{what}",
                        lambda p: f"{r(p)['decode_tok_s']:.2f} / **{r(p)['layers_decode_tok_s']:.2f}** / {r(p)['scan_decode_tok_s']:.2f}",
                        f"{theirs[c]['decode_tok_s']:.2f}" if c in theirs else ""))
        if c == top:
            bold = lambda p, x: f"**{x}**" if p == "full" else x  # noqa: E731
            out.append(line(f"of the roofline, {kb(c)} (layers / scan)",
                            lambda p: f"{bold(p, pct(r(p)['layers_roofline']))} / {pct(r(p)['scan_roofline'])}"))
            if c in theirs:
                out.append(line(f"ours / transformers at {kb(c)} (layers / scan)",
                                lambda p: f"{bold(p, format(r(p)['vs_transformers'], '.2f') + '×')} / {r(p)['scan_vs_transformers']:.2f}×", "1"))
                out.append(line(f"{DECODE_X}× transformers at {kb(c)} would be, of the roofline",
                                lambda p: pct(r(p)["roofline_needed"])))
            out.append(line(f"cache bytes a {kb(c)} step reads", lambda p: f"{r(p)['kv_read_bytes'] / 1e6:.0f} MB"))
        else:
            out.append(line(f"of the roofline, {kb(c)} (layers)", lambda p: pct(r(p)["layers_roofline"])))
    for i, c in enumerate(ctxs):
        what = " (chunks of 512)" if i == 0 else ""
        out.append(line(f"prefill tok/s, {kb(c)}{what}", lambda p: f"{ours[p, c]['prefill_tok_s']:.0f}",
                        f"{theirs[c]['prefill_tok_s']:.0f}" if c in theirs else ""))
    both = " / ".join(kb(c) for c in ctxs)
    if all(c in theirs for c in ctxs):
        out.append(line(f"prefill ours / transformers, {both}",
                        lambda p: " / ".join(f"{ours[p, c]['prefill_vs_transformers']:.2f}×" for c in ctxs), "1"))
    for c in ctxs:
        tf = theirs.get(c)
        out.append(line(f"prefill GFLOP/s needed, {kb(c)} (of the matmul rate)",
                        lambda p: f"{ours[p, c]['prefill_gflop_s']:.0f} ({pct(ours[p, c]['prefill_of_matmul'])})",
                        f"{tf['prefill_gflop_s']:.0f} ({pct(tf['prefill_of_torch_matmul'])} of PyTorch's)" if tf else ""))
    if all(c in theirs for c in ctxs):
        out.append(line(f"{PREFILL_X}× transformers' prefill would need, {both}, of the matmul rate",
                        lambda p: " / ".join(pct(ours[p, c]["matmul_needed"]) for c in ctxs)))
    out.append(line(f"decode compile: host step, {both} (s)",
                    lambda p: " / ".join(f"{ours[p, c]['decode_compile_s']:.2f}" for c in ctxs)))
    out.append(line(f"first generate call's compile, {both}, layers (s)",
                    lambda p: " / ".join(f"{ours[p, c]['layers_compile_s']:.2f}" for c in ctxs)))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--sink-window", type=int, default=1020)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--policies", nargs="+", default=["full", "sink", "int8", "int8_after_rope"],
                    choices=["full", "sink", "int8", "int8_after_rope"])
    ap.add_argument("--out", default=None, help="write the rows here, one JSON object per line")
    ap.add_argument("--no-scaling", action="store_true", help="skip the step-cost-vs-position/max_len rows")
    ap.add_argument("--codec-only", action="store_true",
                    help="only the codec row (full, int8 and int4 before/after RoPE, alternated) at the largest context")
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds of the codec row")
    args = ap.parse_args(argv)

    from evals.data import default_text

    model, tok = load_default_model()
    tokens = np.asarray(tok.encode(default_text()[:200_000]), np.int32)
    if args.codec_only:
        rows = [bench_codec(model, tokens, max(args.contexts), args.steps, args.chunk, args.rounds)]
        print(json.dumps(rows[0]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(rows[0]) + "\n")
        return rows
    policies = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=args.sink_window),
                "int8": kvpolicies.get("full", codec="int8"),
                "int8_after_rope": kvpolicies.get("full", codec="int8_after_rope")}
    policies = {k: policies[k] for k in args.policies}
    bw, mm = read_bandwidth(), matmul_rate()
    print(json.dumps({"read_bandwidth_GB_s": bw / 1e9, "matmul_GFLOP_s": mm / 1e9, "when": "start"}), flush=True)
    rows = []
    for ctx in args.contexts:
        ours = []
        for name, pol in policies.items():
            r = dict(impl="kvpolicies", policy=name, context=ctx, **bench_ours(model, tokens, pol, ctx, args.steps, args.chunk))
            span = pol.n_sink + pol.window if name == "sink" else None  # keys a sink query may see
            r["prefill_gflop_s"] = prefill_flops(model.cfg, ctx, span) / ctx * r["prefill_tok_s"] / 1e9
            ours.append(_fractions(r, bw, mm))
            rows.append(r)
        if not args.no_transformers:
            t = dict(impl="transformers", policy="full", context=ctx, **bench_transformers(tokens, ctx, args.steps))
            t["torch_matmul_GFLOP_s"] = torch_matmul_rate() / 1e9  # the same shapes through PyTorch, now
            t["prefill_gflop_s"] = prefill_flops(model.cfg, ctx) / ctx * t["prefill_tok_s"] / 1e9
            t["prefill_of_torch_matmul"] = t["prefill_gflop_s"] / t["torch_matmul_GFLOP_s"]
            for r in ours:
                r["transformers_decode_tok_s"], r["transformers_prefill_tok_s"] = t["decode_tok_s"], t["prefill_tok_s"]
                _fractions(r, bw, mm)
                r["vs_transformers"] = r["layers_decode_tok_s"] / t["decode_tok_s"]  # generate's default loop
                r["scan_vs_transformers"] = r["scan_decode_tok_s"] / t["decode_tok_s"]
                r["prefill_vs_transformers"] = r["prefill_tok_s"] / t["prefill_tok_s"]
            rows.append(t)
        for r in rows[-len(ours) - (0 if args.no_transformers else 1):]:
            print(json.dumps(r), flush=True)
    if "full" in policies and "int8" in policies:
        r = bench_codec(model, tokens, max(args.contexts), args.steps, args.chunk, args.rounds)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if not args.no_scaling:
        for r in bench_scaling(model, args.steps, args.sink_window):
            print(json.dumps(r), flush=True)
            rows.append(r)
    # The machine is shared: measure both rates again and divide by the better of the two, so that a
    # slow moment at the start does not flatter the fractions (the rows written to --out).
    bw_end, mm_end = read_bandwidth(), matmul_rate()
    bw_start, mm_start = bw, mm
    bw, mm = max(bw, bw_end), max(mm, mm_end)
    rates = {"impl": "rates", "read_bandwidth_GB_s": [bw_start / 1e9, bw_end / 1e9],
             "matmul_GFLOP_s": [mm_start / 1e9, mm_end / 1e9], "used_read_bandwidth_GB_s": bw / 1e9,
             "used_matmul_GFLOP_s": mm / 1e9}  # [start, end], and the better one used
    print(json.dumps(rates), flush=True)
    rows.insert(0, rates)
    for r in rows:
        if r["impl"] == "kvpolicies":
            _fractions(r, bw, mm)
    if args.out:  # one JSON object per line, with the fractions over the better rates
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(markdown_table(rows, args.sink_window), flush=True)  # docs/results/speed.md's table, from the rows
    return rows


if __name__ == "__main__":
    main()
