"""kvpress 0.5.5's RestoreKVPress beside `kvpolicies.compat.kvpress("RestoreKVPress", ...)` with the SAME arrays
(restore embeddings and LoRA, seeded random here; `evals.train_restorekv` trains real ones): kvpress runs in a
subprocess with its own transformers (evals/kvpress_worker.py, through tests/conftest.py's `kvpress_ref`), its hub
download replaced by our arrays and PEFT's LoRA forward set on the torch modules (`kvpress_worker.given_lora`); ours
runs `Engine.prompt` -> `models.lora.restore` -> `compress`. Kept positions per (layer, kv head), the restore slots
included, and the greedy answer must be identical."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import pytest

from kvpolicies.compat import kvpress
from kvpolicies.memory import tree_nbytes
from kvpolicies.restorekv import LORA_MODULES, RestoreKV, load_restore, save_restore
from models import lora
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf
from models.tokenizer import ByteTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
pytestmark = [pytest.mark.ref, pytest.mark.kvpress, pytest.mark.skipif(
    not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")]

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW, N_RESTORE, RANK = 320, 8, 6, 8, 4
FULL = os.environ.get("KVP_KVPRESS_FULL") == "1"  # every case (suite time: kvpress's default on the tiny Llama)
# (kind, ratio, layerwise): kvpress's default (one choice over all layers); layerwise and the tiny Qwen2 with FULL
CASES = [("llama", 0.5, False)] + ([("llama", 0.75, True), ("qwen2", 0.5, False)] if FULL else [])

def restore_arrays(path: pathlib.Path, cfg: dict, seed: int = 0) -> pathlib.Path:
    """Seeded random restore embeddings [n, d] and a rank-4 LoRA (alpha 8) on every projection of the tiny model,
    large enough to move the restore tokens' keys (kvpolicies.restorekv's file format)."""
    rng = np.random.default_rng(seed)
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kd = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    dims = {"wq": (d, d), "wk": (d, kd), "wv": (d, kd), "wo": (d, d), "w_gate": (d, f), "w_up": (d, f),
            "w_down": (f, d)}
    a = {k: rng.normal(0, i ** -0.5, (n, RANK, i)).astype(np.float32) for k, (i, o) in dims.items()}
    b = {k: rng.normal(0, 0.05, (n, o, RANK)).astype(np.float32) for k, (i, o) in dims.items()}
    return save_restore(path, rng.normal(0, 1.0, (N_RESTORE, d)), a, b, alpha=8.0)


@pytest.fixture(scope="module", params=sorted({kind for kind, _, _ in CASES}))
def tiny_run(request, tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, the arrays file, kvpress's results) for one tiny architecture."""
    tmp = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(3)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    arrays = restore_arrays(tmp / "restore.npz", TINY)
    cases = [(r, lw) for kind, r, lw in CASES if kind == request.param]
    job = {"checkpoint": None, "save_to": str(tmp / "ckpt"),
           "tiny": {"kind": request.param, "seed": 0,
                    "config": dict(TINY, tie_word_embeddings=request.param == "qwen2")},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW, "tokenizer": "ascii",
           "presses": [["RestoreKVPress", r, {"restore_model_name": str(arrays), "layerwise": lw}] for r, lw in cases]
           + [["KVzipPress", round(r + N_RESTORE / N_CTX, 6), {"layerwise": lw}] for r, lw in cases[:1]]}
    ref = kvpress_ref.job(job, tmp)
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, arrays, ref


def ours(model, ratio: float, layerwise: bool, ctx, question, arrays):
    """(kept positions, answer, the compressed state, the restore slots' values [L, K, n, D] after the pass)."""
    pol = kvpress("RestoreKVPress", ratio, max_new=16, restore_model_name=str(arrays), layerwise=layerwise)
    eng = Engine(model, pol, max_len=N_CTX + N_RESTORE + N_Q + N_NEW, repeat=ByteTokenizer())
    restored = lora.restore(eng, eng.prompt(ctx[None]))
    values = np.asarray(restored.cache[0].v)[:, 0, :, N_CTX:N_CTX + N_RESTORE]  # one run of 3 layers: [L, K, n, D]
    state = eng.compress(restored)
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
    return kept, eng.continue_generate(state, question[None], N_NEW)[0].tolist(), state, values


