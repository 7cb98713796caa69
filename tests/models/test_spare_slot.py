"""A decode step written in place (`kvpolicies.slots.SpareSlot`): a shape class's prompt scorers
decode on states with one spare slot, the token written where attention reads it and where it is
kept, so that attention reads the same slots in the same order as the view [stored S, new token]
the step concatenates otherwise. Checked against that step (the policy without its spare slot):
outputs bit for bit, the same positions, statistics and kept keys/values; layer by layer in the
engine, the same hidden states bit for bit and the same greedy ids; and in the compiled step
(its text, never a clock), no copy nor slot-axis concatenation of the state, which is donated and
aliased to the new state."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvpolicies import attend
from kvpolicies.codecs import Absmax, Identity
from kvpolicies.compat import kvpress
from kvpolicies.rope import Rope
from kvpolicies.slots import spare_slots, spared
from models.config import LlamaConfig
from models.engine import Engine, grid_slots
from models.engine.layers import layer_weights, split_layers
from models.llama import Llama

# the presses of issue 57's grid that are prompt scorers, plus observed (column sums) and keydiff
PRESSES = {"SnapKVPress": {"window_size": 8}, "KnormPress": {}, "StreamingLLMPress": {},
           "ExpectedAttentionPress": {"n_future_positions": 16}, "ObservedAttentionPress": {}, "TOVAPress": {},
           "KeyDiffPress": {}}
CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
N, GEN = 60, 6


def _same_state(a, b, where: str) -> None:
    """Equal fields bit for bit, keys and values on the filled slots (an empty slot's are never read)."""
    filled = np.asarray(a.pos) >= 0  # [B, Kp, S]
    for f in dataclasses.fields(a):
        for x, y in zip(jax.tree.leaves(getattr(a, f.name)), jax.tree.leaves(getattr(b, f.name)), strict=True):
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape, (where, f.name)
            if f.name in ("k", "v"):
                x, y = x[np.broadcast_to(filled, x.shape[:3])], y[np.broadcast_to(filled, y.shape[:3])]
            np.testing.assert_array_equal(x, y, err_msg=f"{where}: {f.name}")


@pytest.mark.parametrize("press, codec", [(p, Identity()) for p in sorted(PRESSES)] + [("SnapKVPress", Absmax())])
def test_a_step_in_the_spare_slot_equals_the_concatenated_step(press, codec):
    """attend through the spared policy on a padded packed state, per-head fills differing: outputs
    bit for bit, and after every step the state without its spare slot equals the other one's
    (int8 keys and values too: every leaf of a codec's encoding)."""
    b, k, g, s, d = 2, 2, 3, 24, 8
    rng = np.random.default_rng(1)
    pol = dataclasses.replace(kvpress(press, 0.5, max_new=8, **PRESSES[press]).shape_class(s), codec=codec)
    sp = spared(pol)
    assert spare_slots(sp) == 1 and spare_slots(pol) == 0 and spared(kvpress(press, 0.5)) is None  # shape classes only
    st = pol.init(b, k, d, jnp.float32, 100)
    fill = np.array([[5, 12], [17, 9]])  # tokens held per (row, kv head): the first free slot differs
    pos = np.where(np.arange(s) < fill[..., None], np.arange(s) * 3, -1).astype(np.int32)
    keys = jnp.asarray(rng.standard_normal((b, k, s, d)).astype(np.float32))
    st = dataclasses.replace(st, k=codec.encode(keys), v=codec.encode(-keys[..., ::-1]), pos=jnp.broadcast_to(
        jnp.asarray(pos), st.pos.shape))
    if hasattr(st, "mass"):
        st = dataclasses.replace(st, mass=jnp.asarray(np.where(pos >= 0, rng.random((b, k, s)), 0).astype(np.float32)))
    step = jax.jit(lambda p, st, q, kk, v, at: attend(p, st, q, kk, v, at, Rope(d)), static_argnums=0)
    padded = sp.pad_spare(st)
    assert padded.pos.shape[-1] == s + 1 and (np.asarray(padded.pos)[..., -1] == -1).all()
    for i in range(3):
        q, kk, v = (jnp.asarray(rng.standard_normal((b, 1, n, d)).astype(np.float32)) for n in (k * g, k, k))
        at = jnp.full((b, 1), 100 + i, jnp.int32)
        out, st = step(pol, st, q, kk, v, at)
        out_sp, padded = step(sp, padded, q, kk, v, at)
        np.testing.assert_array_equal(np.asarray(out_sp), np.asarray(out))
        assert (np.asarray(padded.pos)[..., -1] == -1).all()  # the spare slot is empty again
        _same_state(st, sp.cut_spare(padded), f"{press} step {i}")
    # a step with no free slot left would evict: a spared policy only appends, its outputs are NaN
    full = dataclasses.replace(padded, pos=jnp.where(jnp.arange(s + 1) < s, 7, -1) + jnp.zeros_like(padded.pos))
    out, _ = step(sp, full, q, kk, v, at)
    assert np.isnan(np.asarray(out)).all()


@pytest.fixture(scope="module")
def model():
    return Llama(CFG)


def _engine(model, press):
    pols = [kvpress(press, r, max_new=GEN + 2, **PRESSES[press]) for r in (0.25, 0.5)]
    return Engine(model, pols[1], max_len=N + GEN + 2, slots=grid_slots(pols, CFG.n_layers, N + GEN + 2))


@pytest.mark.parametrize("press", ["ExpectedAttentionPress", "SnapKVPress"])
def test_layer_by_layer_decoding_in_place_is_the_same_computation(model, press, monkeypatch):
    """A shape-class engine's layer-by-layer decoding: every layer's output of a step bit for bit,
    the states after it, and the greedy ids, with and without the spare slot."""
    import models.engine.layers as layers

    eng = _engine(model, press)
    st = eng.compress(eng.prompt(np.random.default_rng(0).integers(0, 97, (1, N)).astype(np.int32)))
    first = jnp.argmax(st.logits, axis=-1).astype(jnp.int32)
    pos = jnp.full((1,), N, jnp.int32)
    sp = tuple(spared(p) for p in eng.policies)
    assert all(p is not None for p in sp)
    x = eng._embed_step(eng.params, first)
    out_sp, after_sp = eng._through_layers(split_layers(st.cache, (sp[0],)), x, pos, eng._layer_tables(), None, sp)
    out, after = eng._through_layers(split_layers(st.cache), x, pos, eng._layer_tables(), None)
    np.testing.assert_array_equal(np.asarray(out_sp), np.asarray(out))
    for i, (a, b) in enumerate(zip(after, after_sp, strict=True)):
        _same_state(a, sp[i].cut_spare(b), f"layer {i}")
    ids_sp, states_sp = eng._decode_layers(st.cache, first, pos, GEN, None)
    monkeypatch.setattr(layers, "spared", lambda policy: None)  # the concatenating step
    ids, states = eng._decode_layers(st.cache, first, pos, GEN, None)
    np.testing.assert_array_equal(np.asarray(ids_sp), np.asarray(ids))
    for i, (a, b) in enumerate(zip(states, states_sp, strict=True)):
        _same_state(a, b, f"layer {i} after {GEN} tokens")


def _state_moves(txt: str, shape: str) -> list[str]:
    """The instructions of compiled HLO text that copy an array of `shape` or concatenate one along
    the slot axis (dimension 2)."""
    return [line.strip() for line in txt.splitlines()
            if re.search(rf"= {re.escape(shape)}\S* (copy\(|concatenate\(.*dimensions=\{{2\}})", line)]


def test_the_compiled_step_writes_the_state_in_place(model):
    """The decode layer step of a spared policy: its state donated and aliased to its output, no
    copy nor slot-axis concatenation of a state-sized array (the concatenating step has one)."""
    eng = _engine(model, "SnapKVPress")
    st = eng.compress(eng.prompt(np.random.default_rng(0).integers(0, 97, (1, N)).astype(np.int32)))
    pol = eng.policies[0]
    sp = spared(pol)
    w, x, pos = layer_weights(model)[0], eng._embed_step(eng.params, jnp.zeros((1,), jnp.int32)), jnp.full((1,), N)
    old = split_layers(st.cache)[0]
    new = split_layers(st.cache, (sp,))[0]

    def low(step, p, state):
        return step.lower(w, state, x, pos, eng._layer_tables(), policy=p, local=False, reach=None).compile()

    cold, cnew = low(eng._layer_step, pol, old), low(eng._layer_step_in_place, sp, new)
    b, k, s, d = old.k.shape
    assert _state_moves(cold.as_text(), f"f32[{b},{k},{s + 1},{d}]")  # the view [stored S, new token]
    assert not _state_moves(cnew.as_text(), f"f32[{b},{k},{s + 1},{d}]")
    kv = 2 * new.k.size * new.k.dtype.itemsize
    assert cnew.memory_analysis().alias_size_in_bytes >= kv > cold.memory_analysis().alias_size_in_bytes


@pytest.mark.parametrize("press, fields", [("KeyRerotationPress", {"press": "KnormPress"}),
                                           ("FinchPress", {"window_size": 8})])
def test_a_press_that_ranks_its_keys_by_slot_takes_no_spare_slot(model, press, fields):
    """KeyRerotationPress and Finch (re-rotated keys) give RoPE each stored key its slot's index, which the spare
    slot is not: their shape classes decode without one (`spared` None), with the greedy ids of the exact
    policy's engine (on SmolLM2 the spare slot's index as a rank changed kvpress's ids from the first decoded token)."""
    ctx = np.random.default_rng(1).integers(0, 97, (1, N)).astype(np.int32)
    q = np.random.default_rng(2).integers(0, 97, (1, 5)).astype(np.int32)
    pols = [kvpress(press, r, max_new=GEN + 8, **fields) for r in (0.25, 0.5)]
    shaped = Engine(model, pols[1], max_len=N + GEN + 8, slots=grid_slots(pols, CFG.n_layers, N + GEN + 8))
    exact = Engine(model, pols[1], max_len=N + GEN + 8)
    assert all(spared(p) is None for p in shaped.policies) and shaped.slots
    ids = [e.continue_generate(e.compress(e.prompt(ctx)), q, GEN + 2) for e in (shaped, exact)]
    np.testing.assert_array_equal(ids[0], ids[1])
