"""kvpress 0.5.5's decoding presses beside `kvpolicies.compat.kvpress`: DecodingPress,
CompressionRatioDecodingPress and PrefillDecodingPress (and DMSPress, LUKVPress: the tests at the end) on the
tiny random Llama (3 layers, 4 query / 2 kv heads), the same token ids. kvpress runs its pipeline's loop in a
subprocess with its own transformers (.venv/kvpress-ref, `WORKER` below, over evals/kvpress_worker.py): the
context prefilled (under the press for PrefillDecodingPress, without it for a DecodingPress, as
`KVPressTextGenerationPipeline._forward` does), then the question in one forward step and greedy ids one step
each under the press, whose hook compresses every `compression_interval` steps; `kvpress_worker.Tracker`
follows each slot's position through the compressions. Ours: `Engine.prompt` -> `compress` ->
`continue_generate`, and `feed` of the same steps (the question whole, then one id a step) for the kept
positions after the last id fed. The kept positions per (layer, kv head) after the prefill and at the end, the
cache length after every step, and the greedy ids must be identical.

The cases keep clear of float32 ties: at every compression kvpress's n_kept-th and next scores (per kv head) differ by
at least TIE_EPS float32 epsilons (relative), so rounding cannot reorder them (ours agree with a float64 run of
kvpress's scores within about 1.3e-7, one to two epsilons). SnapKVPress(0.5) on this context is not: at layer 1, kv
head 1, positions 78 and 196 both score 0x1.c85c4p-9 in kvpress (float64: 78 ahead by 2.2e-10, 0.95 of a float32
spacing), so its 96th candidate is a tie that torch.topk gives to 78 and our top_mask, whose sums round 78 and 196 to
the same float32 or one spacing apart depending on XLA's compile flags, to either. Hence SnapKVPress(0.45) below."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import pytest

from kvpolicies.compat import PRESSES, kvpress
from kvpolicies.decoding import Decoding
from kvpolicies.keydiff import KeyDiff
from kvpolicies.knorm import Knorm
from kvpolicies.kvzap import KVzap, random_surrogate
from kvpolicies.memory import tree_nbytes
from kvpolicies.snapkv import SnapKV
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
pytestmark = [pytest.mark.ref, pytest.mark.kvpress, pytest.mark.skipif(not (REF / "kvpress").is_dir(),
                                                      reason="kvpress not installed (bash scripts/setup.sh test)")]

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW = 320, 8, 40
LUKV_RATIO = 0.5  # LUKVPress's compression_ratio (the curve's row 49)
DMS_WINDOW = 64  # DMSPress's sliding_window_size (kvpress's default 128)
MAX_NEW = N_Q + 16  # our decode slots beyond the prompt's kept tokens (the question, the tokens before a compression)
PREFILL_RATIO = 0.45  # SnapKVPress's on the prefill: 0.5 puts a float32 tie at its boundary (the module docstring)
TIE_EPS = 8  # the least gap at a compression's boundary, in float32 epsilons relative to the scores

Q_FILTERS = np.random.default_rng(9).standard_normal((3, 2, 16)).astype(np.float32)  # [L, K, D] QFilterPress's filters

# (kvpress's side, ours): the press as the worker builds it, and our front door's call
CASES = {
    # the whole context kept by the prefill; every 16 steps (the question is step 1) back to 160 per head
    "decoding": ({"kind": "DecodingPress", "base": "KeyDiffPress", "interval": 16, "target": 160},
                 ("DecodingPress", 0, {"base_press": "KeyDiffPress", "compression_interval": 16, "target_size": 160})),
    # a target below the question's 8 tokens: the question's step compresses (kvpress's q_len >= target_size)
    "question": ({"kind": "DecodingPress", "base": "KeyDiffPress", "interval": 12, "target": 6},
                 ("DecodingPress", 0, {"base_press": "KeyDiffPress", "compression_interval": 12, "target_size": 6})),
    # every 10 steps back to int(n_seen (1 - 0.4)) of the n_seen tokens seen
    "ratio": ({"kind": "CompressionRatioDecodingPress", "base": "KeyDiffPress", "interval": 10, "ratio": 0.4},
              ("CompressionRatioDecodingPress", 0.4, {"base_press": "KeyDiffPress", "compression_interval": 10})),
    # SnapKV keeps 176 of the context, then every 8 steps back to 100: the first compression holds 191
    "prefill": ({"kind": "PrefillDecodingPress", "prefill": "SnapKVPress", "prefill_ratio": PREFILL_RATIO,
                 "decoding": {"kind": "DecodingPress", "base": "KeyDiffPress", "interval": 8, "target": 100}},
                ("PrefillDecodingPress", PREFILL_RATIO, {"prefilling_press": "SnapKVPress", "decoding_press": kvpress(
                    "DecodingPress", 0, base_press="KeyDiffPress", compression_interval=8, target_size=100)})),
    # QFilterPress's per-layer filters (seeded random, the same array on both sides): every 12 steps back to 120
    "qfilter": ({"kind": "DecodingPress", "base": "QFilterPress", "interval": 12, "target": 120},
                ("DecodingPress", 0, {"base_press": "QFilterPress", "q_filters": Q_FILTERS, "compression_interval": 12,
                                      "target_size": 120})),
    # both in one (the suite's case): SnapKV keeps 176, then every 8 steps back to int(n_seen (1 - 0.6)) (191 -> 134)
    "prefill_ratio": ({"kind": "PrefillDecodingPress", "prefill": "SnapKVPress", "prefill_ratio": PREFILL_RATIO,
                       "decoding": {"kind": "CompressionRatioDecodingPress", "base": "KeyDiffPress", "interval": 8,
                                    "ratio": 0.6}},
                      ("PrefillDecodingPress", PREFILL_RATIO,
                       {"prefilling_press": "SnapKVPress", "decoding_press": kvpress(
                           "CompressionRatioDecodingPress", 0.6, base_press="KeyDiffPress", compression_interval=8)})),
}

# the suite runs one case (its time: PrefillDecodingPress over CompressionRatioDecodingPress, whose machinery is
# DecodingPress's) and DMSPress's and LUKVPress's kept sets and bytes; KVP_KVPRESS_FULL=1 all cases and the answers
FULL = bool(os.environ.get("KVP_KVPRESS_FULL"))
SUITE = tuple(CASES) if FULL else ("prefill_ratio",)

# kvpress's side: its pipeline's prefill and greedy loop (kvpress_worker.greedy: the question in one step at
# positions after the context, then one id a step), a Tracker of every slot's position, the length of layer
# 0's cache after each decoding step
WORKER = r"""
import contextlib, json, sys, torch
import numpy as np
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
import kvpress
from kvpress.presses.scorer_press import compute_n_kept
from transformers import DynamicCache

