"""`evals.shared_answers`: the compressed states of different presses' shape classes answer as the rows
of one batch through one canonical append-only policy. Checked against each press's own engine: at the
same batch the canonical form gives its question logits bit for bit, and in one batch of every press
the same greedy ids; the answers' programs compile once for all presses, not once per press (JAX's
compilation events, never a clock); what has no canonical form is refused before anything runs. Head
pools (adakv's shape class, adascored, criticaladakv) convert to per-head rows holding the pool's own (head, position,
key, value) sets (a numpy oracle), and answer to float32 rounding with the same greedy ids."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvpolicies
from evals.compiles import CompileLog
from evals.peer import answer_rows
from kvpolicies.compat import kvpress
from kvpolicies.prompt import shape_class_of
from models.config import LlamaConfig
from models.engine import Engine, grid_slots
from evals.shared_answers import answering_engine, canonical, canonical_of, pool_rows, shared_rows
from models.llama import Llama
from models.tokenizer import ByteTokenizer

CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
N, Q, GEN = 150, 9, 8
MAX_LEN = N + Q + GEN
MAX_NEW = Q + GEN
# the shape-class prompt scorers of issue 57's grid (evals.peer's names), at fields that fit the tiny prompt
# (streamingllm's state is knorm's: a SlotState; snapkv and expected keep statistics, tova one position row)
PRESSES = {"SnapKVPress": {"window_size": 8}, "KnormPress": {}, "ExpectedAttentionPress": {"n_future_positions": 16},
           "TOVAPress": {}}
RATIOS = (0.25, 0.5, 0.75)


class Record:
    """`answer_rows`'s phase callback: keeps each phase's value (the question's `Prompted`)."""

    def __init__(self):
        self.value = {}

    def __call__(self, name, value):
        self.value[name] = value
        return value


def _compressed(model, ctx, presses, ratios=RATIOS):
    """{press: [(engine, compressed state) per ratio]}: each press's ratios in one shape class."""
    out = {}
    for press in presses:
        pols = [kvpress(press, r, max_new=MAX_NEW, **PRESSES[press]) for r in ratios]
        slots = grid_slots(pols, CFG.n_layers, MAX_LEN)
        engines = [Engine(model, pol, max_len=MAX_LEN, slots=slots, share_steps=True) for pol in pols]
        prompt = engines[0].prompt(ctx)
        out[press] = [(e, e.compress(prompt)) for e in engines]
    return out


@pytest.fixture(scope="module")
def setup():
    model = Llama(CFG)
    rng = np.random.default_rng(0)
    ctx, q = rng.integers(0, 97, (1, N)).astype(np.int32), rng.integers(0, 97, (1, Q)).astype(np.int32)
    return model, ctx, q, _compressed(model, ctx, PRESSES)


def test_the_canonical_form_answers_a_press_bit_for_bit_and_all_presses_alike(setup):
    model, ctx, q, states = setup
    forms = {canonical_of(e) for rows in states.values() for e, _ in rows}
    assert len(forms) == 1 and None not in forms  # one slot count: one canonical policy for the four presses
    own, alike = {}, {}
    for press, rows in states.items():  # the reference: each press's own engine, its ratios as one batch
        rec = Record()  # the question in one step, as the canonical form takes it (evals.peer's default there)
        ids = answer_rows(rows[0][0], [s for _, s in rows], q[0], GEN, rec, question=[Q])
        rec2 = Record()
        ids2 = answer_rows(None, [s for _, s in rows], q[0], GEN, rec2, engines=[e for e, _ in rows])
        # (press mode's default pieces, 8 + 1: other floats, the same ids here)
        np.testing.assert_array_equal(answer_rows(rows[0][0], [s for _, s in rows], q[0], GEN, Record()), ids)
        # the same batch through the canonical form: the question's logits and the ids bit for bit
        alike_logits, own_logits = (np.asarray(r.value["question"].logits) for r in (rec2, rec))
        np.testing.assert_array_equal(alike_logits, own_logits)
        np.testing.assert_array_equal(ids2, ids)
        own[press] = ids
        alike[press] = rows
    pairs = [x for rows in alike.values() for x in rows]
    together = answer_rows(None, [s for _, s in pairs], q[0], GEN, Record(), engines=[e for e, _ in pairs])
    np.testing.assert_array_equal(together, np.concatenate([own[p] for p in alike]))
    # and the states stay usable (forks): a press's own answer afterwards is unchanged
    e, s = states["SnapKVPress"][0]
    np.testing.assert_array_equal(e.continue_generate(s, q, GEN)[0], own["SnapKVPress"][0])


def test_presses_after_the_first_compile_no_answer_programs(setup):
    """evals.peer's answer=shared: each press's batch through the canonical form's engine; the first
    press's batch compiles the question and decode programs, every later press's compiles none (each
    press's own engine compiles its own set: press mode)."""
    model, ctx, q, states = setup

    def programs(press):  # its first two ratios (a batch of 2: a shape no other test here compiles)
        rows = states[press][:2]
        with CompileLog() as log:
            answer_rows(None, [s for _, s in rows], q[0], GEN, Record(), engines=[e for e, _ in rows])
        return log.programs

    counts = [programs(p) for p in PRESSES]
    assert counts[0] > 0 and counts[1:] == [0] * (len(PRESSES) - 1), counts


def test_what_has_no_canonical_form_is_refused(setup):
    model, ctx, q, states = setup
    assert canonical(kvpress("AdaKVPress", 0.5, max_new=MAX_NEW, window_size=8), MAX_LEN) is None  # not a shape class
    with pytest.raises(ValueError, match="max_len"):
        canonical(kvpress("AdaKVPress", 0.5, max_new=MAX_NEW, press="KnormPress"))  # a head pool: its rows' S'
    duo = kvpress("DuoAttentionPress", 0.5, max_new=MAX_NEW, n_layers=CFG.n_layers, head_scores=[[0.1, 0.9]] * CFG.n_layers)
    assert canonical(duo[0], MAX_LEN) is None  # streaming heads beside full ones: a decode of its own
    with pytest.raises(ValueError, match="max_len"):
        canonical(kvpolicies.get("full"))  # the full cache: rows of its engine's max_len slots
    assert canonical(kvpolicies.get("full"), MAX_LEN).slots == MAX_LEN
    exact = kvpress("KnormPress", 0.5, max_new=MAX_NEW)
    assert canonical(exact) is None  # not a shape class: it sizes itself by ratio
    rer = kvpress("KeyRerotationPress", 0.5, max_new=MAX_NEW, press="KnormPress")
    assert canonical(shape_class_of(rer, MAX_LEN, MAX_LEN)[0]) is None  # a shape class, but its own extend (RoPE)
    assert canonical(shape_class_of(exact, MAX_LEN, MAX_LEN)[0]).slots == MAX_LEN
    plain = Engine(model, exact, max_len=MAX_LEN)
    st = plain.compress(plain.prompt(ctx))
    with pytest.raises(ValueError, match="no common canonical"):
        answering_engine(plain)
    (ka, sa), (kb, sb) = states["KnormPress"][:2]
    with pytest.raises(ValueError, match="same canonical policy"):
        shared_rows([(ka, sa), (plain, st)], Q + GEN - 1)
    with pytest.raises(ValueError, match="past max_new"):
        shared_rows([(ka, sa), (kb, sb)], MAX_NEW + 1)
    longer = kb.compress(kb.prompt(np.concatenate([ctx, ctx[:, :3]], axis=1)))
    with pytest.raises(ValueError, match="different lengths"):
        shared_rows([(ka, sa), (kb, longer)], Q + GEN - 1)
    with pytest.raises(ValueError, match="compressed"):
        shared_rows([(ka, ka.prompt(ctx))], Q + GEN - 1)


def test_the_canonical_form_holds_its_keys_rotated_once(setup):
    """Without a codec (or with one after RoPE) the canonical policy stores its keys after RoPE
    (`PromptScored.rotated`): `shared_rows` rotates each press's stored keys once, at their positions
    (against a float64 numpy RoPE of the press's keys), so no question or decode step rotates them
    again (the answers above stay bit for bit); a codec before RoPE keeps them un-rotated; anything
    but an answering shape class is refused."""
    from kvpolicies.codecs import Absmax
    from kvpolicies.knorm import Knorm

    model, ctx, q, states = setup
    rows = states["KnormPress"]
    assert canonical(rows[0][0].policies[0]).rotated_keys
    int8 = dataclasses.replace(rows[0][0].policies[0], codec=Absmax())
    assert not canonical(int8).rotated_keys and canonical(int8).codec == Absmax()
    eng, st = shared_rows(rows, Q + GEN - 1)
    got, pos = np.asarray(st.cache[0].k), np.asarray(st.cache[0].pos)  # [L, B, K, S, D], [L, B, K, S]
    raw = np.concatenate([np.asarray(s.cache[0].k) for _, s in rows], axis=1)
    half = CFG.head_dim // 2
    inv = 1.0 / (CFG.rope_theta ** (np.arange(half) * 2.0 / CFG.head_dim))
    ang = pos[..., None].astype(np.float64) * inv  # [L, B, K, S, D/2]
    x1, x2 = raw[..., :half].astype(np.float64), raw[..., half:].astype(np.float64)
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)
    filled = pos >= 0
    np.testing.assert_allclose(got[filled], want[filled], rtol=1e-5, atol=1e-5)
    assert np.abs(got[filled] - raw[filled]).max() > 0.1  # rotated, not the stored keys as they were
    with pytest.raises(ValueError, match="rotated=True"):
        Knorm(budget=4, max_new=2, rotated=True)  # not a shape class
    answering = Engine(model, canonical(rows[0][0].policies[0]), max_len=MAX_LEN)
    with pytest.raises(ValueError, match="runs no prompt"):
        answering.compress(answering.prompt(ctx))