@pytest.mark.parametrize("ratio,layerwise", sorted({(r, lw) for _, r, lw in CASES}))
def test_restorekv_keeps_kvpress_positions_and_answers(tiny_run, ratio, layerwise, request):
    """The context's pairs removed at r + n / t (over all layers, or per layer), the restore slots t..t+n-1 kept in
    every head, the question at t + n: the same kept positions and answer as kvpress's RestoreKVPress."""
    kind = request.node.callspec.params["tiny_run"]
    if (kind, ratio, layerwise) not in CASES:
        pytest.skip("checked on the other architecture (suite time)")
    model, ctx, question, arrays, ref = tiny_run
    want = ref[f"RestoreKVPress@{ratio}"]
    assert "error" not in want, want
    kh, nl = model.cfg.n_kv_heads, model.cfg.n_layers
    removed = int(kh * N_CTX * min(1.0, ratio + N_RESTORE / N_CTX)) * (1 if layerwise else nl)
    sizes = [sum(map(len, layer)) for layer in want["kept"]]
    if layerwise:
        assert sizes == [kh * (N_CTX + N_RESTORE) - removed] * nl
    else:
        assert sum(sizes) == nl * kh * (N_CTX + N_RESTORE) - removed and len(set(sizes)) > 1
    restored = list(range(N_CTX, N_CTX + N_RESTORE))
    assert all(h[-N_RESTORE:] == restored for layer in want["kept"] for h in layer)
    kept, answer, state, values = ours(model, ratio, layerwise, ctx, question, arrays)
    # the restore tokens' values, every layer (the LoRA-adapted pass: kvpress adds PEFT's product, we merge)
    np.testing.assert_allclose(values, np.asarray(want["restore_values"]), rtol=1e-4, atol=2e-5)
    pairs = [(g, w) for gl, wl in zip(kept, want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    for i, (g, w) in enumerate(pairs):
        assert g == w, (ratio, layerwise, divmod(i, kh), sorted(set(g) ^ set(w))[:10])
    assert answer == want["answer"]
    # bytes: kvpress holds every context token and the restore tokens in every head (it masks); ours holds the
    # head pool: all layers at full size for kvpress's default (layers keep different counts), each layer's
    # share when layerwise
    d = model.cfg.head_dim
    assert want["cache_bytes"] == nl * kh * (N_CTX + N_RESTORE) * 2 * d * 4
    mine = tree_nbytes(state.cache)
    s = state.cache[0].pos.shape[-1]  # the pool's slots per kv head: max_len (one choice over all layers), else
    assert s == (N_CTX + N_RESTORE + N_Q + N_NEW if not layerwise else  # the layer's share + 1 + max_new
                 int(np.ceil((N_CTX + N_RESTORE + N_Q + N_NEW) * (1 - ratio))) + 1 + 16)
    assert mine == nl * kh * s * (2 * d * 4 + 4 + 4)  # keys, values, positions, scores
    if layerwise:  # each layer's share stored: fewer bytes than kvpress, which masks
        assert mine < want["cache_bytes"]


def test_restore_pass_is_lora_adapted_and_kvzip_s_choice_budget_matched(tiny_run):
    """What the restore pass adds, on kvpress's side: its tokens' layer-0 values are the numpy oracle's
    rmsnorm(E) (W_v + (alpha / r) A^T B^T), not the unadapted ones; and the context pairs it keeps are those
    of KVzipPress at the budget-matched ratio r + n / t (the scores are the context's alone)."""
    model, ctx, question, arrays, ref = tiny_run
    ratio, layerwise = next((r, lw) for _, r, lw in CASES)
    want = ref[f"RestoreKVPress@{ratio}"]
    zip_ = ref[f"KVzipPress@{round(ratio + N_RESTORE / N_CTX, 6)}"]
    assert [[h[:-N_RESTORE] for h in layer] for layer in want["kept"]] == zip_["kept"]
    a = load_restore(str(arrays))
    e = a["embeddings"].astype(np.float64)
    w = {k: np.asarray(v[...], np.float64)[0] for k, v in model.layers.items()}
    h = e / np.sqrt((e * e).mean(-1, keepdims=True) + model.cfg.norm_eps) * w["attn_norm"]  # [n, d]
    delta = (a["alpha"] / RANK) * a["lora_A"]["wv"][0].T.astype(np.float64) @ a["lora_B"]["wv"][0].T  # [d, K D]
    bias = w.get("bv", 0.0)
    kh, d = model.cfg.n_kv_heads, model.cfg.head_dim
    got = np.asarray(want["restore_values"][0])  # [K, n, D]
    oracle = (h @ (w["wv"] + delta) + bias).reshape(N_RESTORE, kh, d).transpose(1, 0, 2)
    plain = (h @ w["wv"] + bias).reshape(N_RESTORE, kh, d).transpose(1, 0, 2)
    np.testing.assert_allclose(got, oracle, rtol=1e-4, atol=1e-5)
    assert np.abs(got - plain).max() > 100 * 1e-5


def test_merged_lora_is_peft_s_sum():
    """`models.lora.merge`: h (W + (alpha / r) A^T B^T) equals PEFT's h W + (alpha / r) (h A^T) B^T (float64 oracle)
    to float32 rounding, per layer of a stacked weight."""
    rng = np.random.default_rng(0)
    w, a, b = rng.normal(size=(2, 24, 40)), rng.normal(size=(2, 3, 24)), rng.normal(size=(2, 40, 3))
    h = rng.normal(size=(5, 24))
    merged = lora.merge({"wq": w.astype(np.float32)}, {"wq": a.astype(np.float32)}, {"wq": b.astype(np.float32)}, 6.0)
    for layer in range(2):
        peft = h @ w[layer] + (6.0 / 3) * (h @ a[layer].T) @ b[layer].T
        np.testing.assert_allclose(h @ merged["wq"][layer], peft, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        lora.merge({"wq": w}, {"wq": a[:, :, :5]}, {"wq": b}, 1.0)


def test_restorekv_refuses_clearly(tmp_path):
    """Errors before any compute: no arrays file, a missing file, kvzip+ normalization, a restore pass on an
    engine without restorekv, on a compressed state, without room for the restore tokens (compress without the
    restore pass: tests/evals/test_train_restorekv.py, whose engine has a prompt)."""
    from models.config import LlamaConfig
    from models.engine import Prompted

    with pytest.raises(ValueError, match="restore_model_name"):
        kvpress("RestoreKVPress", 0.5)
    with pytest.raises(NotImplementedError, match="kvzip_plus_normalization"):
        kvpress("RestoreKVPress", 0.5, restore_model_name="x.npz", kvzip_plus_normalization=True)
    with pytest.raises(ValueError, match="no such file"):
        RestoreKV(ratio=0.5, restore=str(tmp_path / "none.npz")).n_restore
    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48)
    model = Llama(cfg)
    arrays = restore_arrays(tmp_path / "r.npz", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                     num_attention_heads=2, num_key_value_heads=1))
    assert set(load_restore(str(arrays))["lora_A"]) == set(LORA_MODULES)
    eng = Engine(model, kvpress("RestoreKVPress", 0.5, max_new=8, restore_model_name=str(arrays)), max_len=64,
                 repeat=ByteTokenizer())
    state = Prompted(cache=(), length=60, logits=None, compressed=False, tokens=np.zeros((1, 60), np.int32))
    with pytest.raises(ValueError, match="max_len"):
        lora.restore(eng, state)
    with pytest.raises(ValueError, match="uncompressed"):
        lora.restore(eng, dataclasses.replace(state, compressed=True))
    with pytest.raises(ValueError, match="no layer of this engine restores"):
        lora.restore(Engine(model, kvpress("KVzipPress", 0.5), max_len=64, repeat=ByteTokenizer()), state)


def test_engine_runs_the_restore_pass(tmp_path):
    """`Engine.generate`, `prefill` and `compress` over RestoreKVPress run the restore pass themselves (the
    `kvpolicies.prompt.Appends` hook): the same greedy ids, kept positions per (layer, kv head) and decode cache as
    the by-hand sequence `compress(lora.restore(prompt))` checked beside kvpress above, for kvpress's default and
    layerwise; a restored state is not restored twice, and more prompt after the restore tokens is refused."""
    from models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48)
    model = Llama(cfg)
    arrays = restore_arrays(tmp_path / "r.npz", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                     num_attention_heads=2, num_key_value_heads=1))
    t, n_new = 40, 5
    ctx = np.random.default_rng(7).integers(0, 128, (1, t))
    for layerwise in (False, True):
        eng = Engine(model, kvpress("RestoreKVPress", 0.5, max_new=8, restore_model_name=str(arrays),
                                    layerwise=layerwise), max_len=t + N_RESTORE + n_new, repeat=ByteTokenizer())
        prompt = eng.prompt(ctx)
        restored = lora.restore(eng, prompt)
        assert restored.length == t + N_RESTORE and lora.restore(eng, restored).length == t + N_RESTORE
        by_hand = eng.compress(restored)
        auto = eng.compress(prompt)  # the engine's restore pass
        assert by_hand.length == auto.length == t + N_RESTORE
        want = [[h.tolist() for h in layer] for layer in eng.kept_positions(by_hand)]
        assert [[h.tolist() for h in layer] for layer in eng.kept_positions(auto)] == want
        assert all(h[-N_RESTORE:] == list(range(t, t + N_RESTORE)) for layer in want for h in layer)
        assert sum(map(len, want[0] + want[1])) < 2 * (t + N_RESTORE)  # some context pairs removed
        _, cache = eng.prefill(ctx)
        assert int(cache.length[0]) == t + N_RESTORE
        for got, ref in zip(cache.runs, by_hand.cache, strict=True):
            np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(ref.pos))
            np.testing.assert_array_equal(np.asarray(got.v), np.asarray(ref.v))
        ids = eng.generate(ctx, n_new)
        assert ids.tolist() == eng.continue_generate(by_hand, np.zeros((1, 0), np.int32), n_new).tolist()
        assert ids.tolist() == eng.generate([ctx[0]], n_new).tolist()  # a ragged batch of one row
        with pytest.raises(ValueError, match="appends"):
            eng.extend_prompt(restored, ctx[:, :2])
    with pytest.raises(ValueError, match="max_len"):
        eng.generate(ctx, n_new + 1)


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, kvpress_ref):
    """SmolLM2 (float32) on the 1,024-token text with a needle of test_kvpress_parity.py, seeded random restore
    arrays of its shape (or RESTOREKV_ARRAYS: a file of evals.train_restorekv), kvpress's RestoreKVPress at 0.5."""
    from evals.data import default_text
    from models.loading import load_default_model, smollm2_gguf_path

    model, tok = load_default_model()
    text = default_text()[20000:24000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:1024]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    tmp = tmp_path_factory.mktemp("smollm2_restore")
    c = model.cfg
    arrays = os.environ.get("RESTOREKV_ARRAYS") or restore_arrays(tmp / "restore.npz", dict(
        hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads))
    path = smollm2_gguf_path()
    job = {"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
           "question": question.tolist(), "n_new": 12,
           "presses": [["RestoreKVPress", 0.5, {"restore_model_name": str(arrays)}]]}
    return model, ctx, question, arrays, kvpress_ref.job(job, tmp, timeout=3600)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="KVP_KVPRESS_FULL=1 only (SmolLM2's kvzip passes on both sides: minutes)")
def test_smollm2_restorekv_equals_kvpress(smollm2_run):
    """SmolLM2, 1,024 tokens, RestoreKVPress at 0.5 (kvpress's default): kept-set Jaccard per (layer, kv head) and
    the same 12 greedy tokens as kvpress."""
    model, ctx, question, arrays, ref = smollm2_run
    want = ref["RestoreKVPress@0.5"]
    assert "error" not in want, want
    pol = kvpress("RestoreKVPress", 0.5, max_new=64, restore_model_name=str(arrays))
    eng = Engine(model, pol, max_len=len(ctx) + N_RESTORE + len(question) + 12)
    state = eng.compress(lora.restore(eng, eng.prompt(ctx[None])))
    kept = eng.kept_positions(state)
    js = [len(set(g.tolist()) & set(w)) / len(set(g.tolist()) | set(w))
          for gl, wl in zip(kept, want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    answer = eng.continue_generate(state, question[None], 12)[0].tolist()
    print(f"RestoreKVPress 0.5: mean Jaccard {np.mean(js):.4f}, min {np.min(js):.4f}, answers equal "
          f"{answer == want['answer']}")
    assert np.mean(js) >= 0.99
    assert answer == want["answer"]
