"""kvpress 0.5.5's presses that download arrays from the Hugging Face hub, beside `kvpolicies.compat.kvpress`,
with the SAME arrays on both sides: QFilterPress (the filters), ExpectedAttentionStatsPress (the query
statistics), KVzapPress (the surrogate's weights). The tiny random Llama of the other parity tests;
kvpress runs in a subprocess with its own transformers (.venv/kvpress-ref, `WORKER` below, over
evals/kvpress_worker.py), where the arrays are also produced independently of this library from
transformers' own queries (the authors' recipes in float64 numpy: the Q-Filters SVD, kvpress's
`collect_queries` statistics); ours are produced by `evals.qfilter` / `evals.expected_stats` on our port
of the model and must equal them. Kept positions per (layer, kv head) and greedy answers must be identical."""

from __future__ import annotations

import collections
import os
import pathlib

import jax
import numpy as np
import pytest

from kvpolicies.compat import kvpress
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
pytestmark = [pytest.mark.ref, pytest.mark.kvpress, pytest.mark.skipif(not (REF / "kvpress").is_dir(),
                                                      reason="kvpress not installed (bash scripts/setup.sh test)")]

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW = 320, 8, 6
CALIB, CALIB_LEN, SAMPLES, SEED = 3, 96, 200, 0  # calibration windows of random ids, SVD samples, the draw's seed

