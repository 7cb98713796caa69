"""kvpress 0.5.5's wrappers AdaKVPress over scorers other than SnapKV (`kvpolicies.adascored`),
ChunkKVPress (`kvpolicies.compat.ChunkKV`) and KeyRerotationPress (`compat.Rerotated`) beside
`kvpolicies.compat.kvpress`, as
tests/kvpolicies/test_kvpress_parity.py runs the others: the same tiny random Llama and token ids,
kvpress's press prefilling the context in its own environment (evals/kvpress_worker.py), ours
`Engine.prompt` -> `compress` -> `kept_positions` / `continue_generate`: kept positions per (layer,
kv head) and greedy answers identical. Also: the bytes each library holds (kvpress masks AdaKV's
evicted slots, ours stores each head's share), and the counted head pool's stream extension against
a float64 numpy re-simulation (Ada-KV's allocation over key norms, attention per head's own set)."""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

from kvpolicies.adascored import AdaScored, CountedPool
from kvpolicies.compat import kvpress
from kvpolicies.expected import Expected
from kvpolicies.knorm import Knorm
from kvpolicies.memory import tree_nbytes
from models.engine import Engine
from models.llama import Llama
from models.loading import load_hf
from tests.refs.headwise import K, ROPE, THETA, attend_sets, qkv, rotated
from tests.refs.helpers import run_policy
from tests.refs.oracle import default_inv_freq
from tests.refs.prompt_scored import expected_scores

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = ROOT / ".venv" / "kvpress-ref"
needs_kvpress = pytest.mark.skipif(not (REF / "kvpress").is_dir(), reason="kvpress not installed (bash scripts/setup.sh test)")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
N_CTX, N_Q, N_NEW = 320, 8, 6
# (press, ratio, fields); the worker keys results by name@ratio, so each press runs at its own ratios.
# ChunkKVPress at chunk_length 30: 10 full chunks and one of 20 tokens, which wins in some layers
# (kvpress then keeps 140 or 150 tokens per layer and fails on the question); at 20 (the default),
# 16 full chunks, over SnapKVPress (its window at kvpress's max + 1, our sums over G and the kernel in
# kvpress's units)
# Each wrapper at two ratios in the suite (its time); KVP_KVPRESS_FULL=1 adds AdaKVPress(KeyDiffPress) at 0.75,
# ChunkKVPress(KeyDiffPress) at 0.75 with chunks of 20, AdaKVPress over TOVAPress (one score shared by the
# heads: each keeps n_kept) and over PyramidKVPress (AdaKVPress reads only its score, SnapKV's: our `adakv`)
CASES = (("AdaKVPress", 0.5, {"press": "KeyDiffPress"}), ("AdaKVPress", 0.6, {"press": "ExpectedAttentionPress"}),
         ("ChunkKVPress", 0.5, {"press": "KeyDiffPress", "chunk_length": 30}),
         ("ChunkKVPress", 0.6, {"press": "SnapKVPress"}),  # kvpress's leaderboard row `chunkkv`
         ("KeyRerotationPress", 0.5, {"press": "KeyDiffPress"}), ("KeyRerotationPress", 0.75, {"press": "KeyDiffPress"}),
         ("EntropyGatedChunkKVPress", 0.5, {"press": "KeyDiffPress"}),
         ("EntropyGatedChunkKVPress", 0.75, {"press": "KeyDiffPress", "chunk_length": 30})) + (
    (("AdaKVPress", 0.75, {"press": "KeyDiffPress"}), ("ChunkKVPress", 0.75, {"press": "KeyDiffPress"}),
     ("AdaKVPress", 0.7, {"press": "TOVAPress"}), ("AdaKVPress", 0.65, {"press": "PyramidKVPress"}))
    if os.environ.get("KVP_KVPRESS_FULL") else ())
