"""`kvcompose`'s choice over all layers (`compose_keep`; `compose_keep_heads`, structured=False) against kvpress's
KVComposePress rule re-simulated in numpy, its fields and its refusals. Its pass and kept sets beside kvpress
itself: test_kvpress_parity_kvcompose.py; on transformers' attention: test_prompt_matrix.py; its stream rule: the
registry matrix (tests/refs/kvcompose.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies.compat import kvpress
from kvpolicies.full import Full
from kvpolicies.kvcompose import KVCompose, KVComposeHeads, compose_keep, compose_keep_heads

L, B, K, M = 3, 2, 2, 12
N = (12, 9)  # context tokens of each batch row (row 1: 3 empty slots)


def np_compose(score, vnorm, n, ratio, agg_head, add_mean, lower_bound, uniform):
    """kvpress 0.5.5 KVComposePress (structured) on one row's scores [L, K, n], written as its loops:
    `enhance_scores`, `compute_composite_scores`, `compute_important_per_layer`, `prepare_important_masks`
    (ties: the earlier layer in the top-k, the newer token within a head). Returns kept [L][K] sets."""
    s = score.astype(np.float64) * (vnorm if vnorm is not None else 1.0)
    if add_mean:
        s = s + s.mean(axis=1, keepdims=True)
    ranked = -np.sort(-s, axis=-1)  # [L, K, n]
    comp = ranked.mean(axis=1) if agg_head == "mean" else ranked.max(axis=1)  # [L, n]
    comp[:, :lower_bound] += 1e9
    comp[0] = comp.max(axis=0)
    if uniform:
        counts = [min(ratio, n)] * L  # `ratio` is the budget here
    else:
        top = sorted(range(L * n), key=lambda i: (-comp.flat[i], i))[:max(1, int(L * n * (1 - ratio)))]
        counts = [max(sum(1 for i in top if i // n == layer), max(1, lower_bound)) for layer in range(L)]
    return [[set(sorted(range(n), key=lambda j: (-s[layer, h, j], -j))[:counts[layer]]) for h in range(K)]
            for layer in range(L)]


@pytest.mark.parametrize("case", [
    dict(ratio=0.5, agg_head="mean", add_mean=True, lower_bound=0, v=False, uniform=False),  # kvpress's defaults
    dict(ratio=0.7, agg_head="max", add_mean=False, lower_bound=2, v=True, uniform=False),
    dict(ratio=5, agg_head="mean", add_mean=True, lower_bound=0, v=False, uniform=True),  # a budget of 5
], ids=["defaults", "max-bound-vnorm", "budget"])
def test_compose_keep_matches_kvpress_rule(case):
    rng = np.random.default_rng(3)
    score = rng.random((L, B, K, M)).astype(np.float32)
    vnorm = rng.random((L, B, K, M)).astype(np.float32) + 0.5 if case["v"] else None
    pos = np.where(np.arange(M)[None] < np.asarray(N)[:, None], np.arange(M)[None], -1).astype(np.int32)  # [B, M]
    pos = np.broadcast_to(pos[None, :, None], (L, B, 1, M))
    if case["uniform"]:
        table = np.minimum(case["ratio"], np.arange(M + 1))
    else:
        table = np.asarray([max(1, int(L * n * (1 - case["ratio"]))) for n in range(M + 1)])
    kept = np.asarray(compose_keep(jnp.asarray(score), jnp.asarray(pos), None if vnorm is None else jnp.asarray(vnorm),
                                   jnp.asarray(table, jnp.int32), case["agg_head"], case["add_mean"],
                                   case["lower_bound"], case["uniform"]))  # [L, B, K, M]
    for b, n in enumerate(N):
        want = np_compose(score[:, b, :, :n], None if vnorm is None else vnorm[:, b, :, :n], n, case["ratio"],
                          case["agg_head"], case["add_mean"], case["lower_bound"], case["uniform"])
        got = [[set(np.flatnonzero(kept[layer, b, h]).tolist()) for h in range(K)] for layer in range(L)]
        assert got == want, (case, b)
        counts = [len(g[0]) for g in got]
        assert len(set(counts)) > 1 or case["uniform"], counts  # the layers' counts differ (but a budget's)


def np_compose_heads(score, vnorm, n, ratio, add_mean, lower_bound):
    """kvpress 0.5.5 KVComposePress(structured=False) on one row's scores [L, K, n]: `enhance_scores`,
    `composite_scores_per_head` (each head's scores sorted, its first lower_bound ranks + 1e9), `important_per_head`
    (the top max(1, int(L K n (1 - r))) of all of them binned by (layer, head): no floor, no layer-0 rule), each
    head's own best (ties: the earlier (layer, head, rank) in the top-k, the newer token within a head)."""
    s = score.astype(np.float64) * (vnorm if vnorm is not None else 1.0)
    if add_mean:
        s = s + s.mean(axis=1, keepdims=True)
    ranked = -np.sort(-s, axis=-1)  # [L, K, n]
    ranked[..., :lower_bound] += 1e9
    top = sorted(range(L * K * n), key=lambda i: (-ranked.flat[i], i))[:max(1, int(L * K * n * (1 - ratio)))]
    counts = np.bincount([i // n for i in top], minlength=L * K).reshape(L, K)
    return [[set(sorted(range(n), key=lambda j: (-s[layer, h, j], -j))[:counts[layer, h]]) for h in range(K)]
            for layer in range(L)]


@pytest.mark.parametrize("case", [dict(ratio=0.5, add_mean=True, lower_bound=0, v=False),  # kvpress's defaults
                                  dict(ratio=0.7, add_mean=False, lower_bound=2, v=True)],
                         ids=["defaults", "bound-vnorm"])
def test_compose_keep_heads_matches_kvpress_rule(case):
    rng = np.random.default_rng(4)
    score = rng.random((L, B, K, M)).astype(np.float32)
    vnorm = rng.random((L, B, K, M)).astype(np.float32) + 0.5 if case["v"] else None
    pos = np.where(np.arange(M)[None] < np.asarray(N)[:, None], np.arange(M)[None], -1).astype(np.int32)  # [B, M]
    pos = np.broadcast_to(pos[None, :, None], (L, B, 1, M))
    table = np.asarray([max(1, int(L * K * n * (1 - case["ratio"]))) for n in range(M + 1)], np.int32)
    kept = np.asarray(compose_keep_heads(jnp.asarray(score), jnp.asarray(pos),
                                         None if vnorm is None else jnp.asarray(vnorm), jnp.asarray(table),
                                         case["add_mean"], case["lower_bound"]))  # [L, B, K, M]
    for b, n in enumerate(N):
        want = np_compose_heads(score[:, b, :, :n], None if vnorm is None else vnorm[:, b, :, :n], n, case["ratio"],
                                case["add_mean"], case["lower_bound"])
        got = [[set(np.flatnonzero(kept[layer, b, h]).tolist()) for h in range(K)] for layer in range(L)]
        assert got == want, (case, b)
        counts = [len(h) for g in got for h in g]
        assert sum(counts) == table[n] and len(set(counts)) > 1, counts  # each (layer, head) its own count


def test_fields_and_refusals():
    pol = kvpress("KVComposePress", 0.5, max_new=8, agg_task="mean", keep_token_lower_bound=3)
    assert isinstance(pol, KVCompose) and (pol.ratio, pol.agg_task, pol.keep_token_lower_bound) == (0.5, "mean", 3)
    assert pol.capacity(100) == 100 and pol.fit(20).capacity(100) == 28 and pol.fit(95).capacity(100) == 100
    assert kvpolicies.get("kvcompose", budget=8, max_new=4).capacity(100) == 12
    assert isinstance(kvpress("KVComposePress", 0), Full)
    heads = kvpress("KVComposePress", 0.5, max_new=8, structured=False, agg_head="max")  # agg_head: unused there
    assert isinstance(heads, KVComposeHeads) and heads.capacity(100) == 100 and heads.fit(20).capacity(100) == 28
    with pytest.raises(ValueError, match="unknown field"):
        kvpress("KVComposePress", 0.5, window_size=8)
    with pytest.raises(ValueError, match="agg_head"):
        KVCompose(agg_head="median")
    with pytest.raises(ValueError, match="keep_token_lower_bound"):
        KVCompose(keep_token_lower_bound=-1)


def test_every_layer_must_be_kvcompose():
    """The choice is over all layers at once: an engine with another policy in a layer is refused at the pass."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))
    eng = Engine(model, (kvpolicies.get("kvcompose", ratio=0.5), Full()), max_len=32)
    prompted = eng.prompt(np.arange(20, dtype=np.int32)[None])
    with pytest.raises(ValueError, match="every layer must run the same kvcompose"):
        eng.compress(prompted)


def heads_stream(pol, q, k, v, max_len):
    """KVComposeHeads's stream extension re-simulated in float64 numpy, from an empty pool of K x S slots (S its
    capacity): every token appended to every kv head; when the pool overflows, it keeps the K x (S - max_new)
    slots of all heads that the overflowing query attends most, averaged over the head's G query heads (ties:
    the newer token). Returns the outputs [B, T, N, D] and the kept positions [B][K]."""
    from tests.refs.headwise import B, G, K as KH, rotated

    qr, kr = rotated(q, k)
    v = np.asarray(v, np.float64)
    t, d = q.shape[1], q.shape[-1]
    s = pol.capacity(max_len)
    out, kept_all = np.zeros(q.shape), []
    for b in range(B):
        kept = [set() for _ in range(KH)]
        for p in range(t):
            probs = {}
            for h in range(KH):
                js = np.asarray(sorted(kept[h] | {p}))
                lg = np.einsum("jd,gd->gj", kr[b, js, h], qr[b, p, h * G:(h + 1) * G]) / np.sqrt(d)
                w = np.exp(lg - lg.max(axis=1, keepdims=True))
                w /= w.sum(axis=1, keepdims=True)  # [G, J]
                out[b, p, h * G:(h + 1) * G] = w @ v[b, js, h]
                probs.update({(h, j): x for j, x in zip(js.tolist(), w.mean(axis=0))})
                kept[h] = set(js.tolist())
            if sum(len(x) for x in kept) > KH * s:
                best = sorted(probs, key=lambda hj: (-probs[hj], -hj[1]))[:KH * max(s - pol.max_new, 1)]
                kept = [{j for hh, j in best if hh == h} for h in range(KH)]
        kept_all.append([sorted(x) for x in kept])
    return out, kept_all


def test_kvcompose_heads_stream_extension_matches_its_reference():
    """KVComposeHeads (structured=False) streamed token by token through `attend` from an empty pool of 2 x 8 slots
    (fitted at 5, max_new 3): its outputs and kept sets equal `heads_stream`'s; the heads (keys scaled 4 and 0.5:
    peaked and diffuse attention) end with different counts; chunks of 3 and 1 give the same outputs (the
    policy evicts after every token: `per_token`)."""
    from tests.refs.headwise import ROPE, qkv
    from tests.refs.helpers import run_policy

    pol = KVComposeHeads(ratio=0.5, max_new=3, fitted=5)
    q, k, v = qkv(24, seed=3, head_scale=(4.0, 0.5))
    out, state = run_policy(pol, q, k, v, [1], ROPE)
    want, kept = heads_stream(pol, q, k, v, 64)
    np.testing.assert_allclose(out, want, atol=3e-5, rtol=0)
    for b in range(2):
        assert [h.tolist() for h in state.held(b, 2, pol)] == kept[b], b
    assert any(len(set(len(h) for h in x)) > 1 for x in kept), kept
    np.testing.assert_allclose(run_policy(pol, q, k, v, [3, 1], ROPE)[0], out, atol=1e-5, rtol=0)  # chunks alike
