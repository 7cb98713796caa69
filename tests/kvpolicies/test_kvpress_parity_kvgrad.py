"""kvpress 0.5.5's KVgradPress beside `kvpolicies.compat.kvpress("KVgradPress", r, **fields)` (the registered `kvgrad`):
the tiny random Llama and Qwen2 of tests/kvpolicies/test_kvpress_parity.py, the same token ids, kvpress's press
prefilling the context and scoring it with its replay and backward pass in its own environment
(evals/kvpress_worker.py, through tests/conftest.py's `kvpress_ref`), ours `Engine.prompt` -> `compress` (the
reconstruction pass, with the gradient pass of `models.gradient` before each repeat input) -> `kept_positions` /
`continue_generate`. Kept positions per (layer, kv head) and greedy answers are identical: one context chunk
(kvpress's default 512 over 320 tokens) and several (chunk_size 128 and 100: the "starting with" prompts), kvpress's
default choice over all layers and its `layerwise=True` (whose bytes are measured: kvpress masks, each of our layers
stores its share). The tiny Qwen2 runs with KVP_KVPRESS_FULL=1 (suite time)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from kvpolicies.compat import kvpress
from kvpolicies.kvgrad import KVgrad, value_output_norms
from kvpolicies.memory import tree_nbytes
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf
from models.tokenizer import ByteTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
FULL = bool(os.environ.get("KVP_KVPRESS_FULL"))
needs_kvpress = pytest.mark.skipif(not (REF / "kvpress").is_dir(),
                                   reason="kvpress not installed (bash scripts/setup.sh test)")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW, MAX_NEW = 320, 8, 6, 64
# (ratio, fields) per model; kvpress's results are keyed by press@ratio, so one ratio per case
CASES = {"llama": ((0.5, {}), (0.75, {"chunk_size": 128, "layerwise": True})),
         "qwen2": ((0.5, {"chunk_size": 100}),)}


@pytest.fixture(scope="module", params=sorted(CASES) if FULL else ["llama"])
def tiny_run(request, tmp_path_factory, kvpress_ref):
    """(model kind, our model, context ids, question ids, kvpress's results)."""
    tmp = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(1)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    job = {"checkpoint": None, "save_to": str(tmp / "ckpt"),
           "tiny": {"kind": request.param, "seed": 0,
                    "config": dict(TINY, tie_word_embeddings=request.param == "qwen2")},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW, "tokenizer": "ascii",
           "presses": [["KVgradPress", r, f] for r, f in CASES[request.param]]}
    ref = kvpress_ref.job(job, tmp)
    cfg, params = load_hf(tmp / "ckpt")
    return request.param, Llama(cfg, params), ctx, question, ref


@pytest.mark.ref
@pytest.mark.kvpress
@needs_kvpress
def test_kvgrad_keeps_kvpress_positions_and_answers(tiny_run):
    kind, model, ctx, question, ref = tiny_run
    n_layers, kh, d = model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.head_dim
    for ratio, fields in CASES[kind]:
        want = ref[f"KVgradPress@{ratio}"]
        assert "error" not in want, want
        pol = kvpress("KVgradPress", ratio, max_new=MAX_NEW, **fields)
        layerwise = fields.get("layerwise", False)
        assert pol == KVgrad(ratio=ratio, max_new=MAX_NEW, n_sink=4, repeat_chunk=fields.get("chunk_size", 512),
                             scope="layer" if layerwise else "model", keep_last=False, prompts="kvpress")
        eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW, repeat=ByteTokenizer())  # kvpress's ASCII ids
        state = eng.compress(eng.prompt(ctx[None]))
        assert eng.traces["gradient"] >= 1  # the gradient pass ran (once per repeat-input bucket)
        kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
        sizes = [sum(map(len, layer)) for layer in want["kept"]]
        if layerwise:  # K n - int(K n r) per layer, the heads' shares differ
            assert sizes == [kh * N_CTX - int(kh * N_CTX * ratio)] * n_layers
        else:  # int(L K n r) removed over all layers: the layers' counts differ
            assert sum(sizes) == n_layers * kh * N_CTX - int(n_layers * kh * N_CTX * ratio) and len(set(sizes)) > 1
        assert any(len(h) != len(layer[0]) for layer in want["kept"] for h in layer)  # head-wise
        for i, (g, w) in enumerate((g, w) for gl, wl in zip(kept, want["kept"], strict=True)
                                   for g, w in zip(gl, wl, strict=True)):
            assert g == w, (kind, ratio, fields, divmod(i, kh), sorted(set(g) ^ set(w))[:10])
        assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]
        # kvpress masks: every layer still holds its n keys and values
        assert want["cache_bytes"] == n_layers * 2 * kh * N_CTX * d * 4
        ours = tree_nbytes(state.cache)
        print(f"KVgradPress({fields}) at {ratio}: ours {ours} bytes, kvpress {want['cache_bytes']}")
        if layerwise:  # each head's share in a pool of K x (n_kept + 1 + max_new) slots per layer
            s = pol.capacity(N_CTX + N_Q + N_NEW)
            assert s == int(np.ceil((N_CTX + N_Q + N_NEW) * (1 - ratio))) + 1 + MAX_NEW
            assert ours == n_layers * kh * s * (2 * d * 4 + 4 + 4)  # k, v, position, mass per slot
            assert ours < want["cache_bytes"]


