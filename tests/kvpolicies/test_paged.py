"""Paged storage (kvpolicies/paged.py): equal to the dense policies it lays out (attention level,
through the model, with codecs), block-granular freeing, refcount/fork/copy-on-write invariants
under random operation sequences (hypothesis), prefix sharing through the engine, pool exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpolicies
from tests.refs.helpers import run_policy
from kvpolicies import Rope
from evals.planner import live_blocks
from kvpolicies.memory import closed_form_bytes, state_bytes
from kvpolicies.paged import (Paged, PrefixIndex, block_hashes, check, common_prefix, count_refs, fork,
                              fragmentation, occupancy, shared_blocks)

N, K, D = 4, 2, 16
ROPE = Rope(D, 10000.0)


def qkv(b, t, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, t, h, D)).astype(np.float32) for h in (N, K, K))


LAYOUTS = [
    Paged(block=4),  # full over pages
    Paged(block=5, window=6),  # window, a ring of blocks
    Paged(block=3, window=7, n_sink=5, positions="original"),  # sinks spanning two blocks
    Paged(block=4, window=9, n_sink=2, codec=kvpolicies.get_codec("int4", group=16)),  # int8: the engine test
]


@pytest.mark.parametrize("pol", LAYOUTS, ids=lambda p: f"blk{p.block}-w{p.window}-s{p.n_sink}-{p.codec.name}")
def test_pages_equal_the_dense_policy(pol):
    """Outputs equal the dense policy's (same visibility, RoPE and codec) for a chunked stream."""
    q, k, v = qkv(2, 29, seed=pol.block)
    out, st_ = run_policy(pol, q, k, v, [7, 3, 64], ROPE)
    ref, _ = run_policy(pol.dense(), q, k, v, [7, 3, 64], ROPE)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    check(st_)


@pytest.mark.parametrize("pol", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2]], ids=["full", "window", "sink"])
def test_blocks_are_freed_as_the_window_passes(pol):
    """Token by token (= the dense outputs): a row holds at most ceil(dense slots / block) + 1
    blocks after every step, exactly the planner's `live_blocks`; the newest block's unwritten tail < 1 block; evicted tokens still
    stored < 1 block (the oldest window block), + < 1 block when the sinks end inside a block."""
    q, k, v = qkv(2, 29, seed=pol.block)
    dense = pol.dense()
    ref1, _ = run_policy(dense, q, k, v, [1], ROPE)
    cap, state, outs = dense.capacity(64), None, []
    for t in range(29):
        o, state = run_policy(pol, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], [1], ROPE, state=state, start=t)
        outs.append(o)
        rows = (np.asarray(state.table) >= 0).sum(-1)
        assert rows.max() <= -(-min(cap, t + 1) // pol.block) + 1, (t, rows)
        assert (rows == live_blocks(pol, t)).all()  # the planner's closed form (evals/planner.py)
        frag = fragmentation(state, pol, t + 1)
        assert max(frag["unwritten"]) < pol.block
        assert max(frag["evicted"]) < pol.block * (2 if pol.n_sink % pol.block else 1)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref1, atol=1e-5, rtol=0)
    check(state)


def test_full_over_pages_stores_the_dense_bytes():
    """max_len a multiple of the block: the same key/value bytes as dense `full` (the closed
    form), plus positions, block tables and refcounts."""
    for codec in ("none", "int8"):
        pol = Paged(block=16, codec=kvpolicies.get_codec(codec))
        got = state_bytes(pol, kv_heads=3, head_dim=64, max_len=4096, n_layers=30)
        dense = state_bytes(pol.dense(), kv_heads=3, head_dim=64, max_len=4096, n_layers=30)
        assert got.kv == dense.kv
        if codec == "none":
            assert got.kv == closed_form_bytes(n_layers=30, kv_heads=3, head_dim=64, slots=4096, bytes_per_elem=2)
        # per layer: slot positions 4096 x 4, table 256 x 4, refcounts 256 x 4, the flag 4
        assert got.meta == 30 * (4096 * 4 + 256 * 4 + 256 * 4 + 4)


