"""Shape classes (`Engine(slots=S)`, `kvpolicies.prompt.KeptTable`) and shared steps: a press's
ratios, budgets and pyramidkv's layers run one shape class, keep exactly the tokens the exact
policies keep (per layer and kv head) and decode the same greedy ids; the compiled programs of a
grid do not grow with its ratios (counted from JAX's compilation events, never timed); what a
shape-class engine cannot reproduce is refused before anything runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvpolicies
from evals.compiles import CompileLog
from kvpolicies.compat import kvpress
from kvpolicies.memory import filled_bytes, tree_nbytes
from kvpolicies.prompt import KeptTable, shape_class_of
from models.config import LlamaConfig
from models.engine import Engine, grid_slots
from models.llama import Llama

CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
N, Q, GEN = 150, 9, 8
MAX_LEN = N + Q + GEN
MAX_NEW = Q + GEN
# kvpress's presses with a kept table, at fields that fit the tiny prompt
PRESSES = {"SnapKVPress": {"window_size": 8}, "PyramidKVPress": {"window_size": 8}, "KnormPress": {},
           "StreamingLLMPress": {}, "ExpectedAttentionPress": {"n_future_positions": 16},
           "ObservedAttentionPress": {}, "TOVAPress": {}, "AdaKVPress": {"window_size": 8},
           # Ada-KV over another scorer, its critical form, and LU-KV's per-(layer, kv head) budgets (a seeded
           # curve, each head's prune ratio growing with the row as a real curve's: a policy per layer, each head
           # its own count): "Wrapper:Inner"
           "AdaKVPress:ExpectedAttentionPress": {"n_future_positions": 16},
           "CriticalAdaKVPress:SnapKVPress": {"window_size": 8},
           # wrappers whose ranking reads per-length counts of their own (ChunkKV's chunks, Critical's stage 1:
           # rows of their kept table after the kept counts), and KeyRerotation's shape class over its inner's
           "ChunkKVPress:SnapKVPress": {"window_size": 8},
           "EntropyGatedChunkKVPress:SnapKVPress": {"window_size": 8},
           "CriticalKVPress:SnapKVPress": {"window_size": 8},
           "KeyRerotationPress:ExpectedAttentionPress": {"n_future_positions": 16},
           # ChunkPress's per-chunk counts and BlockPress's n_kept as rows of the table (chunks and blocks that
           # cut the tiny prompt several times)
           "ChunkPress:KnormPress": {"chunk_length": 64}, "BlockPress:KeyDiffPress": {"block_size": 32},
           "LUKVPress": {"budget_curves": np.sort(np.random.default_rng(5).uniform(0.0, 1.0, (99, CFG.n_layers,
                                                                                              CFG.n_kv_heads)), axis=0)}}
RATIOS = (0.25, 0.5, 0.75, 0.875)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG)


@pytest.fixture(scope="module")
def engine(model):
    """`engine(pol, slots=0)`: this module's Engine of `pol` on `model` at MAX_LEN (a shape class with
    `slots`, sharing its steps), built once: the tests that run an equal engine (an exact press at 0.5,
    a class's ratios) reuse its compiled steps instead of tracing and compiling them again."""
    built = {}

    def get(pol, slots=0):
        if (pol, slots) not in built:
            built[pol, slots] = Engine(model, pol, max_len=MAX_LEN, slots=slots, share_steps=bool(slots))
        return built[pol, slots]

    return get


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, 97, (1, N)).astype(np.int32), rng.integers(0, 97, (1, Q)).astype(np.int32)


def _pols(press, ratios):
    name, _, inner = press.partition(":")
    fields = PRESSES[press] | ({"press": inner} if inner else {})
    return [kvpress(name, r, max_new=MAX_NEW, **fields) for r in ratios]


def _answer(eng, tokens, state=False):
    """Kept positions and greedy ids after the question (and the compressed state, with `state`)."""
    ctx, q = tokens
    st = eng.compress(eng.prompt(ctx))
    out = eng.kept_positions(st), eng.continue_generate(st, q, GEN)
    return (*out, st) if state else out