# -- head pools: per-head rows of max_len slots ------------------------------------------------------------
# question logits through the canonical rows against the pool's own engine: measured 2.8e-7 of the
# largest logit here (float32 rounding: the pool sums over the masked K x S pool, the rows over each head's S')
REL = 2e-6
# adakv's shape class; adascored; criticaladakv (adascored's subclass: the same decode steps)
POOLS = {"AdaKVPress": ("AdaKVPress", {"window_size": 8}), "AdaScored": ("AdaKVPress", {"press": "KnormPress"}),
         "CriticalAda": ("CriticalAdaKVPress", {"press": "SnapKVPress"}),
         "KVzip": ("KVzipPress", {})}  # kvzip's pool (kvpress's scope="model": max_len slots per head)


@pytest.fixture(scope="module")
def pools(setup):
    """{name: [(engine, compressed state) per ratio]}: adakv's ratios in one shape class (its grid's slots),
    and adascored's (its kept table: kvpress's n_kept) in one of their own."""
    model, ctx, q, _ = setup
    out = {}
    for name, (press, fields) in POOLS.items():
        pols = [kvpress(press, r, max_new=MAX_NEW, **fields) for r in RATIOS]
        if press == "KVzipPress":  # a policy per ratio; its repeat prompts in bytes (no tokenizer here)
            engines = [Engine(model, pol, max_len=MAX_LEN, repeat=ByteTokenizer(), share_steps=True) for pol in pols]
        else:
            slots = grid_slots(pols, CFG.n_layers, MAX_LEN)
            engines = [Engine(model, pol, max_len=MAX_LEN, slots=slots, share_steps=True) for pol in pols]
        out[name] = [(e, e.compress(e.prompt(ctx))) for e in engines]
    assert [type(e.policies[0]).__name__ for e, _ in out["AdaScored"]] == ["AdaScored"] * 3
    assert [type(e.policies[0]).__name__ for e, _ in out["CriticalAda"]] == ["CriticalAda"] * 3
    assert all(out[name][0][0].policies[0].slots > 0 for name in POOLS if name != "KVzip")  # kvzip: no shape class
    return out


