"""kvpress 0.5.5's channel press beside `kvpolicies.compat.kvpress`: ThinKPress on the tiny random Llama
(3 layers, 4 query / 2 kv heads, head_dim 16), the same token ids. kvpress prefills the context under the
press in a subprocess with its own transformers (.venv/kvpress-ref, `WORKER` below, over
evals/kvpress_worker.py) and zeroes the pruned key channels of a cache of the same size; ours stores only
the kept channels. The pruned channels per (layer, kv head) and the greedy answers must be identical, and
our stored bytes are measured against kvpress's cache tensors."""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

from kvpolicies.compat import kvpress
from kvpolicies.memory import tree_nbytes
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
# key_channel_compression_ratio: 8 (and 12) of 16 channels pruned; 0.75 under KVP_KVPRESS_FULL=1 (suite time)
CHANNEL_RATIOS = (0.5, 0.75) if os.environ.get("KVP_KVPRESS_FULL") else (0.5,)
SNAP_RATIOS = (0.5,)  # ComposedPress([SnapKVPress(r), ThinKPress(0.5)])
CAM_INTERVAL = 8  # CAMPress(KnormPress, compression_interval=8, target_size=N_CTX)

# kvpress's side: evals/kvpress_worker.py's model building, prefill and greedy decoding. ThinKPress keeps
# every token and zeroes the pruned channels: a channel is pruned where a head's cached keys are all 0.
WORKER = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
import kvpress
from transformers import DynamicCache

job = json.load(open(sys.argv[1]))
path = job.get("checkpoint") or w.build_tiny(job["tiny"], job["save_to"])
model = w.load(path, "sdpa", job.get("gguf_file"))
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])
with torch.no_grad():
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
out = {}
for c in job["ratios"] + [f"snapkv{r}" for r in job.get("snapkv", [])]:
    if isinstance(c, str):  # ComposedPress([SnapKVPress(r), ThinKPress(0.5)])
        press = kvpress.ComposedPress([kvpress.SnapKVPress(compression_ratio=float(c[6:])),
                                       kvpress.ThinKPress(key_channel_compression_ratio=0.5,
                                                          window_size=job["window"])])
    else:
        press = kvpress.ThinKPress(key_channel_compression_ratio=c, window_size=job["window"])
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
    keys = [layer.keys[0] for layer in cache.layers]  # [K, n, D] each
    pruned = [[sorted(torch.nonzero((k[h] == 0).all(dim=0)).flatten().tolist()) for h in range(k.shape[0])]
              for k in keys]
    kept = []  # each cached key's context position: the nearest uncompressed key over the head's kept channels
    for layer, k in enumerate(keys):
        heads = []
        for h in range(k.shape[0]):
            on = torch.ones(k.shape[-1], dtype=torch.bool)
            on[pruned[layer][h]] = False
            d = torch.cdist(k[h][:, on], full.layers[layer].keys[0, h][:, on],
                            compute_mode="donot_use_mm_for_euclid_dist")
            assert float(d.min(-1).values.max()) < 1e-5
            heads.append(sorted(d.argmin(-1).tolist()))
        kept.append(heads)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    tokens = [int(k.shape[1]) for k in keys]
    n, q = ctx.shape[1], question.shape[1]
    with torch.no_grad():  # the question's last logits after the compressed context (on a copy of the cache)
        logits = model(input_ids=question, past_key_values=w._copy(cache),
                       position_ids=torch.arange(n, n + q)[None]).logits
    answer = w.greedy(model, cache, question, n, job["n_new"])
    out[str(c)] = {"pruned": pruned, "kept": kept, "cache_bytes": held, "tokens": tokens, "answer": answer,
                   "logits": logits[0, -1].tolist(), "compression_ratio": press.compression_ratio}
