"""benchmarks.decode_speed's roofline arithmetic (the timings themselves are benchmarks, not tests):
the bytes a decode step must read are every weight plus the filled slots' keys, values and
positions, in closed form."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

import kvpolicies
from benchmarks.decode_speed import matmul_rate, prefill_flops, read_bandwidth, step_read_bytes
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama

CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=96)


def test_step_reads_the_weights_and_the_filled_slots():
    model = Llama(CFG)
    head = 0 if CFG.tie_embeddings else 48 * 97  # an untied output head is read too
    n_params = sum(int(np.prod(v.shape)) for v in model.layers.values()) + 97 * 48 + 48 + head  # + embed, norm
    eng = Engine(model, kvpolicies.get("full"), max_len=64)
    got = step_read_bytes(model, eng.init_cache(1), ctx=31)  # 32 of 64 slots filled after the step
    per_slot = CFG.n_layers * (CFG.n_kv_heads * 2 * CFG.head_dim * 4 + 4)  # k, v float32; one int32 position
    assert got == {"weight_bytes": 4 * n_params, "kv_read_bytes": 32 * per_slot}
    sink = Engine(model, kvpolicies.get("sink", n_sink=2, window=14), max_len=64)
    assert step_read_bytes(model, sink.init_cache(1), ctx=31)["kv_read_bytes"] == 16 * per_slot  # all its slots


class _Clock:
    """A fake `time` for the benchmark's timers: each timed run lasts the next of `spans` seconds
    (perf_counter is read at a run's start and end), so a rate is its exact work / the best span."""

    def __init__(self, spans):
        self.ticks, t = [], 0.0
        for dt in spans:
            self.ticks += [t, t + dt]
            t += dt + 1.0

    def perf_counter(self):
        return self.ticks.pop(0)


def _timed(monkeypatch, spans):
    from benchmarks import decode_speed

    clock = _Clock(spans)
    monkeypatch.setattr(decode_speed, "time", clock)
    return clock


def test_read_bandwidth_is_bytes_over_the_best_run(monkeypatch):
    clock = _timed(monkeypatch, [0.5, 0.25])
    assert read_bandwidth(16 << 20, repeats=2) == (16 << 20) / 0.25 and not clock.ticks


def test_gpu_script_dry_run_measures_every_policy(tmp_path):
    """benchmarks.gpu --dry-run (what the CPU can check of the H200 script): every policy decodes
    on the tiny bfloat16 model and gets its roofline fraction; no test subprocess is started;
    cuDNN's and Pallas' attention compute ours (section 5); --out holds every row."""
    from benchmarks import gpu

    rows = gpu.main(["--dry-run", "--out", str(tmp_path / "gpu.jsonl")])
    assert [json.loads(x) for x in (tmp_path / "gpu.jsonl").read_text().splitlines()] == json.loads(json.dumps(rows))
    assert rows[0]["platform"] == "cpu" and "tests" not in {k for r in rows for k in r}
    kernels = [r for r in rows if r.get("section") == "kernels"]
    assert {(r["shape"], r["phase"], r["impl"]) for r in kernels} == {
        (s, p, i) for s in ("smollm2", "qwen") for p in ("prefill", "decode")
        for i in ("ours", "sdpa_xla", "sdpa_cudnn") + (("pallas",) if p == "decode" else ())}
    for r in kernels:
        if r["impl"] == "sdpa_cudnn":  # no GPU here: an error row, and the run went on
            assert "cuDNN" in r["error"] and "ms" not in r
        else:
            assert r["context"] == 256 and r["ms"] > 0 and r["max_abs_diff"] <= 1e-5, r
    measured = [r for r in rows if "policy" in r]
    assert [r["policy"] for r in measured] == list(gpu.POLICIES)
    assert all(r["context"] == 64 and r["scan_roofline"] > 0 and r["layers_roofline"] > 0 and r["kv_read_bytes"] > 0
               for r in measured)
    by = {r["policy"]: r for r in measured}
    for name in ("int8", "int8_after_rope"):  # the codec's smaller bytes are what a step reads
        assert by[name]["kv_read_bytes"] < by["full"]["kv_read_bytes"]


def twin_fields(cfg) -> dict:
    """The fields of a LlamaConfig that benchmarks.gpu's shape twins copy."""
    from benchmarks.gpu import SHAPE_TWINS

    return {k: getattr(cfg, k) for k in SHAPE_TWINS["smollm2"]}


def test_gpu_shape_twin_of_smollm2_has_the_installed_models_shapes():
    """The random-weight SmolLM2 of benchmarks.gpu (a device without the packages) has the config our
    loader reads from the GGUF file, and every weight its shape (Qwen's: tests/models/test_long_models.py)."""
    import jax
    from flax import nnx

    from benchmarks.gpu import SHAPE_TWINS, shape_twin
    from models.loading import load_default_model

    real, _ = load_default_model()
    assert twin_fields(real.cfg) == SHAPE_TWINS["smollm2"]
    drawn = {}

    def build():
        model, drawn["ids"] = shape_twin("smollm2")
        return model

    twin, ids = nnx.eval_shape(build), drawn["ids"]  # its shapes, without drawing 135M random weights
    shapes = lambda m: [x.shape for x in jax.tree.leaves(nnx.state(m))]  # noqa: E731
    assert shapes(twin) == shapes(real) and ids.max() < real.cfg.vocab_size and len(ids) == 40_000


def test_gpu_models_fall_back_to_their_shapes_where_not_installed(monkeypatch):
    """A device without the packages (here: evals.data's rdata missing) measures each model's shape
    twin, and a row says why."""
    from benchmarks import gpu

    def missing(name):
        raise ModuleNotFoundError("No module named 'rdata'")

    monkeypatch.setattr(gpu, "_real", missing)
    monkeypatch.setattr(gpu, "shape_twin", lambda name: (f"twin of {name}", np.arange(3)))
    rows = []
    got = [(n, m, w) for n, m, _, w in gpu.models(False, emit=rows.append)]
    assert got == [("smollm2", "twin of smollm2", "random"), ("qwen", "twin of qwen", "random")]
    assert [(r["model"], r["weights"]) for r in rows] == [("smollm2", "random"), ("qwen", "random")]
    assert all("rdata" in r["why"] for r in rows)


def test_gpu_check_script_runs_benchmarks_gpu_from_a_bare_python(tmp_path):
    """scripts/gpu_check.sh (for a device that installs nothing): the checkout on PYTHONPATH, rows in
    OUT/gpu.jsonl, the log beside; here with this venv's python, a dry run of one policy."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PY=sys.executable, PYTHONPATH="")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), str(tmp_path), "--dry-run", "--policies",
                           "full", "--skip-quest", "--skip-kernels"], cwd="/", env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert rows[0]["platform"] == "cpu" and [r["policy"] for r in rows if "policy" in r] == ["full"]
    assert "jax" in (tmp_path / "gpu.log").read_text().splitlines()[0]


def test_gpu_test_subset_runs_in_workers_and_is_stopped_at_its_time(monkeypatch):
    """Section 1 of benchmarks.gpu: the subset in pytest's xdist workers (here one quick test), its
    return code; past its time it is stopped and the row says so."""
    from benchmarks import gpu

    monkeypatch.setattr(gpu, "TEST_SUBSET", ["tests/benchmarks/test_benchmarks.py", "-k", "read_bandwidth_is_bytes", "-q",
                                             "-p", "no:cacheprovider"])
    calls, real = [], gpu.subprocess.call
    monkeypatch.setattr(gpu.subprocess, "call", lambda cmd, env, timeout: (calls.append(env), real(cmd, env=env,
                                                                                                   timeout=timeout))[1])
    row = gpu.test_subset(300)
    assert calls[0]["JAX_DEFAULT_MATMUL_PRECISION"] == "highest" and calls[0]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert row["returncode"] == 0 and " -n " in row["tests"]
    assert gpu.test_subset(0.5)["returncode"] == "stopped after 0 s"


def test_gpu_rows_name_the_cpu_runs_numbers_of_the_same_row():
    """benchmarks.gpu reads the CPU run (k) of docs/results/speed.md for the GPU rows to be compared with: SmolLM2 full
    at 4K is (k)'s row; rows the CPU run lacks get nothing."""
    from benchmarks import gpu

    ref = gpu.cpu_reference("smollm2", "full", 4096)
    row = [json.loads(x) for x in gpu.CPU_RUN.read_text().splitlines()][6]
    assert (row["policy"], row["context"]) == ("full", 4096)
    assert ref["cpu_layers_decode_tok_s"] == row["layers_decode_tok_s"] and ref["cpu_prefill_tok_s"] == row["prefill_tok_s"]
    assert gpu.cpu_reference("smollm2", "quest", 4096) == {} == gpu.cpu_reference("qwen", "full", 4096)
    assert gpu.cpu_reference("smollm2", "full", 16384) == {}


def test_gpu_script_reports_a_failed_measurement_and_goes_on(monkeypatch):
    """A measurement that raises (say, an API of another JAX version) is a row with its error; the
    other policies are still measured."""
    from benchmarks import gpu

    real = gpu.bench_ours

    def flaky(model, tokens, pol, *a, **k):
        if pol == gpu.POLICIES["sink"]():
            raise AttributeError("module 'jax' has no attribute 'something'")
        return real(model, tokens, pol, *a, **k)

    monkeypatch.setattr(gpu, "bench_ours", flaky)
    rows = gpu.main(["--dry-run", "--skip-quest", "--skip-kernels", "--policies", "full", "sink", "int8"])
    by = {r["policy"]: r for r in rows if "policy" in r}
    assert "AttributeError" in by["sink"]["error"] and "scan_roofline" not in by["sink"]
    assert by["full"]["scan_roofline"] > 0 and by["int8"]["scan_roofline"] > 0


def test_gpu_script_starts_nothing_past_its_budget():
    """--budget-s 0: every measurement is a row saying it was skipped, none is run."""
    from benchmarks import gpu

    rows = gpu.main(["--dry-run", "--budget-s", "0"])
    skipped = [r for r in rows if r.get("skipped") == "budget"]
    assert [r.get("policy", r.get("section")) for r in skipped] == [*gpu.POLICIES, "kernels", "quest_gather"]
    assert not any("ms" in r or "scan_roofline" in r for r in rows)


def test_attention_kernels_report_a_kernel_that_computes_something_else(monkeypatch):
    """The kernels' max_abs_diff can fail: without RoPE on their side, XLA's dot_product_attention
    and the Pallas kernel no longer compute ours."""
    import jax.numpy as jnp

    from benchmarks import attention_kernels as ak

    monkeypatch.setattr(ak, "_rotate", lambda table, x, pos: x)
    rows = ak.measure("decode", "qwen", 256, jnp.float32, 1, 1, 8e9, interpret=True)
    by = {r["impl"]: r for r in rows}
    assert by["ours"]["max_abs_diff"] == 0.0
    assert by["sdpa_xla"]["max_abs_diff"] > 0.05 and by["pallas"]["max_abs_diff"] > 0.05


def test_prefill_flops_count_the_weights_the_causal_attention_and_the_last_logits():
    """prefill_flops in closed form from the model's own weight shapes, and against XLA's count of
    the compiled one-chunk prefill. That step computes more pairs than the causal T(T+1)/2: `full`
    hands attention its stored slots (all max_len = T of them, empty, masked) and the T new ones, so
    every query meets 2T keys; the rest of XLA's count is elementwise work. One layer: XLA counts a
    loop's body once."""
    import dataclasses

    import jax.numpy as jnp

    cfg = dataclasses.replace(CFG, n_layers=1, d_model=96, d_ff=192)
    model, t = Llama(cfg), 32
    mats = sum(int(np.prod(v.shape)) for v in model.layers.values() if v.ndim == 3)  # [L, a, b] stacked matrices
    attn = 4 * cfg.n_heads * cfg.head_dim
    assert prefill_flops(cfg, t) == 2 * mats * t + attn * t * (t + 1) // 2 + 2 * cfg.d_model * cfg.vocab_size
    head = 2 * cfg.d_model * cfg.vocab_size
    pairs = sum(min(i + 1, 5) for i in range(t))  # a policy that keeps 5 slots: each query sees at most 5 keys
    assert prefill_flops(cfg, t, span=5) == prefill_flops(cfg, t) - attn * (t * (t + 1) // 2 - pairs)
    assert prefill_flops(cfg, t, span=t) == prefill_flops(cfg, t, span=10 * t) == prefill_flops(cfg, t)
    assert prefill_flops(dataclasses.replace(cfg, n_layers=3), t) - head == 3 * (prefill_flops(cfg, t) - head)
    eng = Engine(model, kvpolicies.get("full"), max_len=t)
    toks = jnp.zeros((1, t), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    xla = eng._logits_step.lower(eng.params, eng.init_cache(1), toks, pos).compile().cost_analysis()
    xla = (xla[0] if isinstance(xla, list) else xla)["flops"]
    computed = prefill_flops(cfg, t) + attn * (t * 2 * t - t * (t + 1) // 2)  # every (query, key) pair of T x 2T
    assert computed <= xla < 1.06 * computed, (xla, computed)  # T x T pairs would give 1.09


def test_matmul_rate_counts_the_matmuls_flops_over_the_best_run(monkeypatch):
    clock = _timed(monkeypatch, [0.5, 0.125, 0.25])
    flops = 2 * 64 * (48 * 96 + 96 * 32)  # [64, a] @ [a, b], a multiply-add = 2 FLOPs
    assert matmul_rate(rows=64, shapes=[(48, 96), (96, 32)], repeats=3) == flops / 0.125 and not clock.ticks


def test_prompt_speed_dry_run_times_every_prompt_phase():
    from benchmarks import prompt_speed

    rows = prompt_speed.main(["--dry-run"])
    assert [r["policy"] for r in rows] == list(prompt_speed.POLICIES)
    assert all(r["prompt_tok_s"] > 0 and r["traces"]["logits"] == 1 for r in rows)  # 64 tokens: one bucket, chunks of 16
    one, = prompt_speed.main(["--dry-run", "--chunk", "0", "--policies", "full"])  # the whole prompt as one chunk
    assert one["chunk"] == 64 and one["traces"]["logits"] == 1 and one["peak_rss_GB"] > 0


def test_attention_ab_dry_run_compares_each_choice_with_the_path_it_replaced():
    from benchmarks import attention_ab

    rows = attention_ab.main(["--dry-run", "--prompt", "--prefill", "--sink", "64"])
    assert [r["measure"] for r in rows[:4]] == ["sink score tok/s, blocks by visibility and segment",
                                                "sink score tok/s, ring first vs sinks first",
                                                "sink chunk s at a full window, softmax over flat rows vs [B, K, G, T, S]",
                                                "decode step ms, sink 4+60 at position 216"]
    assert rows[0]["new"] == rows[1]["new"] > 0 and rows[3]["slots"] == 64 and rows[3]["old"] > 0
    assert rows[2]["new"] > 0 and rows[2]["old"] > 0 and rows[2]["max_logit_diff"] == 0.0  # the same numbers
    rows = rows[4:]
    assert [r["measure"] for r in rows] == ["decode step ms", "16-token chunk s", "chunk step XLA temporaries MB",
                                            "16-token chunk s, blocks by visibility", "snapkv prompt s",
                                            "prefill tok/s, blocks by visibility"]
    assert all(r["new"] > 0 and r["old"] > 0 for r in rows[:2] + rows[3:])
    assert rows[2]["old"] > rows[2]["new"]  # 96 slots in blocks of 8: the blocked step holds less
    import importlib

    assert not hasattr(importlib.import_module("kvpolicies.attend"), "BLOCK")  # no module-level switch to change


def test_sink_chunk_profile_names_the_blocks_ops_with_their_shapes(monkeypatch):
    """benchmarks.decode_profile --sink-chunk on the tiny model (blocks of 8 slots): a steady-state
    chunk's costliest ops from the profiler, each with its compiled shape; a block's logits
    [K, G x tile, block] and its exponentials over [(K G tile), block] rows are among them (a chunk
    of 16 tokens attends in query tiles of block = 8)."""
    from benchmarks import decode_profile
    from kvpolicies.attention import Tuning
    from models.llama import with_tuning

    row = decode_profile.sink_chunk(with_tuning(Llama(CFG), Tuning(block=8)), 24, 16, 2, 200)
    assert row["position"] == 40 and row["step_s"] > 0 and row["ops"]
    assert all(op["ms"] >= 0 and op["calls"] >= 1 for op in row["ops"])
    shapes = {op["shape"].split("{")[0] for op in row["ops"]}
    assert "f32[2,24,8]" in shapes  # a block's logits: K = 2 kv heads, G x 8 = 3 x 8 queries, 8 slots
    assert "f32[48,8]" in shapes  # its softmax over rows: (K G tile) = 48 rows of 8 slots


def test_long_stream_scores_every_chunk_with_one_trace_and_a_constant_state():
    """benchmarks.long_stream on the tiny model, through Engine.score's NLL step: one trace for
    every chunk, the state's bytes unchanged, the last position stored, rates for both tenths."""
    from benchmarks import long_stream

    row = long_stream.stream(4096, 256, kvpolicies.get("sink", n_sink=4, window=252), score=True)
    assert row["traces"] == {"nll": 1} and row["score"]
    assert row["state_bytes"] == row["state_bytes_end"] and row["max_position"] == 4095
    assert row["tok_s_first_10pct"] > 0 and row["tok_s_last_10pct"] > 0


def test_target_ceilings_in_closed_form():
    """The fraction of the roofline a decode DECODE_X x transformers' needs, and of the matmul rate
    a prefill PREFILL_X x transformers' needs, from the same run's rates."""
    from benchmarks.decode_speed import DECODE_X, PREFILL_X, _fractions

    row = dict(weight_bytes=500, kv_read_bytes=100, decode_tok_s=0.5, scan_decode_tok_s=0.4, layers_decode_tok_s=0.6,
               prefill_tok_s=10.0, prefill_gflop_s=30.0, transformers_decode_tok_s=0.2, transformers_prefill_tok_s=8.0)
    alone = {k: v for k, v in row.items() if "transformers" not in k}  # a run without transformers
    r = _fractions(row, bw=1200.0, mm=120e9)  # floor 0.5 s; 3 GFLOP per prefill token
    assert np.isclose(r["roofline_ms"], 500) and np.isclose(r["layers_roofline"], 0.3)
    assert np.isclose(r["roofline_needed"], DECODE_X * 0.2 * 0.5)
    assert np.isclose(r["matmul_needed"], PREFILL_X * 8.0 * 3.0 / 120)
    assert "roofline_needed" not in _fractions(alone, 1200.0, 120e9)


def test_torch_matmul_rate_counts_the_same_flops(monkeypatch):
    from benchmarks.decode_speed import torch_matmul_rate

    clock = _timed(monkeypatch, [0.25, 0.5])
    flops = 2 * 64 * (48 * 96 + 96 * 32)
    assert torch_matmul_rate(rows=64, shapes=[(48, 96), (96, 32)], repeats=2) == flops / 0.25 and not clock.ticks


def test_alternated_step_ratios_run_on_a_tiny_model(monkeypatch):
    """The codec row (int8 before and after RoPE over full, layer by layer) and the host-loop step times behind the
    scaling rows, on a tiny random model. The times are read from a fake clock, so the arithmetic is checked, never
    the machine's speed: a codec step is (long call - 1-step call) / (steps - 1), or the long call's mean when the
    1-step call took longer (noise), its median over the rounds, and its ratio to full's; a host-loop step is the best
    round's time over its steps."""
    from benchmarks import decode_speed
    from benchmarks.decode_speed import bench_codec, step_ms

    ticks, t = [], 0.0
    # bench_codec reads the clock 3 times per engine and round (before the long call, between, after the short):
    # (long, short) seconds for none, int8, int8_after_rope in round 1, then round 2
    for long, short in [(0.050, 0.010), (0.070, 0.010), (0.060, 0.020), (0.050, 0.010), (0.070, 0.010), (0.030, 0.050)]:
        ticks += [t, t + long, t + long + short]
        t += long + short + 1.0
    # step_ms twice per engine and round: full then sink, round 1 then round 2
    for span in (0.006, 0.003, 0.009, 0.0015):
        ticks += [t, t + span]
        t += span + 1.0
    monkeypatch.setattr(decode_speed, "time", SimpleNamespace(perf_counter=lambda: ticks.pop(0)))
    model = Llama(CFG)
    tokens = np.arange(40, dtype=np.int32) % 97
    row = bench_codec(model, tokens, ctx=32, steps=3, chunk=16, rounds=2, codecs=("int8", "int8_after_rope"))
    # none: (50 - 10) / 2 = 20 ms; int8: 30 ms; int8_after_rope: 20 ms, then 10 ms (the long call's mean): median 15
    assert row["context"] == 32 and row["codecs"] == ["none", "int8", "int8_after_rope"]
    assert np.allclose(row["ms"], [20.0, 30.0, 15.0]) and np.isclose(row["ratio"], 1.5)
    assert row["ratios"].keys() == {"int8", "int8_after_rope"} and np.isclose(row["ratios"]["int8_after_rope"], 0.75)
    full, int8, rot = row["kv_read_bytes"]  # the same codes and scales, stored rotated or not
    assert int8 == rot < full / 2
    times = step_ms(model, [(kvpolicies.get("full"), 48, 8), (kvpolicies.get("sink", n_sink=2, window=8), 48, 8)],
                    steps=3, rounds=2)
    assert np.allclose(times, [2.0, 0.5]) and not ticks  # the best round of 3 steps: 6 / 3 ms, 1.5 / 3 ms


def test_speed_table_is_the_saved_run_s_table():
    """The speed table (docs/results/speed.md) is `markdown_table` of the run it cites (docs/results/runs/decode_speed_run_2026-12-02k.jsonl)."""
    import json
    from pathlib import Path

    from benchmarks.decode_speed import markdown_table

    root = Path(__file__).resolve().parents[2]
    run = root / "docs" / "results" / "runs" / "decode_speed_run_2026-12-02k.jsonl"
    page = (root / "docs" / "results" / "speed.md").read_text()
    assert run.name in page
    table = markdown_table([json.loads(line) for line in run.read_text().splitlines()])
    assert table in page
    assert table.count("\n") == 16 and "| 3× transformers at 4K would be, of the roofline | 102 % |" in table
    assert "| kvpolicies full int8 after RoPE |" in table.splitlines()[0]


def test_int4_basis_codec_ranges_are_the_saved_runs():
    """The codec table after the basis reads (docs/results/speed.md) gives, per codec, the range of the three saved
    alternated runs (docs/results/runs/decode_speed_codec_2026-12-02b.jsonl) and the first run's ms."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = [json.loads(line) for line in (root / "docs" / "results" / "runs" / "decode_speed_codec_2026-12-02b.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["impl"] == "codec" and r["context"] == 4096 for r in rows)
    names = ("int8", "int8_after_rope", "int4", "int4_after_rope")
    ranges = [f"{min(r['ratios'][n] for r in rows):.2f}–{max(r['ratios'][n] for r in rows):.2f}×" for n in names]
    cells = " | ".join(f"{x:.1f}" for x in rows[0]["ms"])
    readme = (root / "docs" / "results" / "speed.md").read_text()
    assert f"| ms (first run) | {cells} |" in readme
    assert f"| over `full`'s, three runs | 1 | {ranges[0]} | {ranges[1]} | {ranges[2]} | **{ranges[3]}** |" in readme
    assert max(r["ratios"]["int4_after_rope"] for r in rows) <= 1.3  # the target, in every run


def test_attention_kernels_cpu_table_is_the_saved_run():
    """The CPU table (docs/results/speed.md) of XLA's dot_product_attention against ours is the saved run
    (docs/results/runs/attention_kernels_cpu_2026-12-02.jsonl), and its outputs agreed with ours."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = [json.loads(x) for x in (root / "docs" / "results" / "runs" / "attention_kernels_cpu_2026-12-02.jsonl").read_text().splitlines()]
    by = {(r["phase"], r["context"], r["impl"]): r for r in rows}
    readme = (root / "docs" / "results" / "speed.md").read_text()
    for phase in ("prefill", "decode"):
        ms = " | ".join(f"{by[(phase, c, 'ours')]['ms']:.{1 if phase == 'prefill' else 2}f}" for c in (1024, 4096))
        assert f"| {phase}: `attend`, ms | {ms} |" in readme
        ratio = " | ".join(f"{by[(phase, c, 'sdpa_xla')]['vs_ours']:.2f}×" for c in (1024, 4096))
        assert f"| {phase}: XLA `dot_product_attention` / ours | {ratio} |" in readme
    diffs = " | ".join(f"≤ {max(r['max_abs_diff'] for k, r in by.items() if k[1] == c and 'max_abs_diff' in r):.1e}"
                       for c in (1024, 4096))
    assert f"| outputs, max \\|diff\\| from ours | {diffs} |" in readme
    pallas = [by[("decode", c, "pallas")]["vs_ours"] for c in (1024, 4096)]
    assert f"interpreter times ({min(pallas):.1f}–{max(pallas):.1f}× ours)" in readme
    assert all("cuDNN" in r["error"] for r in rows if r["impl"] == "sdpa_cudnn")


def test_layer_steps_profile_names_each_layers_ops_with_their_shapes():
    """benchmarks.decode_profile --layers on the tiny model: layer-by-layer generation after a
    40-token prompt, its step time and roofline fraction, and its ops per step with their compiled
    shapes: the logits over the 40 + 6 slots [K, S, G], the values' product [K, G, D], the fused
    gate/up projection [1, 2F], each once per layer; the output head once per step. The step time
    is read from a fake clock (a 5-token call of 50/80 ms minus a 2-token call of 20 ms, over the 3
    steps between them): the arithmetic is checked, never the machine's speed."""
    from benchmarks import decode_profile

    ticks = iter([0.0, 0.050, 0.070, 1.0, 1.080, 1.100])  # per round: start, after the long call, after the short
    row = decode_profile.layer_steps(Llama(CFG), kvpolicies.get("full"), 40, 4, 200, rounds=2, clock=lambda: next(ticks))
    assert row["context"] == 40 and len(row["step_ms_rounds"]) == 2
    assert np.allclose(row["step_ms_rounds"], [10.0, 20.0]) and abs(row["step_ms"] - 15.0) < 1e-9
    want = (row["weight_bytes"] + row["kv_read_bytes"]) / (row["read_bandwidth_GB_s"] * 1e9) * 1e3 / row["step_ms"]
    assert abs(row["roofline"] - want) < 1e-9 and row["weight_bytes"] > 0 and row["kv_read_bytes"] > 0
    calls = {op["shape"].split("{")[0]: op["calls"] for op in row["ops"]}
    assert calls["f32[2,46,3]"] == CFG.n_layers  # logits: K = 2 kv heads, 46 slots, G = 3 queries per head
    assert calls["f32[2,3,8]"] == CFG.n_layers  # probabilities x values: [K, G, D]
    assert calls[f"f32[1,{2 * CFG.d_ff}]"] == CFG.n_layers  # h @ [w_gate | w_up]
    assert calls[f"f32[1,{CFG.vocab_size}]"] == 1  # the output head, once per step


def test_kvzap_overhead_dry_run_times_the_three_prefills(tmp_path):
    from benchmarks import kvzap_overhead

    res = kvzap_overhead.main(["--dry-run", "--repeats", "1", "--out", str(tmp_path / "o.json")])
    assert json.loads((tmp_path / "o.json").read_text()) == res
    assert res["model"] == "tiny_random" and res["surrogate"] == "random" and res["budget"] == 128
    assert min(res["full_s"], res["kvzap_s"], res["kvzip_s"]) > 0
    assert res["kvzap_over_prefill"] > 0 and res["kvzip_over_prefill"] > 0  # (ratios of unrounded times)


def test_kvzap_overhead_table_is_the_saved_runs():
    """docs/guide/kvzap.md's overhead table is `markdown_table` of the runs it cites."""
    from pathlib import Path

    from benchmarks.kvzap_overhead import markdown_table

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "guide" / "kvzap.md").read_text()
    names = ["kvzap_overhead_smollm2_2048.json", "kvzap_overhead_qwen_2048.json"]
    assert all(n in page for n in names)
    runs = [json.loads((root / "docs" / "results" / "runs" / n).read_text()) for n in names]
    assert markdown_table(runs) in page


def test_kvzap_fit_dry_run_stores_less_than_the_static_pool():
    """`--fit` on the tiny model: at each threshold the fitted bytes (checked against the closed
    form inside the benchmark) are below the static pool's; the fixed ratio at the achieved ratio
    is sized from the same kept tokens per head; the layers' bytes add up; at these ratios (0.4
    and 0.77) the sparse prefill holds fewer bytes at once than the dense prompt phase and the
    fixed ratio's pools."""
    from benchmarks import kvzap_overhead

    res = kvzap_overhead.main(["--dry-run", "--thresholds=0,1", "--fit", "--max-new", "8"])
    assert [r["threshold"] for r in res["rows"]] == [0.0, 1.0]
    for r in res["rows"]:
        assert r["fitted_bytes"] < r["static_bytes"] and sum(r["fitted_layer_bytes"]) == r["fitted_bytes"]
        assert abs(r["fixed_ratio_bytes"] - r["fitted_bytes"]) < 0.05 * r["fitted_bytes"]
        assert r["alive_sparse"] < r["alive_fixed_ratio"] and 0 < r["sparse_ratio"] < 1
    assert [r["ratio"] for r in res["rows"]] == sorted(r["ratio"] for r in res["rows"])  # higher threshold, fewer kept


def test_kvzap_fit_table_is_the_saved_run():
    """docs/guide/kvzap.md's fitted-bytes table is `fit_table` of the run it cites."""
    from pathlib import Path

    from benchmarks.kvzap_overhead import fit_table

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "guide" / "kvzap.md").read_text()
    assert "kvzap_fit_smollm2_2048.json" in page
    assert fit_table(json.loads((root / "docs" / "results" / "runs" / "kvzap_fit_smollm2_2048.json").read_text())) in page


def test_compressed_decode_dry_run_times_every_press_against_full():
    """benchmarks.compressed_decode on the tiny model: a row per press (kvpress's protocol through
    compat, kvzip's reconstruction included) with its times over full's from the same run. Three
    presses of the default list, one per kind of state it decodes: a prompt scorer's, AdaKV's head
    pool, kvzip's (each press's own decoding is checked in tests/kvpolicies)."""
    from benchmarks.compressed_decode import DEFAULT_PRESSES, main

    presses = ["SnapKVPress", "AdaKVPress", "KVzipPress"]
    assert set(presses) <= set(DEFAULT_PRESSES)
    rows = main(["--dry-run", "--presses", *presses])
    assert [r["press"] for r in rows] == ["full"] + presses
    full = rows[0]
    for r in rows[1:]:
        assert r["question_s"] > 0 and r["generate_s"] > 0
        assert r["question_vs_full"] == r["question_s"] / full["question_s"]
        assert r["generate_vs_full"] == r["generate_s"] / full["generate_s"]


def test_the_peer_speed_tables_are_their_runs():
    """docs/results/speed.md's kvpress-protocol tables are the saved benchmarks.peer_speed and
    benchmarks.first_call runs' numbers (docs/results/runs/peer_speed_*.json, first_call_*.json)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = root / "docs" / "results" / "runs"
    text = (root / "docs" / "results" / "speed.md").read_text()
    before, after, qwen = (json.loads((runs / f"peer_speed_{n}.json").read_text())
                           for n in ("smollm2_before", "smollm2_after", "qwen_after"))
    for label, k in (("first sample (s)", "first"), ("steady state, per sample (s)", "steady"), ("whole grid (s)", "total")):
        kv, b, a = after["sides"]["kvpress"][k], before["sides"]["ours"][k], after["sides"]["ours"][k]
        bk = before["sides"]["kvpress"][k]
        assert f"| {label} | {kv:.1f} | {b:.1f} | {a:.1f} | {b / bk:.2f} | {a / kv:.2f} |" in text
        q, qk = qwen["sides"]["ours"][k], qwen["sides"]["kvpress"][k]
        assert f"| {label} | {qk:.1f} | {q:.1f} | {q / qk:.2f} |" in text
    for ph in ("prefill", "compress", "question", "decode"):
        kv, ours = after["sides"]["kvpress"]["phases"][ph], after["sides"]["ours"]["phases"][ph]
        assert f"| {kv:.1f} | {ours:.1f} | {ours / kv:.2f} |" in text, ph
    assert f"{after['sides']['ours']['phases']['compile']:.1f} ({int(after['sides']['ours']['phases']['programs'])} programs)" in text
    calls = {(r["press"], r["mode"]): r for r in json.loads((runs / "first_call_smollm2_1024.json").read_text())}
    for (press, mode), r in calls.items():
        assert f"| {r['layers_policies']} | {r['first']:.2f} | {r['second']:.2f} |" in text, (press, mode)
    assert calls[("PyramidKVPress", "slots")]["first"] <= 2 * calls[("SnapKVPress", "exact")]["first"]
