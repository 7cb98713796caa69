"""`hier` and `quest` against numpy oracles written from their definitions (token by token),
identities with `full`, a trace count through the engine, and exact memory / bytes-read numbers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from helpers import run_policy
from kvpolicies.memory import bytes_read_per_step, state_bytes
from kvpolicies import Rope
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama
from oracle import default_inv_freq, rope_complex

B, N, K, D, THETA, T = 2, 4, 2, 16, 10000.0, 40
ROPE = Rope(D, THETA)
INV = default_inv_freq(D, THETA)

# Both evict from their top level before T = 40; "mean" with b = 2 has fractional positions.
HIER = {
    "cache": kvpolicies.get("hier", window=1, branch=3, slots_per_level=3, levels=2, positions="cache"),
    "mean": kvpolicies.get("hier", window=3, branch=2, slots_per_level=2, levels=3, positions="mean"),
}
QUEST = {
    "q1": kvpolicies.get("quest", page=4, top_k=2, window=5),
    "q2": kvpolicies.get("quest", page=3, top_k=3, window=1),
}
POL = {**HIER, **QUEST, "full": kvpolicies.get("full"),
       "hier_wide": kvpolicies.get("hier", window=T, branch=2, slots_per_level=2, levels=2),
       "quest_all": kvpolicies.get("quest", page=4, top_k=10, window=1)}


@functools.cache
def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (N, K, K))


@functools.cache
def run(name, chunks):
    out, state = run_policy(POL[name], *qkv(), list(chunks), ROPE)
    return out, jax.tree.map(np.asarray, state)


# ---------------------------------------------------------------------------------------------
# Oracles (float64, complex RoPE, plain Python bookkeeping; nothing shared with the library)
# ---------------------------------------------------------------------------------------------


def hier_oracle(q, k, v, pol):
    """Simulate the levels literally: blocks of `branch` tokens leave the raw window when their
    newest token is no longer among the newest `window`; a full level merges its oldest
    `branch` entries into the next level (the top level drops its oldest) before appending.
    Each entry is the list of token positions it stands for."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    br, m, nl = pol.branch, pol.slots_per_level, pol.levels
    raw, levels, out = [], [[] for _ in range(nl)], np.zeros_like(q)

    def insert(lv, toks):
        if len(levels[lv]) == m:
            if lv == nl - 1:
                levels[lv].pop(0)
            else:
                insert(lv + 1, sum(levels[lv][:br], []))
                del levels[lv][:br]
        levels[lv].append(toks)

    for p in range(t):
        raw.append(p)
        entries = [e for lv in reversed(range(nl)) for e in levels[lv]] + [[j] for j in raw]  # oldest first
        km = np.stack([k[:, e].mean(1) for e in entries], 1)  # [B, E, K, D]
        vm = np.stack([v[:, e].mean(1) for e in entries], 1)
        logc = np.log([len(e) for e in entries])
        if pol.positions == "mean":
            kpos, qpos = np.array([np.mean(e) for e in entries]), p
        else:
            kpos, qpos = np.arange(len(entries), dtype=float), len(entries) - 1
        for h in range(n):
            qr = rope_complex(q[:, p, h], np.full(b, qpos), INV)  # [B, D]
            kr = rope_complex(km[:, :, h // g], np.broadcast_to(kpos, (b, len(entries))), INV)  # [B, E, D]
            lg = np.einsum("bd,bed->be", qr, kr) * d**-0.5 + logc
            w = np.exp(lg - lg.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, p, h] = np.einsum("be,bed->bd", w, vm[:, :, h // g])
        while len(raw) >= br and raw[br - 1] <= p + 1 - pol.window:  # prepare for query p + 1
            insert(0, raw[:br])
            del raw[:br]
    return out, [e for lv in reversed(range(nl)) for e in levels[lv]] + [[j] for j in raw]


def quest_oracle(q, k, v, pol):
    """Per query, batch row and kv head: page min/max of keys rotated at their positions, the
    bound sum_d max(q_d min_d, q_d max_d) (max over the group's heads), the top_k pages before
    the local region (ties -> lower page), and dense attention over the chosen tokens."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    kh_n = k.shape[2]
    g, P = n // kh_n, pol.page
    out, sizes = np.zeros_like(q), {}
    for p in range(t):
        start = P * (max(0, p - pol.window + 1) // P)
        for bb in range(b):
            for kh in range(kh_n):
                heads = list(range(kh * g, (kh + 1) * g))
                kr = rope_complex(k[bb, : p + 1, kh], np.arange(p + 1), INV)  # [p+1, D]
                qr = rope_complex(q[bb, p, heads], np.full(g, p), INV)  # [G, D]
                score = []
                for c in range(start // P):
                    lo, hi = kr[c * P:(c + 1) * P].min(0), kr[c * P:(c + 1) * P].max(0)
                    score.append(np.maximum(qr * lo, qr * hi).sum(-1).max())
                chosen = sorted(range(len(score)), key=lambda c: (-score[c], c))[: pol.top_k]
                vis = [j for j in range(p + 1) if j >= start or j // P in chosen]
                sizes[p, bb, kh] = len(vis)
                for h in heads:
                    lg = kr[vis] @ rope_complex(q[bb, p, h], np.asarray(p), INV) * d**-0.5
                    w = np.exp(lg - lg.max())
                    out[bb, p, h] = (w / w.sum()) @ v[bb, vis, kh]
    return out, sizes


# ---------------------------------------------------------------------------------------------
# hier
# ---------------------------------------------------------------------------------------------

CHUNKS = [(1,), (5,), (T,)]  # one by one; boundaries inside blocks; one chunk with every merge


@pytest.mark.parametrize("name", list(HIER))
def test_hier_matches_oracle_and_chunking_is_exact(name):
    ref, _ = hier_oracle(*qkv(), HIER[name])
    outs = {c: run(name, c) for c in CHUNKS}
    for c, (out, _) in outs.items():
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0, err_msg=f"chunks={c}")
    # Chunked prefill builds the same final state as decoding one by one, slot for slot.
    s1 = outs[(1,)][1]
    for c in CHUNKS[1:]:
        sc = outs[c][1]
        np.testing.assert_array_equal(sc.pos, s1.pos)
        np.testing.assert_array_equal(sc.count, s1.count)
        np.testing.assert_allclose(sc.k, s1.k, atol=1e-6)
        np.testing.assert_allclose(sc.v, s1.v, atol=1e-6)


@pytest.mark.parametrize("name", list(HIER))
def test_hier_state_holds_the_oracles_summaries(name):
    pol = HIER[name]
    _, final = hier_oracle(*qkv(), pol)
    st = run(name, (1,))[1]
    # The state prepared for query T holds the oracle's entries, as (newest token, count) pairs.
    want = sorted((e[-1], len(e)) for e in final)
    pos, cnt = st.pos[0, 0], st.count[0, 0]
    n = int(pol.blocks_done(jnp.asarray(T)))
    h, f = (np.asarray(x) for x in pol.alive(jnp.asarray(n)))
    live = []
    for j, c in zip(pos.tolist(), cnt.tolist()):
        if c == 1 and j >= n * pol.branch:
            live.append((j, 1))
        elif c > 1:
            lv = round(np.log(c) / np.log(pol.branch))
            i = (j + 1) // c - 1
            if f[lv - 1] <= i < h[lv - 1]:
                live.append((j, c))
    assert sorted(live) == want
    assert min(c for _, c in want) == 1 and max(c for _, c in want) == pol.branch**pol.levels
    assert pol.reach(T) == min(j - c + 1 for j, c in want) > 0  # the top level has evicted


def test_hier_summaries_change_the_output():
    full = run("full", (5,))[0]
    for name in HIER:
        out = run(name, (5,))[0]
        late = np.abs(out[:, 20:] - full[:, 20:]).max()
        assert late > 1e-2, name


def test_hier_holding_everything_uncompressed_equals_full():
    np.testing.assert_allclose(run("hier_wide", (5,))[0], run("full", (5,))[0], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# quest
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,chunks", [("q1", (1,)), ("q1", (5,)), ("q1", (T,)), ("q2", (5,))])
def test_quest_matches_oracle(name, chunks):
    ref, sizes = _quest_ref(name)
    out, _ = run(name, chunks)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


@functools.cache
def _quest_ref(name):
    return quest_oracle(*qkv(), QUEST[name])


def test_quest_reads_fewer_tokens_and_the_count_has_a_closed_form():
    for name, pol in QUEST.items():
        _, sizes = _quest_ref(name)
        for (p, _, _), n in sizes.items():
            assert n == pol.reads(p)[0], (name, p)
        assert min(n for (p, _, _), n in sizes.items() if p == T - 1) < T  # pages were skipped


@functools.partial(jax.jit, static_argnums=0)
def _decode_mask(pol, state, q, k, v, p):
    """The selection mask attention applies for one decode query at position p: [B, K, S]."""
    pos = jnp.full((B, 1), p, jnp.int32)
    view = pol.extend(state, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos)
    qr = ROPE.apply(q.reshape(B, 1, K, N // K, D).transpose(0, 2, 3, 1, 4), pos[:, None, None])  # [B, K, G, 1, D]
    mask = pol.select(view, qr, ROPE.apply(view.k, view.pos))
    return mask[:, :, 0, 0] & (jnp.arange(view.pos.shape[-1]) <= p)


def test_quest_mask_reads_what_decode_reads_says():
    """The implementation's own mask for one decode query selects reads() tokens per kv head."""
    pol, p = QUEST["q1"], T - 1
    q, k, v = qkv()
    _, state = run_policy(pol, q[:, :p], k[:, :p], v[:, :p], [1], ROPE)
    counts = np.asarray(_decode_mask(pol, state, q[:, p:], k[:, p:], v[:, p:], p)).sum(-1)  # [B, K]
    assert (counts == pol.reads(p)[0]).all()


def test_quest_with_top_k_covering_all_pages_equals_full():
    np.testing.assert_allclose(run("quest_all", (5,))[0], run("full", (5,))[0], atol=1e-5)
    assert np.abs(run("q1", (5,))[0] - run("full", (5,))[0]).max() > 1e-2  # a small top_k does differ


# ---------------------------------------------------------------------------------------------
# engine, memory, validation
# ---------------------------------------------------------------------------------------------


def test_decode_compiles_once_through_the_engine():
    cfg = LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
    pols = (kvpolicies.get("hier", window=8, branch=2, slots_per_level=3, levels=2),
            kvpolicies.get("quest", page=4, top_k=2, window=4))
    eng = Engine(Llama(cfg), pols, max_len=128)
    toks = np.random.default_rng(0).integers(0, 97, (1, 100)).astype(np.int32)
    cache, logits = eng.init_cache(1), []
    for t in range(100):
        lg, cache = eng.step(cache, toks[:, t:t + 1], t)
        logits.append(np.asarray(lg))
    assert eng.traces["decode"] == 1 and sum(eng.traces.values()) == 1
    assert np.isfinite(np.stack(logits)).all()
    assert int(np.asarray(cache[0].count).max()) == 4  # level-2 summaries were made


def test_state_bytes_closed_form():
    kw = dict(kv_heads=3, head_dim=64, n_layers=30, batch=2, dtype=jnp.bfloat16)
    hier = kvpolicies.get("hier", window=1024, branch=4, slots_per_level=64, levels=3)
    slots = 1024 + 3 + 3 * 64  # raw ring W + b - 1, then 3 levels of 64 summaries
    sb = state_bytes(hier, max_len=8192, **kw)
    assert sb.kv == 30 * 2 * 2 * 3 * 64 * slots * 2
    assert sb.meta == 30 * 2 * slots * (4 + 4)  # int32 position + int32 count per slot
    assert state_bytes(hier, max_len=1000, **kw).kv == 30 * 2 * 2 * 3 * 64 * 1000 * 2  # fits: no summaries

    quest = kvpolicies.get("quest", page=16, top_k=32, window=64)
    sb = state_bytes(quest, max_len=8192, **kw)
    assert sb.kv == 30 * 2 * 2 * 3 * 64 * 8192 * 2
    assert sb.meta == 30 * 2 * (8192 * 4 + 2 * 3 * 512 * 64 * 2)  # positions + min/max per page


def test_bytes_read_per_decode_step_closed_form():
    kw = dict(kv_heads=3, head_dim=64, n_layers=30, batch=2, dtype=jnp.bfloat16, max_len=8192)
    quest = kvpolicies.get("quest", page=16, top_k=32, window=64)
    r = bytes_read_per_step(quest, context=4000, **kw)
    # local region: tokens 3936..4000 (65), 32 pages of 16 tokens, bounds of the 246 pages before 3936
    assert r.read.kv == 30 * 2 * 3 * (65 + 32 * 16) * 2 * 64 * 2
    assert r.read.meta == 30 * 2 * 3 * 246 * 2 * 64 * 2
    assert r.stored == state_bytes(quest, **kw)
    early = bytes_read_per_step(quest, context=100, **kw)  # only 2 candidate pages: all read
    assert early.read.kv == 30 * 2 * 3 * 101 * 2 * 64 * 2
    full = bytes_read_per_step(kvpolicies.get("full"), context=4000, **kw)
    assert full.read.kv == 30 * 2 * 3 * 4001 * 2 * 64 * 2 and full.read.meta == 30 * 2 * 4001 * 4
    hier = kvpolicies.get("hier", window=1024, branch=4, slots_per_level=64, levels=3)
    hr = bytes_read_per_step(hier, context=4000, **kw)
    assert hr.read == hr.stored  # every slot is filled: read densely
    with pytest.raises(ValueError, match="context=8192"):
        bytes_read_per_step(quest, context=8192, **kw)


@pytest.mark.parametrize(
    "name,kw,msg",
    [
        ("hier", dict(branch=1), "hier.branch=1"),
        ("hier", dict(branch=4, slots_per_level=3), "hier.slots_per_level=3"),
        ("hier", dict(positions="original"), "hier.positions='original'"),
        ("hier", dict(branch=2, levels=40), "hier.levels=40"),
        ("quest", dict(page=0), "quest.page=0"),
        ("quest", dict(top_k=0), "quest.top_k=0"),
        ("quest", dict(window=0), "quest.window=0"),
    ],
)
def test_bad_hyperparameters_raise(name, kw, msg):
    with pytest.raises(ValueError, match=msg):
        kvpolicies.get(name, **kw)


# ---------------------------------------------------------------------------------------------
# SmolLM2 (slow): perplexity on 1,024 tokens of real text against the memory each policy uses
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_perplexity_hier_and_quest_vs_full():
    from evals.data import default_text
    from models.engine import perplexity
    from models.loading import load_default_model

    model, tok = load_default_model()
    ids = np.asarray(tok.encode(default_text()[:20000])[:1024], np.int32)
    pols = {
        "full": kvpolicies.get("full"),
        "window": kvpolicies.get("window", window=128),
        "hier": kvpolicies.get("hier", window=128, branch=4, slots_per_level=16, levels=2),
        "quest": kvpolicies.get("quest", page=16, top_k=8, window=64),
    }
    ppl = {n: perplexity(Engine(model, p, max_len=1024).score(ids, chunk=512)) for n, p in pols.items()}
    print({n: round(v, 3) for n, v in ppl.items()})  # measured: full 18.21, window 42.03, hier 35.68, quest 18.83
    assert ppl["full"] < 30
    assert ppl["hier"] < ppl["window"] * 0.95  # 35 summary slots beat a bare window of the same raw size
    assert ppl["quest"] < ppl["full"] * 1.10  # reading ~1/4 of the cache per step costs ~3%