if job.get("cam"):  # CAMPress over KnormPress: the context, a 1-token question, greedy ids up to the first compression
    c = job["cam"]
    press = kvpress.CAMPress(base_press=kvpress.KnormPress(), compression_interval=c["interval"],
                             target_size=len(job["context"]), merge_budget=c["merge_budget"])
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ctx, past_key_values=cache)
        ids = w.greedy(model, cache, question[:, :1], ctx.shape[1], c["interval"])
    fed = torch.tensor([job["context"] + job["question"][:1] + ids[:-1]])
    with torch.no_grad():  # every fed token's key, uncompressed
        whole = DynamicCache()
        model(input_ids=fed, past_key_values=whole)
    kept = []
    for layer in range(len(cache.layers)):
        k, ref = cache.layers[layer].keys[0], whole.layers[layer].keys[0]  # [K, m, D], [K, n, D]
        d = torch.cdist(k, ref, compute_mode="donot_use_mm_for_euclid_dist")
        assert float(d.min(-1).values.max()) < 1e-5
        kept.append([sorted(d[h].argmin(-1).tolist()) for h in range(k.shape[0])])
    out["cam"] = {"ids": ids, "kept": kept, "tokens": [int(x.keys.shape[2]) for x in cache.layers]}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module", params=["llama"])
