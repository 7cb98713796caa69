"""Keys stored rotated (`Policy.rotated_keys`: full, window, sink and duo with the identity codec, or
with a codec that encodes after RoPE): attention reads them as stored, and equals the un-rotated path
that rotates every stored key in every step.

References: the same policy with `rotated_keys` turned off (keys stored before RoPE, the path every
other policy takes), RoPE applied to that policy's stored keys, and the engine's own prefill (a
prompt phase's un-rotated state adopted by `full`, kvzip's reconstruction reading a `full` layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from benchmarks.attention_ab import unrotated
from kvpolicies.attend import attend
from kvpolicies.full import Full
from kvpolicies.kvzip import KVzip
from kvpolicies.rope import Rope
from models.config import LlamaConfig
from kvpolicies.kvzip import recon_policy as _recon_policy
from models.engine import Engine
from models.llama import Llama

ROPE = Rope(8)


def _run(pol, n, chunk, seed=0):
    """Outputs of n tokens fed in chunks, and the final state."""
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.standard_normal((2, n, h, 8)), jnp.float32) for h in (4, 2, 2))
    st, outs = pol.init(2, 2, 8, jnp.float32, 32), []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
        o, st = attend(pol, st, q[:, a:b], k[:, a:b], v[:, a:b], pos, ROPE)
        outs.append(o)
    return jnp.concatenate(outs, axis=1), st


def test_which_policies_store_rotated_keys():
    assert kvpolicies.get("full").rotated_keys and kvpolicies.get("window", window=8).rotated_keys
    assert kvpolicies.get("sink").rotated_keys and kvpolicies.get("sink", positions="original").rotated_keys
    # a codec quantizes un-rotated keys, as before; policies that score or move keys keep them un-rotated
    assert not kvpolicies.get("full", codec="int8").rotated_keys
    assert not kvpolicies.get("window", window=8, codec="int4").rotated_keys
    assert not kvpolicies.get("sink", codec="int8").rotated_keys
    assert kvpolicies.get("duo").rotated_keys and not kvpolicies.get("duo", codec="int8").rotated_keys
    for name in ("snapkv", "h2o", "quest", "knorm"):
        pol = kvpolicies.get(name)
        assert not pol.rotated_keys and not pol.prompt_policy().rotated_keys, name
    # kivi quantizes its keys after RoPE, as its reference does (after_rope=False: before, un-rotated)
    assert kvpolicies.get("kivi").rotated_keys and not kvpolicies.get("kivi", after_rope=False).rotated_keys
    with pytest.raises(ValueError, match="kivi.after_rope='no': must be True or False"):
        kvpolicies.get("kivi", after_rope="no")
    # kvzip's reconstruction reads a full layer's keys as that layer stores them
    assert _recon_policy(Full()).rotated_keys and not _recon_policy(Full(codec=kvpolicies.get_codec("int8"))).rotated_keys
    # a codec that encodes after RoPE: stored rotated where positions are text positions
    for name, kw in (("full", {}), ("window", {"window": 8}), ("sink", {}), ("sink", {"positions": "original"}),
                     ("duo", {})):
        assert kvpolicies.get(name, codec="int8_after_rope", **kw).rotated_keys, name
    assert _recon_policy(Full(codec=kvpolicies.get_codec("int4_after_rope"))).rotated_keys


@pytest.mark.parametrize("name,kw", [("full", {}), ("window", {"window": 5}), ("sink", {"n_sink": 2, "window": 4}),
                                     ("sink", {"n_sink": 2, "window": 4, "positions": "original"})])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_rotated_keys_equal_the_unrotated_path(name, kw, chunk):
    """Outputs within 1e-6 of the un-rotated twin; the stored keys are the twin's rotated at their
    slots' positions (a ring wraps at window=5 over 13 tokens; sink's, past 2 sinks + 4, also
    with its sinks paired with a second query rotation in cache mode)."""
    pol = kvpolicies.get(name, **kw)
    assert pol.rotated_keys
    out, st = _run(pol, 13, chunk)
    ref_out, ref = _run(unrotated(pol), 13, chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(st.pos), np.asarray(ref.pos))
    np.testing.assert_array_equal(np.asarray(st.v), np.asarray(ref.v))
    filled = np.asarray(st.pos) >= 0
    want = np.asarray(ROPE.apply(ref.k, ref.pos))
    np.testing.assert_allclose(np.asarray(st.k)[np.broadcast_to(filled[..., None], want.shape)],
                               want[np.broadcast_to(filled[..., None], want.shape)], atol=1e-6, rtol=0)
    assert not np.allclose(np.asarray(st.k), np.asarray(ref.k))  # they are stored differently


def test_duo_stores_both_head_groups_rotated():
    """duo (kv head 0 retrieval, 1 streaming: 2 sinks + 4) against its un-rotated twin: outputs
    within 1e-6, each group's stored keys the twin's rotated at their positions (13 tokens, the
    streaming ring wrapped)."""
    pol = kvpolicies.get("duo", heads=(1, 0), sink=2, recent=4)
    assert pol.rotated_keys
    for chunk in (1, 5):
        out, st = _run(pol, 13, chunk)
        ref_out, ref = _run(unrotated(pol), 13, chunk)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-6, rtol=0)
        for k, k_ref, p in ((st.k[0], ref.k[0], ref.pos), (st.k[1], ref.k[1], ref.stream_pos)):
            assert np.array_equal(np.asarray(st.pos), np.asarray(ref.pos))
            assert np.array_equal(np.asarray(st.stream_pos), np.asarray(ref.stream_pos))
            filled = np.broadcast_to((np.asarray(p) >= 0)[..., None], k.shape)
            want = np.asarray(ROPE.apply(k_ref, p))
            np.testing.assert_allclose(np.asarray(k)[filled], want[filled], atol=1e-6, rtol=0)
            assert filled.any() and not np.allclose(np.asarray(k)[filled], np.asarray(k_ref)[filled])


CFG = LlamaConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32,
                  layer_types=("local", "global", "local"), sliding_window=64, rope_theta_local=100.0)


@pytest.fixture(scope="module")
def mixed():
    """A 3-layer model with local and global layers (two RoPE bases): `full` everywhere runs both."""
    return Llama(CFG)


def test_full_adopts_a_prompt_phase_state_rotating_its_keys(mixed):
    """`full` compressing a snapkv prompt state (un-rotated keys, local and global layers) holds what
    its own prefill holds, and generates the same tokens."""
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 21)).astype(np.int32)
    snap = Engine(mixed, kvpolicies.get("snapkv", budget=8, obs_window=4, kernel=3, max_new=8), 40)
    full = Engine(mixed, kvpolicies.get("full"), 40)
    assert full.shares_prompt(snap)
    shared = full.compress(snap.prompt(ids, chunk=8))
    own = full.compress(full.prompt(ids, chunk=8))
    for a, b in zip(jax.tree.leaves(shared.cache), jax.tree.leaves(own.cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(full.continue_generate(shared, [[5], [6]], 6),
                                  full.continue_generate(own, [[5], [6]], 6))
    # and the same as full that stores un-rotated keys
    twin = Engine(mixed, unrotated(kvpolicies.get("full")), 40)
    np.testing.assert_array_equal(twin.continue_generate(twin.compress(twin.prompt(ids, chunk=8)), [[5], [6]], 6),
                                  full.continue_generate(own, [[5], [6]], 6))


def test_full_extends_and_decodes_a_prompt_phase_state_as_its_own(mixed):
    """A snapkv prompt state (un-rotated keys) handed to `full` uncompressed (evals.prefills shares
    it): extending it (multi-turn's `every` mode), feeding it, decoding from it and reading its
    positions give what full's own prefill gives."""
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 21)).astype(np.int32)
    more = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
    snap = Engine(mixed, kvpolicies.get("snapkv", budget=8, obs_window=4, kernel=3, max_new=8), 40)
    full = Engine(mixed, kvpolicies.get("full"), 40)
    shared, own = snap.prompt(ids, chunk=8), full.prompt(ids, chunk=8)
    a, b = full.extend_prompt(shared, more), full.extend_prompt(own, more)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(full.continue_generate(a, [[], []], 6), full.continue_generate(b, [[], []], 6))
    np.testing.assert_array_equal(full.continue_generate(shared, [[], []], 6), full.continue_generate(own, [[], []], 6))
    np.testing.assert_array_equal(full.continue_generate(shared, more, 4), full.continue_generate(own, more, 4))
    np.testing.assert_allclose(np.asarray(full.feed(shared, more).logits), np.asarray(b.logits), atol=1e-5, rtol=0)
    assert [[h.tolist() for h in layer] for layer in full.kept_positions(shared)] == \
        [[h.tolist() for h in layer] for layer in full.kept_positions(own)]