def build(spec):
    kind = spec["kind"]
    if kind == "PrefillDecodingPress":
        pre = getattr(kvpress, spec["prefill"])(compression_ratio=spec["prefill_ratio"])
        return kvpress.PrefillDecodingPress(prefilling_press=pre, decoding_press=build(spec["decoding"]))
    base = getattr(kvpress, spec["base"])()
    if spec["base"] == "QFilterPress":  # the job's filters in place of the download
        base.q_filters = torch.tensor(job["q_filters"], dtype=torch.float32)
        base.post_init_from_model = lambda model: None
    if kind == "DecodingPress":
        return kvpress.DecodingPress(base_press=base, compression_interval=spec["interval"], target_size=spec["target"])
    return kvpress.CompressionRatioDecodingPress(base_press=base, compression_interval=spec["interval"],
                                                 target_compression_ratio=spec["ratio"])

def gap_of(press):
    # each compression's least gap (over kv heads) between the n_kept-th and the next score, in float32 epsilons
    # relative to the n_kept-th: a gap of a few is a tie at float32 precision, broken by rounding
    gaps, score = [], press.score
    def scored(module, *args, **kwargs):
        s = score(module, *args, **kwargs)
        n = compute_n_kept(s.shape[-1], press.compression_ratio)
        if n < s.shape[-1]:
            v = s[0].sort(dim=-1, descending=True).values  # [K, k_len]
            gaps.append(float(((v[:, n - 1] - v[:, n]) / v[:, n - 1].abs() / torch.finfo(v.dtype).eps).min()))
        return s
    press.score = scored
    return gaps

