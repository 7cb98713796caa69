"""Layer-by-layer generation (`Engine(decode_loop="layers")`, the default) against the fused
layer scan (`decode_loop="scan"`): the same ids and the same per-layer states, for every
kind of write a decode step makes (every registered policy: tests/models/test_sharding.py), for a
Gemma-style stack of local and global layers and for `full`'s length buckets; the prompt state
stays usable; compiles stay one per (policy, RoPE kind)."""

from __future__ import annotations

import numpy as np
import pytest

import kvpolicies
from kvpolicies.memory import tree_nbytes
from models.config import LlamaConfig, gemma3_layer_types
from models.engine import Engine, layer_weights
from models.llama import Llama
from models.stacks import model_stack
from tests.refs.sharding_check import MAX_LEN, decode, instances, max_diff, per_layer


def _both(eng: Engine, state, n: int):
    """`sharding_check.decode` through both loops: ((ids, states) layer by layer, (ids, states) of the scan)."""
    eng.decode_loop = "layers"
    one = decode(eng, state, n)
    eng.decode_loop = "scan"
    two = decode(eng, state, n)
    eng.decode_loop = "layers"
    return one, two


# One layer per kind of write a decode step makes: appended slots (sink), appended slots and page
# bounds (quest), a whole new state (h2o's scores), paged blocks, KIVI's quantized groups and residual.
MIXED = ("sink", "quest", "h2o", "paged", "kivi")


def test_layers_equal_the_scan_for_each_kind_of_write():
    """(Every registered policy, one per layer, is checked the same way by tests/models/test_sharding.py:
    its one-device engine decodes layer by layer, the mesh's through the scan.)"""
    pols = instances(2)
    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=len(MIXED), n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=64, qkv_bias=True)
    eng = Engine(Llama(cfg), tuple(pols[n] for n in MIXED), MAX_LEN)
    prompt = np.random.default_rng(0).integers(0, 128, (2, 24))
    state = eng.compress(eng.prompt(prompt))
    (ids, states), (ref_ids, ref_states) = _both(eng, state, 8)
    np.testing.assert_array_equal(ids, ref_ids)
    assert len(states) == len(MIXED)
    for name, st, ref, before in zip(MIXED, states, ref_states, per_layer(state.cache), strict=True):
        assert max_diff(st, ref) < 1e-6, (name, max_diff(st, ref))
        assert max_diff(st, before) > 0, name  # the steps wrote into every layer
    # the public path, twice (the state stays usable), against the scan's
    got = [eng.continue_generate(state, np.zeros((2, 0), np.int32), 9) for _ in range(2)]
    eng.decode_loop = "scan"
    want = eng.continue_generate(state, np.zeros((2, 0), np.int32), 9)
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], want)
    assert eng.traces["decode_n"] == 1 and eng.traces["decode_layer"] == len(MIXED)


def test_local_and_global_layers_and_ragged_rows():
    """Gemma 3's 5 local : 1 global pattern (two RoPE bases; a window on local layers): layer by
    layer equals the scan for generate of a batch and of ragged rows; one layer trace per
    (policy, RoPE kind), not per layer."""
    cfg = LlamaConfig(vocab_size=97, d_model=32, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      layer_types=gemma3_layer_types(7), sliding_window=6, rope_theta_local=10_000.0,
                      rope_theta=1_000_000.0, qk_norm=True, post_norms=True, act="gelu_tanh", embed_scale=32**0.5)
    model = Llama(cfg)
    pols = model_stack(cfg, kvpolicies.get("sink", n_sink=2, window=9))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 97, (2, 14))
    rows = [rng.integers(0, 97, n) for n in (5, 11)]
    eng = Engine(model, pols, 48)
    got = eng.generate(prompt, 12), eng.generate(rows, 10)
    assert eng.traces["decode_layer"] == 2 and "decode_n" not in eng.traces  # sink on global layers, window on local
    eng.decode_loop = "scan"  # the same engine: its prefills are compiled once
    np.testing.assert_array_equal(got[0], eng.generate(prompt, 12))
    np.testing.assert_array_equal(got[1], eng.generate(rows, 10))
    assert eng.traces["decode_n"] == 2
    # one copy of the layer weights per model (shared by its engines), as many bytes as the stacked ones,
    # q/k/v and gate/up concatenated
    split, stacked = layer_weights(model), {k: v[...] for k, v in model.layers.items()}
    assert len(split) == 7 and layer_weights(model) is split
    assert tree_nbytes(split) == tree_nbytes(stacked)
    np.testing.assert_array_equal(np.asarray(split[3]["w_gu"]), np.concatenate([stacked["w_gate"][3], stacked["w_up"][3]], -1))
    np.testing.assert_array_equal(np.asarray(split[5]["wqkv"]),
                                  np.concatenate([stacked[k][5] for k in ("wq", "wk", "wv")], -1))
    assert split[0].keys() == stacked.keys() - {"wq", "wk", "wv", "w_gate", "w_up"} | {"wqkv", "w_gu"}


