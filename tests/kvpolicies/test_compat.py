"""`kvpolicies.compat.kvpress` without kvpress: its errors, kvpress's DuoAttention head rule and
KVzip's model-wide choice against numpy re-simulations of kvpress 0.5.5's code
(`DuoAttentionPress.post_init_from_model`, `KVzipPress.compress_post`), and the head pool's
layout for heads that do not keep the newest token. The presses themselves run beside kvpress
in tests/test_kvpress_parity.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvpolicies.adakv import head_of
from kvpolicies.compat import duo_heads, kvpress
from kvpolicies.kvzip import KVzip, model_scope_keep


def test_duo_needs_a_head_pattern_and_refuses_on_the_fly_scoring():
    with pytest.raises(ValueError, match="head_scores"):
        kvpress("DuoAttentionPress", 0.5)
    with pytest.raises(NotImplementedError, match="BookSum"):
        kvpress("DuoAttentionPress", 0.5, on_the_fly_scoring=True)


def test_duo_heads_are_kvpress_lowest_scores():
    rng = np.random.default_rng(3)
    scores = rng.random((5, 4)) * 1.4 - 0.2  # some outside [0, 1]: kvpress clips
    for r in (0.0, 0.25, 0.5, 0.9):
        clipped = np.clip(scores, 0, 1)
        n_pruned = round(clipped.size * r)
        want = np.ones((5, 4), int)
        for i in np.argsort(clipped.reshape(-1))[:n_pruned]:  # kvpress: argsort(axis=None)[:n_pruned] stream
            want[i // 4, i % 4] = 0
        assert np.array_equal(np.asarray(duo_heads(tuple(map(tuple, scores)), r)), want)
    layers = kvpress("DuoAttentionPress", 0.5, head_scores=scores, n_layers=5, sink_size=8, recent_size=16, max_new=32)
    assert [p.heads for p in layers] == [tuple(r) for r in duo_heads(tuple(map(tuple, scores)), 0.5)]
    assert {(p.sink, p.recent, p.appended, p.prompt) for p in layers} == {(8, 16, 32, "dense")}


def test_kvzip_fields_and_errors():
    pol = kvpress("KVzipPress", 0.5)
    assert (pol.scope, pol.keep_last, pol.prompts, pol.repeat_chunk, pol.n_sink) == ("model", False, "kvpress", 2048, 4)
    assert kvpress("KVzipPress", 0.5, layerwise=True).scope == "layer"
    with pytest.raises(NotImplementedError, match="kvzip_plus"):
        kvpress("KVzipPress", 0.5, kvzip_plus_normalization=True)
    with pytest.raises(ValueError, match="ratio"):
        KVzip(scope="model")
    with pytest.raises(ValueError, match="n_sink"):
        KVzip(keep_last=False, n_sink=0)
    with pytest.raises(ValueError, match="unknown field"):
        kvpress("KVzipPress", 0.5, window_size=3)


def kvpress_compress_post(scores: np.ndarray, ratio: float, n_sink: int) -> np.ndarray:
    """kvpress 0.5.5's `KVzipPress.compress_post` (layerwise=False) in numpy: [L, K, n] scores ->
    kept mask (sinks scored max + 1, the int(L K n r) lowest removed, then per layer its count's
    lowest across heads)."""
    s = scores.copy()
    s[..., :n_sink] = s.max() + 1.0
    n_layers, kh, n = s.shape
    pruned = np.argsort(s.reshape(-1), kind="stable")[:int(s.size * ratio)]
    per_layer = np.bincount(pruned // (kh * n), minlength=n_layers)
    kept = np.ones_like(s, bool)
    for layer in range(n_layers):
        drop = np.argsort(s[layer].reshape(-1), kind="stable")[:per_layer[layer]]
        kept[layer].reshape(-1)[drop] = False
    return kept


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75])
def test_model_scope_keep_is_kvpress_compress_post(ratio):
    rng = np.random.default_rng(int(ratio * 100))
    n_layers, kh, n, m = 4, 3, 50, 64  # 50 context tokens in 64 slots
    scores = rng.random((n_layers, kh, n)).astype(np.float32)
    pos = np.full((n_layers, 1, 1, m), -1, np.int32)
    pos[..., :n] = np.arange(n)
    full = np.zeros((n_layers, 1, kh, m), np.float32)
    full[:, 0, :, :n] = scores
    got = np.asarray(model_scope_keep(jnp.asarray(full), jnp.asarray(pos), ratio, 4))[:, 0]
    assert not got[..., n:].any()
    want = kvpress_compress_post(scores, ratio, 4)
    assert np.array_equal(got[..., :n], want)
    sizes = want.sum(axis=(1, 2))
    assert sizes.sum() == n_layers * kh * n - int(n_layers * kh * n * ratio) and len(set(sizes)) > 1


def test_head_of_reads_heads_that_do_not_keep_the_newest_token():
    # head 0 keeps 0..2 and 7, head 1 keeps 0, 1, 9 (the newest), head 2 keeps 0 and 4; then empty slots
    pos = jnp.asarray([[[0, 1, 2, 7, 0, 1, 9, 0, 4, -1, -1]]], jnp.int32)
    assert np.asarray(head_of(pos, 3)).tolist() == [[[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3]]]
    # adakv's layout: every head ends at the newest token
    pos = jnp.asarray([[[3, 5, 9, 2, 9, 8, 9, -1]]], jnp.int32)
    assert np.asarray(head_of(pos, 3)).tolist() == [[[0, 0, 0, 1, 1, 2, 2, 3]]]


def test_press_name_is_positional_and_press_is_a_wrappers_inner_press():
    """`press=` is kvpress's field (AdaKVPress's inner press), by class name or as an inner
    `kvpress(...)` result; the press name itself is positional only."""
    from kvpolicies.adakv import AdaKV

    by_name = kvpress("AdaKVPress", 0.5, press="SnapKVPress", window_size=16)
    by_result = kvpress("AdaKVPress", 0.5, press=kvpress("SnapKVPress", 0.5, window_size=16))
    assert by_name == by_result
    with pytest.raises(ValueError, match="by class name"):  # kvpress(..., 0) is `full`: its fields are gone
        kvpress("AdaKVPress", 0.5, press=kvpress("SnapKVPress", 0.0, window_size=16))
    assert isinstance(by_name, AdaKV) and (by_name.obs_window, by_name.ratio) == (16, 0.5)
    assert kvpress("AdaKVPress", 0.5) == kvpress("AdaKVPress", 0.5, press="SnapKVPress")  # kvpress's default
    with pytest.raises(ValueError, match="compression_ratio 0.3"):
        kvpress("AdaKVPress", 0.5, press=kvpress("SnapKVPress", 0.3))
    with pytest.raises(ValueError, match="given twice"):
        kvpress("AdaKVPress", 0.5, press=kvpress("SnapKVPress", 0.5), window_size=8)
    with pytest.raises(NotImplementedError, match="only SnapKVPress"):  # kvpress refuses it too (eager attention)
        kvpress("AdaKVPress", 0.5, press="ObservedAttentionPress")
    with pytest.raises(ValueError, match="inner press"):
        kvpress("SnapKVPress", 0.5, press="KnormPress")
    with pytest.raises(TypeError):
        kvpress(name="SnapKVPress", compression_ratio=0.5)  # noqa  positional only


def test_per_layer_compression_is_one_inner_policy_per_layer():
    layers = kvpress("PerLayerCompressionPress", 0.5, press="LagKVPress", lag_size=16, compression_ratios=[0.25, 0.75])
    assert [(type(p).__name__, p.ratio, p.lag_size) for p in layers] == [("LagKV", 0.25, 16), ("LagKV", 0.75, 16)]
    assert kvpress("PerLayerCompressionPress", 0.5, press=kvpress("KeyDiffPress", 0.9),
                   compression_ratios=[0.5, 0.5]) == (kvpress("KeyDiffPress", 0.5),) * 2
    with pytest.raises(ValueError, match="mean"):
        kvpress("PerLayerCompressionPress", 0.4, press="KnormPress", compression_ratios=[0.25, 0.75])
    with pytest.raises(ValueError, match="3 layers"):
        kvpress("PerLayerCompressionPress", 0.5, press="KnormPress", compression_ratios=[0.25, 0.75], n_layers=3)
    with pytest.raises(ValueError, match="compression_ratios"):
        kvpress("PerLayerCompressionPress", 0.5, press="KnormPress")


def test_chunk_and_block_press_wrap_a_subset_scorer():
    """ChunkPress keeps max(1, int(len (1 - r))) of each chunk (the last one shorter); BlockPress
    kvpress's n_kept; both refuse scorers that read more than the tokens they rank (BlockPress: or
    their order, LagKV's partitions)."""
    from kvpolicies.compat import Blocked, Chunked

    chunked = kvpress("ChunkPress", 0.75, press="LagKVPress", lag_size=8, chunk_length=64)
    assert isinstance(chunked, Chunked) and chunked.press == kvpress("LagKVPress", 0.75, lag_size=8)
    assert chunked.kept_for(150) == 16 + 16 + 5 and chunked.kept_for(3) == 1  # 64, 64, 22 tokens
    assert kvpress("ChunkPress", 0.75, press="KeyDiffPress").kept_for(150) == 37  # one chunk of 1024
    blocked = kvpress("BlockPress", 0.5, press=kvpress("KeyDiffPress", 0.5))
    assert isinstance(blocked, Blocked) and (blocked.block_size, blocked.kept_for(320)) == (128, 160)
    with pytest.raises(NotImplementedError, match="BlockPress over 'LagKVPress'"):
        kvpress("BlockPress", 0.5, press="LagKVPress")
    with pytest.raises(NotImplementedError, match="ChunkPress over 'SnapKVPress'"):
        kvpress("ChunkPress", 0.5, press="SnapKVPress")
    with pytest.raises(ValueError, match="press="):
        kvpress("ChunkPress", 0.5)
    with pytest.raises(ValueError, match="must be one of"):
        Blocked(ratio=0.5, press=kvpress("LagKVPress", 0.5))