def _pool_segments(run, layer: int, kv_heads: int) -> list[tuple[int, int]]:
    """numpy: (start, count) of each head's segment of layer `layer`'s flat pool (batch row 0): adascored's
    stored counts, or adakv's rule (a head's tokens grow in position; the next head starts where they stop)."""
    if hasattr(run, "counts"):
        counts = np.asarray(run.counts[layer, 0])
    else:
        flat = np.asarray(run.pos[layer, 0]).reshape(-1)
        flat = flat[flat >= 0]
        counts = np.diff(np.r_[0, np.flatnonzero(np.diff(flat) <= 0) + 1, flat.size])
        counts = np.r_[counts, np.zeros(kv_heads - counts.size, int)]
    return [(int(a), int(c)) for a, c in zip(np.cumsum(counts) - counts, counts)]


@pytest.mark.parametrize("name", list(POOLS))
def test_head_pool_rows_hold_the_pools_tokens(setup, pools, name):
    """`pool_rows`: row h holds head h's pool tokens (the engine's `kept_positions`) in text order, each with
    the key and value the pool stores for that head and position (bit for bit), then empty slots."""
    kh = CFG.n_kv_heads
    for e, st in pools[name]:
        run = st.cache[0]
        rows = pool_rows(run, MAX_LEN)
        pos, k, v = (np.asarray(x) for x in (rows.pos, rows.k, rows.v))  # [L, 1, K, S'(, D)]
        assert pos.shape == (CFG.n_layers, 1, kh, MAX_LEN) and k.shape == pos.shape + (CFG.head_dim,)
        pk, pv = (np.asarray(x).reshape(CFG.n_layers, 1, -1, CFG.head_dim) for x in (run.k, run.v))  # [L, 1, P, D]
        ppos = np.asarray(run.pos).reshape(CFG.n_layers, 1, -1)
        kept = e.kept_positions(st)
        for layer in range(CFG.n_layers):
            for h, (start, c) in enumerate(_pool_segments(run, layer, kh)):
                got = pos[layer, 0, h]
                np.testing.assert_array_equal(got[:c], kept[layer][h])  # the same set, in text order
                assert (got[c:] == -1).all() and (k[layer, 0, h, c:] == 0).all()
                seg = slice(start, start + c)  # the pool's slots of head h
                np.testing.assert_array_equal(ppos[layer, 0, seg], got[:c])
                np.testing.assert_array_equal(k[layer, 0, h, :c], pk[layer, 0, seg])
                np.testing.assert_array_equal(v[layer, 0, h, :c], pv[layer, 0, seg])
        assert len({len(h) for layer in kept for h in layer}) > 1  # heads of different counts were checked