def _run_ops(pol, ops, seed):
    """Apply steps and forks to a paged state; returns (outputs per final row [T_b, N, D]
    history, q/k/v history per final row) after checking the invariants after every op."""
    rng = np.random.default_rng(seed)
    state, t = None, 0
    hist = [dict(q=[], k=[], v=[], out=[])]  # per current row
    for op in ops:
        if op[0] == "fork":
            rows = op[1]
            rows = [r % len(hist) for r in rows]
            state = fork(state, rows)
            hist = [{key: list(val) for key, val in hist[r].items()} for r in rows]
        else:
            c = op[1]
            b = len(hist)
            q, k, v = (rng.standard_normal((b, c, h, D)).astype(np.float32) for h in (N, K, K))
            out, state = run_policy(pol, q, k, v, [c], ROPE, state=state, start=t, max_len=48)
            for i, h in enumerate(hist):
                for key, x in (("q", q), ("k", k), ("v", v), ("out", out)):
                    h[key].append(x[i])
            t += c
        if state is not None:
            check(state)
    return state, hist


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from([Paged(block=4, blocks=40), Paged(block=3, window=5, n_sink=2, blocks=40)]),
    ops=st.lists(st.one_of(st.tuples(st.just("step"), st.sampled_from([1, 5])),
                           st.tuples(st.just("fork"), st.lists(st.integers(0, 3), min_size=1, max_size=3))),
                 min_size=1, max_size=5),
)
def test_forks_keep_the_invariants_and_never_change_a_parent(layout, ops):
    """Random steps and forks (beam reorder, best-of-N, dropped rows): refcount = table references,
    no free block referenced, and every row's outputs, through all the forks of its lineage, are
    those of the dense policy run on that row's own history alone (a child's writes never change
    what its parent or siblings see)."""
    ops = [("step", 3)] + ops  # a fork needs a state
    state, hist = _run_ops(layout, ops, seed=len(ops))
    dense = layout.dense()
    for h in hist:
        q, k, v = (np.concatenate(h[key])[None] for key in ("q", "k", "v"))
        ref, _ = run_policy(dense, q, k, v, [q.shape[1]], ROPE, max_len=48)
        np.testing.assert_allclose(np.concatenate(h["out"])[None], ref, atol=1e-5, rtol=0)
    used = (np.asarray(state.refs) > 0).sum()
    assert used == len(set(np.asarray(state.table)[np.asarray(state.table) >= 0].tolist()))


def test_fork_shares_blocks_and_copy_on_write_copies_one():
    pol = Paged(block=4, blocks=32)
    q, k, v = qkv(1, 10)
    _, st1 = run_policy(pol, q, k, v, [10], ROPE, max_len=32)  # blocks 0, 1 full, 2 holds 2 tokens
    st4 = fork(st1, [0, 0, 0, 0])
    assert np.asarray(st4.refs)[:3].tolist() == [4, 4, 4] and occupancy(st4)["used_blocks"] == 3
    q2, k2, v2 = qkv(4, 1, seed=1)
    _, st5 = run_policy(pol, q2, k2, v2, [1], ROPE, state=st4, start=10)
    check(st5)
    # the partial block is copied by every row that writes into it; the two full blocks stay shared
    assert occupancy(st5)["used_blocks"] == 2 + 4
    table = np.asarray(st5.table)
    assert (table[:, :2] == table[0, :2]).all() and len(set(table[:, 2].tolist())) == 4
    assert np.asarray(count_refs(st5.table, 32)).tolist() == np.asarray(st5.refs).tolist()
    # a dropped row frees what only it held
    assert occupancy(fork(st5, [1]))["used_blocks"] == 3


def test_an_exhausted_pool_is_an_error_never_silent():
    pol = Paged(block=4, blocks=3)
    q, k, v = qkv(1, 16)
    out, st_ = run_policy(pol, q, k, v, [4], ROPE, max_len=16)  # 4 blocks needed, 3 in the pool
    assert st_.overflow.tolist() == [1]
    with pytest.raises(ValueError, match="pool of 3 blocks per layer was exhausted"):
        check(st_)
    q2, k2, v2 = qkv(1, 1, seed=2)
    out2, _ = run_policy(pol, q2, k2, v2, [1], ROPE, state=st_, start=16, max_len=17)
    assert np.isnan(out2).all()  # every later output of that cache is NaN


