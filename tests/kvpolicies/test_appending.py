"""Appending views (`View.append`) and deferred writes: attention reads the stored slots in place
and the step's new tokens after them; a model writes the new slots after its layer loop.

References: the same step with every slot in one buffer (`flat`, the layout before appending
views), and the policy's own `compact` (what a deferred write must equal).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies.attend import Deferred, attend, write_deferred
from kvpolicies.memory import tree_nbytes
from kvpolicies.rope import Rope
from kvpolicies.slots import flat

ROPE = Rope(8)
APPENDING = {
    "full": kvpolicies.get("full"),
    "full-int8": kvpolicies.get("full", codec="int8"),
    "full-int8-after-rope": kvpolicies.get("full", codec="int8_after_rope"),
    "sink-fp8-after-rope": kvpolicies.get("sink", n_sink=2, window=5, codec="fp8_after_rope"),
    "window": kvpolicies.get("window", window=5),
    "sink": kvpolicies.get("sink", n_sink=2, window=5),
    "sink-original": kvpolicies.get("sink", n_sink=2, window=5, positions="original"),
}


@dataclasses.dataclass(frozen=True)
class Flat(kvpolicies.Policy):
    """`inner` with its view flattened: every slot in one k/v buffer (the reference layout)."""

    inner: kvpolicies.Policy = kvpolicies.get("full")

    @property
    def rotated_keys(self):  # the state is inner's: its keys as inner stores them
        return self.inner.rotated_keys

    def capacity(self, max_len):
        return self.inner.capacity(max_len)

    def init(self, *a):
        return self.inner.init(*a)

    def extend(self, state, k, v, pos):
        return flat(self.inner.extend(state, k, v, pos))

    def compact(self, view, seen):
        return self.inner.compact(view, seen)


def _qkv(t, seed):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.standard_normal((2, t, h, 8)), jnp.float32) for h in (4, 2, 2))
    return q, k, v


def _prefilled(pol, n):
    """A state after n tokens (chunks of 3), and the next token's q, k, v at position n."""
    q, k, v = _qkv(n + 1, seed=n)
    st = pol.init(2, 2, 8, jnp.float32, 32)
    for a in range(0, n, 3):
        b = min(a + 3, n)
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
        _, st = attend(pol, st, q[:, a:b], k[:, a:b], v[:, a:b], pos, ROPE)
    return st, (q[:, n:], k[:, n:], v[:, n:], jnp.full((2, 1), n, jnp.int32))


@pytest.mark.parametrize("name", sorted(APPENDING))
@pytest.mark.parametrize("n", [4, 11])  # before and after a ring wraps
def test_deferred_write_equals_compact_and_flat_view(name, n):
    pol = APPENDING[name]
    st, (q, k, v, pos) = _prefilled(pol, n)
    out, new = attend(pol, st, q, k, v, pos, ROPE)
    out_d, writes = attend(pol, st, q, k, v, pos, ROPE, defer=True)
    assert isinstance(writes, Deferred) and writes.slots.slots == 1
    np.testing.assert_array_equal(np.asarray(out_d), np.asarray(out))
    for a, b in zip(jax.tree.leaves(write_deferred(st, writes)), jax.tree.leaves(new)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out_f, new_f = attend(Flat(inner=pol), st, q, k, v, pos, ROPE)  # all slots in one buffer
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_f), atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_f)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_only_pure_appends_defer():
    """A ring chunk (folded by compact) and an evictor return their new state, never `Deferred`."""
    q, k, v = _qkv(4, seed=0)
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    for pol in (kvpolicies.get("window", window=3), kvpolicies.get("h2o", heavy=2, recent=2)):
        _, st = attend(pol, pol.init(2, 2, 8, jnp.float32, 32), q, k, v, pos, ROPE, defer=True)
        assert not isinstance(st, Deferred), pol