# kvpress's side. The calibration pass captures each layer's queries before RoPE through kvpress's own
# `patch_rotary_embedding` (ExpectedAttentionStatsPress's collector) and after it through a wrapper of the
# same function; the arrays are computed here in float64 numpy, the presses are given them in place of
# their downloads (QFilterPress's and KVzapPress's post_init_from_model do nothing; ExpectedAttentionStatsPress
# loads nothing once mu and cov are set).
WORKER = r"""
import importlib, json, sys, torch, numpy as np
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
import kvpress
from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStatsPress, patch_rotary_embedding
from kvpress.presses.fastkvzip_press import FastKVzipGate, FastKVzipPress
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel, KVzapPress
from kvpress.presses.qfilter_press import QFilterPress
from transformers import DynamicCache

job = json.load(open(sys.argv[1]))
path = job.get("checkpoint") or w.build_tiny(job["tiny"], job["save_to"])
model = w.load(path, "sdpa", job.get("gguf_file"))
cfg = model.config
L, K, N = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads
mod = importlib.import_module(model.__class__.__module__)
pre, post = [], []
for ids in job.get("calib", []):
    with torch.no_grad(), patch_rotary_embedding(model) as got:
        inner, seen = mod.apply_rotary_pos_emb, []
        def after(q, k, *a, **kw):
            qe, ke = inner(q, k, *a, **kw)
            seen.append(qe.detach())
            return qe, ke
        mod.apply_rotary_pos_emb = after
        try:
            model(input_ids=torch.tensor([ids]))
        finally:
            mod.apply_rotary_pos_emb = inner
    pre.append(torch.cat(got, 0).double().numpy())  # [L, N, T, D] before RoPE
    post.append(torch.cat(seen, 0).double().numpy())  # after RoPE
arrays = dict(np.load(job["given"])) if job.get("given") else {}  # SmolLM2: ours, as both sides' arrays
# Q-Filters (NathanGodey/qfilters make_filters.py): positions drawn once, an SVD per query head, -sign v_1
if post:
    q = np.concatenate(post, axis=2)  # [L, N, P, D]
    idx = np.random.default_rng(job["seed"]).permutation(q.shape[2])[:job["samples"]]
    filt = np.zeros((L, K, q.shape[-1]))
    for l in range(L):
        for n in range(N):
            u, s, vh = np.linalg.svd(q[l, n, idx], full_matrices=False)
            sign = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
            filt[l, n // (N // K)] += -sign * vh[0] / (N // K)
    arrays["q_filters"] = filt
    # kvpress's collect_queries: the first n_sink queries of each sample dropped, mean and covariance (N - 1)
    cat = np.concatenate([p[:, :, job["n_sink"]:] for p in pre], axis=2)  # [L, N, P', D]
    mu = cat.mean(2)
    c = cat - mu[:, :, None]
    arrays["mu"], arrays["cov"] = mu, np.einsum("lnpi,lnpj->lnij", c, c) / (cat.shape[2] - 1)
    np.savez(job["arrays"], **arrays)
f32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32)
QFilterPress.post_init_from_model = lambda self, model: None
KVzapPress.post_init_from_model = lambda self, model: None

def build(name, ratio, fields):
    kind = fields.pop("kind", None)
    if name == "QFilterPress":
        press = QFilterPress(compression_ratio=ratio)
        press.q_filters = f32(arrays["q_filters"])
    elif name == "ExpectedAttentionStatsPress":
        press = ExpectedAttentionStatsPress(compression_ratio=ratio, **fields)
        press.mu, press.cov = f32(arrays["mu"]), f32(arrays["cov"])
    elif name == "FastKVzipPress":  # our gate file in kvpress's FastKVzipGate modules (its own download skipped)
        z, gates = np.load(job["fastkvzip"]), []
        for l in range(L):
            gate = FastKVzipGate(l, cfg.hidden_size, K, N // K, torch.float32)
            gate.load_state_dict({"q_proj.weight": f32(z["q_w"][l].T), "q_proj.bias": f32(z["q_b"][l]),
                                  "k_proj.weight": f32(z["k_w"][l].T), "q_norm.weight": f32(z["q_norm"][l]),
                                  "k_norm.weight": f32(z["k_norm"][l]), "k_base": f32(z["k_base"][l][:, None]),
                                  "b": f32(z["b"][l][:, None])})
            gates.append(gate.eval())
        press = FastKVzipPress(compression_ratio=ratio, **fields)  # layerwise: kvpress's default (False) or given
        press.gates = gates
    else:  # KVzapPress: our surrogate's weights in kvpress's KVzapModel
        z = np.load(job["kvzap"][kind])
        mlp = "w1" in z.files
        zc = KVzapConfig(input_dim=cfg.hidden_size, output_dim=K, n_modules=L,
                         hidden_dim=z["w1"].shape[-1] if mlp else None)
        zm = KVzapModel(zc).eval()
        with torch.no_grad():
            for l, layer in enumerate(zm.layers):
                pairs = [(layer[0], "w1", "b1"), (layer[2], "w2", "b2")] if mlp else [(layer, "w", "b")]
                for lin, wn, bn in pairs:
                    lin.weight.copy_(f32(z[wn][l].T))
                    lin.bias.copy_(f32(z[bn][l]))
        press = KVzapPress(compression_ratio=ratio, model_type="mlp" if mlp else "linear")
        press.kvzap_model = zm
    return press

with torch.no_grad():
    full = DynamicCache()
    model(input_ids=torch.tensor([job["context"]]), past_key_values=full, logits_to_keep=1)
full_keys = [full.layers[i].keys[0] for i in range(len(full.layers))]
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])
out = {}
for name, ratio, fields in job["presses"]:
    key = f"{name}@{ratio}"
    try:
        key += f"@{fields['kind']}" if "kind" in fields else ""
        key += "@layerwise" if fields.get("layerwise") else ""
        out[key] = w.run(model, build(name, ratio, dict(fields)), ctx, question, job["n_new"], full_keys)
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {e}"}
json.dump(out, open(sys.argv[2], "w"))
"""

FULL = os.environ.get("KVP_KVPRESS_FULL") == "1"  # both ratios for every press (suite time: 0.5 only)
RATIOS = (0.5, 0.75) if FULL else (0.5,)
KVZAP_KINDS = ("mlp", "linear") if FULL else ("mlp",)  # kvpress's default model_type: mlp
CASES = [(p, r, {}) for p in ("QFilterPress", "ExpectedAttentionStatsPress", "FastKVzipPress") for r in RATIOS] + [
    ("KVzapPress", r, {"kind": k}) for k in KVZAP_KINDS for r in RATIOS] + [
    ("FastKVzipPress", r, {"layerwise": True}) for r in RATIOS]


