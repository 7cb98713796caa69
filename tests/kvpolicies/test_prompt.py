"""The authors' prompt protocols (issue 35, item 3), checked against their rules re-simulated on
transformers' tensors: the attention weights and the key/value cache of transformers' eager
Qwen2 (the `tiny_qwen` checkpoint, ported to our Llama) on the same ids.

- h2o (FMInference/H2O `utils_real_drop/modify_llama.py`): dense prompt, then per kv head the
  `recent` newest tokens plus the `heavy` older ones with the most attention summed over every
  prompt query (and the query heads of the kv head).
- tova (schwartz-lab-NLP/TOVA `src/tova_cache.py`): dense prompt, then the `budget` tokens with
  the most attention from the last query, averaged over all query heads.
- kivi (jy-yuan/KIVI `models/llama_kivi.py`): dense full-precision prompt, then keys
  X_K[: n - n mod R] quantized per channel in groups of G tokens, values X_V[: n - R] per token
  in groups of G channels, the rest kept in full precision.
- duo (mit-han-lab/duo-attention `duo_attn/patch/llama.py`): dense prefill for every head, then
  streaming heads trimmed to the first `sink` and the last `recent` tokens.

Each: the prompt's logits equal `full`'s (and transformers'), and the state after `compress`
holds what the re-simulated rule keeps. `prompt="stream"` (the per-token rule) stays available,
and differs.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvpolicies
from models.engine import Engine

T = 40  # prompt tokens
MAX_LEN = 64


@pytest.fixture(scope="module")
def hf_run(tiny_qwen):
    """(our model, ids [1, T], transformers' logits [1, T, V], attentions per layer [1, H, T, T],
    keys / values per layer [1, K, T, D] as transformers caches them: keys after RoPE)."""
    import torch

    ref, ours = tiny_qwen
    ids = np.random.default_rng(7).integers(0, ref.config.vocab_size, (1, T))
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_attentions=True, use_cache=True)
    cache = out.past_key_values
    keys = [lay.keys.numpy() for lay in cache.layers]
    values = [lay.values.numpy() for lay in cache.layers]
    return ours, ids, out.logits.numpy(), [a.numpy() for a in out.attentions], keys, values


def _prompted(model, pol, ids):
    eng = Engine(model, pol, max_len=MAX_LEN)
    st = eng.prompt(ids)
    return eng, st, eng.compress(st)


def _check_dense_logits(model, st, hf_logits, ids):
    """The prompt's last logits equal full's (same engine path) and transformers'."""
    full = Engine(model, kvpolicies.get("full"), max_len=MAX_LEN).prompt(ids)
    np.testing.assert_allclose(np.asarray(st.logits), np.asarray(full.logits), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(st.logits), hf_logits[:, -1], atol=1e-4, rtol=0)


def _kept(pos_layer):
    """[Kp, S] slot positions -> per unit the sorted kept positions."""
    return [sorted(int(x) for x in row if x >= 0) for row in np.asarray(pos_layer)]