def test_write_deferred_over_stacked_layers():
    """A run's stacked states [L, ...] take each layer's new slots at that layer's start, and with a
    start per head ([L, B, K]: a prompt scorer's per-head counts) at each head's."""
    pol = kvpolicies.get("full", codec="int8")
    st = jax.tree.map(lambda x: jnp.stack([x, x + 1]), pol.init(2, 2, 8, jnp.float32, 16))  # [L=2, ...]
    new = kvpolicies.slots.encode_new(pol.codec, *(_qkv(3, 1)[1:]), jnp.array([[5, 6, 7], [2, 3, 4]], jnp.int32))
    new = jax.tree.map(lambda x: x.transpose(0, 2, 1, 3) if x.ndim == 4 else x, new)  # [B, K, T, .]
    layers = jax.tree.map(lambda x: jnp.stack([x, 2 * x if jnp.issubdtype(x.dtype, jnp.floating) else x]), new)
    starts = np.array([[5, 2], [3, 9]], np.int32)  # [L, B]
    got = write_deferred(st, Deferred(layers, jnp.asarray(starts)), lead=1)
    for layer in range(2):
        one = jax.tree.map(lambda x: x[layer], st)
        want = kvpolicies.slots.write_at(one, jax.tree.map(lambda x: x[layer], layers), jnp.asarray(starts[layer]))
        for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[layer], got)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    heads = np.array([[[5, 1], [2, 7]], [[0, 4], [9, 3]]], np.int32)  # [L, B, K]
    pst = kvpolicies.base.SlotState(k=jnp.zeros((2, 2, 2, 16, 8)), v=jnp.zeros((2, 2, 2, 16, 8)),
                                    pos=-jnp.ones((2, 2, 2, 16), jnp.int32))
    pnew = kvpolicies.base.SlotState(k=jnp.ones((2, 2, 2, 3, 8)), v=2 * jnp.ones((2, 2, 2, 3, 8)),
                                     pos=jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 2, 1, 3)))
    got = write_deferred(pst, Deferred(pnew, jnp.asarray(heads)), lead=1)
    want = np.full((2, 2, 2, 16), -1)
    for i in np.ndindex(2, 2, 2):  # numpy: each (layer, row, head) its three slots from its start
        want[i][heads[i]:heads[i] + 3] = np.arange(3)
    np.testing.assert_array_equal(np.asarray(got.pos), want)
    np.testing.assert_array_equal(np.asarray(got.k)[..., 0], np.where(want >= 0, 1.0, 0.0))