# the exact ratio each press is checked at in its class (each exact policy compiles steps of its own: one ratio a
# press, for suite time): the middle one for kvpress's peer presses (PRESSES' first eight, whose engines the
# covering-prefill test reuses), the highest (the fewest of the class's slots stored) for the others, and both
# for the presses whose layers or heads keep counts of their own
EXACT_RATIOS = {press: (0.5, 0.875) if press in ("PyramidKVPress", "AdaKVPress", "LUKVPress") else
                (0.5,) if i < 8 else (0.875,) for i, press in enumerate(PRESSES)}


@pytest.mark.parametrize("press", sorted(PRESSES))
def test_a_shape_class_keeps_and_answers_as_the_exact_policy(press, engine, tokens):
    slots = grid_slots(_pols(press, RATIOS), CFG.n_layers, MAX_LEN)  # the class of all four ratios
    assert slots > 0
    # the exact policies of one or two of them (the class is sized by the lowest ratio, so these store fewer of
    # its slots than it allocates)
    for pol in _pols(press, EXACT_RATIOS[press]):
        exact, shaped = engine(pol), engine(pol, slots)
        assert shaped.policies != exact.policies and all(t is not None for t in shaped.keep_tables)
        (ke, ie, se), (ks, is_, ss) = _answer(exact, tokens, True), _answer(shaped, tokens, True)
        assert filled_bytes(ss.cache) == filled_bytes(se.cache) < tree_nbytes(se.cache) <= tree_nbytes(ss.cache)
        for la, lb in zip(ke, ks, strict=True):
            for a, b in zip(la, lb, strict=True):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ie, is_)


def test_budget_sized_policies_have_a_constant_table():
    pol = kvpolicies.get("snapkv", budget=20, obs_window=4, kernel=3, max_new=5)
    table = pol.kept_table(100)
    assert table.shape == (101,) and set(table.tolist()) == {24}  # budget + window, whatever the prompt
    shaped, t = shape_class_of(pol, 100, 64)
    assert shaped.slots == 64 and shaped.budget == 0 and shaped.ratio == 0 and t is not None
    assert shape_class_of(pol, 100, 20) == (pol, None)  # its state (29 slots) does not fit 20: itself
    assert shape_class_of(kvpolicies.get("full"), 100, 64) == (kvpolicies.get("full"), None)
    decoding = kvpress("KnormPress", 0.5, compression_interval=4, target_size=8)  # compresses while decoding
    assert isinstance(decoding, KeptTable) and decoding.kept_table(100) is None
    # wrappers whose ranking reads more counts than the kept one: those counts as more rows of the table
    chunked = kvpress("ChunkPress", 0.5, press="KnormPress", chunk_length=40, max_new=10)
    table = chunked.kept_table(100)  # the kept counts, then chunks [0, 40), [40, 80), [80, 100)
    assert table.shape == (4, 101) and table[:, 100].tolist() == [50, 20, 20, 10] and table[:, 30].tolist() == [15, 15, 1, 1]
    shaped, t = shape_class_of(chunked, 100, 64)
    assert shaped.slots == 64 and shaped.ratio == 0 and shaped.press.ratio == 0 and (t == table).all()
    blocked = kvpress("BlockPress", 0.75, press="KnormPress")
    assert blocked.kept_table(100).tolist() == [[max(1, int(n * 0.25)) for n in range(101)]] * 2


def test_lukv_table_is_its_head_counts_at_every_length():
    """LU-KV's kept table, evaluated once on the host, is the jitted `head_counts` of its layer's prune ratios
    at every prompt length, head by head (so the exact policy, which reads it too, keeps what it kept when
    it computed the counts in its step); Ada-KV's is kvpress's max(1, int(n (1 - ratio)))."""
    import jax
    import jax.numpy as jnp

    from kvpolicies.lukv import head_counts

    counts = jax.jit(head_counts)
    for layer in _pols("LUKVPress", (0.5,))[0].stack(CFG.n_layers):
        table = layer.kept_table(MAX_LEN)
        assert table.shape == (CFG.n_kv_heads, MAX_LEN + 1) and table.dtype == np.int32
        for n in range(MAX_LEN + 1):
            got = counts(jnp.asarray(layer.prune, jnp.float32), jnp.full((1, 1), n, jnp.int32))[0]
            np.testing.assert_array_equal(table[:, n], np.asarray(got), str(n))
    ada = _pols("AdaKVPress:ExpectedAttentionPress", (0.75,))[0]
    cap = ada.capacity(MAX_LEN)
    assert ada.kept_table(MAX_LEN).tolist() == [min(max(1, int(n * 0.25)), cap) for n in range(MAX_LEN + 1)]