def _groups(att, kv_heads):
    """[H, T, T] -> [K, G, T, T] (query head h serves kv head h // G, as transformers' repeat_kv)."""
    h = att.shape[0]
    return att.reshape(kv_heads, h // kv_heads, *att.shape[1:])


# -- h2o ---------------------------------------------------------------------------------------


def h2o_reference(att, kv_heads, heavy, recent):
    """The authors' `H2OKVCache_LayerWise` after a dense prompt: hh_score = attention summed over
    the query axis (and here the kv head's query heads); keep [n - recent, n) and the top
    `heavy` of [0, n - recent) by hh_score."""
    n = att.shape[-1]
    kept = []
    for g in _groups(att, kv_heads):  # [G, T, T]
        hh = g.sum(axis=(0, 1))  # [T]
        if n <= heavy + recent:
            kept.append(list(range(n)))
            continue
        top = np.argsort(-hh[: n - recent], kind="stable")[:heavy]
        kept.append(sorted(top.tolist() + list(range(n - recent, n))))
    return kept


def test_h2o_dense_prompt_then_one_eviction_as_the_authors(hf_run):
    model, ids, logits, atts, _, _ = hf_run
    heavy, recent = 6, 5
    pol = kvpolicies.get("h2o", heavy=heavy, recent=recent)
    assert pol.prompt == "dense"
    eng, st, comp = _prompted(model, pol, ids)
    _check_dense_logits(model, st, logits, ids)
    kh = model.cfg.n_kv_heads
    pos = np.asarray(comp.cache[0].pos)  # [L, B, K, S]
    mass = np.asarray(comp.cache[0].mass)
    for layer, att in enumerate(atts):
        want = h2o_reference(att[0], kh, heavy, recent)
        assert _kept(pos[layer, 0]) == want, f"layer {layer}"
        # the kept tokens' scores carry on into decoding: their prompt attention sums
        hh = _groups(att[0], kh).sum(axis=(1, 2))  # [K, T]
        for u in range(kh):
            live = pos[layer, 0, u] >= 0
            np.testing.assert_allclose(mass[layer, 0, u][live], hh[u][pos[layer, 0, u][live]], rtol=1e-4, atol=1e-5)
    # heads choose differently here (the check is not vacuous) and the stream rule differs
    assert any(_kept(pos[layer, 0])[0] != _kept(pos[layer, 0])[1] for layer in range(len(atts)))
    stream = Engine(model, kvpolicies.get("h2o", heavy=heavy, recent=recent, prompt="stream"), max_len=MAX_LEN)
    assert np.abs(np.asarray(stream.prompt(ids).logits) - np.asarray(st.logits)).max() > 1e-3
    # then decoding is per token: generation runs and keeps heavy + recent slots
    out = eng.continue_generate(comp, np.zeros((1, 0), np.int32), 4)
    assert out.shape == (1, 4)
    np.testing.assert_array_equal(eng.generate(ids, 4), out)  # generate = prompt, compress, decode


def test_h2o_decode_after_the_prompt_continues_the_authors_rule(hf_run, tiny_qwen):
    """One decode step from the compressed cache, in transformers (its cache holding the kept keys
    and values, the new token at position T) and here: the same logits, and the same kept sets
    after the authors' per-step eviction (scores += the new query's attention, the new token's
    own column included; keep the `recent` newest and the top `heavy` others)."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import DynamicCache

    ref, _ = tiny_qwen
    model, ids, _, atts, keys, values = hf_run
    heavy, recent = 6, 5
    eng, st, comp = _prompted(model, kvpolicies.get("h2o", heavy=heavy, recent=recent), ids)
    nxt = int(np.asarray(st.logits).argmax(-1)[0])
    logits, after = eng.step(jax.tree.map(jnp.copy, comp.cache), np.array([[nxt]]), T)
    pos = np.asarray(comp.cache[0].pos)[:, 0]  # [L, K, S]: kept before the step
    kh = model.cfg.n_kv_heads
    cache = DynamicCache()
    for layer in range(len(keys)):
        take = lambda x: torch.tensor(np.stack([x[layer][0, h, pos[layer, h]] for h in range(kh)])[None])  # noqa: E731
        cache.update(take(keys), take(values), layer)
    with torch.no_grad():
        out = ref(torch.tensor([[nxt]]), past_key_values=cache, position_ids=torch.tensor([[T]]),
                  output_attentions=True, use_cache=True)
    np.testing.assert_allclose(np.asarray(logits), out.logits[:, -1].numpy(), atol=1e-4, rtol=0)
    got = np.asarray(after[0].pos)[:, 0]  # [L, K, S]
    for layer, att in enumerate(atts):
        hh = _groups(att[0], kh).sum(axis=(1, 2))  # [K, T]: the prompt's scores
        new = _groups(out.attentions[layer][0].numpy(), kh).sum(axis=(1, 2))  # [K, S + 1]
        for u in range(kh):
            cand = np.append(pos[layer, u], T)  # text order, the new token last
            score = np.append(hh[u][pos[layer, u]], 0.0) + new[u]
            older = np.argsort(-score[: len(cand) - recent], kind="stable")[:heavy]
            want = sorted(cand[older].tolist() + cand[len(cand) - recent:].tolist())
            assert sorted(int(p) for p in got[layer, u] if p >= 0) == want, f"layer {layer} head {u}"


# -- tova --------------------------------------------------------------------------------------


def tova_reference(att, kv_heads, budget, scope):
    """The authors' `TOVACache.reduce` after a dense prompt: the last query's attention averaged
    over all query heads (scope "layer"; per kv head over its G query heads for "head"), top
    `budget`."""
    last = att[:, -1, :]  # [H, T]
    units = [last.mean(axis=0)] if scope == "layer" else [g.mean(axis=0) for g in last.reshape(kv_heads, -1, last.shape[-1])]
    return [sorted(np.argsort(-u, kind="stable")[:budget].tolist()) for u in units]


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_tova_dense_prompt_then_one_topk_by_the_last_query(hf_run, scope):
    model, ids, logits, atts, _, _ = hf_run
    pol = kvpolicies.get("tova", budget=9, scope=scope)
    _, st, comp = _prompted(model, pol, ids)
    _check_dense_logits(model, st, logits, ids)
    pos = np.asarray(comp.cache[0].pos)  # [L, B, Kp, S]
    for layer, att in enumerate(atts):
        assert _kept(pos[layer, 0]) == tova_reference(att[0], model.cfg.n_kv_heads, 9, scope), f"layer {layer}"


# -- kivi --------------------------------------------------------------------------------------


def kivi_reference(x, n, bits, group, residual, axis):
    """The authors' prefill quantization of one head's keys (axis "keys": X[: n - n mod R] per
    channel over groups of G tokens) or values ("values": X[: n - R] per token over groups of G
    channels), dequantized; the rest in full precision. x [T, D] float64."""
    top = 2**bits - 1
    out = x.copy()
    if axis == "keys":
        nq = n - n % residual
        for a in range(0, nq, group):
            blk = x[a:a + group]  # [G, D]: per channel
            mn, mx = blk.min(0), blk.max(0)
            s = (mx - mn) / top
            out[a:a + group] = np.clip(np.round((blk - mn) / np.where(s > 0, s, 1)), 0, top) * s + mn
    else:
        for j in range(max(n - residual, 0)):
            blk = x[j].reshape(-1, group)  # [D / G, G]: per token
            mn, mx = blk.min(1, keepdims=True), blk.max(1, keepdims=True)
            s = (mx - mn) / top
            out[j] = (np.clip(np.round((blk - mn) / np.where(s > 0, s, 1)), 0, top) * s + mn).reshape(-1)
    return out


def test_kivi_full_precision_prefill_then_quantized_as_the_authors(hf_run):
    import jax
    import jax.numpy as jnp

    model, ids, logits, _, keys, values = hf_run
    pol = kvpolicies.get("kivi", bits=2, group=4, residual=8)
    eng, st, comp = _prompted(model, pol, ids)
    _check_dense_logits(model, st, logits, ids)
    cache = comp.cache[0]
    for layer in range(len(keys)):
        one = jax.tree.map(lambda x: x[layer], cache)  # this layer's state [B, ...]
        k, v = pol.dequantize(one, jnp.full((1,), T, jnp.int32), jnp.float32)  # [B, K, S, D]
        k, v = np.asarray(k)[0, :, :T], np.asarray(v)[0, :, :T]
        for h in range(k.shape[0]):
            want_k = kivi_reference(keys[layer][0, h].astype(np.float64), T, 2, 4, 8, "keys")
            want_v = kivi_reference(values[layer][0, h].astype(np.float64), T, 2, 4, 8, "values")
            np.testing.assert_allclose(k[h], want_k, atol=2e-4, rtol=0, err_msg=f"keys, layer {layer} head {h}")
            np.testing.assert_allclose(v[h], want_v, atol=2e-4, rtol=0, err_msg=f"values, layer {layer} head {h}")
        # 2-bit codes: the quantized part is visibly lossy (the check is not vacuous)
        assert np.abs(k[:, :T - T % 8] - keys[layer][0, :, :T - T % 8]).max() > 1e-2
    stream = Engine(model, kvpolicies.get("kivi", bits=2, group=4, residual=8, prompt="stream"), max_len=MAX_LEN)
    assert np.abs(np.asarray(stream.prompt(ids).logits) - np.asarray(st.logits)).max() > 1e-3
    np.testing.assert_array_equal(eng.generate(ids, 4), eng.continue_generate(comp, np.zeros((1, 0), np.int32), 4))


@pytest.mark.parametrize("n,after_rope", [(23, True), (5, True), (40, False), (64, True)])
def test_kivi_after_prompt_leaves_the_per_token_rules_state(n, after_rope):
    """For the same keys and values (one attention layer), the dense prompt quantized once equals
    the state the decode step leaves token by token (the rule is one, only the inputs of later
    layers differ)."""
    import jax
    import jax.numpy as jnp

    from tests.refs.helpers import run_policy
    from kvpolicies import Rope

    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((2, n, h, 16)).astype(np.float32) for h in (4, 2, 2))
    rope = Rope(16, 10000.0)
    pol = kvpolicies.get("kivi", bits=2, group=4, residual=8, after_rope=after_rope)
    _, per_token = run_policy(kvpolicies.get("kivi", bits=2, group=4, residual=8, after_rope=after_rope,
                                             prompt="stream"), q, k, v, [1], rope, max_len=64)
    _, dense = run_policy(pol.prompt_policy(), q, k, v, [n], rope, max_len=64)
    got = jax.jit(pol.after_prompt)(dense)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(per_token)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6, rtol=0)
    assert int((np.asarray(got.pos) >= 0).sum()) == 2 * n


# -- duo ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(1, 0), (0, 0)])
def test_duo_dense_prefill_then_streaming_heads_trimmed_as_the_authors(hf_run, heads):
    """The authors' prefill attends every head densely, then cuts a streaming head's cache to
    keys[:sink] and keys[-recent:] (transformers' keys after RoPE, as the authors cache them)."""
    model, ids, logits, _, keys, values = hf_run
    sink, recent = 2, 5
    pol = kvpolicies.get("duo", sink=sink, recent=recent, heads=heads)
    eng, st, comp = _prompted(model, pol, ids)
    _check_dense_logits(model, st, logits, ids)
    cache = comp.cache[0]
    want_pos = list(range(sink)) + list(range(T - recent, T))
    streaming = [h for h in range(2) if not heads[h]]
    retrieval = [h for h in range(2) if heads[h]]
    for layer in range(len(keys)):
        spos = np.asarray(cache.stream_pos)[layer, 0, 0]  # [W]
        assert sorted(int(p) for p in spos if p >= 0) == want_pos
        live = spos >= 0
        for i, h in enumerate(streaming):
            np.testing.assert_allclose(np.asarray(cache.k[1])[layer, 0, i][live], keys[layer][0, h][spos[live]], atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.v[1])[layer, 0, i][live], values[layer][0, h][spos[live]], atol=1e-5)
        for i, h in enumerate(retrieval):  # every prompt token
            assert (np.asarray(cache.pos)[layer, 0, 0, :T] == np.arange(T)).all()
            np.testing.assert_allclose(np.asarray(cache.k[0])[layer, 0, i, :T], keys[layer][0, h], atol=1e-5)
    stream = Engine(model, kvpolicies.get("duo", sink=sink, recent=recent, heads=heads, prompt="stream"),
                    max_len=MAX_LEN)
    s2 = stream.compress(stream.prompt(ids))
    assert np.abs(np.asarray(s2.logits) - np.asarray(st.logits)).max() > 1e-3  # the masked prefill differs
    # the same layout as the streaming rule's state (so decoding continues with the same step)
    assert [x.shape for x in jax_leaves(s2.cache)] == [x.shape for x in jax_leaves(comp.cache)]
    np.testing.assert_array_equal(np.asarray(s2.cache[0].stream_pos), np.asarray(cache.stream_pos))
    np.testing.assert_array_equal(eng.generate(ids, 4), eng.continue_generate(comp, np.zeros((1, 0), np.int32), 4))


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_duo_defaults_are_the_deployed_ones():
    pol = kvpolicies.get("duo")
    assert (pol.sink, pol.recent, pol.prompt) == (64, 256, "dense")


# -- model-level presets through a bare engine ----------------------------------------------------


def test_bare_engine_applies_a_model_level_preset():
    """One policy for the model is expanded by its `stack(n_layers)`: pyramidkv's per-depth budgets,
    quest's and knorm's dense first layers; a tuple runs as given."""
    from kvpolicies.budgets import pyramid_budgets
    from models.config import LlamaConfig
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    full = kvpolicies.get("full")
    pyr = kvpolicies.get("pyramidkv", budget=8, obs_window=3, kernel=3, max_new=4)
    eng = Engine(model, pyr, max_len=48)
    assert [p.budget for p in eng.policies] == list(pyramid_budgets(32, 4, pyr.beta))
    assert len({p.budget for p in eng.policies}) > 1  # not uniform
    knorm = kvpolicies.get("knorm", budget=8, max_new=4)
    assert Engine(model, knorm, max_len=48).policies == (full, full, knorm, knorm)
    assert Engine(model, kvpolicies.get("knorm", budget=8, max_new=4, dense_layers=0), max_len=48).policies[0] != full
    quest = kvpolicies.get("quest", page=4, top_k=2)
    assert Engine(model, quest, max_len=48).policies == (full, full, quest, quest)
    assert Engine(model, (quest,) * 4, max_len=48).policies == (quest,) * 4
    # knorm's dense layers keep every prompt token; the others keep budget
    ids = np.random.default_rng(2).integers(0, 61, (1, 30))
    eng = Engine(model, knorm, max_len=48)
    cache = eng.compress(eng.prompt(ids)).cache
    counts = [int((np.asarray(run.pos)[i, 0, 0] >= 0).sum()) for run in cache for i in range(run.pos.shape[0])]
    assert counts == [30, 30, 8, 8]


def test_layers_of_different_settings_compress_run_by_run():
    """The prompt phases of kivi / duo layers with different settings stay in separate runs, as
    their decode policies: each run is quantized / trimmed by its own layers' rule."""
    from models.config import LlamaConfig
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    ids = np.random.default_rng(3).integers(0, 61, (1, 30))
    k2, k4 = kvpolicies.get("kivi", bits=2, group=4, residual=8), kvpolicies.get("kivi", bits=4, group=4, residual=8)
    d1, d2 = kvpolicies.get("duo", sink=2, recent=4, heads=(1, 0)), kvpolicies.get("duo", sink=2, recent=4, heads=(0, 1))
    for pols in ((k2, k4, k4), (d1, d2, d2)):
        eng = Engine(model, pols, max_len=40)
        comp = eng.compress(eng.prompt(ids))
        assert len(comp.cache) == 2
        np.testing.assert_array_equal(eng.generate(ids, 3), eng.continue_generate(comp, np.zeros((1, 0), np.int32), 3))