def test_a_full_bucket_reads_its_reach_and_writes_the_whole_cache():
    """`full` in an engine of 2,048 slots generating at positions < 1,024: each layer step reads a
    1,024-slot bucket, and the states it returns keep all 2,048 slots (as the scan's)."""
    model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32))
    eng = Engine(model, kvpolicies.get("full"), max_len=2048)
    state = eng.compress(eng.prompt(np.random.default_rng(2).integers(0, 97, (1, 40))))
    assert eng._reach(state.length + 6) == 1024
    (ids, states), (ref_ids, ref_states) = _both(eng, state, 6)
    np.testing.assert_array_equal(ids, ref_ids)
    assert all(st.k.shape[-2] == 2048 and max_diff(st, ref) < 1e-6 for st, ref in zip(states, ref_states))
    assert (np.asarray(states[0].pos[0, 0, :46]) == np.arange(46)).all() and (np.asarray(states[0].pos[..., 46:]) == -1).all()


def test_decode_loop_is_checked():
    model = Llama(LlamaConfig(vocab_size=97, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=16))
    with pytest.raises(ValueError, match="decode_loop='fused': expected 'layers' or 'scan'"):
        Engine(model, kvpolicies.get("full"), 16, decode_loop="fused")


def test_until_ends_generation_early_with_the_ids_a_full_generation_starts_with():
    """`continue_generate(until=)`: asked with every id so far (the first included) after every UNTIL_EVERY
    steps, never after the last; True ends the generation there, and the ids are the first ones of the
    generation without it. The scan (decode_loop="scan") decodes every id."""
    from models.engine.layers import UNTIL_EVERY

    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
    eng = Engine(Llama(cfg), kvpolicies.get("snapkv", budget=12, obs_window=4, max_new=24), 48)
    state = eng.compress(eng.prompt(np.random.default_rng(1).integers(0, 128, (2, 20))))
    question = np.random.default_rng(2).integers(0, 128, (2, 3))
    full = eng.continue_generate(state, question, 18)
    seen = []

    def until(ids):
        seen.append(ids.copy())
        return ids.shape[1] > 2 * UNTIL_EVERY

    got = eng.continue_generate(state, question, 18, until=until)
    assert [s.shape for s in seen] == [(2, 1 + UNTIL_EVERY), (2, 1 + 2 * UNTIL_EVERY)]
    for s in seen:
        np.testing.assert_array_equal(s, full[:, :s.shape[1]])
    np.testing.assert_array_equal(got, full[:, :1 + 2 * UNTIL_EVERY])
    seen.clear()  # never true: every id, and never asked after the last step
    np.testing.assert_array_equal(eng.continue_generate(state, question, 1 + 2 * UNTIL_EVERY, until=lambda ids: seen.append(
        ids.shape[1]) or False), full[:, :1 + 2 * UNTIL_EVERY])
    assert seen == [1 + UNTIL_EVERY]
    eng.decode_loop = "scan"
    np.testing.assert_array_equal(eng.continue_generate(state, question, 18, until=until), full)