job = json.load(open(sys.argv[1]))
path = w.build_tiny(job["tiny"], job["save_to"])
model = w.load(path, "sdpa")
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])
out = {}
for key, spec in job["presses"].items():
    press = build(spec)
    prefill = isinstance(press, kvpress.PrefillDecodingPress)
    dec = press.decoding_press if prefill else press
    scorers = [p for p in (press.prefilling_press if prefill else None, dec.base_press) if p is not None]
    gaps = [gap_of(p) for p in scorers]
    tracker = w.Tracker(scorers)
    lengths = []
    cache = DynamicCache()
    with torch.no_grad(), (press(model) if prefill else contextlib.nullcontext()):  # the pipeline's prefill
        hooks = tracker.attach(model)
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
        [h.remove() for h in hooks]
    kept = tracker.kept()
    with torch.no_grad(), press(model):
        hooks = tracker.attach(model)
        hooks.append(model.model.layers[0].self_attn.register_forward_hook(
            lambda m, a, k, o: lengths.append(k["past_key_values"].layers[0].keys.shape[2]), with_kwargs=True))
        answer = w.greedy(model, cache, question, ctx.shape[1], job["n_new"])
        [h.remove() for h in hooks]
    out[key] = {"kept": kept, "kept_end": tracker.kept(), "answer": answer, "lengths": lengths,
                "gaps": [g for gap in gaps for g in gap]}

# LUKVPress (its default inner press, ExpectedAttentionPress(epsilon=0.02)), the job's curve in place of the download
curve = np.load(job["lukv"]["curve"])
press = kvpress.LUKVPress(compression_ratio=job["lukv"]["ratio"])
press._budget_curves = curve
with torch.no_grad():
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
full_keys = [full.layers[i].keys[0] for i in range(len(full.layers))]
out["lukv"] = w.run(model, press, ctx, question, job["n_new"], full_keys)
for layer in model.model.layers:  # kvpress leaves its mask on the modules
    layer.self_attn.masked_key_indices = None

# DMSPress over KVzapPress with our surrogate file's weights in kvpress's KVzapModel (its download skipped), the
# threshold midway between the two middle log-scores of the context over every layer (no score at it)
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
z, cfg = np.load(job["dms"]["surrogate"]), model.config
zm = KVzapModel(KVzapConfig(input_dim=cfg.hidden_size, output_dim=cfg.num_key_value_heads,
                            n_modules=cfg.num_hidden_layers, hidden_dim=None)).eval()
with torch.no_grad():
    for l, lin in enumerate(zm.layers):
        lin.weight.copy_(torch.tensor(z["w"][l].T))
        lin.bias.copy_(torch.tensor(z["b"][l]))
zap = kvpress.KVzapPress(model_type="linear")
zap.kvzap_model = zm
zap.post_init_from_model = lambda model: None
scores = []
hooks = [layer.self_attn.register_forward_hook(lambda m, a, k, o: scores.append(zap.score(m, k["hidden_states"], None,
         None, None, k)), with_kwargs=True) for layer in model.model.layers]