def test_kvzip_reconstruction_reads_a_rotated_full_layer(tiny_qwen):
    """kvzip's scores in layer 1 behind a `full` layer 0 do not depend on how layer 0 stores its keys."""
    from tests.refs.kvzip import REPEAT

    _, ours = tiny_qwen
    zipper = KVzip(budget=9, max_new=4, n_sink=2, repeat_chunk=12, repeat_tail=3)
    ctx = np.random.default_rng(1).integers(12, 64, (2, 30)).astype(np.int32)
    scores = []
    for first in (Full(), unrotated(Full())):
        eng = Engine(ours, (first, zipper), max_len=40, repeat=REPEAT)
        state = eng.prompt(ctx, chunk=7)
        scores.append(np.asarray(eng._reconstruct(state.cache, state.tokens)[1].extra["zip"]))
    np.testing.assert_allclose(scores[0], scores[1], atol=1e-6, rtol=0)
    assert scores[0][:, :, :, :30].max() > 0


def test_after_rope_int8_full_in_the_engine(mixed):
    """`full` with int8 after RoPE on a model with local and global layers (two RoPE bases): layer
    0's stored codes are the int8 codes of the keys `full` stores rotated (float32), chunked prefill
    equals token by token, and generation from its own prompt state is the same layer by layer and
    as the fused scan."""
    from tests.refs.quant import np_int8

    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 21)).astype(np.int32)
    eng = Engine(mixed, kvpolicies.get("full", codec="int8_after_rope"), 40)
    ref = Engine(mixed, kvpolicies.get("full"), 40)
    logits, st = eng.prefill(ids, chunk=8)
    _, st_ref = ref.prefill(ids, chunk=8)
    k_ref = np.asarray(st_ref[0].k[0])[:, :, :21]  # layer 0: [B, K, 21, D], rotated keys in float32
    codes, scale = np.asarray(st[0].k.codes[0])[:, :, :21], np.asarray(st[0].k.scale[0])[:, :, :21]
    want_codes, want_scale, _ = np_int8(k_ref)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-6)
    assert np.abs(codes.astype(int) - want_codes).max() <= 1 and (codes == want_codes).mean() > 0.99
    assert not np.allclose(scale, np_int8(np.asarray(Engine(mixed, unrotated(Full()), 40).prefill(ids, chunk=8)[1][0]
                                                     .k[0])[:, :, :21])[1])  # not the un-rotated keys' scales
    one = [eng.prefill(ids[:, :1], chunk=1)]
    for t in range(1, 21):
        one.append(eng.step(one[-1][1], ids[:, t:t + 1], t))
    np.testing.assert_allclose(np.asarray(one[-1][0]), np.asarray(logits), atol=1e-4, rtol=0)
    state = eng.compress(eng.prompt(ids, chunk=8))
    got = {}
    for loop in ("layers", "scan"):
        eng.decode_loop = loop
        got[loop] = eng.continue_generate(state, [[5], [6]], 6)
    np.testing.assert_array_equal(got["layers"], got["scan"])