def test_value_output_norms_equal_numpy():
    """||v W_o^(g)||_2 per (kv head, query head of the group, slot): each query head's rows of W_o, numpy."""
    rng = np.random.default_rng(0)
    b, kh, g, m, d, e = 2, 2, 3, 5, 4, 7
    v = rng.standard_normal((b, kh, m, d)).astype(np.float32)
    wo = rng.standard_normal((kh * g * d, e)).astype(np.float32)
    want = np.empty((b, kh, g, m))
    for h in range(kh):
        for j in range(g):
            rows = wo[(h * g + j) * d:(h * g + j + 1) * d]  # query head h g + j
            want[:, h, j] = np.linalg.norm(v[:, h].astype(np.float64) @ rows, axis=-1)
    np.testing.assert_allclose(np.asarray(value_output_norms(v, wo)), want, rtol=1e-5, atol=1e-6)


def test_kvgrad_press_fields_and_errors():
    pol = kvpress("KVgradPress", 0.5)
    assert (pol.repeat_chunk, pol.scope, pol.n_sink, pol.keep_last, pol.prompts) == (512, "model", 4, False, "kvpress")
    assert kvpress("KVgradPress", 0.25, layerwise=True, n_sink=2).scope == "layer"
    assert type(kvpress("KVgradPress", 0)).__name__ == "Full"  # kvpress's no-op
    with pytest.raises(ValueError, match="kvzip_plus_normalization"):  # fixed off in KVgradPress (init=False)
        kvpress("KVgradPress", 0.5, kvzip_plus_normalization=True)


N_SMOL = 700 if FULL else 400  # SmolLM2's context tokens in the slow test (suite time: one chunk)


@pytest.mark.slow
@pytest.mark.ref
@pytest.mark.kvpress
@needs_kvpress
def test_smollm2_real_text_equals_kvpress(tmp_path, kvpress_ref):
    """SmolLM2 (float32, its chat prefix and tokenizer) on N_SMOL tokens of Pride & Prejudice with a needle,
    KVgradPress at 0.5 (kvpress's default, one choice over all 30 layers; KVP_KVPRESS_FULL=1: 700 tokens, two
    context chunks of 512): mean kept-set Jaccard per (layer, kv head) >= 0.99 and the same 12 greedy ids as
    kvpress 0.5.5."""
    from evals.data import default_text
    from models.loading import load_default_model, smollm2_gguf_path

    model, tok = load_default_model()
    text = default_text()[20000:23000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:N_SMOL]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    path = smollm2_gguf_path()
    job = {"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
           "question": question.tolist(), "n_new": 12, "presses": [["KVgradPress", 0.5, {}]]}
    want = kvpress_ref.job(job, tmp_path, timeout=1800)["KVgradPress@0.5"]
    assert "error" not in want, want
    eng = Engine(model, kvpress("KVgradPress", 0.5, max_new=64), max_len=len(ctx) + len(question) + 12)
    state = eng.compress(eng.prompt(ctx[None]))
    js = [len(set(g.tolist()) & set(w)) / len(set(g.tolist()) | set(w))
          for gl, wl in zip(eng.kept_positions(state), want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    answer = eng.continue_generate(state, question[None], 12)[0].tolist()
    print(f"KVgradPress 0.5 on SmolLM2: mean Jaccard {np.mean(js):.4f}, min {np.min(js):.4f}, "
          f"answers equal {answer == want['answer']}")
    assert np.mean(js) >= 0.99
    assert answer == want["answer"]


def test_gradient_pass_keeps_the_runs_of_the_reconstruction_pass():
    """Adjacent kvgrad layers at different ratios are different runs of the reconstruction pass, whose gradient
    policies are equal (`models.gradient.gradient_runs` keeps the pass's runs): their scores are those of one
    uniform kvgrad (the scores do not read the ratio), over two context chunks."""
    from models.config import LlamaConfig
    from models.reconstruct import RepeatPrompts

    model = Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    repeat = RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11))
    ids = np.random.default_rng(3).integers(0, 97, (1, 24))
    mixed = [KVgrad(ratio=r, max_new=4, repeat_chunk=16, n_sink=2, prompts="authors") for r in (0.5, 0.75)]
    scores = []
    for pols in (tuple(mixed), (mixed[0],) * 2):
        eng = Engine(model, pols, max_len=32, repeat=repeat)
        st = eng.reconstruct(eng.prompt(ids))
        assert eng.traces["gradient"] == 1 and len(st.cache) == len(set(pols))  # runs: 2 or 1
        scores.append(np.concatenate([np.asarray(c.extra["zip"]) for c in st.cache]))  # [L, B, K, M]
        assert all("grad" not in c.extra for c in st.cache)
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5, atol=0)
    assert (scores[0][:, 0, :, :24] > 0).all() and np.isfinite(scores[0]).all()