@pytest.mark.parametrize("press", ["PyramidKVPress", "LUKVPress"])
def test_per_layer_budgets_share_one_run_and_one_layer_step(model, engine, tokens, press):
    """PyramidKV's per-layer budgets and LU-KV's per-(layer, kv head) counts: a policy per layer exactly,
    one policy and one decode-layer step as a shape class, each layer's counts a row of its table."""
    pol = _pols(press, (0.5,))[0]
    exact = engine(pol)  # (the exact press of test_a_shape_class_keeps_and_answers_as_the_exact_policy)
    assert len(set(exact.policies)) == CFG.n_layers  # a policy (so a layer step) per layer
    shaped = Engine(model, pol, max_len=MAX_LEN, slots=grid_slots([pol], CFG.n_layers, MAX_LEN))
    heads = (CFG.n_kv_heads,) if press == "LUKVPress" else ()  # LU-KV: a count per kv head
    assert len(set(shaped.policies)) == 1 and shaped.keep_tables[0].shape == (CFG.n_layers, *heads, MAX_LEN + 1)
    _answer(exact, tokens), _answer(shaped, tokens)
    assert exact.traces["decode_layer"] == CFG.n_layers and shaped.traces["decode_layer"] == 1


def test_a_grid_compiles_the_same_programs_at_two_ratios_as_at_four(tokens):
    """Every press of PRESSES at two ratios, then at the other two of RATIOS (one shape class: the lowest
    ratio sizes it), on a fresh model of its own vocabulary (its programs are compiled nowhere else, so
    none is read back from a persistent cache: scripts/test.sh turns one on): the two added ratios
    compile no program and trace no step (counted from JAX's compilation events), so four ratios
    compile what two do."""
    m = Llama(dataclasses.replace(CFG, vocab_size=101))
    engines = []  # kept alive: a later engine of a class takes the steps of the first

    def grid(ratios) -> tuple[int, int]:
        with CompileLog() as log:
            for press in PRESSES:
                slots = grid_slots(_pols(press, RATIOS), CFG.n_layers, MAX_LEN)
                assert slots == grid_slots(_pols(press, (0.25, 0.5)), CFG.n_layers, MAX_LEN)  # two ratios' class
                for pol in _pols(press, ratios):
                    engines.append(Engine(m, pol, max_len=MAX_LEN, slots=slots, share_steps=True))
                    _answer(engines[-1], tokens)
        traces = {id(e.traces): e.traces for e in engines}.values()
        return log.programs, sum(sum(c.values()) for c in traces)

    two = grid((0.25, 0.5))
    four = grid((0.75, 0.875))
    assert two[0] > 0 and four == (0, two[1])  # nothing compiled or traced for the other two ratios
    assert two[1] <= 4 * len(PRESSES)  # per press: the prompt, the question and one decode-layer step, once


def test_equal_engines_share_their_steps(model, tokens):
    pol = kvpolicies.get("snapkv", budget=20, obs_window=4, kernel=3, max_new=MAX_NEW)
    a, b = (Engine(model, pol, max_len=MAX_LEN, share_steps=True) for _ in range(2))
    c = Engine(model, pol, max_len=MAX_LEN)  # not shared (the default)
    assert a.traces is b.traces and a.traces is not c.traces
    _answer(a, tokens)
    before = sum(a.traces.values())
    with CompileLog() as log:
        _answer(b, tokens)
    assert sum(a.traces.values()) == before and log.programs == 0  # b traced and compiled nothing


