"""kvpress 0.5.5's CriticalKVPress and CriticalAdaKVPress (`kvpolicies.critical`) beside
`kvpolicies.compat.kvpress`, as tests/kvpolicies/test_kvpress_parity_wrappers.py runs the other wrappers:
a tiny random Llama (and Qwen2 with KVP_KVPRESS_FULL=1), the same token ids, kvpress's press prefilling the
context in its own environment (evals/kvpress_worker.py), ours `Engine.prompt` -> `compress` ->
`kept_positions` / `continue_generate`: kept positions per (layer, kv head) and greedy answers identical.
The value norms ||v W_o||_1 reach our policy through the model (`kvpolicies.base.ReadsValues`); the
bytes each library holds for CriticalAdaKV (kvpress masks, ours stores each head's share) are measured."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from kvpolicies.adascored import CountedPool
from kvpolicies.compat import kvpress
from kvpolicies.critical import Critical, CriticalAda, SnapOnce, value_norms
from kvpolicies.memory import tree_nbytes
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
needs_kvpress = pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")
FULL = bool(os.environ.get("KVP_KVPRESS_FULL"))

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW = 320, 8, 6
EXPECTED = {"press": "ExpectedAttentionPress", "use_vnorm": False}  # kvpress's leaderboard rows (its warning)
# (press, ratio, fields). Stage 1 (CriticalKV: int((1 - r) n / 2); CriticalAdaKV: int(b_h / 2) per head) is kept
# at least SnapKV's window, whose tokens all score kvpress's max + 1 (where it is shorter, kvpress keeps
# torch.topk's choice among them, ours the newest): window 64 at 0.5 (stage 1: 80), 32 and 16 at 0.75 (40).
CASES = (("CriticalKVPress", 0.5, {}), ("CriticalAdaKVPress", 0.5, {})) + ((
    ("CriticalKVPress", 0.5, EXPECTED), ("CriticalKVPress", 0.75, {"window_size": 32}), ("CriticalAdaKVPress", 0.75, {"window_size": 16}),
    ("CriticalAdaKVPress", 0.5, EXPECTED), ("CriticalKVPress", 0.75, {"press": "KeyDiffPress"}),
    ("CriticalAdaKVPress", 0.75, {"press": "KeyDiffPress", "first_stage_ratio": 0.3, "epsilon": 1e-2}))
    if FULL else ())
MODELS = ("llama", "qwen2") if FULL else ("llama",)

WORKER = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
from kvpress import CriticalAdaKVPress, CriticalKVPress
from transformers import DynamicCache

job = json.load(open(sys.argv[1]))
model = w.load(job.get("checkpoint") or w.build_tiny(job["tiny"], job["save_to"]), "sdpa", job.get("gguf_file"))
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])
with torch.no_grad():
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
full_keys = [full.layers[i].keys[0] for i in range(len(full.layers))]
out = {}
if job.get("tiny", {}).get("kind") == "qwen2":  # kvpress reads config.head_dim, which Qwen2's config (Qwen2.5's too) lacks
    hd = model.config.head_dim
    del model.config.head_dim
    try:
        w.run(model, CriticalKVPress(press=w.make_press("SnapKVPress", 0.5, {})), ctx, question, 1, full_keys)
    except Exception as e:
        out["no_head_dim"] = f"{type(e).__name__}: {e}"
    model.config.head_dim = hd
for i, (name, ratio, fields) in enumerate(job["presses"]):
    own = {k: fields.pop(k) for k in ("epsilon", "first_stage_ratio", "alpha_safeguard") if k in fields}
    inner = w.make_press(fields.pop("press", "SnapKVPress"), ratio, fields)
    press = (CriticalKVPress if name == "CriticalKVPress" else CriticalAdaKVPress)(press=inner, **own)
    out[f"{name}@{ratio}@{i}"] = w.run(model, press, ctx, question, job["n_new"], full_keys)
    if name == "CriticalKVPress" and "tiny" in job:  # the inner press alone: what the second stage changed
        out[f"{name}@{ratio}@{i}"]["inner"] = w.run(model, inner, ctx, question, 0, full_keys)["kept"]
json.dump(out, open(sys.argv[2], "w"))
"""