def test_head_pools_answer_through_per_head_rows(setup, pools):
    """Each pool's own engine (adakv: its ratios as one batch; adascored: each ratio alone) and the full
    cache's against their rows through the canonical form: the question's logits to float32 rounding
    (`REL`), the greedy ids equal; adakv's, adascored's and the full cache's rows share one canonical
    policy (S' = max_len) and join one batch."""
    model, ctx, q, states = setup
    own_ids, own_logits = [], []
    for name, rows in pools.items():
        engines = [[e for e, _ in rows]] if name == "AdaKVPress" else [[e] for e, _ in rows]
        states_of = [[s for _, s in rows]] if name == "AdaKVPress" else [[s] for _, s in rows]
        for engs, sts in zip(engines, states_of):
            rec = Record()
            own_ids.append(answer_rows(engs[0], sts, q[0], GEN, rec))
            own_logits.append(np.asarray(rec.value["question"].logits))
    full = Engine(model, kvpolicies.get("full"), max_len=MAX_LEN)  # the full cache: its keys already rotated
    full_st = full.compress(full.prompt(ctx))
    rec = Record()
    own_ids.append(answer_rows(full, [full_st], q[0], GEN, rec))
    own_logits.append(np.asarray(rec.value["question"].logits))
    own_ids, own_logits = np.concatenate(own_ids), np.concatenate(own_logits)
    forms = {canonical_of(e) for rows in pools.values() for e, _ in rows} | {canonical_of(full)}
    assert len(forms) == 1 and next(iter(forms)).slots == MAX_LEN
    pairs = [x for rows in pools.values() for x in rows] + [(full, full_st)]
    rec = Record()
    ids = answer_rows(None, [s for _, s in pairs], q[0], GEN, rec, engines=[e for e, _ in pairs])
    logits = np.asarray(rec.value["question"].logits)
    rel = np.abs(logits - own_logits).max() / np.abs(own_logits).max()
    assert 0 <= rel <= REL, rel
    np.testing.assert_array_equal(ids, own_ids)
    assert len({tuple(r) for r in own_ids}) > 1  # the ratios' answers differ: rows were not mixed up
    # a prompt scorer's rows (S' = its slots) do not join a head pool's (S' = max_len)
    with pytest.raises(ValueError, match="same canonical policy"):
        shared_rows([pairs[0], states["KnormPress"][0]], Q + GEN - 1)
    with pytest.raises(ValueError, match="past max_new"):  # a head pool's free slots: its max_new per head
        shared_rows([pools["AdaScored"][0], (full, full_st)], MAX_NEW + 1)
    shared_rows([(full, full_st)], MAX_LEN - N)  # the full cache: up to its max_len


def test_head_pools_after_the_first_compile_no_answer_programs(setup, pools):
    """2 head-pool presses x 2 ratios through the canonical form: adakv's batch compiles the question and
    decode programs; adascored's and criticaladakv's, whose own engines would compile their own, compile none (their
    rows' conversion, a gather per pool shape, compiled beforehand)."""
    model, ctx, q, _ = setup

    def programs(name):  # its first two ratios (a batch of 2 at S' = max_len: a shape no other test compiles)
        rows = pools[name][:2]
        shared_rows(rows, Q + GEN - 1)  # the conversion's programs
        with CompileLog() as log:
            answer_rows(None, [s for _, s in rows], q[0], GEN, Record(), engines=[e for e, _ in rows])
        return log.programs

    counts = [programs(n) for n in POOLS]
    assert counts[0] > 0 and counts[1:] == [0] * (len(POOLS) - 1), counts