# an exact tie that kvpress's torch.topk breaks (`ties="torch_cpu"` replays it, the default keeps others):
# ChunkKV over SnapKV at 0.875 keeps 2 of 16 chunks, and the 3 chunks inside SnapKV's window tie (every token at
# kvpress's max). EntropyGatedChunkKV's ties: `test_entropy_gated_on_given_scores_keeps_kvpress_tokens`
TIED = (("ChunkKVPress", 0.875, {"press": "SnapKVPress"}),)

# kvpress's side: evals/kvpress_worker.py's model, prefill and greedy decoding; KeyRerotationPress re-rotates
# the cached keys (they match no uncompressed key): its kept indices are the ones `rerotate_keys` receives,
# and the question continues at the compressed length, as kvpress's pipeline does for this press
WORKER = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import kvpress_worker as w
from kvpress.presses.key_rerotation_press import KeyRerotationPress
from transformers import DynamicCache

job = json.load(open(sys.argv[1]))
model = w.load(job.get("checkpoint") or w.build_tiny(job["tiny"], job["save_to"]), "sdpa", job.get("gguf_file"))
ctx, question = torch.tensor([job["context"]]), torch.tensor([job["question"]])
with torch.no_grad():
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
full_keys = [full.layers[i].keys[0] for i in range(len(full.layers))]
seen = {}
rerotate = KeyRerotationPress.rerotate_keys
def recording(module, indices, keys):
    seen[module.layer_idx] = indices[0].tolist()
    return rerotate(module, indices, keys)
KeyRerotationPress.rerotate_keys = staticmethod(recording)
out = {}
for name, ratio, fields in job["presses"]:
    press = w.make_press(name, ratio, dict(fields))
    if name != "KeyRerotationPress":
        out[f"{name}@{ratio}"] = w.run(model, press, ctx, question, job["n_new"], full_keys)
        continue
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
    kept = [[sorted(h) for h in seen[i]] for i in range(len(seen))]
    answer = w.greedy(model, cache, question, cache.get_seq_length(), job["n_new"])
    out[f"{name}@{ratio}"] = {"kept": kept, "answer": answer}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, kvpress_ref):
    """(our model, context ids, question ids, kvpress's results) on the tiny Llama."""
    tmp = tmp_path_factory.mktemp("llama")
    rng = np.random.default_rng(1)
    ctx, question = rng.integers(0, 128, N_CTX), rng.integers(0, 128, N_Q)
    job = {"checkpoint": None, "save_to": str(tmp / "ckpt"), "tiny": {"kind": "llama", "seed": 0, "config": TINY},
           "context": ctx.tolist(), "question": question.tolist(), "n_new": N_NEW,
           "presses": [list(c) for c in CASES + TIED], "tokenizer": "ascii"}
    ref = kvpress_ref.job(job, tmp, script=WORKER)
    cfg, params = load_hf(tmp / "ckpt")
    return Llama(cfg, params), ctx, question, ref


def ours(model, press, ratio, fields, ctx, question, answer=True):
    """(kept positions [layer][kv head], greedy ids or None, the compressed cache) of our engine."""
    pol = kvpress(press, ratio, max_new=64, **fields)
    eng = Engine(model, pol, max_len=N_CTX + N_Q + N_NEW, share_steps=True)  # one prompt phase: compiled once
    state = eng.compress(eng.prompt(ctx[None]))
    kept = [[p.tolist() for p in layer] for layer in eng.kept_positions(state)]
    return kept, eng.continue_generate(state, question[None], N_NEW)[0].tolist() if answer else None, state


