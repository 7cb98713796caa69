"""`kvzap`: a learned surrogate of KVzip's scores, pruned by a threshold (DMS) or a budget.

References written independently of the library:
- the surrogate's input is taken from transformers' PyTorch Qwen2 (`output_hidden_states`, each
  layer's `input_layernorm` applied in torch) on a tiny random checkpoint, and its forward pass
  is numpy (x @ w + b; the MLP with an erf GELU from scipy);
- the DMS rule re-simulated as Python sets: a kv head keeps its last `window` positions and every
  older one whose score is >= the threshold;
- the stream extension token by token in float64 numpy (kvzip's: the most attention each slot
  received, the head-wise choice on overflow, the last `window` positions kept);
- training on synthetic data with a known linear map; the committed files' own report.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies.adakv import head_of
from kvpolicies.kvzap import WEIGHTS_DIR, KVzap, kept_counts, random_surrogate
from kvpolicies.memory import state_bytes, tree_bytes, tree_nbytes
from tests.refs.headwise import B, K, MAX_LEN, ROPE, qkv
from tests.refs.kvzap import choose, simulate_stream


def by_head(pos: np.ndarray) -> list[list[int]]:
    """[h] sorted positions of one layer's head pool (pos [K, S] rows, batch 1)."""
    flat = np.asarray(pos).reshape(1, 1, -1)
    head = np.asarray(head_of(jnp.asarray(flat), K))[0, 0]
    return [sorted(int(x) for x in flat[0, 0][head == h]) for h in range(K)]