def key(i: int) -> str:
    name, ratio, _ = CASES[i]
    return f"{name}@{ratio}@{i}"


@pytest.fixture(scope="module", params=MODELS)
def tiny_run(request, tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, kvpress's results) on the tiny Llama (or Qwen2)."""
    tmp = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(2)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    config = dict(TINY, tie_word_embeddings=request.param == "qwen2")
    if request.param == "qwen2":  # kvpress's `vwl1norm` reads config.head_dim (without it: below)
        config["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    job = {"save_to": str(tmp / "ckpt"), "tiny": {"kind": request.param, "seed": 0, "config": config},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW, "presses": [list(c) for c in CASES]}
    ref = kvpress_ref.job(job, tmp, script=WORKER)
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, ref


@needs_kvpress
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{p}-{r}-{'-'.join(map(str, f.values()))}" for p, r, f in CASES])
def test_critical_keeps_kvpress_positions_and_answers(tiny_run, i):
    model, ctx, question, ref = tiny_run
    press, ratio, fields = CASES[i]
    want = ref[key(i)]
    assert "error" not in want, want
    pol = kvpress(press, ratio, max_new=64, **fields)
    assert isinstance(pol, Critical if press == "CriticalKVPress" else CriticalAda)
    eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
    assert kept == want["kept"]  # per (layer, kv head)
    n_kept = int(N_CTX * (1 - ratio))
    if press == "CriticalKVPress":
        assert all(len(h) == n_kept for layer in kept for h in layer)
        # the second stage is not the inner press's own choice (kvpress's): the value norms changed kept tokens
        assert want["inner"] != kept
    else:
        assert all(sum(map(len, layer)) == len(layer) * n_kept for layer in kept)
        assert any(len(h) != n_kept for layer in kept for h in layer)  # the heads' shares differ
        # kvpress masks: every head still holds all 320 tokens; ours stores K x S slots, S = n_kept of
        # max_len + max_new (keys, values, an int32 position each), K int32 counts per layer and, for expected,
        # its query sums (D + D^2 floats per kv head and a count: its stream rule's statistics)
        assert isinstance(state.cache[0], CountedPool)
        d, kh, n_layers = model.cfg.head_dim, model.cfg.n_kv_heads, model.cfg.n_layers
        assert want["cache_bytes"] == n_layers * 2 * kh * N_CTX * d * 4
        s = int((N_CTX + N_Q + N_NEW) * (1 - ratio)) + 64
        stats = (kh * (d + d * d) + 1) * 4 if fields.get("press") == "ExpectedAttentionPress" else 0
        assert tree_nbytes(state.cache) == n_layers * (kh * s * (2 * d * 4 + 4) + kh * 4 + stats)
        print(f"{press}({fields}) at {ratio}: ours {tree_nbytes(state.cache)} bytes, kvpress {want['cache_bytes']}")
        assert tree_nbytes(state.cache) < want["cache_bytes"]
    assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]


@needs_kvpress
@pytest.mark.ref
@pytest.mark.kvpress
def test_kvpress_critical_fails_without_config_head_dim(tiny_run):
    """kvpress 0.5.5's `CriticalKVPress.vwl1norm` reads `module.config.head_dim`, which a Qwen2 config does
    not define unless given (Qwen2.5-0.5B's does not: `evals.peer model=qwen`); ours reads the weights' shapes."""
    model, _, _, ref = tiny_run
    if model.cfg.qkv_bias:  # the Qwen2 run
        assert ref["no_head_dim"] == "AttributeError: 'Qwen2Config' object has no attribute 'head_dim'"
    else:
        assert "no_head_dim" not in ref


# with KVP_KVPRESS_FULL=1 only (three kvpress prefills of 1K tokens and our three engines: minutes, over the slow
# stage's time): kvpress's leaderboard rows critical_adakv_snapkv, critical_snapkv, critical_expected_attention
SLOW_CASES = (("CriticalAdaKVPress", 0.5, {}), ("CriticalKVPress", 0.5, {}), ("CriticalKVPress", 0.5, EXPECTED)) if FULL else ()


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, kvpress_ref):
    """SmolLM2 (float32) on 1,024 tokens of Pride & Prejudice with a needle, and kvpress's results."""
    from evals.data import default_text
    from models.loading import load_default_model, smollm2_gguf_path

    model, tok = load_default_model()
    text = default_text()[20000:24000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:1024]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    path = smollm2_gguf_path()
    job = {"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
           "question": question.tolist(), "n_new": 12, "presses": [list(c) for c in SLOW_CASES]}
    return model, ctx, question, kvpress_ref.job(job, tmp_path_factory.mktemp("smollm2"), script=WORKER)