def test_model_scope_keep_compiles_once_for_every_ratio():
    """kvzip's model-wide choice is one compiled program per shape (not a dozen eager operations):
    a ratio is data (its table of tokens removed), so ratios after the first compile nothing
    (JAX's compilation events)."""
    from evals.compiles import CompileLog

    rng = np.random.default_rng(3)
    scores = jnp.asarray(rng.random((3, 1, 2, 37)).astype(np.float32))  # a shape no other test compiles
    pos = jnp.asarray(np.broadcast_to(np.arange(37, dtype=np.int32), (3, 1, 1, 37)))
    with CompileLog() as first:
        np.asarray(model_scope_keep(scores, pos, 0.25, 4))
    with CompileLog() as log:
        kept = [np.asarray(model_scope_keep(scores, pos, r, 4)).sum() for r in (0.5, 0.75, 0.875)]
    assert first.programs <= 2 and log.programs == 0  # eagerly: 36 programs, one per operation
    assert kept == [3 * 2 * 37 - int(3 * 2 * 37 * r) for r in (0.5, 0.75, 0.875)]


def test_composed_press_chains_kvpress_counts_and_refuses_what_it_cannot_chain():
    """ComposedPress keeps max(1, int(m (1 - r_i))) of what the previous presses kept; its ratio is
    1 - prod(1 - r_i); a later press must rank token sets (not SnapKV's rows, not LagKV's order)."""
    from kvpolicies.compat import Composed

    pol = kvpress("ComposedPress", 0.5, presses=[["SnapKVPress", 0.375, {"window_size": 8}], kvpress("KeyDiffPress", 0.2)])
    assert isinstance(pol, Composed) and pol.presses[0].obs_window == 8
    assert [pol.kept_for(n) for n in (320, 7, 1)] == [160, 3, 1]  # 320 -> 200 -> 160; 7 -> 4 -> 3; 1 -> 1 -> 1
    assert (pol.prompt_policy().obs_window, pol.prompt_policy().query_sink) == (8, 4)  # snapkv's rows, keydiff's RoPE
    with pytest.raises(ValueError, match="1 - prod"):
        kvpress("ComposedPress", 0.6, presses=[["KnormPress", 0.5], ["KeyDiffPress", 0.5]])
    with pytest.raises(ValueError, match="after the first press"):
        kvpress("ComposedPress", 0.75, presses=[["KnormPress", 0.5], ["SnapKVPress", 0.5]])
    with pytest.raises(NotImplementedError, match="prompt scorers only"):
        kvpress("ComposedPress", 0.75, presses=[["AdaKVPress", 0.5], ["KnormPress", 0.5]])
    with pytest.raises(ValueError, match="presses="):
        kvpress("ComposedPress", 0.5)