@pytest.mark.parametrize("chunks", [[1], [6]], ids=str)
def test_stream_extension_matches_the_reference(chunks):
    pol = KVzap(budget=5, max_new=3, window=2, surrogate="random")
    q, k, v = qkv(27, seed=4, head_scale=(4.0, 0.3))
    out, state = run_policy(pol, q, k, v, chunks, ROPE, max_len=MAX_LEN)
    ref, kept = simulate_stream(pol, q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert [by_head(np.asarray(state.pos)[b]) for b in range(B)] == kept


def test_validates_its_fields():
    for kw, field in [(dict(window=0), "window"), (dict(budget=10, window=20), "budget"), (dict(rule="ratio"), "rule"),
                      (dict(kind="cnn"), "kind"), (dict(threshold=float("nan")), "threshold")]:
        with pytest.raises(ValueError, match=f"kvzap.{field}"):
            KVzap(**kw)


# ------------------------------------------------------------------------------------------
# the prompt protocol against transformers
# ------------------------------------------------------------------------------------------


def reference_inputs(ref, ids: np.ndarray) -> list[np.ndarray]:
    """[layer] the surrogate's input [T, d]: transformers' layer input after its input_layernorm."""
    import torch

    with torch.no_grad():
        out = ref(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
        return [ref.model.layers[i].input_layernorm(out.hidden_states[i])[0].numpy().astype(np.float64)
                for i in range(len(ref.model.layers))]


def np_surrogate(params: dict, layer: int, x: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    if "w" in params:
        return x @ params["w"][layer] + params["b"][layer]
    z = x @ params["w1"][layer] + params["b1"][layer]
    z = 0.5 * z * (1 + erf(z / np.sqrt(2)))
    return z @ params["w2"][layer] + params["b2"][layer]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_scores_applied_equal_the_surrogates_forward_pass(tiny_qwen, kind):
    """The log-scores the prompt phase stores for every (layer, kv head, token), prefilled in
    chunks of 7, equal the surrogate's numpy forward pass on transformers' hidden states."""
    from models.engine import Engine

    ref, model = tiny_qwen
    cfg = model.cfg
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 40)).astype(np.int32)
    pol = kvpolicies.get("kvzap", budget=20, max_new=4, window=4, kind=kind, surrogate="random")
    eng = Engine(model, pol, max_len=48)
    zap = np.asarray(eng.prompt(ids, chunk=7).cache[0].extra["zap"])  # [L, B, K, M]
    params = random_surrogate(kind, cfg.d_model, cfg.n_kv_heads, cfg.n_layers)
    for layer, x in enumerate(reference_inputs(ref, ids)):
        want = np_surrogate(params, layer, x)  # [T, K]
        np.testing.assert_allclose(zap[layer, 0, :, :40].T, want, atol=2e-4, rtol=1e-4)
        assert (zap[layer, 0, :, 40:] == np.finfo(np.float32).min).all()  # slots past the prompt: unscored


def test_kept_sets_at_a_threshold_follow_the_dms_rule(tiny_qwen):
    """rule=threshold: each kv head keeps its last `window` tokens and every older token scoring
    >= threshold (DMS), re-simulated as sets on transformers' hidden states; the heads and the
    layers keep different numbers of tokens; the stored bytes are the pool's closed form."""
    from models.engine import Engine

    ref, model = tiny_qwen
    cfg = model.cfg
    t, window = 40, 4
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    params = random_surrogate("linear", cfg.d_model, cfg.n_kv_heads, cfg.n_layers)
    scores = [np_surrogate(params, layer, x) for layer, x in enumerate(reference_inputs(ref, ids))]  # [T, K] each
    threshold = float(np.median(np.concatenate(scores)))
    pol = kvpolicies.get("kvzap", budget=t, max_new=4, window=window, rule="threshold", threshold=threshold,
                         surrogate="random")
    eng = Engine(model, pol, max_len=48)
    state = eng.compress(eng.prompt(ids, chunk=16))
    pool = state.cache[0]
    counts = kept_counts(pool)[:, 0]  # [L, K]
    for layer, sc in enumerate(scores):
        want = [sorted(j for j in range(t) if j > t - 1 - window or sc[j, h] >= threshold) for h in range(K)]
        assert by_head(np.asarray(pool.pos)[layer, 0]) == want, layer
        assert counts[layer].tolist() == [len(w) for w in want]
    assert len(set(counts.ravel().tolist())) > 1, counts  # per-head (and per-layer) counts vary
    cap = pol.capacity(48)
    d = cfg.head_dim
    closed = cfg.n_layers * K * cap * (2 * d * 4 + 4 + 4)  # keys, values, an int32 position, a float32 mass
    assert tree_bytes(pool).total == closed
    assert state_bytes(pol, kv_heads=K, head_dim=d, max_len=48, dtype=jnp.float32).total * cfg.n_layers == closed
    # decoding goes on from the pool (kvzip's stream rule)
    ids2 = eng.continue_generate(state, np.zeros((1, 0), np.int32), 3)
    assert ids2.shape == (1, 3)


def test_fitted_layers_store_what_a_threshold_keeps(tiny_qwen):
    """`Engine.fitted`: each layer's pool cut to the tokens its threshold kept (plus max_new free
    slots per head): the same kept sets, the same greedy ids while the free slots last, stored
    bytes equal to the closed form of each layer's own count, below the static pool's."""
    from models.engine import Engine

    _, model = tiny_qwen
    cfg = model.cfg
    t, window, max_new, d = 40, 4, 8, cfg.head_dim
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    question = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 3)).astype(np.int32)
    pol = kvpolicies.get("kvzap", budget=t, max_new=max_new, window=window, rule="threshold", threshold=0.0,
                         surrogate="random")
    eng = Engine(model, pol, max_len=t + max_new)
    state = eng.compress(eng.prompt(ids, chunk=16))
    fe, fs = eng.fitted(state)
    kept = [[h.tolist() for h in layer] for layer in eng.kept_positions(state)]
    listed = lambda e, st: [[h.tolist() for h in layer] for layer in e.kept_positions(st)]  # noqa: E731
    assert listed(fe, fs) == kept
    held = [sum(len(h) for h in layer) for layer in kept]
    assert len(set(held)) > 1, held  # the layers keep different numbers of tokens
    slots = [max(-(-n // K), window) + max_new for n in held]  # per kv head on average, each layer
    assert [p.capacity(fe.max_len) for p in fe.policies] == slots
    per_slot = 2 * d * 4 + 4 + 4  # keys, values (float32), an int32 position, a float32 mass
    assert tree_nbytes(fs.cache) == sum(K * s * per_slot for s in slots)
    assert tree_nbytes(fs.cache) < tree_nbytes(state.cache) == cfg.n_layers * K * (t + max_new) * per_slot
    # 3 question tokens + 5 generated: 7 new tokens per head, within the max_new free slots
    np.testing.assert_array_equal(fe.continue_generate(fs, question, 5), eng.continue_generate(state, question, 5))
    # rounded to a multiple of 8 tokens per head (fewer shapes), and an engine per fitted tuple
    fe8, fs8 = eng.fitted(state, round_to=8)
    assert [p.budget for p in fe8.policies] == [-(-max(-(-n // K), window) // 8) * 8 for n in held]
    assert eng.fitted(state, round_to=8)[0] is fe8
    assert listed(fe8, fs8) == kept
    # from the uncompressed prompt: counted, then each layer compressed straight to its size
    fe2, fs2 = eng.fitted(eng.prompt(ids, chunk=16))
    assert fe2 is fe and listed(fe2, fs2) == kept
    assert jax.tree.all(jax.tree.map(np.array_equal, fs2.cache, fs.cache))
    # Engine(fit=n): compress gives the fitted state (RULER's query-agnostic path: prompt, compress,
    # continue_generate), which this engine's continue_generate / feed / kept_positions hand to it
    fit_eng = Engine(model, pol, max_len=t + max_new, fit=8)
    staged = fit_eng.compress(fit_eng.prompt(ids, chunk=16))
    assert staged.fitted is not None and staged.fitted is not fit_eng
    assert jax.tree.all(jax.tree.map(np.array_equal, staged.cache, fs8.cache))
    assert listed(fit_eng, staged) == kept and fit_eng.fit_records[-1]["stored_bytes"] == tree_nbytes(fs8.cache)
    np.testing.assert_array_equal(fit_eng.continue_generate(staged, question, 5),
                                  eng.continue_generate(state, question, 5))
    assert listed(fit_eng, fit_eng.feed(staged, question)) == listed(eng, eng.feed(state, question))
    with pytest.raises(ValueError, match="no layer's policy can be fit"):
        Engine(model, kvpolicies.get("snapkv", budget=8, max_new=4), max_len=t + max_new).fitted(state)


def test_fitted_engines_compile_each_layer_step_once_over_prompts(tiny_qwen):
    """Fitted engines (one per prompt whose layers keep other counts) share their parent's
    layer-by-layer steps: a question fed to a second prompt's fitted engine compiles only the
    layers whose fitted policy no earlier engine had, one step per power-of-two piece of the
    question and one decode step; the feed equals the whole-model step's (logits, kept sets)."""
    from models.engine import Engine
    from models.engine.layers import pieces

    _, model = tiny_qwen
    cfg = model.cfg
    t, max_new = 40, 16
    pol = kvpolicies.get("kvzap", budget=t, max_new=max_new, window=4, rule="threshold", threshold=0.0,
                         surrogate="random")
    eng = Engine(model, pol, max_len=t + max_new)
    question = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 7)).astype(np.int32)  # pieces 4, 2, 1
    assert pieces(7) == [4, 2, 1] and pieces(8) == [8] and pieces(1) == [1]
    prompts = [np.random.default_rng(s).integers(0, cfg.vocab_size, (1, t)).astype(np.int32) for s in range(12)]
    fits = [(ids,) + eng.fitted(eng.compress(eng.prompt(ids, chunk=16)), round_to=2) for ids in prompts]
    # two prompts whose fitted engines share one layer's policy and differ in the other
    a, b = next((x, y) for x in fits for y in fits
                if x[1] is not y[1] and len(set(x[1].policies) & set(y[1].policies)) == 1)
    for ids, fe, fs in (a, b):
        assert fe.shares_layer_steps and fe._layer_step is eng._layer_step
        unfitted = eng.compress(eng.prompt(ids, chunk=16))
        fed, want = fe.feed(fs, question), eng.feed(unfitted, question)  # layer by layer vs the whole model
        np.testing.assert_allclose(np.asarray(fed.logits), np.asarray(want.logits), rtol=1e-5, atol=1e-5)
        assert [[h.tolist() for h in lay] for lay in fe.kept_positions(fed)] == \
            [[h.tolist() for h in lay] for lay in eng.kept_positions(want)]
        np.testing.assert_array_equal(fe.continue_generate(fs, question, 4), eng.continue_generate(unfitted, question, 4))
        assert fe.traces["logits"] == fe.traces["decode"] == 0  # no whole-model step compiled for a fitted engine
    before = eng.traces["decode_layer"]
    b[1].continue_generate(b[2], question, 4)  # compiled above: nothing new
    assert eng.traces["decode_layer"] == before
    # a fresh parent: the first prompt compiles its layers' distinct policies, the second only its new one
    eng2 = Engine(model, pol, max_len=t + max_new)
    per_layer = len(pieces(7)) + 1  # the question's pieces and the decode step
    seen: set = set()
    for ids, _, _ in (a, b):
        fe, fs = eng2.fitted(eng2.compress(eng2.prompt(ids, chunk=16)), round_to=2)
        before = eng2.traces["decode_layer"]
        fe.continue_generate(fs, question, 4)
        assert eng2.traces["decode_layer"] - before == per_layer * len(set(fe.policies) - seen)
        seen |= set(fe.policies)
    assert len(seen) == 3  # 2 + 1: the shared layer compiled once


def dms_reference_logits(ref, params: dict, ids: np.ndarray, window: int, threshold: float) -> np.ndarray:
    """[T, V] logits of transformers' model with DMS's sparse prefill as a mask: in each layer,
    query p of kv head h sees token j iff j <= p and (p - j <= window or the surrogate's score of
    (j, h) from the layer's normalised input >= threshold) — an attention function registered
    with transformers, the scores from a forward pre-hook on each attention module."""
    import torch
    from transformers import AttentionInterface

    inputs: dict[int, torch.Tensor] = {}

    def keep_input(module, args, kwargs):
        inputs[module.layer_idx] = kwargs["hidden_states"]

    def dms_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        x = inputs[module.layer_idx][0].double().numpy()  # [T, d]
        score = np_surrogate(params, module.layer_idx, x)  # [T, K]
        t, g = query.shape[2], query.shape[1] // key.shape[1]
        p, j = np.arange(t)[:, None], np.arange(t)[None, :]
        seen = (j <= p)[None] & ((p - j <= window)[None] | (score.T[:, None, :] >= threshold))  # [K, T, T]
        mask = torch.as_tensor(np.repeat(seen, g, axis=0))[None]  # [1, N, T, T]
        k, v = (x.repeat_interleave(g, dim=1) for x in (key, value))
        w = torch.softmax((query @ k.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf")), dim=-1)
        return (w @ v).transpose(1, 2).contiguous(), w

    AttentionInterface.register("kvzap_dms", dms_attention)
    hooks = [layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in ref.model.layers]
    was = ref.config._attn_implementation
    try:
        ref.set_attn_implementation("kvzap_dms")
        with torch.no_grad():
            return ref(torch.as_tensor(ids, dtype=torch.long)).logits[0].numpy()
    finally:
        ref.set_attn_implementation(was)
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_sparse_prefill_is_dms_masked_attention(tiny_qwen, chunk):
    """prefill="sparse": the prompt's logits equal transformers' with DMS's mask (a query sees
    its `window` newest tokens and every older one scoring >= threshold) whatever the chunk; the
    pool after the prompt holds exactly the DMS rule's tokens per head; its state never holds the
    dense prompt (its bytes are the pool's and one score per position)."""
    from models.engine import Engine

    ref, model = tiny_qwen
    cfg = model.cfg
    t, window, max_new = 40, 4, 4
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    params = random_surrogate("linear", cfg.d_model, cfg.n_kv_heads, cfg.n_layers)
    threshold = 0.0
    pol = kvpolicies.get("kvzap", budget=30, max_new=max_new, window=window, rule="threshold", threshold=threshold,
                         surrogate="random", prefill="sparse")
    eng = Engine(model, pol, max_len=t + max_new)
    state = eng.prompt(ids, chunk=chunk)
    want = dms_reference_logits(ref, params, ids, window, threshold)
    np.testing.assert_allclose(np.asarray(state.logits)[0], want[-1], atol=2e-4, rtol=1e-4)
    causal = dms_reference_logits(ref, params, ids, t, threshold)  # a window of the whole prompt: no eviction
    assert np.abs(want[-1] - causal[-1]).max() > 1e-2  # the mask evicts: the dense prefill's logits differ
    zap = np.asarray(state.cache[0].zap)[:, 0]  # [L, K, M]: the scores of the sparse run's own hidden states
    pool = eng.compress(state).cache[0]
    for layer in range(cfg.n_layers):
        keep = [sorted(j for j in range(t) if j > t - 1 - window or zap[layer, h, j] >= threshold) for h in range(K)]
        assert by_head(np.asarray(pool.pos)[layer, 0]) == keep, layer
        assert min(map(len, keep)) < max(map(len, keep)) < t, layer  # heads keep different counts, all evict
    if chunk == 7:  # decoding goes on from the pool; fitted, each layer holds what it kept
        question = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 1)).astype(np.int32)
        fe, fs = eng.fitted(state)
        assert [[h.tolist() for h in layer] for layer in fe.kept_positions(fs)] == \
            [[h.tolist() for h in layer] for layer in eng.kept_positions(eng.compress(state))]
        np.testing.assert_array_equal(fe.continue_generate(fs, question, 3),
                                      eng.continue_generate(eng.compress(state), question, 3))
    dense = kvpolicies.get("kvzap", budget=30, max_new=max_new, window=window, rule="threshold",
                           threshold=threshold, surrogate="random")
    sparse_bytes, dense_bytes = (tree_nbytes(Engine(model, p, max_len=t + max_new).init_cache(1, prompt=True).runs)
                                 for p in (pol, dense))
    assert sparse_bytes == cfg.n_layers * K * (pol.capacity(t + max_new) * (2 * cfg.head_dim * 4 + 8) + (t + max_new) * 4)
    assert sparse_bytes < dense_bytes


def test_a_budget_keeps_the_layers_best_scores(tiny_qwen):
    """rule=budget: the window, then the best K x budget of all heads' scores (head-wise)."""
    from models.engine import Engine

    ref, model = tiny_qwen
    cfg = model.cfg
    t, window, budget = 40, 4, 10
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    params = random_surrogate("linear", cfg.d_model, cfg.n_kv_heads, cfg.n_layers)
    scores = [np_surrogate(params, layer, x) for layer, x in enumerate(reference_inputs(ref, ids))]
    pol = kvpolicies.get("kvzap", budget=budget, max_new=4, window=window, surrogate="random")
    eng = Engine(model, pol, max_len=48)
    pool = eng.compress(eng.prompt(ids)).cache[0]
    for layer, sc in enumerate(scores):
        sets = [set(range(t))] * K
        want = choose([{j: sc[j, h] for j in range(t)} for h in range(K)], sets, window, t - 1, K * budget)
        assert by_head(np.asarray(pool.pos)[layer, 0]) == [sorted(w) for w in want], layer


def test_a_conversation_compressed_at_every_turn_keeps_the_rule_of_its_whole_history(tiny_qwen):
    """evals.multiturn's `every` mode: a context, then turns of (question, answer) fed through
    `extend_prompt` and compressed at each turn. Each compression keeps what the budget rule keeps
    of the whole conversation so far, re-simulated on transformers' hidden states of its ids, and
    what one prompt of those ids compressed keeps: extending never changes a score."""
    from models.engine import Engine

    ref, model = tiny_qwen
    cfg = model.cfg
    window, budget = 4, 12
    rng = np.random.default_rng(7)
    ids = lambda n: rng.integers(0, cfg.vocab_size, (1, n)).astype(np.int32)  # noqa: E731
    params = random_surrogate("linear", cfg.d_model, cfg.n_kv_heads, cfg.n_layers)
    pol = kvpolicies.get("kvzap", budget=budget, max_new=4, window=window, surrogate="random")
    eng = Engine(model, pol, max_len=96)
    seen = ids(30)
    state = eng.prompt(seen, chunk=16)
    for turn in range(3):
        question = ids(5 + turn)
        state = eng.extend_prompt(state, question, chunk=4)
        seen = np.concatenate([seen, question], axis=1)
        kept = [[h.tolist() for h in layer] for layer in eng.kept_positions(eng.compress(state))]
        once = [[h.tolist() for h in layer] for layer in eng.kept_positions(eng.compress(eng.prompt(seen)))]
        assert kept == once, turn
        t = seen.shape[1]
        for layer, x in enumerate(reference_inputs(ref, seen)):
            sc = np_surrogate(params, layer, x)  # [T, K]
            want = choose([{j: sc[j, h] for j in range(t)} for h in range(K)], [set(range(t))] * K, window, t - 1,
                          K * budget)
            assert kept[layer] == [sorted(w) for w in want], (turn, layer)
        answer = eng.continue_generate(eng.compress(state), [], 3)
        state = eng.extend_prompt(state, answer, chunk=2)
        seen = np.concatenate([seen, answer], axis=1)


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_training_reduces_held_out_loss(kind):
    """Synthetic layers whose targets are a linear map of their inputs plus noise: training (optax,
    standardised inputs folded back into the weights) cuts the held-out loss, and the saved raw
    weights reproduce the targets (R^2 > 0.8) through the policy's own forward pass."""
    from evals.train_kvzap import DEFAULTS, evaluate, train

    rng = np.random.default_rng(0)
    L, n, d, kh = 2, 1200, 12, 2
    x = (rng.standard_normal((L, n, d)) * rng.uniform(0.2, 5.0, (L, 1, d)) + 3.0).astype(np.float16)
    w = rng.standard_normal((L, d, kh)) / np.sqrt(d)
    y = (np.einsum("lnd,ldk->lnk", x.astype(np.float32) - 3.0, w / x.astype(np.float32).std(axis=1)[:, :, None])
         - 5.0 + 0.1 * rng.standard_normal((L, n, kh))).astype(np.float32)
    cfg = dict(DEFAULTS, kind=kind, steps=300, batch=256, lr=1e-2, model="synthetic")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        params, losses = train(cfg, x[:, :1000], y[:, :1000], x[:, 1000:], y[:, 1000:], Path(tmp) / "c.npz", False)
    assert all(b < 0.2 * a for a, b in zip(losses["heldout_loss_init"], losses["heldout_loss"])), losses
    _, r2, rho = evaluate(params, x[:, 1000:].astype(np.float32), y[:, 1000:])
    assert min(r2) > 0.8 and min(rho) > 0.8, (r2, rho)


def test_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run stopped right after its step-40 checkpoint and started again ends where an
    uninterrupted run of 80 steps does (same minibatches, optimiser state restored)."""
    import evals.train_kvzap as tk

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 300, 6)).astype(np.float16)
    y = (x.astype(np.float32) @ rng.standard_normal((6, 2))).astype(np.float32)
    cfg = dict(tk.DEFAULTS, steps=80, batch=32, save_every=40, model="synthetic")
    data = (x[:, :200], y[:, :200], x[:, 200:], y[:, 200:])
    whole, _ = tk.train(cfg, *data, tmp_path / "a.npz", False)

    class Stop(Exception):
        pass

    real = np.savez

    def save_then_stop(path, *a, **kw):
        real(path, *a, **kw)
        raise Stop

    monkeypatch.setattr(tk.np, "savez", save_then_stop)
    with pytest.raises(Stop):
        tk.train(cfg, *data, tmp_path / "b.npz", False)
    monkeypatch.setattr(tk.np, "savez", real)
    (tmp_path / "b.tmp.npz").rename(tmp_path / "b.npz")  # the checkpoint written before the stop
    assert int(np.load(tmp_path / "b.npz")["step"]) == 40
    resumed, _ = tk.train(cfg, *data, tmp_path / "b.npz", False)
    for key in whole:
        np.testing.assert_allclose(resumed[key], whole[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("stem", sorted(p.stem for p in WEIGHTS_DIR.glob("*.json")))
def test_committed_surrogates_beat_their_initialisation(stem):
    """Each committed weight file: every trained layer's held-out loss is below its initialisation's
    (the mean log-score), its held-out Spearman correlation is positive, and the file holds what
    the policy loads."""
    rep = json.loads((WEIGHTS_DIR / f"{stem}.json").read_text())
    assert all(b < a for a, b in zip(rep["heldout_loss_init"], rep["heldout_loss"])), stem
    assert min(rep["spearman"]) > 0.0
    pol = KVzap(kind=rep["kind"], surrogate=stem)
    with np.load(WEIGHTS_DIR / f"{stem}.npz") as z:
        p = pol.surrogate_params(int(z["d_model"]), int(z["kv_heads"]), int(z["n_layers"]))
    assert all(np.isfinite(v).all() for k, v in p.items() if k in ("w", "b", "w1", "b1", "w2", "b2"))


def test_prompt_phases_share_only_with_the_same_surrogate():
    """One prefill may serve kvzap at any budget or rule (the phase stores the same scores), never
    another surrogate's (`kvpolicies.prompt.prompt_key`)."""
    from kvpolicies.prompt import prompt_key as _prompt_key

    a = KVzap(budget=256, surrogate="random").prompt_policy()
    b = KVzap(budget=512, rule="threshold", surrogate="random").prompt_policy()
    c = KVzap(budget=256, surrogate="random", kind="mlp").prompt_policy()
    d = kvpolicies.get("kvzip", budget=256).prompt_policy()
    assert _prompt_key(a) == _prompt_key(b)
    assert _prompt_key(a) != _prompt_key(c) and _prompt_key(a) != _prompt_key(d)


def test_training_data_of_a_model_with_local_layers_holds_its_global_layers(tmp_path, monkeypatch):
    """`evals.train_kvzap.collect` on a Gemma-3-like model (two sliding-window layers, one global):
    one file per context, the global layer's hidden states [1, T, d] and kvzip log-scores [1, T, K],
    the scores those of the registered kvzip's reconstruction pass over that context."""
    from evals.train_kvzap import DEFAULTS, EPS, collect
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama
    from models.reconstruct import repeat_prompts
    from models.stacks import model_stack
    from models.tokenizer import ByteTokenizer

    monkeypatch.setenv("KVP_DATA", str(tmp_path))
    cfg = LlamaConfig(vocab_size=260, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                      layer_types=("local", "local", "global"), sliding_window=8)
    model, tok = Llama(cfg), ByteTokenizer()
    conf = dict(DEFAULTS, model="tinylocal", contexts=2, holdout=1, length=24, progress=False)
    paths = collect(model, tok, conf, False)
    assert [p.name for p in paths] == ["ctx0_24.npz", "ctx24_24.npz"]
    z = np.load(paths[1])
    assert z["h"].shape == (1, 24, 32) and z["y"].shape == (1, 24, 2)
    from evals.data import paul_graham

    x = np.asarray(tok.encode(paul_graham()), np.int32)[None, 24:48]
    eng = Engine(model, model_stack(cfg, kvpolicies.get("kvzip", budget=24, max_new=0)), max_len=24,
                 repeat=repeat_prompts(tok))
    zc = eng._reconstruct(eng.prompt(x).cache, x)
    got = [np.asarray(st.extra["zip"])[:, 0] for st in zc if "zip" in getattr(st, "extra", {})]  # global: [1, K, T]
    np.testing.assert_allclose(z["y"][0], np.log(got[0][0].T + EPS), rtol=1e-5, atol=1e-5)