def test_what_a_shape_class_cannot_reproduce_is_refused(model, tokens):
    ctx, q = tokens
    pol = kvpress("SnapKVPress", 0.5, max_new=MAX_NEW, window_size=8)
    eng = Engine(model, pol, max_len=MAX_LEN + 40, slots=grid_slots([pol], CFG.n_layers, MAX_LEN + 40))
    st = eng.compress(eng.prompt(ctx))
    with pytest.raises(ValueError, match=r"past max_new=17"):
        eng.continue_generate(st, q, GEN + 2)  # 9 + 9 written after the compression
    with pytest.raises(ValueError, match="past max_new"):
        eng.feed(eng.feed(st, q), np.zeros((1, GEN + 1), np.int32))
    with pytest.raises(ValueError, match="not on an Engine"):
        eng.score(ctx[0])
    with pytest.raises(ValueError, match="not on an Engine"):
        eng.step(eng.init_cache(), ctx[:, :4], 0)
    with pytest.raises(ValueError, match="past max_new"):
        eng.generate(ctx, MAX_NEW + 2)
    assert eng.continue_generate(st, q, GEN).shape == (1, GEN)  # within max_new: fine
    with pytest.raises(ValueError, match="no layer's policy has a kept table"):
        Engine(model, kvpolicies.get("full"), max_len=MAX_LEN, slots=64)
    with pytest.raises(ValueError, match="not with fit= or mesh="):
        Engine(model, pol, max_len=MAX_LEN, slots=64, fit=4)