@needs_kvpress
@pytest.mark.slow
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.parametrize("i", range(len(SLOW_CASES)), ids=[f"{p}-{r}-{'-'.join(map(str, f.values()))}"
                                                         for p, r, f in SLOW_CASES])
def test_smollm2_critical_equals_kvpress(smollm2_run, i):
    """SmolLM2, 1,024 tokens: mean kept-set Jaccard per (layer, kv head) >= 0.98 (float32 sums in another
    order can swap near ties) and the same 12 greedy tokens as kvpress 0.5.5."""
    model, ctx, question, ref = smollm2_run
    press, ratio, fields = SLOW_CASES[i]
    want = ref[f"{press}@{ratio}@{i}"]
    assert "error" not in want, want
    eng = Engine(model, kvpress(press, ratio, max_new=64, **fields), max_len=len(ctx) + len(question) + 12)
    state = eng.compress(eng.prompt(ctx[None]))
    js = [len(set(g.tolist()) & set(w)) / len(set(g.tolist()) | set(w))
          for gl, wl in zip(eng.kept_positions(state), want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    answer = eng.continue_generate(state, question[None], 12)[0].tolist()
    print(f"{press}({fields}) {ratio}: mean Jaccard {np.mean(js):.4f}, min {np.min(js):.4f}, "
          f"answers equal {answer == want['answer']}")
    assert np.mean(js) >= 0.98
    assert answer == want["answer"]


def test_value_norms_are_kvpress_vwl1norm_in_numpy():
    """||v W_o^(n)||_1 averaged over each kv head's query heads (n = h G + g: transformers' repeat_kv and our
    query layout), against a float64 loop over heads as kvpress's `vwl1norm` writes it."""
    rng = np.random.default_rng(0)
    b, t, kh, g, d, dm = 2, 5, 2, 3, 4, 7
    v = rng.standard_normal((b, t, kh, d)).astype(np.float32)
    wo = rng.standard_normal((kh * g * d, dm)).astype(np.float32)
    want = np.zeros((b, kh, t))
    for n in range(kh * g):
        out = v[:, :, n // g].astype(np.float64) @ wo[n * d:(n + 1) * d].astype(np.float64)  # [B, T, dm]
        want[:, n // g] += np.abs(out).sum(-1) / g
    np.testing.assert_allclose(np.asarray(value_norms(v, wo)), want, rtol=1e-5)


def test_critical_refuses_bad_fields_before_any_compute():
    assert kvpress("CriticalKVPress", 0.5) == Critical(ratio=0.5, max_new=256, press=kvpress("SnapKVPress", 0.5))
    assert kvpress("CriticalKVPress", 0.5, press="PyramidKVPress") == kvpress("CriticalKVPress", 0.5)  # its score
    assert kvpress("CriticalAdaKVPress", 0.5, press=kvpress("SnapKVPress", 0.5)) == kvpress("CriticalAdaKVPress", 0.5)
    assert isinstance(kvpress("CriticalAdaKVPress", 0.5).press, SnapOnce)
    with pytest.raises(ValueError, match="first_stage_ratio=1.5"):
        kvpress("CriticalKVPress", 0.5, first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="epsilon=-1"):
        kvpress("CriticalAdaKVPress", 0.5, epsilon=-1)
    with pytest.raises(NotImplementedError, match="CriticalKVPress over 'TOVAPress'"):
        kvpress("CriticalKVPress", 0.5, press="TOVAPress")
    with pytest.raises(ValueError, match="unknown field"):
        kvpress("CriticalKVPress", 0.5, window=3)
