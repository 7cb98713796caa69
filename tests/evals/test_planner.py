"""The capacity planner (evals/planner.py): the published arithmetic of KV-cache capacity planning,
reproduced exactly from the policies' real state shapes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import kvpolicies
from evals.planner import (
    GB,
    PRESETS,
    fmt_bytes,
    kv_bytes,
    main,
    parse_context,
    parse_policy,
    plan,
    read_hf_config,
)
from kvpolicies.memory import closed_form_bytes

L8, K8, D8 = 32, 8, 128  # Llama-3-8B: layers, kv heads, head dim


def test_preset_parameter_counts():
    # The published parameter counts, recomputed from the architectures' tensor shapes.
    want = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
            "qwen2-7b": 7_615_616_512, "smollm2-135m": 134_515_008,
            "llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360}  # the leaderboard's two models
    assert {k: m.params for k, m in PRESETS.items()} == want
    shapes = {k: (m.n_layers, m.kv_heads, m.head_dim) for k, m in PRESETS.items()}
    assert shapes == {"llama-3-8b": (32, 8, 128), "llama-3-70b": (80, 8, 128), "mistral-7b": (32, 8, 128),
                      "qwen2-7b": (28, 4, 128), "smollm2-135m": (30, 3, 64), "llama-3.1-8b": (32, 8, 128),
                      "qwen3-8b": (36, 8, 128)}
    assert fmt_bytes(PRESETS["llama-3-8b"].weight_bytes) == "16.1 GB"  # "16 GB of weights"


def test_llama3_8b_1k_and_128k():
    one_k = kv_bytes("llama-3-8b", 1024)
    assert one_k.kv == 134_217_728 == 2 * L8 * K8 * D8 * 1024 * 2
    assert (fmt_bytes(one_k.kv), fmt_bytes(one_k.kv, binary=True)) == ("134 MB", "128 MiB")
    assert one_k.scales == 0 and one_k.meta == L8 * 1024 * 4  # one int32 position per slot and layer
    big = kv_bytes("llama-3-8b", 131072)
    assert big.kv == 17_179_869_184 and fmt_bytes(big.kv) == "17.2 GB"
    assert fmt_bytes(big.kv, binary=True) == "16.0 GiB"


def test_mha_is_four_times_gqa():
    mha = dataclasses.replace(PRESETS["llama-3-8b"], kv_heads=32)
    gqa, full_mha = kv_bytes("llama-3-8b", 131072), kv_bytes(mha, 131072)
    assert full_mha.kv == 4 * gqa.kv == 68_719_476_736
    assert fmt_bytes(full_mha.kv) == "68.7 GB"


def test_int8_halves_the_codes_and_adds_scales():
    bf16 = kv_bytes("llama-3-8b", 131072)
    slots_x_heads = 2 * L8 * K8 * 131072  # keys and values, every slot and kv head
    if "int8" in kvpolicies.CODECS:
        q = kv_bytes("llama-3-8b", 131072, "full:codec=int8")
        assert q.codes == bf16.kv // 2 == 8_589_934_592
        assert q.scales == slots_x_heads * 4  # one float32 absmax scale per token and kv head
        assert q.kv == q.codes + q.scales and q.meta == bf16.meta
    else:  # the codec is not registered: the closed form with one byte per element
        codes = closed_form_bytes(n_layers=L8, kv_heads=K8, head_dim=D8, slots=131072, bytes_per_elem=1)
        assert codes == bf16.kv / 2


def test_80gb_gpu_examples():
    # 80 GB GPU, 16 GB of weights, 10-15 GB overhead.
    for overhead in (10, 15):
        short = plan("llama-3-8b", 8192, 80, overhead, ["full"], batch=8)[0]
        assert short["batch_bytes"] == 8 * (2 * L8 * K8 * D8 * 8192 * 2 + L8 * 8192 * 4)
        assert round(short["batch_bytes"] / GB, 1) == 8.6 and short["batch_fits"]
        long = plan("llama-3-8b", 32768, 80, overhead, ["full"], batch=8)[0]
        assert round(long["batch_bytes"] / GB) == 34 and long["batch_fits"]
        # "nears the limit": at most 4 more such requests fit (11 at 15 GB overhead, 12 at 10 GB).
        assert long["max_requests"] == {10: 12, 15: 11}[overhead]
    assert not plan("llama-3-8b", 32768, 80, 15, ["full"], batch=12)[0]["batch_fits"]


def test_requests_that_fit_closed_form():
    gpu, overhead, ctx = 80, 12, 32768
    rows = plan("llama-3-8b", ctx, gpu, overhead, ["full", "sink:window=4096", "window:window=8192", "full:codec=int8"])
    available = gpu * GB - 2 * 8_030_261_248 - overhead * GB
    slots = [ctx, 4 + 4096, 8192, ctx]
    for row, s in zip(rows, slots):
        assert row["slots"] == s and row["available_bytes"] == available
        code_bytes = 1 if "int8" in row["policy"] else 2
        kv = closed_form_bytes(n_layers=L8, kv_heads=K8, head_dim=D8, slots=s, bytes_per_elem=code_bytes)
        kv += 2 * L8 * K8 * s * 4 if code_bytes == 1 else 0  # int8 scales
        per = int(kv) + L8 * s * 4
        assert row["bytes_per_request"] == per
        assert row["max_requests"] == available // per == math.floor(available / per)
        assert row["total_bytes"] == row["max_requests"] * per <= available < (row["max_requests"] + 1) * per
    assert [r["max_requests"] for r in rows] == [12, 96, 48, 23]


def test_window_and_sink_cap_the_cache():
    for spec, cap in (("window:window=4096", 4096), ("sink:n_sink=4,window=4092", 4096)):
        capped = {c: kv_bytes("llama-3-8b", c, spec).total for c in (4096, 8192, 131072, 1 << 20)}
        assert len(set(capped.values())) == 1  # independent of context beyond the window
        assert capped[4096] == kv_bytes("llama-3-8b", 4096).total  # = a full cache of W tokens
        assert kv_bytes("llama-3-8b", 2048, spec).total == kv_bytes("llama-3-8b", 2048).total < capped[4096]


def test_hf_config_json(tmp_path):
    llama3 = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama3))
    for where in (tmp_path, tmp_path / "config.json"):
        m = read_hf_config(where)
        assert (m.n_layers, m.kv_heads, m.head_dim, m.params) == (32, 8, 128, 8_030_261_248)
    assert kv_bytes(str(tmp_path / "config.json"), 1024).kv == 134_217_728

    # Qwen3-8B's config.json: q/k-norm weights ([L, D] each) counted, the published 8,190,735,360
    qwen3 = {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
             "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "sliding_window": None,
             "use_sliding_window": False, "max_position_embeddings": 40960}
    (tmp_path / "qwen3.json").write_text(json.dumps(qwen3))
    m = read_hf_config(tmp_path / "qwen3.json")
    assert (m.n_layers, m.kv_heads, m.head_dim, m.params) == (36, 8, 128, 8_190_735_360)
    (tmp_path / "as_llama.json").write_text(json.dumps(qwen3 | {"model_type": "llama"}))  # no q/k-norm
    assert m.params - read_hf_config(tmp_path / "as_llama.json").params == 2 * 36 * 128  # q_norm, k_norm [L, D]
    (tmp_path / "act.json").write_text(json.dumps(qwen3 | {"hidden_act": "gelu"}))  # the loader refuses it
    assert read_hf_config(tmp_path / "act.json").params is None

    # MHA (no num_key_value_heads), explicit head_dim, unknown architecture: weights must be given.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "gemma", "num_hidden_layers": 4, "num_attention_heads": 6,
                                 "hidden_size": 100, "head_dim": 32}))
    m = read_hf_config(other)
    assert (m.n_layers, m.kv_heads, m.head_dim, m.params) == (4, 6, 32, None)
    with pytest.raises(ValueError, match="weights_gb"):
        plan(m, 1024, 80, 10)
    row = plan(m, 1024, 80, 10, weights_gb=1)[0]
    assert row["kv_bytes"] == 2 * 4 * 6 * 32 * 1024 * 2 and row["available_bytes"] == 69 * GB

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        read_hf_config(bad)


def test_policy_specs():
    p = parse_policy("sink:n_sink=8,window=1024")
    assert (type(p).__name__, p.n_sink, p.window) == ("Sink", 8, 1024)
    if "int4" in kvpolicies.CODECS:
        assert parse_policy("full:codec=int4,codec.group=64").codec.group == 64
    with pytest.raises(ValueError, match="must be one of"):
        parse_policy("nope")
    with pytest.raises(ValueError, match="no field"):
        parse_policy("window:windw=3")
    with pytest.raises(ValueError, match="field=value"):
        parse_policy("window:4096")
    assert parse_context("32K") == 32768 and parse_context("128k") == 131072 and parse_context("1000") == 1000


def test_cli(capsys, tmp_path):
    argv = ["--model", "llama-3-8b", "--context", "32768", "--gpu-gb", "80", "--overhead-gb", "12",
            "--policy", "full", "sink:window=4096", "window:window=8192", "full:codec=int8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("---")) + 1:]
    rows = {line.split()[0]: line.split() for line in table}
    assert list(rows) == ["full", "sink:window=4096", "window:window=8192", "full:codec=int8"]
    assert "51.9 GB for the cache" in out and "8,030,261,248 params" in out
    assert rows["full"][1:3] == ["32,768", "4.29"] and "12" in rows["full"]
    assert rows["sink:window=4096"][1] == "4,100" and "96" in rows["sink:window=4096"]
    assert rows["window:window=8192"][1] == "8,192" and "48" in rows["window:window=8192"]
    assert "23" in rows["full:codec=int8"] and "67.1" in rows["full:codec=int8"]  # its scales, in MB

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    assert main(["--config", str(tmp_path), "--weights-gb", "0.27", "--context", "8K", "--gpu-gb", "24",
                 "--overhead-gb", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "30 layers x 3 kv heads x head_dim 64" in out and "4 requests" in out

    assert main(["--policy", "bogus"]) == 1  # an error row (every row: exit 1), not an abort
    assert "bogus: error: policy 'bogus': not registered; must be one of" in capsys.readouterr().out


def test_paged_numbers_against_the_closed_form():
    """`plan(..., block=16, shared_prefix=2048)`: a block of all layers is keys + values of 16
    tokens, their int32 positions and an int32 refcount; a request holds ceil(context / 16)
    blocks (full) or 1 sink block + ceil((W - 2) / 16) + 1 window blocks (sink), plus its table;
    a shared prefix's blocks are stored once (a sink at 8K has only its sink block left of it)."""
    from evals.planner import paged_bytes

    rows = plan("llama-3-8b", 8192, 80, 12, ["full", "sink:window=4096", "h2o"], block=16, shared_prefix=2048)
    full, sink, h2o = rows
    blk = L8 * (2 * K8 * 16 * D8 * 2 + 16 * 4 + 4)
    assert full["paged_block_bytes"] == sink["paged_block_bytes"] == blk == 2_099_328
    per = 512 * blk + L8 * 512 * 4  # 512 blocks + a table of 512 entries
    assert (full["paged_blocks"], full["paged_bytes_per_request"], full["paged_unwritten_slots"]) == (512, per, 0)
    avail = full["available_bytes"]
    assert full["paged_max_requests"] == (avail - 4 * L8) // per == full["max_requests"] == 48
    assert full["paged_shared_blocks"] == 128
    assert full["paged_max_requests_shared"] == (avail - 128 * blk - 4 * L8) // (per - 128 * blk) == 64
    assert sink["paged_blocks"] == 1 + math.ceil((4096 - 2) / 16) + 1 == 258
    assert sink["paged_bytes_per_request"] == 258 * blk + L8 * (1 + (4096 - 1) // 16 + 2) * 4
    assert sink["paged_shared_blocks"] == 1 and sink["paged_max_requests_shared"] >= sink["paged_max_requests"]
    assert h2o["paged_blocks"] is None and h2o["paged_max_requests"] is None  # no paged layout
    odd = paged_bytes("llama-3-8b", 1000, "full:codec=int8", 16)
    assert (odd.blocks, odd.unwritten) == (63, 63 * 16 - 1000)
    assert odd.block_bytes == L8 * (2 * K8 * 16 * (D8 + 4) + 16 * 4 + 4)  # int8 codes + a float32 scale per token


def test_paged_cli_columns(capsys):
    assert main(["--model", "llama-3-8b", "--context", "8K", "--block", "16", "--shared-prefix", "2K",
                 "--policy", "full", "h2o"]) == 0
    out = capsys.readouterr().out
    assert "blocks of 16" in out and "fit (shared 2,048)" in out
    line = next(x for x in out.splitlines() if x.startswith("full "))
    assert line.split()[-6:] == ["512", "0", "1.07", "GB", "48", "64"]  # blocks, unwritten, bytes, fits
    assert next(x for x in out.splitlines() if x.startswith("h2o ")).split()[-5:] == ["-"] * 5
    with pytest.raises(SystemExit):
        main(["--shared-prefix", "2K"])  # needs --block


# -- issue 38: equal memory, error rows, refused settings --------------------------------------------


@pytest.mark.parametrize("budget", [0.25, 0.125, 200])
def test_planner_budget_sizes_every_policy_as_evals_run_does(budget):
    """`--budget b` resolves each policy to exactly what `evals.run budget=b` builds for SmolLM2
    (float32) at the same length: the same fields, max_new lowered alike."""
    from evals import config as C

    names = ["window", "sink", "h2o", "tova", "snapkv"]
    rows = plan("smollm2-135m", 1024, 80, 12, names, dtype="float32", budget=budget)
    for name, row in zip(names, rows):
        conf = C.validate(C.compose([f"policy={name}", f"budget={budget}", "tokens=1024"]))
        pol, sizing = C.resolve_policy(conf)
        assert row["resolved"] == planner_label(pol), name
        assert row["bytes_per_request"] == sizing["stored_bytes"] * 30  # per layer x 30 layers
        assert row["sizing"].startswith("sized")


def planner_label(pol):
    from evals.planner import label_of

    return label_of(pol)


def test_planner_error_rows_unsized_notes_and_spec_budgets(capsys):
    rows = plan("smollm2-135m", 1024, 80, 12, ["duo", "full", "sink:budget=0.25", "snk"], dtype="float32",
                budget=0.5)
    assert "error" in rows[0] and "error" in rows[3] and "did you mean 'sink'" in rows[3]["error"]
    assert rows[1]["sizing"] == "not sized: full has no token budget"
    assert rows[2]["resolved"] == "sink:window=252"  # its own budget=0.25 wins over --budget 0.5
    assert main(["--model", "smollm2-135m", "--context", "1024", "--budget", "0.25", "--policy", "sink", "duo"]) == 0
    out = capsys.readouterr().out
    assert "resolved as" in out and "duo: error:" in out and "the KV cache only" in out.split("---")[0]


@pytest.mark.parametrize("bad", [["--gpu-gb", "-80"], ["--gpu-gb", "0"], ["--overhead-gb", "-1"],
                                 ["--gpu-gb", "10"], ["--budget", "1.5"], ["--model", "lama-3-8b"]])
def test_planner_refuses_impossible_settings(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1].startswith("python -m evals.planner: error:")
    if bad[0] == "--model":
        assert "did you mean 'llama-3-8b'" in err