def zap_weights(tmp: pathlib.Path, kind: str, cfg: dict) -> pathlib.Path:
    """Seeded random surrogate weights of `kind` for the tiny model, in kvzap's file format (the arrays
    both sides load: kvzap's surrogate=<file> and kvpress's KVzapModel)."""
    from kvpolicies.kvzap import random_surrogate

    d, kh, n = cfg["hidden_size"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    w = random_surrogate(kind, d, kh, n, seed=3)
    w = {k: v + (0.1 * np.random.default_rng(4).standard_normal(v.shape)).astype(np.float32) if k.startswith("b") else v
         for k, v in w.items()}  # nonzero biases
    path = tmp / f"zap_{kind}.npz"
    np.savez(path, kind=kind, d_model=d, kv_heads=kh, n_layers=n, **w)
    return path


def gate_weights(tmp: pathlib.Path, cfg: dict) -> pathlib.Path:
    """Seeded random FastKVzip gates for the tiny model in our file format (kvpolicies.fastkvzip.GATE_NAMES)."""
    rng = np.random.default_rng(5)
    d, kh, n, g, e = (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["num_hidden_layers"],
                      cfg["num_attention_heads"] // cfg["num_key_value_heads"], 16)
    r = lambda *s, scale=1.0: (scale * rng.standard_normal((n,) + s)).astype(np.float32)  # noqa: E731
    path = tmp / "gates.npz"
    np.savez(path, q_w=r(d, kh * g * e, scale=d ** -0.5), q_b=r(kh * g * e, scale=0.1),
             k_w=r(d, kh * e, scale=d ** -0.5),
             q_norm=1 + r(e, scale=0.1), k_norm=1 + r(e, scale=0.1), k_base=r(kh, 16, e), b=r(kh, g, scale=0.5))
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, calibration windows, kvpress's results, the worker's arrays)."""
    tmp = tmp_path_factory.mktemp("hub")
    rng = np.random.default_rng(7)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    calib = [rng.integers(0, 128, CALIB_LEN) for _ in range(CALIB)]
    job = {"save_to": str(tmp / "ckpt"), "tiny": {"kind": "llama", "seed": 0, "config": TINY},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW,
           "calib": [c.tolist() for c in calib], "samples": SAMPLES, "seed": SEED, "n_sink": 4,
           "arrays": str(tmp / "arrays.npz"), "presses": [list(c) for c in CASES],
           "kvzap": {k: str(zap_weights(tmp, k, TINY)) for k in KVZAP_KINDS}, "fastkvzip": str(gate_weights(tmp, TINY))}
    ref = kvpress_ref.job(job, tmp, script=WORKER)
    arrays = dict(np.load(tmp / "arrays.npz"))
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, calib, ref, {**arrays, "tmp": tmp}


@pytest.fixture(scope="module")
def tiny_qwen2_run(tmp_path_factory, kvpress_ref):
    """(our tiny Qwen2, context ids, question ids, kvpress's FastKVzipPress results, the gates' file): the same
    ids and gates as `tiny_run`'s, a Qwen2 (qkv biases, tied embeddings) of the same shape."""
    tmp = tmp_path_factory.mktemp("hub_qwen2")
    rng = np.random.default_rng(7)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    gates = gate_weights(tmp, TINY)
    job = {"save_to": str(tmp / "ckpt"), "tiny": {"kind": "qwen2", "seed": 0,
                                                   "config": dict(TINY, tie_word_embeddings=True)},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW, "fastkvzip": str(gates),
           "presses": [["FastKVzipPress", r, {}] for r in RATIOS]}
    ref = kvpress_ref.job(job, tmp, script=WORKER)
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, ref, gates


def ours(model, press: str, ratio: float, ctx, question, **fields):
    """(kept positions [layer][kv head], greedy answer) through `kvpress(press, ratio, **fields)`."""
    eng = Engine(model, kvpress(press, ratio, max_new=16, **fields), max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
    return kept, eng.continue_generate(state, question[None], N_NEW)[0].tolist()


def check_same(press, ratio, kept, answer, want, tied_ids=None):
    """The same kept positions per (layer, kv head) and the same answer. `tied_ids` (the context ids): the
    scores of layer 0 are a function of the token alone (its input is the token's embedding), so repeated
    ids tie exactly there and torch.topk breaks the tie its way (ours: the newer token): layer 0 keeps the
    same token ids (a multiset), the other layers the same positions."""
    assert "error" not in want, want
    assert all(len(h) == int(N_CTX * (1 - ratio)) for layer in want["kept"] for h in layer)
    for layer, (gl, wl) in enumerate(zip(kept, want["kept"], strict=True)):
        for h, (g, w) in enumerate(zip(gl, wl, strict=True)):
            if tied_ids is not None and layer == 0:
                assert sorted(tied_ids[g]) == sorted(tied_ids[w]), (press, ratio, layer, h)
            else:
                assert g == w, (press, ratio, layer, h, sorted(set(g) ^ set(w))[:10])
    assert answer == want["answer"]


def test_our_qfilters_are_the_authors_recipe_on_transformers_queries(tiny_run):
    """`evals.qfilter.compute` on our port of the model and the same calibration ids and draw: the filters
    the worker computed from transformers' post-RoPE queries in float64 (the authors' make_filters.py)."""
    from evals.qfilter import compute

    model, _, _, calib, _, arrays = tiny_run
    got = compute(model, calib, samples=SAMPLES, seed=SEED)
    assert got.shape == arrays["q_filters"].shape == (3, 2, 16)
    np.testing.assert_allclose(got, arrays["q_filters"], atol=2e-5, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_qfilter_keeps_kvpress_positions_and_answers(tiny_run, ratio):
    """QFilterPress with the same [L, K, D] filters on both sides: kvpress's n_kept per head, the same
    positions per (layer, kv head), the same answer."""
    model, ctx, question, _, ref, arrays = tiny_run
    kept, answer = ours(model, "QFilterPress", ratio, ctx, question, q_filters=arrays["q_filters"])
    check_same("QFilterPress", ratio, kept, answer, ref[f"QFilterPress@{ratio}"])


def test_our_statistics_are_kvpress_s_collect_queries(tiny_run):
    """`evals.expected_stats.compute` on our port and the same calibration ids: the mean and covariance (N - 1)
    the worker computed, as kvpress's `collect_queries`, from the queries kvpress's own patch captured."""
    from evals.expected_stats import compute

    model, _, _, calib, _, arrays = tiny_run
    mu, cov = compute(model, calib, n_sink=4)
    assert mu.shape == arrays["mu"].shape == (3, 4, 16) and cov.shape == arrays["cov"].shape == (3, 4, 16, 16)
    np.testing.assert_allclose(mu, arrays["mu"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(cov, arrays["cov"], atol=1e-4 * np.abs(arrays["cov"]).max(), rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_expected_stats_keeps_kvpress_positions_and_answers(tiny_run, ratio):
    """ExpectedAttentionStatsPress with the same statistics on both sides (the worker's, saved as our file
    format): the same positions per (layer, kv head), the same answer."""
    model, ctx, question, _, ref, arrays = tiny_run
    path = arrays["tmp"] / "stats.npz"
    np.savez(path, mu=arrays["mu"].astype(np.float32), cov=arrays["cov"].astype(np.float32))
    kept, answer = ours(model, "ExpectedAttentionStatsPress", ratio, ctx, question, stats_folder=str(path))
    check_same("ExpectedAttentionStatsPress", ratio, kept, answer, ref[f"ExpectedAttentionStatsPress@{ratio}"])


@pytest.mark.parametrize("kind", KVZAP_KINDS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_kvzap_press_keeps_kvpress_positions_and_answers(tiny_run, ratio, kind):
    """KVzapPress with the same surrogate weights in kvpress's KVzapModel and in our kvzap file: per kv head
    the n_kept best surrogate scores of the layer's normalised input hidden states, the same positions per
    (layer, kv head), the same answer."""
    model, ctx, question, _, ref, arrays = tiny_run
    kept, answer = ours(model, "KVzapPress", ratio, ctx, question, model_type=kind,
                        kvzap_model_name=str(arrays["tmp"] / f"zap_{kind}.npz"))
    check_same("KVzapPress", ratio, kept, answer, ref[f"KVzapPress@{ratio}@{kind}"], tied_ids=ctx)


def same_head_sets(kept, want, ctx, what):
    """The same kept positions per (layer, kv head); layer 0: the same token ids (a multiset: its gates read only
    the token's embedding, so repeated ids tie exactly and torch.topk breaks the tie its way, ours the newer)."""
    for layer, (gl, wl) in enumerate(zip(kept, want, strict=True)):
        for h, (g, w) in enumerate(zip(gl, wl, strict=True)):
            if layer == 0:
                assert sorted(ctx[g]) == sorted(ctx[w]), (what, layer, h)
            else:
                assert g == w, (what, layer, h, sorted(set(g) ^ set(w))[:10])


@pytest.mark.parametrize("ratio", RATIOS)
def test_fastkvzip_layerwise_keeps_kvpress_positions_and_answers(tiny_run, ratio):
    """FastKVzipPress(layerwise=True) with the same gates in kvpress's FastKVzipGate and in our file: the sinks
    and the last 2 % scored 1, each layer's int(K n r) lowest pairs over its heads dropped (kvpress masks them,
    we store each head's share): the same positions per (layer, kv head) (layer 0: the same token ids), the
    same answer."""
    model, ctx, question, _, ref, arrays = tiny_run
    want = ref[f"FastKVzipPress@{ratio}@layerwise"]
    assert "error" not in want, want
    assert [sum(len(h) for h in layer) for layer in want["kept"]] == [2 * N_CTX - int(2 * N_CTX * ratio)] * 3
    pol = kvpress("FastKVzipPress", ratio, max_new=16, layerwise=True, gates=str(arrays["tmp"] / "gates.npz"))
    eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    same_head_sets([[p.tolist() for p in layer] for layer in eng.kept_positions(state)], want["kept"], ctx, ratio)
    assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", RATIOS)
def test_fastkvzip_keeps_kvpress_positions_answers_and_bytes(kind, ratio, request):
    """FastKVzipPress at kvpress's default (layerwise=False) with the same gates on both sides (the tiny Llama at
    0.5; 0.75 and the tiny Qwen2 with KVP_KVPRESS_FULL=1): the int(L K n r)
    lowest (layer, kv head, token) of all layers removed, so the layers keep different numbers of pairs; the
    same positions per (layer, kv head) (layer 0: the same token ids) and the same answer. Bytes: kvpress masks
    the removed pairs and holds every layer's n keys and values (float32); ours, stored at what each layer kept
    (`Engine(fit=1)`), holds ceil(c_l / K) + max_new slots per kv head (a position and a float32 mass each),
    fewer; unfitted, max_len slots per kv head (a layer may keep all)."""
    from kvpolicies.memory import tree_nbytes

    if kind == "qwen2" and not FULL:
        pytest.skip("the tiny Qwen2: KVP_KVPRESS_FULL=1 (suite time)")
    if kind == "llama":
        model, ctx, question, _, ref, arrays = request.getfixturevalue("tiny_run")
        gates = arrays["tmp"] / "gates.npz"
    else:
        model, ctx, question, ref, gates = request.getfixturevalue("tiny_qwen2_run")
    kh, d, n_layers = model.cfg.n_kv_heads, model.cfg.head_dim, model.cfg.n_layers
    max_len = N_CTX + N_Q + N_NEW
    want = ref[f"FastKVzipPress@{ratio}"]
    assert "error" not in want, want
    counts = [sum(len(h) for h in layer) for layer in want["kept"]]  # pairs kept per layer
    assert sum(counts) == n_layers * kh * N_CTX - int(n_layers * kh * N_CTX * ratio) and len(set(counts)) > 1, counts
    pol = kvpress("FastKVzipPress", ratio, max_new=16, gates=str(gates))
    assert not pol.layerwise
    eng = Engine(model, pol, max_len=max_len, fit=1)
    state = eng.compress(eng.prompt(ctx[None]))
    same_head_sets([[p.tolist() for p in layer] for layer in eng.kept_positions(state)], want["kept"], ctx, ratio)
    assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]
    assert want["cache_bytes"] == n_layers * kh * N_CTX * 2 * d * 4
    slot = 2 * d * 4 + 4 + 4  # a key and a value (float32), a position, a mass
    assert tree_nbytes(state.cache) == sum(kh * min(-(-c // kh) + 16, max_len) * slot for c in counts)
    assert tree_nbytes(state.cache) < want["cache_bytes"]
    assert tree_nbytes(eng.init_cache(1).runs) == n_layers * kh * max_len * slot


# SmolLM2 (slow, with KVP_KVPRESS_FULL=1 only: kvpress's 1K-token prefills and our per-layer compilations take
# minutes): the arrays produced by our commands at small settings (the filters of 2 x 512 tokens, the
# statistics of 20 pieces) and kvzap's trained linear surrogate, given to both libraries.
SLOW_CASES = [(p, 0.5) for p in ("QFilterPress", "ExpectedAttentionStatsPress", "KVzapPress")]


@pytest.fixture(scope="module")
def smollm2_hub(tmp_path_factory, kvpress_ref):
    from evals import expected_stats, qfilter
    from evals.data import default_text
    from kvpolicies.kvzap import weight_file
    from models.loading import load_default_model, smollm2_gguf_path

    tmp = tmp_path_factory.mktemp("hub_smollm2")
    model, tok = load_default_model()
    text = default_text()[20000:24000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:1024]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    filters = qfilter.compute(model, qfilter.windows_of(tok, 2, 512), samples=1000, seed=0)
    mu, cov = expected_stats.compute(model, expected_stats.windows_of(tok, 20, 1000), n_sink=4)
    np.savez(tmp / "given.npz", q_filters=filters, mu=mu.astype(np.float32), cov=cov.astype(np.float32))
    path = smollm2_gguf_path()
    job = {"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
           "question": question.tolist(), "n_new": 12, "given": str(tmp / "given.npz"),
           "kvzap": {"linear": str(weight_file("smollm2_linear"))},
           "presses": [[p, r, {"kind": "linear"} if p == "KVzapPress" else {}] for p, r in SLOW_CASES]}
    return model, ctx, question, tmp, kvpress_ref.job(job, tmp, timeout=3600, script=WORKER)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="minutes: KVP_KVPRESS_FULL=1")
@pytest.mark.parametrize(("press", "ratio"), SLOW_CASES)
def test_smollm2_with_our_arrays_equals_kvpress(smollm2_hub, press, ratio):
    """SmolLM2 on 1,024 tokens of Pride & Prejudice with a needle, the same arrays on both sides: mean
    kept-set Jaccard per (layer, kv head) >= 0.98 and the same 12 greedy tokens as kvpress 0.5.5."""
    model, ctx, question, tmp, ref = smollm2_hub
    want = ref[f"{press}@{ratio}" + ("@linear" if press == "KVzapPress" else "")]
    assert "error" not in want, want
    fields = {"QFilterPress": {"q_filters": str(tmp / "given.npz")},
              "ExpectedAttentionStatsPress": {"stats_folder": str(tmp / "given.npz")},
              "KVzapPress": {"model_type": "linear", "kvzap_model_name": "smollm2_linear"}}[press]
    pol = kvpress(press, ratio, n_layers=model.cfg.n_layers, max_new=64, **fields)
    eng = Engine(model, pol, max_len=len(ctx) + len(question) + 12)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = eng.kept_positions(state)
    js = [len(set(g.tolist()) & set(w)) / len(set(g.tolist()) | set(w))
          for gl, wl in zip(kept, want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    answer = eng.continue_generate(state, question[None], 12)[0].tolist()
    print(f"{press} {ratio}: mean Jaccard {np.mean(js):.4f}, min {np.min(js):.4f}, "
          f"answers equal {answer == want['answer']}")
    assert np.mean(js) >= 0.98
    assert answer == want["answer"]


@pytest.mark.slow
def test_smollm2_fastkvzip_equals_kvpress(tmp_path, kvpress_ref):
    """SmolLM2 on 1,024 tokens of Pride & Prejudice with a needle, FastKVzipPress at kvpress's default
    (layerwise=False: one choice over all layers) at 0.5, the same seeded random gates of SmolLM2's shape on both
    sides: mean kept-set Jaccard per (layer, kv head) >= 0.99 (layer 0's gates read each token's embedding alone:
    its repeated ids tie exactly and torch.topk breaks the tie its way, so there the token ids are compared),
    the same 12 greedy tokens, and our bytes, each layer stored at what it kept (`Engine.fitted`, what
    `Engine(fit=1)` stores), below kvpress's cache (every layer's n keys and values, the removed pairs masked)."""
    from evals.data import default_text
    from kvpolicies.memory import tree_nbytes
    from models.loading import load_default_model, smollm2_gguf_path

    model, tok = load_default_model()
    text = default_text()[20000:24000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:1024]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    c = model.cfg
    gates = gate_weights(tmp_path, dict(hidden_size=c.d_model, num_key_value_heads=c.n_kv_heads,
                                        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads))
    path = smollm2_gguf_path()
    want = kvpress_ref.job({"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
                            "question": question.tolist(), "n_new": 12, "fastkvzip": str(gates),
                            "presses": [["FastKVzipPress", 0.5, {}]]}, tmp_path, timeout=3600,
                           script=WORKER)["FastKVzipPress@0.5"]
    assert "error" not in want, want
    eng = Engine(model, kvpress("FastKVzipPress", 0.5, max_new=64, gates=str(gates)),
                 max_len=len(ctx) + len(question) + 12)
    state = eng.compress(eng.prompt(ctx[None]))
    _, fitted = eng.fitted(state)  # each layer's pool cut to what it kept (Engine(fit=1)'s state; decoding it
    # compiles a step per layer size: minutes here, so the kept sets and answer are the unfitted state's, equal
    # to the fitted one's on the tiny models above)
    kept = eng.kept_positions(state)
    js = []
    for layer, (gl, wl) in enumerate(zip(kept, want["kept"], strict=True)):
        for g, w in zip(gl, wl, strict=True):
            a, b = (collections.Counter(ctx[x].tolist()) if layer == 0 else collections.Counter(x)
                    for x in (g.tolist(), w))
            js.append(sum((a & b).values()) / sum((a | b).values()))
    counts = [sum(len(h) for h in layer) for layer in want["kept"]]
    assert len(set(counts)) > 1  # one choice over all layers: they keep different numbers of pairs
    answer = eng.continue_generate(state, question[None], 12)[0].tolist()
    print(f"FastKVzipPress 0.5 on SmolLM2: mean Jaccard {np.mean(js):.4f}, min {np.min(js):.4f}, answers equal "
          f"{answer == want['answer']}, bytes ours {tree_nbytes(fitted.cache)} kvpress {want['cache_bytes']}")
    assert len(js) == c.n_layers * c.n_kv_heads and np.mean(js) >= 0.99
    assert answer == want["answer"]
    assert tree_nbytes(fitted.cache) < want["cache_bytes"]
    assert sum(int(np.asarray(st.pos >= 0).sum()) for st in fitted.cache) == sum(counts)  # every kept pair in it


def test_expected_stats_stream_extension_matches_its_reference(tmp_path):
    """ExpectedStats's stream (ours: recompress on overflow with the same statistics) through `attend`, in
    chunks of 5 then 1, against its float64 re-simulation (tests/refs/hub.expected_stats_stream); a file of
    another head count or layer count is refused before any compute."""
    from kvpolicies.expected_stats import ExpectedStats
    from tests.refs.helpers import run_policy
    from tests.refs.hub import expected_stats_stream
    from tests.refs.registry import ROPE, qkv

    rng = np.random.default_rng(2)
    a = rng.standard_normal((1, 4, 16, 16)) / 4
    mu, cov = rng.standard_normal((1, 4, 16)), a @ np.swapaxes(a, -1, -2)  # PSD covariances
    np.savez(tmp_path / "s.npz", mu=mu.astype(np.float32), cov=cov.astype(np.float32))
    pol = ExpectedStats(budget=6, max_new=3, n_sink=2, n_future_positions=8, stats=str(tmp_path / "s.npz"), layer=0)
    q, k, v = qkv(24, seed=3)
    out, _ = run_policy(pol, q, k, v, [5, 1], ROPE)
    want = expected_stats_stream(pol, q, k, v, mu[0].astype(np.float32), cov[0].astype(np.float32))
    np.testing.assert_allclose(out, want, atol=3e-5, rtol=0)
    with pytest.raises(ValueError, match="hold 1 layers, the model has 3"):
        pol.stack(3)
    with pytest.raises(ValueError, match="query heads of dim 16, the layer has 3 kv heads"):
        pol.moments(3, 16)


def test_train_fastkvzip_fits_a_teacher_s_scores(tmp_path):
    """`evals.train_fastkvzip.train` (the authors' BCE, SGD with momentum and schedule) on hidden states whose
    targets are a random teacher gate's scores: the held-out BCE falls well below the initial gates' and the
    thresholded agreement rises; the saved gates load into `kvpolicies.fastkvzip` (its file format)."""
    import jax.numpy as jnp

    from evals.train_fastkvzip import agreement, bce, init_gates, train
    from kvpolicies.fastkvzip import gate_scores, load_gates

    rng = np.random.default_rng(0)
    n_layers, d, kh, g = 2, 32, 2, 2
    teacher = {k: jnp.asarray(v * 3) for k, v in init_gates(d, kh, g, n_layers, seed=9).items()}
    teacher["b"] = jnp.asarray(rng.standard_normal((n_layers, kh, g)), jnp.float32) - 2.0
    x = rng.standard_normal((n_layers, 1200, d)).astype(np.float32)
    y = np.asarray(jax.vmap(lambda p, h: gate_scores(p, h[None])[0])(teacher, jnp.asarray(x))).transpose(0, 2, 1)
    xtr, ytr, xte, yte = x[:, :1000], y[:, :1000], x[:, 1000:], y[:, 1000:]
    gates = train(xtr, ytr, kh, g, steps=100, batch=200, lr=0.2, seed=0)
    init = {k: jnp.asarray(v) for k, v in init_gates(d, kh, g, n_layers, seed=0).items()}
    trained = {k: jnp.asarray(v) for k, v in gates.items()}
    before, after = np.asarray(bce(init, xte, yte)), np.asarray(bce(trained, xte, yte))
    floor = np.asarray(bce(teacher, xte, yte))  # the entropy of the targets: no gate goes below it
    assert np.all(after - floor < 0.5 * (before - floor)), (before, after, floor)
    assert np.mean(agreement(trained, xte, yte)) > np.mean(agreement(init, xte, yte))
    np.savez(tmp_path / "g.npz", **gates)
    loaded = load_gates(str(tmp_path / "g.npz"))
    assert {k: v.shape for k, v in loaded.items()} == {k: v.shape for k, v in gates.items()}