def tiny_run(request, tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, kvpress's results by press) on a tiny architecture: the Llama in
    the suite; the tiny Qwen2 (biases, tied embeddings: a second kvpress run) gave the same results when
    this file was written (add "qwen2" to `params` to rerun it)."""
    tmp = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(7)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    config = dict(TINY, tie_word_embeddings=request.param == "qwen2")
    job = {"save_to": str(tmp / "ckpt"), "tiny": {"kind": request.param, "seed": 0, "config": config},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW, "ratios": [0.0, *CHANNEL_RATIOS],
           "snapkv": list(SNAP_RATIOS), "cam": {"interval": CAM_INTERVAL, "merge_budget": 32},
           "window": 32}
    ref = kvpress_ref.job(job, tmp, script=WORKER)
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, ref


def ours(model: Llama, pol, ctx: np.ndarray, question: np.ndarray):
    """(pruned channels [layer][kv head], kept positions, answer, the question's last logits, the compressed
    cache) through the policy `pol`."""
    eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW)
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
    logits = np.asarray(eng.feed(state, question[None]).logits[0], np.float64)
    answer = eng.continue_generate(state, question[None], N_NEW)[0].tolist()
    chan = getattr(state.cache[0], "chan", None)  # [L, B, K, D]: kept channels, then the pruned ones
    pruned = None
    if chan is not None:
        chan, c = np.asarray(chan), pol.kept_channels(chan.shape[-1])
        pruned = [[sorted(chan[layer, 0, h, c:].tolist()) for h in range(chan.shape[2])]
                  for layer in range(chan.shape[0])]
    return pruned, kept, answer, logits, state.cache


@pytest.mark.parametrize("channel_ratio", CHANNEL_RATIOS)
def test_think_prunes_kvpress_channels_and_answers(tiny_run, channel_ratio):
    """ThinKPress(key_channel_compression_ratio=c, window_size=32): the same int(16 c) channels pruned per
    (layer, kv head) as kvpress, the same greedy answer after the question. Stored bytes: kvpress's cache
    keeps every key channel (zeroed), ours the 16 - int(16 c) kept ones of the 320 context keys."""
    model, ctx, question, ref = tiny_run
    want = ref[str(channel_ratio)]
    assert want["compression_ratio"] == channel_ratio / 2  # kvpress's read-only compression_ratio
    assert all(len(h) == int(16 * channel_ratio) for layer in want["pruned"] for h in layer)
    pol = kvpress("ThinKPress", channel_ratio / 2, key_channel_compression_ratio=channel_ratio, max_new=N_Q + N_NEW)
    pruned, kept, answer, logits, cache = ours(model, pol, ctx, question)
    assert pruned == want["pruned"]
    assert kept == [[list(range(N_CTX))] * 2] * 3  # every token
    assert answer == want["answer"]
    err = np.abs(logits - want["logits"]).max()
    assert err < 1e-4, err  # the question read the zeroed channels as kvpress's
    # the answers are the uncompressed cache's on this random model; the logits are not (kvpress's no-op run)
    assert np.abs(np.asarray(ref["0.0"]["logits"]) - want["logits"]).max() > 100 * err
    # bytes: kvpress's key and value tensors hold every key channel (zeroed ones included) of every token;
    # ours the kept channels of the context's keys (an engine of max_len = 334 slots for the prompt) and
    # every value, the question's and answer's 14 tokens whole, int32 positions and channel orders, `chosen`
    layers, kh, d, m, r = 3, 2, 16, N_CTX + N_Q + N_NEW, N_Q + N_NEW
    c = d - int(d * channel_ratio)
    assert want["tokens"] == [N_CTX] * layers and want["cache_bytes"] == layers * kh * N_CTX * 2 * d * 4
    assert cache[0].k.kept.shape[-1] == c
    mine = tree_nbytes(cache)
    assert mine == layers * (kh * (m * c + r * d + (m + r) * d + d) + (m + r)) * 4 + layers  # + a bool per layer
    theirs = layers * kh * m * 2 * d * 4  # kvpress's cache once the question and answer are appended
    assert mine < theirs and tree_nbytes(cache[0].k.kept) == layers * kh * m * c * 4


@pytest.mark.parametrize("snap_ratio", SNAP_RATIOS)
def test_think_after_snapkv_keeps_kvpress_tokens_channels_and_answers(tiny_run, snap_ratio):
    """ComposedPress([SnapKVPress(r), ThinKPress(0.5)]): SnapKV keeps its n_kept tokens per kv head, then
    ThinK scores the channels on the keys it kept (and the context's last 32 queries): the same kept
    positions and pruned channels per (layer, kv head) as kvpress, the same answer, the question's logits
    within 1e-4. Our state stores the kept tokens with 8 of 16 key channels."""
    model, ctx, question, ref = tiny_run
    want = ref[f"snapkv{snap_ratio}"]
    r = 1 - (1 - snap_ratio) * (1 - 0.25)  # kvpress's compression_ratio of the composition
    pol = kvpress("ComposedPress", r, presses=[["SnapKVPress", snap_ratio], ["ThinKPress", 0.25]], max_new=N_Q + N_NEW)
    pruned, kept, answer, logits, cache = ours(model, pol, ctx, question)
    n_kept = int(N_CTX * (1 - snap_ratio))
    assert all(len(h) == n_kept for layer in want["kept"] for h in layer)
    assert kept == want["kept"]
    assert pruned == want["pruned"]
    assert answer == want["answer"]
    assert np.abs(logits - want["logits"]).max() < 1e-4
    assert pruned != ref["0.5"]["pruned"]  # ThinKPress(0.5) alone, over every key, prunes other channels
    # bytes: kvpress's cache holds the n_kept tokens' 16 key channels; ours their 8 kept ones (+ whole values,
    # positions per head, the channel orders and the whole slots of the question and answer)
    assert want["cache_bytes"] == 3 * 2 * n_kept * 2 * 16 * 4
    assert tree_nbytes(cache[0].k.kept) == 3 * 2 * int((N_CTX + N_Q + N_NEW) * (1 - snap_ratio)) * 8 * 4


# -- CAMPress: merging while decoding; its draw is ours (torch.bernoulli's cannot be reproduced) -----------------


def np_cam(q, k, v, target, interval, merge_budget, seed, inv):
    """kvpress's `CAMPress(base_press=KnormPress(), compression_interval, target_size, merge_budget)` re-simulated
    in float64 numpy from its code on one attention layer (q [T, H, D], k, v [T, K, D] before RoPE; the first
    `target` tokens a prompt, then one decode step per token), torch.bernoulli replaced by our draw (u < p, u the
    documented hash of (seed, kv head, position)): (the decode steps' outputs [T - target, H, D], the final
    positions, values [K, n, D], merges done, merge candidates)."""
    from tests.refs.oracle import rope_complex
    from tests.refs.prompt_scored import np_hash

    t, h_n, d = q.shape
    kh = k.shape[1]
    g = h_n // kh
    at = np.arange(t)[:, None]
    qr = rope_complex(q, np.broadcast_to(at, q.shape[:2]), inv)  # [T, H, D]
    kr = rope_complex(k, np.broadcast_to(at, k.shape[:2]), inv)  # [T, K, D]
    pos, keys, vals = list(range(target)), kr[:target].transpose(1, 0, 2), v[:target].transpose(1, 0, 2).copy()
    att = np.zeros((kh, target))  # attention received from the decode queries (summed over G: p is a ratio)
    outs, steps, merges, candidates = [], 0, 0, 0
    for p in range(target, t):
        pos.append(p)
        keys = np.concatenate([keys, kr[p][:, None]], axis=1)
        vals = np.concatenate([vals, v[p][:, None]], axis=1)
        att = np.concatenate([att, np.zeros((kh, 1))], axis=1)
        out = np.zeros((h_n, d))
        for h in range(h_n):
            lg = keys[h // g] @ qr[p, h] / np.sqrt(d)
            w = np.exp(lg - lg.max())
            w /= w.sum()
            out[h] = w @ vals[h // g]
            att[h // g] += w
        outs.append(out)
        steps += 1
        n = len(pos)
        if steps < interval or n <= target:
            continue
        score = (-np.linalg.norm(keys, axis=-1)).mean(0)  # [n] the base press's score averaged over heads
        evict = sorted(sorted(range(n), key=lambda j: score[j])[:n - target])
        kept = sorted(set(range(n)) - set(evict))
        merge = sorted(sorted(evict, key=lambda j: (-score[j], -pos[j]))[:steps])  # ties: the later position
        new_vals = vals.copy()
        for i in merge:
            start = sum(1 for j in kept if j <= i)  # searchsorted(kept, i, right=True)
            window = kept[start:start + merge_budget]
            for h in range(kh):
                candidates += 1
                mean = att[h, window].sum() / max(len(window), 1)
                prob = (0.0 if att[h, i] == 0 else 1.0) if mean == 0 else min(max(att[h, i] / mean, 0.0), 1.0)
                if window and np_hash(seed, h, pos[i]) < prob:
                    new_vals[h, window] += vals[h, i] / len(window)
                    merges += 1
        pos, keys, vals, att = [pos[j] for j in kept], keys[:, kept], new_vals[:, kept], att[:, kept]
        steps = 0
    return np.stack(outs), pos, vals, merges, candidates


def test_cam_merges_as_kvpress_rule_with_our_draw():
    """CAM (kvpress's CAMPress over KnormPress: target 12, interval 4, merge_budget 3) on one attention layer of
    random q, k, v: a 12-token prompt, then 13 one-token decode steps (three compressions). Outputs, kept positions and
    merged values equal `np_cam` (kvpress's rule in numpy with our draw); the draw matters (some merges pass,
    some do not), and the state is ordinary slots (`Decoding`'s: max_len without a prefilling press)."""
    import jax.numpy as jnp

    from kvpolicies import Rope
    from kvpolicies.cam import CAM
    from tests.refs.helpers import run_policy
    from tests.refs.oracle import default_inv_freq

    target, interval, mb, n_dec, d = 12, 4, 3, 13, 8
    rope = Rope(d, 10000.0)
    rng = np.random.default_rng(3)
    t = target + n_dec
    q, k, v = (rng.standard_normal((1, t, h, d)).astype(np.float32) for h in (4, 2, 2))
    pol = kvpress("CAMPress", 0, base_press="KnormPress", compression_interval=interval, target_size=target,
                  merge_budget=mb)
    assert type(pol) is CAM and (pol.interval, pol.target, pol.merge_budget) == (interval, target, mb)
    _, st = run_policy(pol.prompt_policy(), q[:, :target], k[:, :target], v[:, :target], [target], rope, max_len=t)
    st = jax.jit(pol.after_prompt)(st)
    out, st = run_policy(pol, q[:, target:], k[:, target:], v[:, target:], [1], rope, state=st, start=target)
    want_out, want_pos, want_vals, merges, candidates = np_cam(
        *(x[0].astype(np.float64) for x in (q, k, v)), target, interval, mb, pol.seed, default_inv_freq(d, 10000.0))
    np.testing.assert_allclose(out[0], want_out, atol=1e-5, rtol=0)
    pos = np.asarray(st.pos[0])  # [K, S]
    order = np.argsort(np.where(pos[0] >= 0, pos[0], 10**9))
    assert all(sorted(p[p >= 0].tolist()) == want_pos for p in pos)
    np.testing.assert_allclose(np.asarray(st.v[0])[:, order[:len(want_pos)]], want_vals, atol=1e-5, rtol=0)
    assert 0 < merges < candidates  # the draw decides
    s = t  # the whole prompt kept (no prefilling press) and the steps after it: every slot of max_len
    assert tree_nbytes(st) == 2 * s * (2 * d * 4 + 4 + 4) + 4  # keys, values, positions, attention; the step count
    assert isinstance(st.v, jnp.ndarray)


def test_cam_evicts_kvpress_tokens(tiny_run):
    """CAMPress(base_press=KnormPress(), compression_interval=8, target_size=320, merge_budget=32) after the
    320-token context: a 1-token question and 7 greedy ids make kvpress's 8th decode step, which compresses
    the 328 tokens back to 320; we feed the same tokens one step each (our last logits give kvpress's 8th id).
    Its merges draw torch.bernoulli: the merged values are not compared here (see
    test_cam_merges_as_kvpress_rule_with_our_draw). The same kept positions in every (layer, kv head) but exact
    ties of repeated tokens in layer 0: the evicted tokens do not depend on the draw."""
    model, ctx, question, ref = tiny_run
    want = ref["cam"]
    assert want["tokens"] == [N_CTX] * 3
    pol = kvpress("CAMPress", 0, base_press="KnormPress", compression_interval=CAM_INTERVAL, target_size=N_CTX)
    eng = Engine(model, pol, max_len=N_CTX + CAM_INTERVAL + 1)
    state = eng.compress(eng.prompt(ctx[None]))
    after = eng.feed(state, np.asarray([question[:1].tolist() + want["ids"][:-1]]), chunk=1)  # kvpress's 8 steps
    assert int(np.argmax(np.asarray(after.logits)[0])) == want["ids"][-1]  # its last id (before the compression)
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(after)]
    assert kept[1:] == want["kept"][1:]
    # layer 0: a key before RoPE is its token's, so repeated ids tie exactly in norm (ours keeps the newer;
    # kvpress ranks the rotated keys, whose norms differ in the last bits): the sets may differ only there
    fed = ctx.tolist() + question[:1].tolist() + want["ids"][:-1]
    for ours_h, theirs_h in zip(kept[0], want["kept"][0]):
        mine, theirs = set(ours_h) - set(theirs_h), set(theirs_h) - set(ours_h)
        assert len(mine) <= 2 and sorted(fed[j] for j in mine) == sorted(fed[j] for j in theirs)
    assert all(len(h) == N_CTX for layer in kept for h in layer) and kept[0][0] != list(range(N_CTX))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVP_KVPRESS_FULL"), reason="suite time: KVP_KVPRESS_FULL=1 runs it (270 s "
                    "at load 17 on the 2 shared cores, mostly compiling SmolLM2's 30 layers)")
def test_smollm2_think_equals_kvpress(tmp_path, kvpress_ref):
    """SmolLM2 (30 layers, 3 kv heads, head_dim 64) on 1,024 tokens of Pride & Prejudice with a needle,
    ThinKPress(key_channel_compression_ratio=0.5): the pruned channels per (layer, kv head) as kvpress's (mean
    Jaccard >= 0.98: near ties of the channel scores may swap) and the same 12 greedy ids. Measured: all 90 sets
    identical, the same ids."""
    from evals.data import default_text
    from models.loading import load_default_model, smollm2_gguf_path

    model, tok = load_default_model()
    text = default_text()[20000:24000]
    cut = len(text) // 2
    text = text[:cut] + " The secret passphrase is 'purple elephant 42'. " + text[cut:]
    ctx = np.asarray(tok.encode(text), np.int32)[:1024]
    question = np.asarray(tok.encode("\nQuestion: What is the secret passphrase?\nAnswer:"), np.int32)
    path = smollm2_gguf_path()
    ref = kvpress_ref.job({"checkpoint": str(path.parent), "gguf_file": path.name, "context": ctx.tolist(),
                           "question": question.tolist(), "n_new": 12, "ratios": [0.5], "window": 32}, tmp_path,
                          script=WORKER)["0.5"]
    pol = kvpress("ThinKPress", 0.25, max_new=len(question) + 12)
    eng = Engine(model, pol, max_len=len(ctx) + len(question) + 12)
    state = eng.compress(eng.prompt(ctx[None]))
    chan = np.asarray(state.cache[0].chan)  # [L, B, K, D]
    c = pol.kept_channels(chan.shape[-1])
    pruned = [set(chan[layer, 0, h, c:].tolist()) for layer in range(chan.shape[0]) for h in range(chan.shape[2])]
    want = [set(h) for layer in ref["pruned"] for h in layer]
    jac = [len(a & b) / len(a | b) for a, b in zip(pruned, want)]
    print(f"ThinK on SmolLM2: mean pruned-channel Jaccard {np.mean(jac):.4f} (min {min(jac):.4f}), "
          f"{sum(j == 1 for j in jac)} of {len(jac)} sets identical")
    assert len(pruned) == len(want) == 90 and np.mean(jac) >= 0.98
    assert eng.continue_generate(state, question[None], 12)[0].tolist() == ref["answer"]


def test_think_stream_folds_full_whole_slots_as_the_numpy_rule():
    """Our stream extension (kvpolicies.think, ThinK alone): 30 tokens through `think` (max_new 6) from an empty
    state, in chunks of 5 and 1. A token that finds the 6 whole slots full attends to them, then they fold into
    the prompt slots with their kept channels (chosen at the first fold by ThinK's score over the whole keys and
    that token's query) and the token joins the emptied whole slots; outputs equal the rule re-simulated in
    float64 numpy (keys after RoPE, zeroed channels)."""
    from kvpolicies import Rope
    from tests.refs.helpers import run_policy
    from tests.refs.oracle import default_inv_freq, rope_complex

    t, g, kh, d, r = 30, 2, 2, 8, 6
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, t, h, d)).astype(np.float32) for h in (g * kh, kh, kh))
    pol = kvpress("ThinKPress", 0.25, max_new=r)  # 4 of 8 channels pruned
    out, st = run_policy(pol, q, k, v, [5, 1], Rope(d, 10000.0), max_len=32)
    at = np.arange(t)[:, None]
    inv = default_inv_freq(d, 10000.0)
    qr = rope_complex(q[0].astype(np.float64), np.broadcast_to(at, (t, g * kh)), inv)  # [T, H, D]
    kr = rope_complex(k[0].astype(np.float64), np.broadcast_to(at, (t, kh)), inv)  # [T, K, D]
    keys, whole, pruned, want = kr.copy(), [], [], []
    for p in range(t):
        seen = pruned + whole + [p]  # the token attends to the cache as it finds it, itself included
        row = []
        for h in range(g * kh):
            lg = keys[seen, h // g] @ qr[p, h] / np.sqrt(d)
            w = np.exp(lg - lg.max())
            row.append((w / w.sum()) @ v[0, seen, h // g])
        want.append(row)
        if len(whole) == r:  # then full whole slots fold, before the token joins them
            if not pruned:
                k_sq = (kr[whole] ** 2).sum(0)  # [K, D]
                q_sq = (qr[p] ** 2).reshape(kh, g, d).sum(1)  # [K, D]
                drop = [np.argsort(q_sq[h] * k_sq[h], kind="stable")[:d // 2] for h in range(kh)]
            for j in whole:
                for h in range(kh):
                    keys[j, h, drop[h]] = 0.0
            pruned, whole = pruned + whole, []
        whole.append(p)
    np.testing.assert_allclose(out[0], np.asarray(want), atol=1e-5, rtol=0)
    assert np.asarray(st.chosen).all() and sorted(np.asarray(st.chan[0, 0, d // 2:]).tolist()) == sorted(drop[0])