def test_chunk_as_a_list_of_steps(model, tokens):
    ctx, _ = tokens
    eng = Engine(model, kvpolicies.get("full"), max_len=MAX_LEN)
    one = eng.prompt(ctx, chunk=64)
    listed = eng.prompt(ctx, chunk=[128, 16, 4, 2])
    np.testing.assert_allclose(np.asarray(listed.logits), np.asarray(one.logits), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sum to 149, not to the 150"):
        eng.prompt(ctx, chunk=[128, 16, 4, 1])
    with pytest.raises(ValueError, match=r"chunk\[1\]"):
        eng.prompt(ctx, chunk=[149, 0, 1])


def test_one_covering_prefill_serves_every_covered_press(model, engine, tokens):
    """`kvpolicies.prompt.covers`: the covering phase's state, cut by `restrict`, is each phase's own
    bit for bit, and compressing it keeps the same positions and answers the same ids."""
    from kvpolicies.prompt import PromptPhase, covers, superset

    ctx, q = tokens
    steps = [128, 16, 4, 2]  # no 1-token step (evals.peer.shared_phase)
    engines = {press: engine(pol) for press in list(PRESSES)[:8] if press != "ObservedAttentionPress"
               for pol in _pols(press, (0.5,))}  # kvpress's peer presses (PRESSES' first eight)
    phases = {e.prompt_policies[0] for e in engines.values()}
    assert len(phases) == 4  # snapkv's and adakv's 8 rows, tova's 1, knorm's and streamingllm's none, expected's sums
    wide = superset(phases | {kvpolicies.get("full")})
    assert wide == PromptPhase(obs_window=8, query_sink=4) and all(covers(wide, x) for x in phases)
    assert superset(phases | {PromptPhase(obs_window=2, columns=True)}) == wide  # observed's columns: not covered
    assert superset({PromptPhase(obs_window=2), PromptPhase(query_sink=1), PromptPhase(query_sink=2)}) is None
    big = Engine(model, wide, max_len=MAX_LEN)
    shared = big.prompt(ctx, chunk=steps)
    for press, eng in engines.items():
        assert eng.shares_prompt(big), press
        own = eng.prompt(ctx, chunk=steps)
        mine, theirs = own.cache[0], eng._adopt(shared.cache)[0]
        for name in ("k", "v", "pos", "rows", "row_pos"):
            np.testing.assert_array_equal(np.asarray(getattr(theirs, name)), np.asarray(getattr(mine, name)), press)
        assert set(theirs.extra) == set(mine.extra)
        for name in mine.extra:
            np.testing.assert_array_equal(np.asarray(theirs.extra[name]), np.asarray(mine.extra[name]))
        a, b = eng.compress(own), eng.compress(shared)
        assert [list(map(list, x)) for x in eng.kept_positions(a)] == [list(map(list, x)) for x in eng.kept_positions(b)]
        np.testing.assert_array_equal(eng.continue_generate(a, q, GEN), eng.continue_generate(b, q, GEN))


def test_a_press_ratios_answer_as_rows_of_one_batch(engine, tokens):
    """`evals.peer.answer_rows`: the compressed states of a press's ratios (one shape class) decode as
    the rows of one batch, each row the ids it gets alone."""
    from evals.peer import answer_rows

    ctx, q = tokens
    pols = _pols("SnapKVPress", RATIOS)
    slots = grid_slots(pols, CFG.n_layers, MAX_LEN)
    engines = [engine(pol, slots) for pol in pols]
    prompt = engines[0].prompt(ctx)
    states = [e.compress(prompt) for e in engines]
    alone = [e.continue_generate(s, q, GEN)[0] for e, s in zip(engines, states)]
    together = answer_rows(engines[0], states, q[0], GEN, lambda name, value: value)
    np.testing.assert_array_equal(together, np.stack(alone))


@pytest.mark.parametrize("press", ["SnapKVPress", "KnormPress", "ExpectedAttentionPress", "ObservedAttentionPress", "AdaKVPress"])
def test_a_question_that_evicts_nothing_attends_in_one_piece(model, tokens, press, monkeypatch):
    """A chunk of a per-token prompt scorer that no head overflows (`appends_quietly`: each
    observation takes T queries at once, `@chunked`) attends in one piece: the same positions as
    its token-by-token steps, keys and values bit for bit, statistics (snapkv's window mass,
    expected's query sums, observed's column sums, adakv's pool mass) and logits within float
    rounding; its shape class traces no token-by-token step at all."""
    import jax

    ctx, q = tokens
    pol = kvpress(press, 0.5, n_layers=CFG.n_layers, max_new=MAX_NEW, **PRESSES[press])
    kind = type(pol)
    asked = []
    own = kind.appends_quietly
    monkeypatch.setattr(kind, "appends_quietly", lambda self, state, t: asked.append(own(self, state, t))
                        or asked[-1])
    eng = Engine(model, pol, max_len=MAX_LEN)
    st = eng.compress(eng.prompt(ctx))
    fed = eng.feed(st, q, chunk=Q)
    monkeypatch.setattr(kind, "appends_quietly", lambda self, state, t: None)
    steps = Engine(model, pol, max_len=MAX_LEN).feed(st, q, chunk=Q)
    assert asked and all(a is not None for a in asked)  # traced once per layer run
    for a, b in zip(jax.tree.leaves(fed.cache), jax.tree.leaves(steps.cache)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(fed.logits), np.asarray(steps.logits), atol=2e-5, rtol=0)
    # a shape class (its engine refuses chunks past the free slots): no token-by-token steps traced
    monkeypatch.setattr(kind, "appends_quietly", own)
    import kvpolicies.attention.step as attention_step

    def refused(*a, **k):
        raise AssertionError("a shape class traced token-by-token steps for a chunk that only appends")

    monkeypatch.setattr(attention_step, "token_by_token", refused)
    cls = Engine(model, pol, max_len=MAX_LEN, slots=grid_slots([pol], CFG.n_layers, MAX_LEN))
    shaped = cls.feed(cls.compress(cls.prompt(ctx)), q, chunk=Q)
    np.testing.assert_allclose(np.asarray(shaped.logits), np.asarray(fed.logits), atol=2e-5, rtol=0)


def test_feed_without_a_fork_takes_the_state_buffers(model, tokens):
    """`feed(fork=False)` (a batch built for one question, evals.peer's) gives the forked feed's
    state bit for bit, without the copy: the input state's cache buffers are donated to the step."""
    import jax

    ctx, q = tokens
    eng = Engine(model, kvpress("SnapKVPress", 0.5, n_layers=CFG.n_layers, max_new=MAX_NEW), max_len=MAX_LEN)
    st = eng.compress(eng.prompt(ctx))
    forked = eng.feed(st, q, chunk=Q)
    assert not any(x.is_deleted() for x in jax.tree.leaves(st.cache))  # the fork left it usable
    taken = eng.feed(st, q, chunk=Q, fork=False)
    for a, b in zip(jax.tree.leaves((forked.cache, forked.logits)), jax.tree.leaves((taken.cache, taken.logits)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(x.is_deleted() for x in jax.tree.leaves(st.cache[0].k))