@needs_kvpress
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.parametrize(("press", "ratio", "fields"), CASES, ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_wrapper_keeps_kvpress_positions_and_answers(tiny_run, press, ratio, fields):
    model, ctx, question, ref = tiny_run
    want = ref[f"{press}@{ratio}"]
    kept, answer, state = ours(model, press, ratio, fields, ctx, question, answer="error" not in want)
    assert kept == want["kept"]  # per (layer, kv head)
    n_kept = int(N_CTX * (1 - ratio))
    if press == "AdaKVPress":
        assert all(sum(map(len, layer)) == len(layer) * n_kept for layer in kept)
    if press == "AdaKVPress" and fields["press"] in ("KeyDiffPress", "ExpectedAttentionPress"):
        assert any(len(h) != n_kept for layer in kept for h in layer)  # the heads' shares differ
        # a head need not keep its newest token: the pool's segments come from the stored counts
        assert any(max(h) < N_CTX - 1 for layer in kept for h in layer)
        # kvpress masks: every head still holds all 320 tokens; ours stores K x S slots, S = n_kept of
        # max_len + max_new (keys, values, an int32 position each), K int32 counts and, for expected, its
        # query sums (D + D^2 floats per kv head and a count: its stream rule's statistics)
        d, kh, n_layers = model.cfg.head_dim, model.cfg.n_kv_heads, model.cfg.n_layers
        assert want["cache_bytes"] == n_layers * 2 * kh * N_CTX * d * 4
        s = int((N_CTX + N_Q + N_NEW) * (1 - ratio)) + 64
        stats = (kh * (d + d * d) + 1) * 4 if fields["press"] == "ExpectedAttentionPress" else 0
        assert tree_nbytes(state.cache) == n_layers * (kh * s * (2 * d * 4 + 4) + kh * 4 + stats)
        print(f"AdaKVPress({fields['press']}) at {ratio}: ours {tree_nbytes(state.cache)} bytes, kvpress {want['cache_bytes']}")
        assert tree_nbytes(state.cache) < want["cache_bytes"]
    if press == "ChunkKVPress" and fields.get("chunk_length") == 30:
        # 5 of 11 chunks: where the short last one (20 tokens) wins, 140 tokens, else 150; the layers
        # then differ and kvpress's question fails (one causal mask from layer 0's length, as PyramidKVPress)
        assert sorted({len(h) for layer in kept for h in layer}) == [140, 150]
        assert "size of tensor" in want.get("error", ""), want.get("error")
        return
    if press == "EntropyGatedChunkKVPress":  # kvpress's n_kept exactly, the same set in every head
        assert all(len(h) == n_kept and h == layer[0] for layer in kept for h in layer)
        c = fields.get("chunk_length", 10)
        parts = [np.bincount(np.asarray(layer[0]) // c, minlength=-(-N_CTX // c)) for layer in kept]
        whole = [np.minimum(c, N_CTX - c * np.arange(len(parts[0])))]
        assert any(((0 < n) & (n < w)).any() for n in parts for w in whole)  # spiky chunks cut (or the top-up)
    assert "error" not in want, want
    assert answer == want["answer"]


@needs_kvpress
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.parametrize(("press", "ratio", "fields"), TIED, ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_wrapper_exact_ties_broken_as_torch_topk(tiny_run, press, ratio, fields):
    """A wrapper's own top-k calls cut an exact tie (`TIED`): with ties="torch_cpu" every layer keeps kvpress's
    positions and the answer is kvpress's; the default (the newer tied token or chunk) keeps others."""
    model, ctx, question, ref = tiny_run
    want = ref[f"{press}@{ratio}"]
    assert "error" not in want, want
    kept, answer, _ = ours(model, press, ratio, {**fields, "ties": "torch_cpu"}, ctx, question)
    assert kept == want["kept"] and answer == want["answer"]
    newer, _, _ = ours(model, press, ratio, fields, ctx, question, answer=False)
    assert newer != want["kept"]


# kvpress's EntropyGatedChunkKVPress.compress and ChunkKVPress.compress themselves, their inner press's `score`
# returning given scores [1, K, n]; the kept token indices read back from keys that hold their own index
GIVEN = r"""
import json, sys, types, torch
from kvpress import ChunkKVPress, EntropyGatedChunkKVPress
from kvpress.presses.scorer_press import ScorerPress

class Given(ScorerPress):
    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.given

out = []
for case in json.load(open(sys.argv[1]))["cases"]:
    inner = Given(compression_ratio=case["ratio"])
    inner.given = torch.tensor(case["scores"], dtype=torch.float32)[None]
    press = (EntropyGatedChunkKVPress if case["press"] == "entropy" else ChunkKVPress)(inner, chunk_length=case["chunk"])
    kh, n = inner.given.shape[1:]
    keys = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, kh, n, 1)
    kept, _ = press.compress(types.SimpleNamespace(head_dim=1), None, keys, keys, None, {})
    out.append(sorted(int(i) for i in kept[0, 0, :, 0].tolist()))
json.dump(out, open(sys.argv[2], "w"))
"""


def given_scores(rng, press: str, n: int = 200, kh: int = 2) -> np.ndarray:
    """[K, n] float32 scores in [0, 1) with exact ties by construction. entropy (chunks of 10): 5 spiky chunks,
    7 tokens tied at one high value and 3 near 0 (the chunk's torch.topk keeps 4 of the 7; the budget's top-up
    cuts through the rest). chunkkv (chunks of 20): 3 chunks copied from one high one (their means tie)."""
    x = rng.uniform(0.0, 1.0, (kh, n)).astype(np.float32)
    if press == "entropy":
        for ch in rng.choice(n // 10, 5, replace=False):
            x[:, 10 * ch: 10 * ch + 10] = rng.uniform(0.0, 0.05, (kh, 10))
            x[:, 10 * ch + rng.choice(10, 7, replace=False)] = rng.uniform(2.0, 3.0)
    else:
        top = rng.uniform(2.0, 3.0, (kh, 20)).astype(np.float32)
        for ch in rng.choice(n // 20, 3, replace=False):
            x[:, 20 * ch: 20 * ch + 20] = top
    return x


def test_entropy_gated_on_given_scores_keeps_kvpress_tokens(tmp_path, kvpress_ref, monkeypatch):
    """EntropyGatedChunkKV (and ChunkKV) on given scores with exact ties at every cut kvpress makes with torch.topk
    (inside a spiky chunk, the budget's top-up, ChunkKV's chunks): kvpress's own `compress` keeps, on every
    case, the tokens ours keeps with ties="torch_cpu" (the budgets: kvpress's float64 int(n (1 - ratio)), 89 of
    200 tokens at 0.55, 1 of 10 chunks at 0.8, where float32 gives 90 and 2); the default (the newer tied token)
    keeps others on every entropy case and on most chunkkv ones. (On the tiny random model, the entropy gate
    over SnapKV's near-uniform scores is decided by float rounding: not a place to check ties.)"""
    import types

    import jax.numpy as jnp

    from kvpolicies.compat import ChunkKV, EntropyChunkKV
    from kvpolicies.keydiff import KeyDiff

    # the inner press scores a token by its key's first channel (our side's `press.score`)
    monkeypatch.setattr(KeyDiff, "prompt_rank", lambda self, state, slots, keys, stats: (keys[..., 0], slots.pos))
    rng = np.random.default_rng(0)
    cases = [{"press": p, "ratio": r, "chunk": 10 if p == "entropy" else 20, "scores": given_scores(rng, p).tolist()}
             for p, ratios in (("entropy", (0.3, 0.55, 0.75)), ("chunkkv", (0.8, 0.875))) for r in ratios for _ in range(3)]
    ref = kvpress_ref.job({"cases": cases}, tmp_path, script=GIVEN)
    differs = []
    for case, want in zip(cases, ref, strict=True):
        x = np.asarray(case["scores"], np.float32)
        kh, n = x.shape
        got = {}
        for ties in ("torch_cpu", "newer"):
            cls = EntropyChunkKV if case["press"] == "entropy" else ChunkKV
            pol = cls(ratio=case["ratio"], press=KeyDiff(ratio=case["ratio"]), chunk_length=case["chunk"], ties=ties)
            slots = types.SimpleNamespace(pos=jnp.broadcast_to(jnp.arange(n), (1, kh, n)))
            kept = np.asarray(pol.chosen(None, slots, jnp.asarray(x)[None, :, :, None], None, jnp.asarray(pol.given(n))))
            assert (kept[0] == kept[0, :1]).all()  # the same tokens in every kv head
            got[ties] = np.flatnonzero(kept[0, 0]).tolist()
        assert got["torch_cpu"] == want, (case["press"], case["ratio"], sorted(set(got["torch_cpu"]) ^ set(want)))
        differs.append((case["press"], got["newer"] != want))
        if case["press"] == "entropy":
            assert len(want) == int(n * (1 - case["ratio"]))
    # the rule matters: every entropy case, and 5 of the 6 chunkkv ones (one kept the newest tied chunk)
    assert all(d for p, d in differs if p == "entropy") and sum(d for p, d in differs if p == "chunkkv") >= 4


@pytest.mark.parametrize("inner", ["knorm", "expected"])
def test_counted_pool_stream_extension_matches_numpy(inner):
    """AdaScored at the policy level: a dense 22-token prompt, one head-adaptive compression (kvpress's
    rule), then decoding, whose pool overflows and is compressed again by the same rule over the held
    tokens (to S - max_new per head on average), ranked by the inner press's stream rule: knorm's key
    norms, or expected attention with the query statistics the pool keeps (the prompt's per query head,
    then every query so far pooled over a kv head's query heads, as `expected`'s stream extension).
    Outputs against float64 attention over each head's own set; the kept sets against the allocation
    re-simulated; the counts against them."""
    ratio, alpha, max_new, max_len, L, T = 0.5, 0.2, 3, 30, 22, 40
    press = (Knorm(ratio=ratio, dense_layers=0, max_new=max_new) if inner == "knorm" else
             Expected(ratio=ratio, max_new=max_new, n_future_positions=16))
    pol = AdaScored(press=press, ratio=ratio, alpha_safeguard=alpha, max_new=max_new)
    q, k, v = qkv(T, seed=3, head_scale=(1.3, 0.8))  # head 1's keys are shorter: it wins more tokens
    _, st = run_policy(pol.prompt_policy(), q[:, :L], k[:, :L], v[:, :L], [8], ROPE, max_len=max_len)
    st = jax.jit(pol.after_prompt)(st)
    assert isinstance(st, CountedPool)
    out, st = run_policy(pol, q[:, L:], k[:, L:], v[:, L:], [1], ROPE, max_len=max_len, state=st, start=L)
    s = pol.capacity(max_len)
    ref_out, ref_kept, overflows = simulate(press, q, k, v, L, s, max_new, ratio, alpha)
    assert overflows >= 2
    got = [st.held(b, K, pol) for b in range(q.shape[0])]
    assert [[h.tolist() for h in row] for row in got] == ref_kept
    assert np.asarray(st.counts).tolist() == [[len(h) for h in row] for row in ref_kept]
    assert any(len(row[0]) != len(row[1]) for row in ref_kept)
    np.testing.assert_allclose(out, ref_out[:, L:], atol=1e-5, rtol=0)


def allocate(score, sets, n_kept, alpha):
    """kvpress's AdaKVPress rule in plain Python: score[h][j] (higher kept), sets[h] the tokens."""
    n_safe = max(1, int(n_kept * alpha)) if alpha > 0 else 0
    safe = [set(sorted(sets[h], key=lambda j, h=h: (-score[h][j], -j))[:n_safe]) for h in range(len(sets))]
    items = sorted(((h, j) for h in range(len(sets)) for j in sets[h]),
                   key=lambda hj: (-(np.inf if hj[1] in safe[hj[0]] else score[hj[0]][hj[1]]), -hj[1], hj[0]))
    kept = [set() for _ in sets]
    for h, j in items[: len(sets) * n_kept]:
        kept[h].add(j)
    return kept


def simulate(press, q, k, v, prompt_len, s, max_new, ratio, alpha):
    """(outputs [B, T, N, D], kept [b][h] sorted, overflows) of Ada-KV over `press`'s scores (knorm:
    minus the norms of the un-rotated keys; expected: tests/refs/prompt_scored.expected_scores): the
    prompt dense, compressed once to K x n_kept; decoding appends to every head and, when the pool of
    K x s slots overflows, the held tokens are compressed to K x (s - max_new)."""
    qr, kr = rotated(q, k)
    inv = default_inv_freq(q.shape[-1], THETA)
    norm = np.linalg.norm(np.asarray(k, np.float64), axis=-1)  # [B, T, K]: of the un-rotated keys
    g = q.shape[2] // K
    out, kept_all, overflows = np.zeros(q.shape), [], 0

    def scores(b, sets, p, pooled):  # each head's scores of its tokens, after the query at position p
        if isinstance(press, Knorm):
            return [{j: -norm[b, j, h] for j in sets[h]} for h in range(K)]
        qs = np.asarray(q, np.float64)[b, press.n_sink:p + 1]  # [n, N, D]: the queries the statistics hold
        out_ = []
        for h in range(K):
            qh = qs[:, h * g:(h + 1) * g].transpose(1, 0, 2)  # [G, n, D]: one Gaussian per query head
            js = sorted(sets[h])
            out_.append(expected_scores(press, qh.reshape(1, -1, qh.shape[-1]) if pooled else qh, kr[b, js, h],
                                        np.asarray(v, np.float64)[b, js, h], js, max(js) + 1, inv))
        return out_

    for b in range(q.shape[0]):
        for p in range(prompt_len):
            for h in range(K):
                out[b, p, g * h:g * h + g] = attend_sets(qr, kr, v, b, p, h, range(p + 1))[0]
        n_kept = max(1, int(prompt_len * (1 - ratio)))
        sets = [set(range(prompt_len))] * K
        kept = allocate(scores(b, sets, prompt_len - 1, False), sets, n_kept, alpha)
        for p in range(prompt_len, q.shape[1]):
            kept = [x | {p} for x in kept]
            for h in range(K):
                out[b, p, g * h:g * h + g] = attend_sets(qr, kr, v, b, p, h, kept[h])[0]
            if sum(map(len, kept)) > K * s:
                kept = allocate(scores(b, kept, p, True), kept, max(s - max_new, 1), alpha)
                overflows += b == 0
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all, overflows


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


# in the suite: AdaKV over expected attention (kvpress's leaderboard row); KVP_KVPRESS_FULL=1 adds the
# leaderboard's chunkkv, EntropyGatedChunkKV over SnapKV (one exact tie per layer: the straddling chunk's
# window tokens, all at kvpress's max + 1, cut to 4 by torch.topk's order, ours the newest) and KeyRerotation
SLOW_CASES = (("AdaKVPress", 0.5, {"press": "ExpectedAttentionPress"}),) + (
    (("ChunkKVPress", 0.5, {"press": "SnapKVPress"}), ("EntropyGatedChunkKVPress", 0.5, {"press": "SnapKVPress"}),
     ("KeyRerotationPress", 0.5, {"press": "ExpectedAttentionPress"})) if os.environ.get("KVP_KVPRESS_FULL") else ())


@needs_kvpress
@pytest.mark.slow
@pytest.mark.ref
@pytest.mark.kvpress
@pytest.mark.parametrize(("press", "ratio", "fields"), SLOW_CASES, ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_smollm2_wrapper_equals_kvpress(smollm2_run, press, ratio, fields):
    """SmolLM2, 1,024 tokens: mean kept-set Jaccard per (layer, kv head) >= 0.98 (float32 sums in
    another order can swap near ties) and the same 12 greedy tokens as kvpress 0.5.5."""
    model, ctx, question, ref = smollm2_run
    want = ref[f"{press}@{ratio}"]
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


def test_wrappers_refuse_bad_fields_before_any_compute():
    """The front door's errors: fields named, inner presses the wrappers cannot take refused."""
    from kvpolicies.compat import ChunkKV, EntropyChunkKV, Rerotated
    from kvpolicies.snapkv import SnapKV

    assert isinstance(kvpress("AdaKVPress", 0.5, press="KnormPress"), AdaScored)
    assert kvpress("AdaKVPress", 0.5, press=kvpress("KeyDiffPress", 0.5)) == kvpress("AdaKVPress", 0.5, press="KeyDiffPress")
    assert kvpress("ChunkKVPress", 0.5, press="KnormPress") == ChunkKV(ratio=0.5, press=Knorm(ratio=0.5, dense_layers=0))
    assert isinstance(kvpress("KeyRerotationPress", 0.5, press="LagKVPress", lag_size=16), Rerotated)
    assert kvpress("EntropyGatedChunkKVPress", 0.5, press="KnormPress").chunk_length == 10  # kvpress's default
    with pytest.raises(ValueError, match="chunk_length=0"):
        kvpress("ChunkKVPress", 0.5, press="KnormPress", chunk_length=0)
    with pytest.raises(ValueError, match="low_entropy_chunk_length=10"):
        EntropyChunkKV(ratio=0.5, press=Knorm(ratio=0.5), low_entropy_chunk_length=10)
    with pytest.raises(ValueError, match="per-slot statistics"):  # SnapKV's accumulated attention: `adakv`
        AdaScored(press=SnapKV(ratio=0.5), ratio=0.5)
    with pytest.raises(ValueError, match="wrapper's ratio"):
        AdaScored(press=Knorm(ratio=0.25), ratio=0.5)
    with pytest.raises(ValueError, match="alpha_safeguard"):
        kvpress("AdaKVPress", 0.5, press="KnormPress", alpha_safeguard=1.5)
    with pytest.raises(NotImplementedError, match="ChunkKVPress over 'ObservedAttentionPress'"):
        kvpress("ChunkKVPress", 0.5, press="ObservedAttentionPress")  # kvpress refuses attentions there too
    with pytest.raises(ValueError, match="give press="):
        kvpress("KeyRerotationPress", 0.5)
    # the inner SnapKV's own fields reach it through every wrapper (they were dropped before 2026-12-07), and
    # a press without them refuses them
    for wrapper in ("ChunkKVPress", "EntropyGatedChunkKVPress", "KeyRerotationPress"):
        inner = kvpress(wrapper, 0.5, press="SnapKVPress", window_size=67, kernel_size=3).press
        assert (inner.obs_window, inner.kernel) == (67, 3), wrapper
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['window_size'\]"):
        kvpress("KnormPress", 0.5, window_size=3)
    # ties="torch_cpu": honoured by the wrappers whose own top-k calls replay it, refused where a choice of the
    # wrapper's own would break its ties otherwise (never ignored)
    assert kvpress("EntropyGatedChunkKVPress", 0.5, press="SnapKVPress", ties="torch_cpu").ties == "torch_cpu"
    assert kvpress("KeyRerotationPress", 0.5, press="LagKVPress", ties="torch_cpu").ties == "torch_cpu"
    for name, inner in (("ChunkPress", "KeyDiffPress"), ("BlockPress", "KeyDiffPress"), ("CriticalKVPress", "SnapKVPress"),
                        ("MergingPress", "KeyDiffPress")):
        with pytest.raises(ValueError, match="breaks the ties of its prompt compression its own way"):
            kvpress(name, 0.5, press=inner, ties="torch_cpu")