@pytest.mark.parametrize("phase", ["decode", "prompt"])
def test_quest_defers_its_slots_and_page_bounds(phase):
    """Quest's step writes its new slots and folds their rotated keys into their pages' bounds:
    deferred (`Quest.defer`: the slots, plus the bounds of the n pages the step's tokens touch),
    those writes equal its own `compact`, with the same outputs. Steps of 1 token (a gathered
    decode read), of 3 inside one page and across two, and at the cache's end (the last pages:
    `first` clamped so that its n pages fit)."""
    pol = kvpolicies.get("quest", page=4, top_k=2)
    pol = pol.prompt_policy() if phase == "prompt" else pol
    q, k, v = _qkv(32, seed=9)
    st = pol.init(2, 2, 8, jnp.float32, 32)  # 8 pages
    step = jax.jit(lambda st, q, k, v, pos, defer: attend(pol, st, q, k, v, pos, ROPE, defer=defer), static_argnums=5)
    for a, b in ((0, 3), (3, 6), (6, 7), (7, 13), (13, 14), (14, 29), (29, 32)):
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
        args = (q[:, a:b], k[:, a:b], v[:, a:b], pos)
        out, new = step(st, *args, False)
        out_d, writes = step(st, *args, True)
        assert isinstance(writes, Deferred) and writes.slots.slots == b - a
        n = (b - a + 2) // 4 + 1  # pages b - a contiguous tokens can touch
        assert writes.fields["kmin"][0].shape[2] == n and int(writes.fields["kmin"][1][0]) == min(a // 4, 8 - n)
        np.testing.assert_array_equal(np.asarray(out_d), np.asarray(out))
        for x, y in zip(jax.tree.leaves(write_deferred(st, writes)), jax.tree.leaves(new)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        st = new
    assert int(st.pos.min()) == 0 and np.isfinite(np.asarray(st.kmin)).all()  # every slot and page written


def test_model_decode_step_does_not_copy_the_cache():
    """The decode step of `full`, `sink` and `quest` reads its stacked cache in place: XLA's
    temporary buffers hold less than a third of the cache (the layer scan copied the whole cache
    through its outputs before appending views, and quest's before it deferred its page bounds:
    temporaries of at least the cache's size)."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32))
    for pol in (kvpolicies.get("full"), kvpolicies.get("sink", n_sink=4, window=2044), kvpolicies.get("quest")):
        eng = Engine(model, (pol,) * model.cfg.n_layers, max_len=2048)  # quest in every layer, not its preset
        cache = eng.init_cache(1)
        tok, pos = np.zeros((1, 1), np.int32), np.full((1, 1), 100, np.int32)
        mem = eng._logits_step.lower(eng.params, cache, tok, pos).compile().memory_analysis()
        assert mem.temp_size_in_bytes < tree_nbytes(cache) / 3, (pol, mem.temp_size_in_bytes, tree_nbytes(cache))


@pytest.mark.parametrize("s, t, block", [(40, 3, 8), (40, 12, 8), (37, 20, 16), (20, 5, 512)])
def test_a_shape_class_question_joined_in_place_is_the_concatenated_step(s, t, block, monkeypatch):
    """A shape class's chunk after its compression (`PromptScored.appends_in_place`): a joined view
    (the stored whole blocks read in place, the rest joined to the new slots) gives the outputs of
    the view it replaces (stored and new slots concatenated, then packed by `compact`) bit for bit,
    blocked (tails of whole blocks and a remainder) or in one piece, per-head fills differing; its
    deferred writes give that step's state on the filled slots."""
    from kvpolicies.attention.tuning import Tuning
    from kvpolicies.compat import kvpress
    from kvpolicies.prompt_scored import PromptScored

    pol = kvpress("KnormPress", 0.5, max_new=32).shape_class(s)
    assert pol.appends_in_place
    rng = np.random.default_rng(s + t)
    st = pol.init(2, 2, 8, jnp.float32, 200)
    fill = np.array([[s - t - 4, s - t], [3, s - t - 9]])  # tokens held per (row, kv head)
    pos = np.where(np.arange(s) < fill[..., None], np.arange(s) * 2, -1).astype(np.int32)
    keys = jnp.asarray(rng.standard_normal((2, 2, s, 8)).astype(np.float32))
    st = dataclasses.replace(st, k=keys, v=-keys[..., ::-1], pos=jnp.broadcast_to(jnp.asarray(pos), st.pos.shape))
    q, k, v = (jnp.asarray(rng.standard_normal((2, t, h, 8)).astype(np.float32)) for h in (4, 2, 2))
    at = jnp.broadcast_to(jnp.arange(100, 100 + t, dtype=jnp.int32), (2, t))
    tune = Tuning(block=block)
    out_j, writes = attend(pol, st, q, k, v, at, ROPE, defer=True, tuning=tune)
    assert isinstance(writes, Deferred)
    out_c, new_c = attend(pol, st, q, k, v, at, ROPE, tuning=tune)  # compact: the same step, written by compact
    monkeypatch.setattr(PromptScored, "appends_in_place", property(lambda self: False))
    out, new = attend(pol, st, q, k, v, at, ROPE, tuning=tune)  # the concatenated view, packed by compact
    np.testing.assert_array_equal(np.asarray(out_j), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(out_c), np.asarray(out))
    for got in (write_deferred(st, writes), new_c):
        np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(new.pos))
        filled = np.broadcast_to(np.asarray(new.pos)[..., None] >= 0, new.k.shape)
        for a, b in ((got.k, new.k), (got.v, new.v)):
            np.testing.assert_array_equal(np.asarray(a)[filled], np.asarray(b)[filled])
