"""Blocked attention for chunks: a chunk (T > 1) over more than `Tuning.block` stored slots folds
them block by block into an online softmax instead of materialising its [B, K, G, T, S] logits.

References: every registered policy's independent reference (the registry matrix of
tests/kvpolicies/test_policies.py), the same steps in one piece (blocks larger than any view), the masks'
own count of visible keys, and XLA's memory analysis of the compiled step.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies.slots import quiet_chunk
from tests.refs.helpers import run_policy
from tests.refs.registry import REFERENCES, ROPE, qkv

from kvpolicies.attention import Tuning

step_mod = importlib.import_module("kvpolicies.attention.step")
blocked_mod = importlib.import_module("kvpolicies.attention.blocked")


def fresh_step(block=512, skip_blocks=True):
    """A jitted attention step with its own tuning (static: a fresh trace per setting)."""
    tuning = Tuning(block=block, skip_blocks=skip_blocks)
    return functools.partial(jax.jit, static_argnums=(0, 6))(
        lambda policy, state, q, k, v, pos, rope: kvpolicies.attend(policy, state, q, k, v, pos, rope, tuning=tuning))


def count_blocked(monkeypatch) -> list:
    """A list that grows by one each time a step is traced through the blocked path."""
    calls = []
    real = step_mod.blocked
    monkeypatch.setattr(step_mod, "blocked", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_blocks_equal_one_piece_for_every_policy(name, monkeypatch):
    """Blocks of 4 slots (a remainder block and an appended part in most steps): each registered
    policy's outputs stay within 1e-6 of the one-piece softmax and 3e-5 of its reference; its
    states match. Policies whose `compact` reads per-slot probabilities keep the one-piece path."""
    instances, ref = REFERENCES[name]
    q, k, v = qkv(24, seed=3)
    blocked = count_blocked(monkeypatch)
    for pol in instances:
        blocked.clear()
        one_piece_step = fresh_step(10**9)
        whole, st_whole = run_policy(pol, q, k, v, [9, 1], ROPE, step=one_piece_step)
        assert not blocked
        # a single token is never blocked: its steps are the one-piece run's (traced once, for suite time)
        chunks_step = fresh_step(4)
        step = lambda policy, state, q, *rest: (one_piece_step if q.shape[1] == 1 else chunks_step)(  # noqa: E731
            policy, state, q, *rest)
        out, st = run_policy(pol, q, k, v, [9, 1], ROPE, step=step)
        np.testing.assert_allclose(out, whole, atol=1e-6, rtol=0, err_msg=repr(pol))
        np.testing.assert_allclose(out, ref(pol, q, k, v, [9, 1]), atol=3e-5, rtol=0, err_msg=repr(pol))
        for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(st_whole)):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=0)
        # one piece where compact reads per-slot probabilities, where chunks run as single-token
        # steps (per_token, unless a chunk that only appends may attend whole: `appends_quietly`),
        # and where a policy narrows each query's slots (select: quest)
        steps_only = pol.per_token and quiet_chunk(pol, st_whole, 1)[0] is None
        one_piece = {"scores", "logits"} & set(pol.observes) or steps_only or \
            type(pol).select is not kvpolicies.Policy.select
        assert bool(blocked) == (not one_piece), (repr(pol), len(blocked))


def test_blocked_visible_count_and_all_masked_blocks(monkeypatch):
    """The busiest query's visible keys are counted across blocks; blocks whose slots are all
    empty or out of the window (leading ones, before any visible slot, included) add nothing."""
    q, k, v = qkv(30, seed=5)
    for pol, want in ((kvpolicies.get("full"), 30), (kvpolicies.get("window", window=6), 6)):
        with kvpolicies.record_visible() as rec:
            out, _ = run_policy(pol, q, k, v, [10], ROPE, max_len=64, step=fresh_step(4))  # 64 slots, 30 filled
        assert rec["max_visible"] == want, (pol, rec)
        ref = REFERENCES[type(pol).__name__.lower()][1](pol, q, k, v, [10])
        np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0)


@pytest.mark.parametrize("t,s,name", [(64, 8192, "full"), (2048, 64, "window"), (2048, 2048, "observed")])
def test_blocked_chunk_never_materialises_the_logits(t, s, name):
    """XLA's temporaries of a chunk of T tokens over S stored slots (64 over 8,192; 2,048 over 64,
    a window of 64 where the T x T logits of its own tokens dominate; observed's prompt phase, a
    2,048-token prompt in one chunk, whose column sums take a second pass over the blocks): the
    one-piece step holds at least two [B, K, G, T, S'] float32 buffers (S' the slots it attends:
    S + T appended, or the prompt phase's S holding the chunk), the blocked one (query tiles of
    512 over the stored blocks and the appended tiles) under a third of one."""
    pol = {"full": kvpolicies.get("full"), "window": kvpolicies.get("window", window=s),
           "observed": kvpolicies.get("observed").prompt_policy()}[name]
    b, n, kv, d = 1, 16, 2, 32
    state = jax.eval_shape(lambda: pol.init(b, kv, d, jnp.float32, s))
    args = [jax.ShapeDtypeStruct((b, t, h, d), jnp.float32) for h in (n, kv, kv)]
    pos = jax.ShapeDtypeStruct((b, t), jnp.int32)
    temps = {}
    for label, block in (("whole", 10**9), ("blocked", 512)):
        f = jax.jit(lambda st, q, k, v, p, t=Tuning(block=block): kvpolicies.attend(pol, st, q, k, v, p,
                                                                                  kvpolicies.Rope(d), tuning=t))
        temps[label] = f.lower(state, *args, pos).compile().memory_analysis().temp_size_in_bytes
    logits = b * n * t * (s if name == "observed" else s + t) * 4  # one [B, K, G, T, S'] float32 buffer
    assert temps["whole"] >= 2 * logits and temps["blocked"] < logits / 3, (temps, logits)


@pytest.mark.parametrize("name,kw", [("snapkv", dict(budget=8, obs_window=5, kernel=3, max_new=8)),
                                     ("pyramidkv", dict(budget=8, obs_window=5, kernel=3, max_new=8)),
                                     ("observed", dict(budget=8, max_new=8))])
def test_prompt_phase_keeps_the_newest_rows_in_blocks(name, kw, monkeypatch):
    """A prompt phase that keeps the attention rows of its newest W queries (`score_rows`) is handed
    only those rows and attends its chunks in blocks: the prompt state (rows, their positions, the
    slots; observed's column sums, from a second pass over the blocks) and the compressed state
    equal the one-piece run's."""
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama, with_tuning

    model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32))
    ids = np.random.default_rng(7).integers(0, 97, (2, 37)).astype(np.int32)
    pol = kvpolicies.get(name, **kw)
    assert pol.prompt_policy().score_rows == (None if name == "observed" else 5)  # observed: no rows, columns
    blocked = count_blocked(monkeypatch)
    runs = {}
    for label, block in (("whole", 10**9), ("blocked", 4)):
        eng = Engine(with_tuning(model, Tuning(block=block)), pol, max_len=48)
        state = eng.prompt(ids, chunk=9)  # chunks of 9: 4 full ones and a ragged last one
        runs[label] = (state.cache, state.logits, eng.compress(state).cache)
    assert blocked
    for a, b in zip(jax.tree.leaves(runs["blocked"]), jax.tree.leaves(runs["whole"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6, rtol=0)


def test_blocks_are_skipped_unmasked_or_masked_by_what_the_queries_see(monkeypatch):
    """A block that no query of the tile sees is not read; one that every query sees whole is
    attended without a mask; the rest are masked. `full`, 30 tokens in chunks of 10 over 64 stored
    slots in blocks of 4: each chunk runs as 3 query tiles of 4 (the last padded), and its 10
    appended slots as 3 tiles too, which query tile i reads whole before its own (j < i), masked at
    its own (j = i) and not at all after it (its causal future): 3 whole + 3 masked per chunk. Of
    the stored blocks, each query tile of the chunk at 10 sees blocks 0-1 whole and block 2 in part
    (slots 8, 9), of the chunk at 20 blocks 0-4 whole; every other stored block is empty and
    skipped. The empty slots of those blocks hold NaN keys and values: a block that were read would
    turn the outputs into NaN (it does with skip_blocks off: 0 x NaN), so the outputs matching the
    reference show they were not read."""
    pol = kvpolicies.get("full")
    q, k, v = qkv(30, seed=11)
    empty = pol.init(q.shape[0], k.shape[2], q.shape[-1], jnp.float32, 64)
    nan = lambda x: x.at[:, :, 12:].set(jnp.nan)  # noqa: E731  (slots 12+: only in blocks no query sees)
    poisoned = empty.__class__(k=nan(empty.k), v=nan(empty.v), pos=empty.pos)
    hits = []
    real = blocked_mod.masked_logits

    def logits(*a, mask=None, **kw):  # records, when a block's branch runs, how it was attended
        kind = "piece" if mask is None else "whole" if mask is True else "masked"
        jax.debug.callback(lambda: hits.append(kind))
        return real(*a, mask=mask, **kw)

    monkeypatch.setattr(blocked_mod, "masked_logits", logits)
    out, _ = run_policy(pol, q, k, v, [10], ROPE, state=poisoned, step=fresh_step(4))
    jax.effects_barrier()
    stored = {"whole": 3 * (2 + 5), "masked": 3 * 1}  # query tiles x blocks
    assert {h: hits.count(h) for h in set(hits)} == {"whole": stored["whole"] + 3 * 3, "masked": stored["masked"] + 3 * 3}, hits
    ref = REFERENCES["full"][1](pol, q, k, v, [10])
    np.testing.assert_allclose(out, ref, atol=3e-5, rtol=0)
    # every block read and masked: 0 x NaN
    out_all, _ = run_policy(pol, q, k, v, [10], ROPE, state=poisoned, step=fresh_step(4, skip_blocks=False))
    assert np.isnan(out_all).all(), "a read empty block should poison the outputs"
    clean, _ = run_policy(pol, q, k, v, [10], ROPE, max_len=64, step=fresh_step(4))
    np.testing.assert_allclose(out, clean, atol=1e-6, rtol=0)


def _spy_segments(monkeypatch, seen: list, pieces: bool):
    """Record, each time a stored block (pieces False: masked_logits called with a mask) or a piece
    outside the blocks (pieces True: without one) runs, whether it computed its RoPE segments."""
    real = blocked_mod.masked_logits

    def logits(st, kp, kpos, vmask, bias, seg, *a, mask=None, **kw):
        if (mask is None) == pieces:
            kind = "segments" if seg is not None else "one segment"
            jax.debug.callback(lambda: seen.append(kind))
        return real(st, kp, kpos, vmask, bias, seg, *a, mask=mask, **kw)

    monkeypatch.setattr(blocked_mod, "masked_logits", logits)


def _same_sink_run(run, other, pol, q, k, v, chunks):
    """A sink run (outputs, state) equals another way of running it: outputs within 1e-6, the
    reference within 3e-5, the same state."""
    np.testing.assert_allclose(run[0], other[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(run[0], REFERENCES["sink"][1](pol, q, k, v, chunks), atol=3e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(run[1]), jax.tree.leaves(other[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_blocks_without_sinks_compute_one_rope_segment(monkeypatch):
    """`sink` in cache mode pairs its sinks with another query rotation than its window (two RoPE
    segments): a stored block that holds no sink computes only the window's logits, the block
    with the sinks both. 40 tokens in chunks of 8 through 2 sinks + a window of 14 (16 slots,
    blocks of 4): the same outputs as every block with every segment (skip_blocks off) and as the
    reference; the sinks' block ran with its segments, the others without."""
    pol = kvpolicies.get("sink", n_sink=2, window=14)
    assert pol.positions == "cache"
    q, k, v = qkv(40, seed=13)
    seen = []
    _spy_segments(monkeypatch, seen, pieces=False)
    out, st = run_policy(pol, q, k, v, [8], ROPE, max_len=64, step=fresh_step(4))
    jax.effects_barrier()
    assert seen.count("one segment") > seen.count("segments") > 0, seen
    _same_sink_run((out, st), run_policy(pol, q, k, v, [8], ROPE, max_len=64, step=fresh_step(4, skip_blocks=False)),
                   pol, q, k, v, [8])


def test_a_chunks_own_tokens_past_the_sinks_compute_one_rope_segment(monkeypatch):
    """`sink` in cache mode, chunks of 3 tokens (not tiled: at most a block) over 2 sinks + a window
    of 13 (15 slots: 3 blocks of 4, then a remainder of 3). The sinks are stored last (slots 13,
    14), so the remainder holds them and the blocks hold window keys only. Outside the blocks, the
    remainder (sinks or empty slots) runs with both segments at every chunk; a chunk's own tokens
    run with one segment once past the sinks (chunks 1-12; chunk 0 holds them; the last token
    alone is a decode step, not blocked). The same outputs as one piece and as the reference."""
    pol = kvpolicies.get("sink", n_sink=2, window=13)
    q, k, v = qkv(40, seed=17)
    seen = []
    _spy_segments(monkeypatch, seen, pieces=True)
    out, st = run_policy(pol, q, k, v, [3], ROPE, max_len=64, step=fresh_step(4))
    jax.effects_barrier()
    assert {h: seen.count(h) for h in set(seen)} == {"segments": 13 + 1, "one segment": 12}, seen
    assert np.asarray(st.pos)[0, 0, 13:].tolist() == [0, 1]  # the sinks, in the last slots
    whole = run_policy(pol, q, k, v, [3], ROPE, max_len=64, step=fresh_step(10**9))
    _same_sink_run((out, st), whole, pol, q, k, v, [3])


def test_sinks_first_layout_twin_gives_the_same_outputs(monkeypatch):
    """benchmarks.attention_ab's `sinks_first` (the layout before: sinks in the first slots) is the
    same policy in another slot order: outputs within 1e-6 and the same tokens stored, in blocks."""
    from benchmarks.attention_ab import sinks_first

    pol = kvpolicies.get("sink", n_sink=2, window=13)
    q, k, v = qkv(40, seed=19)
    out, st = run_policy(pol, q, k, v, [3, 8, 1], ROPE, max_len=64, step=fresh_step(4))
    twin, st_twin = run_policy(sinks_first(pol), q, k, v, [3, 8, 1], ROPE, max_len=64, step=fresh_step(4))
    np.testing.assert_allclose(out, twin, atol=1e-6, rtol=0)
    assert np.asarray(st.pos)[0, 0, 13:].tolist() == [0, 1] and np.asarray(st_twin.pos)[0, 0, :2].tolist() == [0, 1]
    assert sorted(np.asarray(st.pos)[0, 0].tolist()) == sorted(np.asarray(st_twin.pos)[0, 0].tolist())
