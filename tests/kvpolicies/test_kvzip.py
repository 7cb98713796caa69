"""`kvzip`: KVzip's context-reconstruction scores and head-wise budgets.

References written independently of the library:
- the prompt protocol against transformers' PyTorch Qwen2 (eager attention, `output_attentions`)
  on a tiny random checkpoint: the authors' scoring re-simulated in numpy on transformers'
  attention probabilities (repeat inputs built from the authors' rule, the softmax restricted to
  the sinks, the chunk and the repeat input by renormalising, max over the group's query heads
  and the repeat queries), then the per-layer head-wise choice (sinks and the last token, then
  the best K x budget of all heads' scores) as Python sets;
- the stream extension token by token in float64 numpy (the most attention each slot received,
  the same head-wise choice on overflow), as tests/kvpolicies/test_adakv.py does for Ada-KV.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies.kvzip import KVzip
from kvpolicies.memory import state_bytes
from models.reconstruct import repeat_inputs
from tests.refs.headwise import B, K, MAX_LEN, ROPE, kept_by_head, qkv
from tests.refs.kvzip import REPEAT, choose, simulate_stream


@pytest.mark.parametrize("chunks", [[1], [6]], ids=str)
def test_stream_extension_matches_the_reference(chunks):
    pol = KVzip(budget=5, max_new=3, n_sink=2)
    q, k, v = qkv(27, seed=4, head_scale=(4.0, 0.3))
    out, state = run_policy(pol, q, k, v, chunks, ROPE, max_len=MAX_LEN)
    ref, kept = simulate_stream(pol, q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert kept_by_head(state) == kept
    counts = [[len(x) for x in kb] for kb in kept]
    assert any(c[0] != c[1] for c in counts), counts  # heads hold different numbers of tokens


# ------------------------------------------------------------------------------------------
# the paper's protocol against transformers
# ------------------------------------------------------------------------------------------


def test_repeat_inputs_follow_the_authors_chunking():
    ctx = np.arange(100, 125, dtype=np.int32)[None]  # 25 tokens, chunks of 10
    got = repeat_inputs(ctx, REPEAT, chunk=10, tail=3)
    assert [(lo, hi) for lo, hi, _ in got] == [(0, 10), (10, 20), (20, 25)]
    assert got[0][2][0].tolist() == [5, 6, 7, 10, 11] + list(range(100, 110))
    assert got[1][2][0].tolist() == [8, 9, 107, 108, 109, 10, 11] + list(range(110, 120))
    assert got[2][2][0].tolist() == [8, 9, 117, 118, 119, 10, 11] + list(range(120, 125))


def reference_scores(ref, ctx, pol):
    """[layer][b][h] {pos: score}: the authors' scoring on transformers' attention probabilities."""
    import torch
    from transformers import DynamicCache

    b, t = ctx.shape
    n_layers, kh = ref.config.num_hidden_layers, ref.config.num_key_value_heads
    g = ref.config.num_attention_heads // kh
    cache = DynamicCache()
    with torch.no_grad():
        ref(torch.tensor(ctx, dtype=torch.long), past_key_values=cache, use_cache=True)
    scores = [[[dict() for _ in range(kh)] for _ in range(b)] for _ in range(n_layers)]
    for lo, hi, ids in repeat_inputs(ctx, REPEAT, pol.repeat_chunk, pol.repeat_tail):
        with torch.no_grad():
            att = ref(torch.tensor(ids, dtype=torch.long), past_key_values=copy.deepcopy(cache), use_cache=True,
                      output_attentions=True).attentions  # layers x [B, N, R, T + R]
        cols = np.arange(t + ids.shape[1])
        allowed = (cols < pol.n_sink) | ((cols >= lo) & (cols < hi)) | (cols >= t)
        for layer, a in enumerate(att):
            p = a.double().numpy() * allowed
            p = p / p.sum(axis=-1, keepdims=True)  # the softmax over the allowed keys only
            for bb in range(b):
                for h in range(kh):
                    best = p[bb, h * g:(h + 1) * g].max(axis=(0, 1))  # max over group and queries
                    scores[layer][bb][h].update({j: best[j] for j in range(lo, hi)})
    return scores


def test_prompt_protocol_matches_transformers(tiny_qwen):
    """Scores of every prompt token, per layer and kv head, equal the authors' rule on
    transformers' attention (<= 1e-5), and the compressed cache keeps exactly the head-wise
    choice; the heads of a layer keep different numbers of tokens, K x budget in all."""
    from models.engine import Engine

    ref, ours = tiny_qwen
    pol = KVzip(budget=9, max_new=4, n_sink=2, repeat_chunk=12, repeat_tail=3)
    ctx = np.random.default_rng(1).integers(12, 64, (B, 30)).astype(np.int32)
    eng = Engine(ours, pol, max_len=40, repeat=REPEAT)
    state = eng.prompt(ctx, chunk=7)
    zipped = eng._reconstruct(state.cache, state.tokens)[0].extra["zip"]  # [L, B, K, M]
    want = reference_scores(ref, ctx, pol)
    for layer in range(2):
        for b in range(B):
            for h in range(K):
                got = np.asarray(zipped[layer, b, h, :30], np.float64)
                np.testing.assert_allclose(got, [want[layer][b][h][j] for j in range(30)], atol=1e-5, rtol=0)
    fed = eng.reconstruct_tokens
    comp = eng.compress(state)
    assert eng.reconstruct_tokens - fed == B * (17 + 19 + 13)  # three repeat inputs: prompt + suffix + chunk
    for layer in range(2):
        st = jax.tree.map(lambda x: x[layer], comp.cache[0])
        kept = kept_by_head(st)
        for b in range(B):
            sets = [set(range(30)) for _ in range(K)]
            assert [set(x) for x in kept[b]] == choose(want[layer][b], sets, 2, 29, K * 9)
            counts = [len(x) for x in kept[b]]
            assert sum(counts) == K * 9
    assert any(len(x[0]) != len(x[1]) for layer in range(2)
               for x in kept_by_head(jax.tree.map(lambda a: a[layer], comp.cache[0]))), "heads all kept equal counts"
    # the prompt state is unchanged by the reconstruction (read, not written), and stays usable
    again = eng.compress(state)
    for a, c in zip(jax.tree.leaves(again.cache), jax.tree.leaves(comp.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_repeat_inputs_are_padded_to_a_bucket_and_their_pads_score_nothing(tiny_qwen, monkeypatch):
    """The reconstruction pads each repeat input at its end to a multiple of RECON_BUCKET (at most
    to max_len): prompts
    of 30 and 27 tokens (repeat inputs of 17, 19, 13 and 17, 19, 10 tokens) compile one
    reconstruction step, not three; the scores equal those of unpadded inputs (rounding only: the
    shapes differ) and the authors' rule above; pads are counted apart from the real tokens."""
    import models.reconstruct as R
    from models.engine import Engine

    _, ours = tiny_qwen
    pol = KVzip(budget=9, max_new=4, n_sink=2, repeat_chunk=12, repeat_tail=3)
    rng = np.random.default_rng(3)
    ctxs = [rng.integers(12, 64, (B, n)).astype(np.int32) for n in (30, 27)]

    def scores(bucket):
        monkeypatch.setattr(R, "RECON_BUCKET", bucket)
        eng = Engine(ours, pol, max_len=40, repeat=REPEAT)
        out = []
        for ctx in ctxs:
            state = eng.prompt(ctx, chunk=7)
            out.append(np.asarray(eng._reconstruct(state.cache, state.tokens)[0].extra["zip"]))
        return out, eng

    padded, eng = scores(16)
    assert eng.traces["reconstruct"] == 2  # inputs of 10-19 tokens: buckets 16 and 32
    assert eng.reconstruct_tokens == B * (17 + 19 + 13 + 17 + 19 + 10)
    assert eng.reconstruct_pad_tokens == B * ((32 - 17) + (32 - 19) + (16 - 13) + (32 - 17) + (32 - 19) + (16 - 10))
    plain, eng1 = scores(1)
    assert eng1.traces["reconstruct"] == 4 and eng1.reconstruct_pad_tokens == 0  # 17, 19, 13, 10
    for a, b in zip(padded, plain):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    # never past max_len (40 here): a layer of another policy may write the input into its slots
    capped, eng2 = scores(128)
    assert eng2.traces["reconstruct"] == 1 and eng2.reconstruct_pad_tokens == B * (6 * 40 - 95)
    for a, b in zip(capped, plain):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_generate_equals_prompt_compress_continue(tiny_qwen):
    """`generate` (query-aware: the whole prompt reconstructed) is prompt + compress +
    continue_generate of the same ids; the prefill chunk changes nothing."""
    from models.engine import Engine

    _, ours = tiny_qwen
    pol = KVzip(budget=9, max_new=8, n_sink=2, repeat_chunk=12, repeat_tail=3)
    ctx = np.random.default_rng(2).integers(12, 64, (B, 26)).astype(np.int32)
    eng = Engine(ours, pol, max_len=40, repeat=REPEAT)
    a = eng.generate(ctx, 6, chunk=5)
    b = eng.continue_generate(eng.compress(eng.prompt(ctx, chunk=26)), np.zeros((B, 0), np.int32), 6)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_one_reconstruction_pass_serves_every_ratio(tiny_qwen, scope):
    """`Engine.reconstruct` runs kvzip's pass once; engines at other ratios compress its state
    without a pass (no repeat token fed) to the kept positions and answers of their own pass
    (scope="model": each engine's choice over all layers made again from the shared scores); more
    prompt tokens, or another n_sink, mean a pass again."""
    import dataclasses

    from models.engine import Engine

    _, ours = tiny_qwen
    rng = np.random.default_rng(4)
    ctx, q = (rng.integers(12, 64, (B, n)).astype(np.int32) for n in (30, 2))
    engs = [Engine(ours, KVzip(ratio=r, max_new=6, n_sink=2, repeat_chunk=12, repeat_tail=3, scope=scope), max_len=40,
                   repeat=REPEAT) for r in (0.25, 0.5, 0.75)]
    state = engs[0].prompt(ctx, chunk=7)
    scored = engs[0].reconstruct(state)
    assert engs[0].reconstruct_tokens == B * (17 + 19 + 13) and scored.scored is not None and state.scored is None
    assert engs[0].reconstruct(scored) is scored and engs[0].reconstruct_tokens == B * (17 + 19 + 13)
    kept_counts = []
    for e in engs:
        own = e.compress(state)  # its own pass
        fed = e.reconstruct_tokens
        shared = e.compress(scored)
        assert e.reconstruct_tokens == fed, "compress ran a pass over a state already scored alike"
        for b in range(B):
            want, got = e.kept_positions(own, b), e.kept_positions(shared, b)
            assert [[x.tolist() for x in layer] for layer in got] == [[x.tolist() for x in layer] for layer in want]
        np.testing.assert_array_equal(e.continue_generate(shared, q, 4), e.continue_generate(own, q, 4))
        kept_counts.append(sum(len(x) for layer in e.kept_positions(shared) for x in layer))
    assert kept_counts[0] > kept_counts[1] > kept_counts[2]  # the ratios keep what they should, not one set
    more = engs[1].extend_prompt(scored, ctx[:, :3])
    assert more.scored is None  # the scores are stale
    other = Engine(ours, dataclasses.replace(engs[1].policies[0], n_sink=3), max_len=40, repeat=REPEAT)
    other.compress(scored)
    assert other.reconstruct_tokens == B * (17 + 19 + 13)  # another n_sink scores differently: a pass
    with pytest.raises(ValueError, match="uncompressed"):
        engs[0].reconstruct(engs[0].compress(scored))
    with pytest.raises(ValueError, match="no layer of this engine reconstructs"):
        Engine(ours, kvpolicies.get("full"), max_len=40).reconstruct(state)


def test_needs_repeat_prompts_before_any_compute(tiny_qwen):
    from models.engine import Engine

    _, ours = tiny_qwen
    eng = Engine(ours, KVzip(budget=9, max_new=4), max_len=40)
    ctx = np.ones((1, 20), np.int32)
    for call in (lambda: eng.prompt(ctx), lambda: eng.generate(ctx, 2), lambda: eng.prefill(ctx)):
        with pytest.raises(ValueError, match="repeat_prompts"):
            call()
    assert eng.traces == {}  # nothing was compiled


def test_stores_the_bytes_of_a_uniform_pool():
    """State bytes: K x S slots of keys and values, an int32 position and a float32 score per
    slot (closed form), equal to Ada-KV's at the same slots."""
    pol = kvpolicies.get("kvzip", budget=100, max_new=28)
    d, m = 16, 1000
    s = 128
    size = dict(kv_heads=K, head_dim=d, max_len=m, dtype=jnp.float32)
    assert state_bytes(pol, **size).total == K * s * (2 * d * 4 + 4 + 4)
    ada = kvpolicies.get("adakv", budget=100 - 32, obs_window=32, max_new=28)
    assert state_bytes(ada, **size).total == state_bytes(pol, **size).total