with torch.no_grad():
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
[h.remove() for h in hooks]
every = torch.cat([s.flatten() for s in scores]).sort().values
threshold = float(every[len(every) // 2 - 1: len(every) // 2 + 1].mean())  # between the two middle scores
press = kvpress.DMSPress(press=zap, threshold=threshold, sliding_window_size=job["dms"]["window"])
res = w.run(model, press, ctx, question, job["n_new"], [full.layers[i].keys[0] for i in range(len(full.layers))])
out["dms"] = {**res, "threshold": threshold, "compression_ratio": press.compression_ratio}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module", params=["llama"])
def tiny_run(request, tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, kvpress's results by case) on a tiny architecture: the Llama in
    the suite (add "qwen2" to `params` for the tiny Qwen2: biases, tied embeddings, a second kvpress run)."""
    tmp = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(11)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    config = dict(TINY, tie_word_embeddings=request.param == "qwen2")
    job = {"save_to": str(tmp / "ckpt"), "tiny": {"kind": request.param, "seed": 0, "config": config},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW,
           "presses": {key: CASES[key][0] for key in SUITE}, "q_filters": Q_FILTERS.tolist(),
           "dms": {"surrogate": str(zap_weights(tmp, config)), "window": DMS_WINDOW},
           "lukv": {"curve": str(lukv_curve(tmp, config)), "ratio": LUKV_RATIO}}
    ref = {**kvpress_ref.job(job, tmp, script=WORKER), "dms_surrogate": job["dms"]["surrogate"],
           "lukv_curve": job["lukv"]["curve"]}
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, ref


def zap_weights(tmp: pathlib.Path, cfg: dict) -> pathlib.Path:
    """Seeded random linear surrogate weights (nonzero biases) for the tiny model, in kvzap's file format: the
    arrays both sides load (kvzap's surrogate=<file>, kvpress's KVzapModel)."""
    d, kh, n = cfg["hidden_size"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    w = random_surrogate("linear", d, kh, n, seed=5)
    w["b"] = (0.1 * np.random.default_rng(6).standard_normal(w["b"].shape)).astype(np.float32)
    path = tmp / "zap_linear.npz"
    np.savez(path, kind="linear", d_model=d, kv_heads=kh, n_layers=n, **w)
    return path


def lukv_curve(tmp: pathlib.Path, cfg: dict) -> pathlib.Path:
    """A seeded random LU-KV budget curve [99, L, K] (row i: prune ratios spread around (i + 1) / 100), the
    array both sides get (kvpress's LUKVPress downloads the authors' one curve, for Llama-3.1-8B)."""
    shape = (99, cfg["num_hidden_layers"], cfg["num_key_value_heads"])
    u = np.random.default_rng(8).random(shape)
    curve = np.clip(np.arange(1, 100)[:, None, None] / 100 + 0.4 * (u - 0.5), 0, 0.99).astype(np.float32)
    np.save(tmp / "lukv_curve.npy", curve)
    return tmp / "lukv_curve.npy"


def lengths_of(pol: Decoding, prompt_kept: int) -> list[int]:
    """Layer 0's cache length after each decoding step (the question, then N_NEW - 1 ids), by kvpress's rule
    re-simulated in Python: a step's tokens appended, at the interval-th step (or one of T >= target
    tokens) back to the target if the cache holds more, the count restarting."""
    held, steps, out = prompt_kept, 0, []
    for i, t in enumerate([N_Q] + [1] * (N_NEW - 1)):
        held, steps = held + t, steps + 1
        n_seen = N_CTX + N_Q + i
        target = max(1, int(n_seen * (1 - pol.target_ratio))) if pol.target_ratio else pol.target
        if steps >= pol.interval or t >= target:
            held, steps = min(held, target), 0
        out.append(held)
    return out


@pytest.mark.parametrize("case", SUITE)
def test_decoding_presses_equal_kvpress(tiny_run, case):
    """The kept positions per (layer, kv head) after the prefill and after the last id fed (three to six
    compressions while decoding), layer 0's length after every step, and the greedy ids equal kvpress's."""
    model, ctx, question, ref = tiny_run
    want = ref[case]
    name, ratio, fields = CASES[case][1]
    pol = kvpress(name, ratio, max_new=MAX_NEW, **fields)
    eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    answer = eng.continue_generate(state, question[None], N_NEW)[0]
    end = eng.feed(state, np.concatenate([question, answer[:-1]])[None], chunk=(N_Q,) + (1,) * (N_NEW - 1))
    assert want["gaps"] and min(want["gaps"]) >= TIE_EPS, (case, "a float32 tie at kvpress's boundary (the module "
                                                           "docstring): choose another case", min(want["gaps"]))
    assert want["lengths"] == lengths_of(pol, len(want["kept"][0][0]))
    assert min(want["lengths"]) < max(want["lengths"])  # compressed while decoding
    for what, st in (("kept", state), ("kept_end", end)):
        got = [[h.tolist() for h in layer] for layer in eng.kept_positions(st)]
        for i, (g, w) in enumerate((g, w) for gl, wl in zip(got, want[what], strict=True)
                                   for g, w in zip(gl, wl, strict=True)):
            assert g == w, (case, what, divmod(i, model.cfg.n_kv_heads), sorted(set(g) ^ set(w))[:10])
    assert len(want["kept_end"][0][0]) == want["lengths"][-1]
    assert any(p >= N_CTX for layer in want["kept_end"] for h in layer for p in h)  # the answer compressed too
    assert answer.tolist() == want["answer"]


def test_decoding_press_front_door():
    """kvpress's field names and defaults; what is refused, before anything runs."""
    assert {"DecodingPress", "CompressionRatioDecodingPress", "PrefillDecodingPress"} <= set(PRESSES)
    pol = kvpress("DecodingPress", 0, base_press="KnormPress")
    assert (pol.interval, pol.target, pol.target_ratio, pol.prefill) == (512, 2048, 0.0, None)  # kvpress's defaults
    assert type(pol.press) is Knorm and pol.press.dense_layers == 0
    assert kvpress("CompressionRatioDecodingPress", 0, base_press="KnormPress").target_ratio == 0.5
    inner = kvpress("KeyDiffPress", 0.3)
    assert kvpress("DecodingPress", 0, base_press=inner).press == dataclasses.replace(inner, ratio=0.0)
    pre = kvpress("PrefillDecodingPress", 0.5, prefilling_press="SnapKVPress", window_size=16,
                  decoding_press=kvpress("CompressionRatioDecodingPress", 0.25, base_press="KeyDiffPress"))
    assert type(pre.prefill) is SnapKV and (pre.prefill.ratio, pre.prefill.obs_window) == (0.5, 16)
    assert type(pre.press) is KeyDiff and pre.target_ratio == 0.25
    # a prefill press alone is that press; no press at all is the full cache
    assert kvpress("PrefillDecodingPress", 0.5, prefilling_press="KnormPress") == kvpress("KnormPress", 0.5)
    # the state: the prompt's kept tokens + max_new, or the target + interval - 1, at most max_len
    assert pre.capacity(4000) == max(2000 + 256, int(4000 * 0.75) + 512 - 1)
    small = kvpress("DecodingPress", 0, base_press="KnormPress", target_size=64, compression_interval=8)
    assert small.capacity(1000) == 1000  # the whole prompt held until the first compression
    assert dataclasses.replace(small, prefill=kvpress("KnormPress", 0.5)).capacity(1000) == 500 + 256
    with pytest.raises(NotImplementedError, match="only KnormPress, KeyDiffPress and QFilterPress"):
        kvpress("DecodingPress", 0, base_press="SnapKVPress")
    with pytest.raises(ValueError, match="give base_press"):
        kvpress("DecodingPress", 0)
    with pytest.raises(ValueError, match="has no compression_ratio"):
        kvpress("DecodingPress", 0.5, base_press="KnormPress")
    with pytest.raises(ValueError, match="target_compression_ratio"):
        kvpress("CompressionRatioDecodingPress", 0.5, base_press="KnormPress", target_compression_ratio=0.25)
    with pytest.raises(ValueError, match="target_size is not a field"):
        kvpress("CompressionRatioDecodingPress", 0.5, base_press="KnormPress", target_size=10)
    with pytest.raises(ValueError, match="compression_interval=0"):
        kvpress("DecodingPress", 0, base_press="KnormPress", compression_interval=0)
    with pytest.raises(ValueError, match="prefilling press has compression_ratio"):
        kvpress("PrefillDecodingPress", 0.25, prefilling_press=kvpress("KnormPress", 0.5), decoding_press=pol)
    with pytest.raises(ValueError, match="unknown field"):
        kvpress("DecodingPress", 0, base_press="KnormPress", window=3)


def test_dms_press_over_kvzap_equals_kvpress_and_frees_what_it_masks(tiny_run):
    """DMSPress(KVzapPress) with the same surrogate on both sides, the threshold at the median log-score: per
    kv head the newest 64 tokens and every older one scoring >= threshold, the same positions per (layer, kv
    head) (data-dependent counts), the same greedy ids. kvpress masks the others (every head still stores 320
    keys and values); stored at what each layer kept (`Engine(fit=1)`), ours holds only the kept ones."""
    model, ctx, question, ref = tiny_run
    want = ref["dms"]
    assert "error" not in want, want
    pol = kvpress("DMSPress", 0, press="KVzapPress", model_type="linear", kvzap_model_name=ref["dms_surrogate"],
                  threshold=want["threshold"], sliding_window_size=DMS_WINDOW, max_new=N_Q + N_NEW)
    assert isinstance(pol, KVzap) and (pol.rule, pol.window, pol.kind) == ("threshold", DMS_WINDOW, "linear")
    max_len = N_CTX + N_Q + N_NEW
    eng = Engine(model, pol, max_len=max_len, fit=1)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[h.tolist() for h in layer] for layer in eng.kept_positions(state)]
    pairs = [(g, w) for gl, wl in zip(kept, want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    for i, (g, w) in enumerate(pairs):
        assert g == w, ("dms", divmod(i, model.cfg.n_kv_heads), sorted(set(g) ^ set(w))[:10])
    sizes = [len(h) for layer in want["kept"] for h in layer]
    assert min(sizes) >= DMS_WINDOW and len(set(sizes)) > 1 and max(sizes) < N_CTX  # data-dependent counts
    # kvpress: 3 layers x 2 heads x 320 tokens x 16 dims x (keys + values) x 4 bytes, the masked included; ours:
    # per layer K x (its mean kept per head + max_new) slots of keys, values, an int32 position and a float32 mass
    kh, d = model.cfg.n_kv_heads, model.cfg.d_model // model.cfg.n_heads
    assert want["cache_bytes"] == model.cfg.n_layers * kh * N_CTX * d * 2 * 4
    slots = sum(kh * (-(-sum(map(len, layer)) // kh) + N_Q + N_NEW) for layer in want["kept"])
    assert tree_nbytes(state.cache) == slots * (2 * d * 4 + 4 + 4) < want["cache_bytes"]
    if FULL:  # the question and 40 greedy ids (a decode step compiled for the fitted pool: suite time)
        assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]


def test_lukv_press_with_a_given_curve_equals_kvpress_and_frees_what_it_masks(tiny_run):
    """LUKVPress with the same (random) budget curve on both sides, its default ExpectedAttentionPress(epsilon=0.02):
    per (layer, kv head) kvpress's keep counts from the curve's row and the same kept positions, the same 40 greedy
    ids (KVP_KVPRESS_FULL=1); kvpress masks the others (320 tokens stored per head), ours stores a head pool."""
    from kvpolicies.lukv import LUKV

    model, ctx, question, ref = tiny_run
    want = ref["lukv"]
    assert "error" not in want, want
    pols = kvpress("LUKVPress", LUKV_RATIO, budget_curves=ref["lukv_curve"], n_layers=model.cfg.n_layers,
                   max_new=N_Q + N_NEW)
    assert all(isinstance(p, LUKV) and p.press.epsilon == 2e-2 for p in pols)
    eng = Engine(model, pols, max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[h.tolist() for h in layer] for layer in eng.kept_positions(state)]
    curve = np.load(ref["lukv_curve"])[49]  # [L, K]
    for layer, row in zip(want["kept"], curve, strict=True):  # kvpress's counts: floors, then the largest fractions
        ideal = np.clip(1 - row, 0, 1).astype(np.float32) * np.float32(N_CTX)
        counts = np.floor(ideal).astype(int)
        counts[np.argsort(-(ideal - counts), kind="stable")[:int(np.round(ideal.sum())) - counts.sum()]] += 1
        assert [len(h) for h in layer] == counts.tolist()
    pairs = [(g, w) for gl, wl in zip(kept, want["kept"], strict=True) for g, w in zip(gl, wl, strict=True)]
    for i, (g, w) in enumerate(pairs):
        assert g == w, ("lukv", divmod(i, model.cfg.n_kv_heads), sorted(set(g) ^ set(w))[:10])
    assert tree_nbytes(state.cache) == 172_884 < want["cache_bytes"] == 245_760  # pools + counts + query sums
    if FULL:  # the question and 40 greedy ids (three layers' decode steps compiled: suite time)
        assert eng.continue_generate(state, question[None], N_NEW)[0].tolist() == want["answer"]