def test_block_hashes_chain_the_prefix():
    a = list(range(10))
    b = [99] + list(range(1, 10))
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    assert len(ha) == 2  # full blocks only
    assert ha[0] != hb[0] and ha[1] != hb[1]  # block 1 holds the same ids, but its parent differs
    assert block_hashes(a + [7, 7], 4) == ha + block_hashes(a + [7, 7], 4)[2:]
    idx = PrefixIndex(4)
    idx.insert(a, [5, 6])
    assert idx.lookup(a[:8] + [1, 2, 3]) == [5, 6] and idx.lookup(b) == []
    # 3 prompts: a 2,048-token system prompt (128 blocks of 16) + suffixes of 40 tokens
    sys_prompt = list(range(2048))
    prompts = [sys_prompt + [3000 + i] * 40 for i in range(3)]
    got = shared_blocks(prompts, 16)
    # each suffix: 2 full blocks + one of 8 tokens (2088 = 130 x 16 + 8)
    assert got == {"independent": 3 * 131, "shared": 128 + 3 * 3, "shared_tokens": 2 * 2048}
    assert common_prefix(prompts) == 2048


@pytest.fixture(scope="module")
def tiny_model():
    from models.config import LlamaConfig
    from models.llama import Llama

    return Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))


@pytest.mark.parametrize("pol", [Paged(block=4), Paged(block=4, window=6, n_sink=2),
                                 Paged(block=4, codec=kvpolicies.get_codec("int8"))],
                         ids=["full", "sink", "full-int8"])
def test_engine_over_pages_equals_the_dense_engine(pol, tiny_model):
    """Through the model (2 layers, scanned): streaming NLL to 1e-5, greedy tokens equal (full)."""
    from models.engine import Engine

    toks = np.random.default_rng(4).integers(0, 97, (2, 43)).astype(np.int32)
    got, cache = Engine(tiny_model, pol, 48).score(toks, chunk=7, return_cache=True)
    want = Engine(tiny_model, pol.dense(), 48).score(toks, chunk=7)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    check(cache)
    if pol.window is None and pol.codec.name == "none":
        # greedy decoding of a ragged batch: rows prefilled alone, pools joined (paged.concat_rows)
        ragged = [toks[0, :20], toks[1, :13]]
        np.testing.assert_array_equal(Engine(tiny_model, pol, 48).generate(ragged, 12),
                                      Engine(tiny_model, pol.dense(), 48).generate(ragged, 12))


def test_benchmark_dry_run_shares_the_prefix_and_the_beams(tmp_path):
    """benchmarks.paged --dry-run (tiny model): 3 prompts = 40 shared tokens + 6 each, blocks of 8.
    `prefill_shared` (the prefix prefilled once with batch 1, forked, each suffix fed) gives the
    last logits of the independent prefill; the pool holds the 5 prefix blocks once + one block
    per row (tokens 40..45), vs 3 x 6 blocks; beam search (4 beams, 20-token prompt, 4 steps)
    shares the prompt's blocks."""
    import json

    from benchmarks.paged import main

    out = tmp_path / "paged.json"
    main(["--dry-run", "--out", str(out)])
    res = json.loads(out.read_text())
    pre = res["prefix"]
    assert (pre["blocks_independent"], pre["blocks_shared"]) == (3 * 6, 5 + 3)
    assert pre["blocks_hash_plan"] == {"independent": 18, "shared": 8, "shared_tokens": 2 * 40}
    assert (pre["prefill_tokens_independent"], pre["prefill_tokens_shared"]) == (3 * 46, 40 + 3 * 6)
    assert pre["max_logit_diff"] < 1e-5
    assert pre["unwritten_slots_per_row"] == [2, 2, 2]
    beam = res["beam"]
    # 23 tokens per beam (prompt 20 + 3 fed): independent 4 x 3 blocks; forked: blocks 0-1 (tokens
    # 0..15) shared by every beam, block 2 (tokens 16..23) one per distinct path of fed tokens
    assert beam["blocks_independent"] == 12
    assert beam["blocks_forked"] == 2 + beam["distinct_fed_paths"] <= 2 + 4
    # parallel sampling, 4 rows: blocks 0-1 shared, block 2 copied by each row on its first write
    samp = res["sampling"]
    assert samp["blocks_forked"] == samp["blocks_closed_form"] == 2 + 4 and samp["blocks_independent"] == 12


@pytest.mark.parametrize("kw,msg", [(dict(block=0), "paged.block=0"), (dict(n_sink=2), "paged.n_sink=2: sinks need a window"),
                                    (dict(window=0), "paged.window=0"), (dict(blocks=0), "paged.blocks=0"),
                                    (dict(window=4, positions="rank"), "paged.positions='rank'")])
def test_bad_fields_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Paged(**kw)
