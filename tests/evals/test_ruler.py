"""RULER-style tasks (evals/ruler.py): exact lengths, determinism, needles where asked, RULER's
scoring and Wilson's interval against hand computations; the staged Engine API behind the
query-agnostic and multi-query protocols (compression before the question, one prefill for N
questions, forks that do not interfere, one dense prefill shared by several policies)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import kvpolicies
from evals import retrieval as R
from evals import ruler
from evals.common import TaskContext
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama
from tests.refs.texts import TEXT, TOK  # the byte tokenizer with a chat template


# -- scoring and intervals --------------------------------------------------------------------------
def test_wilson_matches_hand_computation_and_the_quadratic_roots():
    lo, hi = ruler.wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)  # worked by hand: centre 0.7167, half 0.2266
    for k, n in ((0, 10), (3, 7), (10, 10), (37, 50)):
        # independent form: the roots in p of (p_hat - p)^2 = z^2 p (1 - p) / n
        z2, ph = 1.959963984540054 ** 2, k / n
        a, b, c = 1 + z2 / n, -(2 * ph + z2 / n), ph * ph
        roots = sorted(((-b - math.sqrt(b * b - 4 * a * c)) / (2 * a), (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))
        np.testing.assert_allclose(ruler.wilson(k, n), roots, atol=1e-12)
    assert ruler.accuracy_record([1, 0, 1, 1]) == pytest.approx(
        {"accuracy": 0.75, "ci_low": ruler.wilson(3, 4)[0], "ci_high": ruler.wilson(3, 4)[1], "trials": 4})


@pytest.mark.parametrize("pred, refs, want", [
    ("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"], 2 / 3),
    ("ANSWER: Apple\x00 banana", ["apple", "Banana"], 1.0),  # case-insensitive, control chars
    ("12345678", ["1234567"], 1.0),  # RULER's substring match: no digit boundary
    ("nothing", ["a1"], 0.0),
])
def test_string_match_all(pred, refs, want):
    assert ruler.string_match_all(pred, refs) == pytest.approx(want)


def test_string_match_part():
    assert ruler.string_match_part("it is Paris", ["paris", "london"]) == 1.0
    assert ruler.string_match_part("it is Rome", ["paris", "london"]) == 0.0


# -- generators ------------------------------------------------------------------------------------------
HAY = ruler.haystack(TOK, "text", TEXT, 4000)


def _all(length, seed=0, trials=2):
    """Samples of every RULER task at `length` (byte tokenizer; text haystack)."""
    out = {}
    for name in ruler.RULER_SET:
        cfg = ruler.check({"name": name, "lengths": [length], "trials": trials, "haystack": "text"}
                          | ({"haystack": "filler"} if name == "ruler_vt" else {}))
        text = TEXT + " ".join(f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}" for i in range(1200))
        if name == "ruler_cwe":
            words = tuple(sorted({f"{a}{b}{c}x" for a in "bcdfg" for b in "aeiou" for c in "lmnprstvwz"}))
            out[name] = ruler.cwe_samples(TOK, words * 1, length, trials, seed, prompt_tokens=length - cfg["gen"])
        else:
            out[name] = ruler.samples(cfg, TOK, text, length, seed)
    return out


@pytest.mark.parametrize("length", [3000, 3700])
def test_every_task_has_the_exact_length_and_its_answers_inside(length):
    for name, ss in _all(length).items():
        gen = ruler.TASK_KEYS[name]["gen"]
        for s in ss:
            assert len(s.tokens) == length - gen, name  # prompt + answer = length (RULER's max_seq_length)
            text = TOK.decode(s.tokens)
            assert text.startswith("<system>") and "<assistant>" in TOK.decode(s.tokens[s.split:])
            context = TOK.decode(s.tokens[:s.split])
            for r in s.refs:
                assert r.lower() in context.lower(), (name, r)


def test_generators_are_deterministic_by_seed():
    a, b, c = _all(3000, seed=3), _all(3000, seed=3), _all(3000, seed=4)
    for name in a:
        assert all((x.tokens == y.tokens).all() and x.refs == y.refs for x, y in zip(a[name], b[name])), name
        assert any(x.refs != y.refs for x, y in zip(a[name], c[name])), name


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.77, 1.0])
def test_niah_single_needle_at_the_requested_depth(depth):
    (s,) = ruler.niah_samples(TOK, HAY, 2000, 1, seed=1, depth=depth, prompt_tokens=1968)
    (start,) = s.needle_starts
    needle = " " + ruler.NIAH_NEEDLE.format(kind="numbers", key=TOK.decode(s.tokens).split("for ")[-1]
                                            .split(" mentioned")[0], value=s.refs[0])
    assert TOK.decode(s.tokens[start:start + len(needle)]) == needle
    assert abs(s.depths[0] - depth) <= R.SNAP / 1500  # snapped to a sentence end within SNAP tokens
    head = len(R.frame(TOK, ruler.NIAH_INSTRUCTION.format(kind="numbers"), "", "")[0])
    fill = s.split - head - len(needle) - 2  # the haystack tokens (the question's "\n\n" excluded)
    assert abs((start - head) / fill - depth) <= (R.SNAP + 2) / fill


def test_multikey_multivalue_multiquery_references():
    (mk,) = ruler.niah_samples(TOK, HAY, 2500, 1, seed=2, n_keys=4, prompt_tokens=2500)
    assert len(mk.refs) == 1 and len(mk.needle_starts) == 4
    (mv,) = ruler.niah_samples(TOK, HAY, 2500, 1, seed=2, n_values=4, prompt_tokens=2500)
    text = TOK.decode(mv.tokens)
    assert len(mv.refs) == 4 and text.count("One of the special magic numbers for") == 4
    (mq,) = ruler.niah_samples(TOK, HAY, 2500, 1, seed=2, n_keys=4, n_queries=2, prompt_tokens=2500)
    assert len(mq.refs) == 2 and ", and " in TOK.decode(mq.tokens[mq.split:])


def test_vt_chain_in_order_and_cwe_fwe_counts():
    (vt,) = ruler.vt_samples(TOK, ruler.haystack(TOK, "filler", None, 3000), 1500, 1, seed=0)
    text = TOK.decode(vt.tokens)
    first = text.index(f"VAR {vt.refs[0]} = ")
    value = text[first:].split("= ")[1].split(".")[0]
    assert value.isdigit() and f"assigned the value {value}" in text
    at = [text.index(f"VAR {vt.refs[j + 1]} = VAR {vt.refs[j]}.") for j in range(4)]
    assert first < at[0] < at[1] < at[2] < at[3]  # the chain in order
    words = tuple(sorted({f"{a}{b}{c}x" for a in "bcdfg" for b in "aeiou" for c in "lmnprstvwz"}))
    (cwe,) = ruler.cwe_samples(TOK, words, 8192, 1, seed=0)
    items = TOK.decode(cwe.tokens[:cwe.split]).split("Memorize the ones that appear most often.\n")[-1].split()
    listed = [w for w in items if w.endswith("x") and not w[0].isdigit()]
    counts = {w: listed.count(w) for w in set(listed)}
    assert all(counts[w] == 30 for w in cwe.refs) and len(cwe.refs) == 10
    assert all(c == 3 for w, c in counts.items() if w not in cwe.refs)
    (fwe,) = ruler.fwe_samples(TOK, 3000, 1, seed=0)
    body = TOK.decode(fwe.tokens[:fwe.split]).split()
    top = sorted({w for w in body if len(w) == 6 and w.isalpha()}, key=lambda w: -body.count(w))[:3]
    assert sorted(top) == sorted(fwe.refs)
    n = body.count("...")
    assert body.count(fwe.refs[0]) == int(n / 4)  # Zipf, alpha 2: rank 2 has a quarter of rank 1's count


def test_check_rejects_bad_keys():
    with pytest.raises(ValueError, match="protocol"):
        ruler.check({"name": "ruler_vt", "protocol": "sideways"})
    with pytest.raises(ValueError, match="unknown key"):
        ruler.check({"name": "ruler_cwe", "n_keys": 3})
    with pytest.raises(ValueError, match="n_queries"):
        ruler.check({"name": "ruler_niah_multiquery", "n_keys": 2, "n_queries": 3})


# -- protocols through the Engine ----------------------------------------------------------------------
CFG = LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
MODEL = Llama(CFG)
SNAP = kvpolicies.get("snapkv", budget=16, obs_window=4, kernel=3, max_new=24)


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_query_agnostic_compresses_before_the_question_and_forks_do_not_interfere():
    rng = np.random.default_rng(0)
    context = rng.integers(0, 256, (1, 48)).astype(np.int32)
    q1, q2 = rng.integers(0, 256, (1, 8)).astype(np.int32), rng.integers(0, 256, (1, 8)).astype(np.int32)
    eng = Engine(MODEL, SNAP, max_len=96)
    state = eng.compress(eng.prompt(context, chunk=8))  # chunk 8 everywhere: one compiled prompt step
    kept = jax.tree.map(np.asarray, state.cache)
    a1 = eng.continue_generate(state, q1, 5)
    a2 = eng.continue_generate(state, q2, 5)
    assert _leaves_equal(kept, state.cache)  # the compressed state does not depend on the question
    np.testing.assert_array_equal(eng.continue_generate(state, q1, 5), a1)  # forks do not interfere
    again = eng.compress(eng.prompt(context, chunk=8))  # a second, independent prefill gives the same answers
    np.testing.assert_array_equal(eng.continue_generate(again, q2, 5), a2)
    assert eng.prefills == 2 and eng.prompts_compressed == 2 and eng.traces["logits"] == 2  # prompt, question
    # query-aware: the question is observed by the compression, so what is kept depends on it
    dense = eng.prompt(context, chunk=8)
    aware = [eng.compress(eng.extend_prompt(dense, q, chunk=8)) for q in (q1, q2)]
    pos = [np.asarray(s.cache[0].pos) for s in aware]
    assert not np.array_equal(pos[0], pos[1])
    whole = np.concatenate([context, q1], axis=1)  # staged query-aware is Engine.generate
    np.testing.assert_array_equal(eng.continue_generate(aware[0], [], 5), eng.generate(whole, 5, chunk=8))


def test_multiquery_uses_one_prefill_per_context(monkeypatch):
    # keys of equal length: every question has the same number of tokens (one compiled step)
    monkeypatch.setattr(R, "ADJECTIVES", ("amber", "brisk", "dusty", "eager"))
    monkeypatch.setattr(R, "NOUNS", ("anchor", "badger", "canyon", "engine"))
    engines = []

    class Recording(TaskContext):  # one engine for both runs (its compiled steps too)
        def engine(self, max_len):
            if not engines:
                engines.append(super().engine(max_len))
            return engines[0]

    task = {"name": "multiquery", "lengths": [600], "trials": 2, "n_queries": 3, "gen": 4, "haystack": "text"}
    ctx = Recording(model=MODEL, tokenizer=TOK, policies=SNAP, text=TEXT, progress=False, chunk=600, task=task)
    res = ruler.run(ctx)
    assert engines[0].prefills == 2 and res.metrics["prefills"] == 2  # 2 contexts, 6 questions
    assert engines[0].prompts_compressed == 2  # query_agnostic: compressed once per context
    assert [g["question"] for g in res.grid] == [0, 1, 2] and res.arrays["score"].shape == (1, 2, 3)
    assert all(g["protocol"] == "query_agnostic" and g["trials"] == 2 for g in res.grid)
    ctx.task = dict(task, protocol="query_aware")
    ruler.run(ctx)
    assert engines[0].prefills == 4 and engines[0].prompts_compressed == 2 + 6  # one compression per question


def test_one_dense_prefill_shared_by_prompt_compressors():
    prompts = [ruler.Sample(np.random.default_rng(i).integers(0, 256, 40).astype(np.int32), ("x",), 32)
               for i in range(2)]  # two contexts, three policies
    stacks = [SNAP, kvpolicies.get("snapkv", budget=8, obs_window=4, kernel=3, max_new=24), kvpolicies.get("full")]
    engines = [Engine(MODEL, s, 64) for s in stacks]
    out, counts = ruler.shared_prefill(engines, prompts, 4, "query_agnostic", chunk=None)
    assert counts == {"prefills": 2, "prefills_unshared": 6}
    assert [e.prefills for e in engines] == [2, 0, 0]  # the first snapkv prefilled for all three
    for e, answers in zip(engines[1:], out[1:]):  # each policy's answers are its own, unshared ones
        assert answers == [ruler.answer(e, [p], 4, "query_agnostic", None)[0] for p in prompts]
    sink = Engine(MODEL, kvpolicies.get("sink", n_sink=2, window=16), 64)
    assert not sink.shares_prompt(engines[0]) and not engines[0].shares_prompt(engines[2])


def test_kvzip_budgets_share_one_prefill_and_one_reconstruction_pass():
    """kvzip at two budgets, knorm (the same dense prompt phase) and full in one shared run: one
    prefill and one kvzip reconstruction pass per context (the second kvzip engine feeds no repeat
    input), and every engine's answers are its own unshared ones."""
    prompts = [ruler.Sample(np.random.default_rng(i).integers(0, 256, 40).astype(np.int32), ("x",), 32)
               for i in range(2)]
    stacks = [kvpolicies.get("kvzip", budget=b, max_new=24, n_sink=2, repeat_chunk=16, repeat_tail=3) for b in (8, 16)]
    stacks += [kvpolicies.get("knorm", budget=16, max_new=24), kvpolicies.get("full")]
    engines = [Engine(MODEL, s, 64, repeat=TOK) for s in stacks]
    out, counts = ruler.shared_prefill(engines, prompts, 4, "query_agnostic", chunk=None)
    assert counts == {"prefills": 2, "prefills_unshared": 8}
    assert engines[0].reconstruct_tokens > 0 and engines[1].reconstruct_tokens == 0
    for s, answers in zip(stacks, out):
        fresh = Engine(MODEL, s, 64, repeat=TOK)
        assert answers == [ruler.answer(fresh, [p], 4, "query_agnostic", None)[0] for p in prompts]


# -- the suite preset ---------------------------------------------------------------------------------
def test_suite_expands_the_ruler_set_and_averages_with_a_pooled_interval():
    from evals import suite

    a = suite.parse_args(["tasks=ruler", "task.trials=3", "policies=[snapkv]", "budgets=[0.5]", "extra=[quest]"])
    assert a.tasks == list(ruler.RULER_SET) and a.extra == ["quest"]
    assert a.task_keys == {"lengths": [4096], "protocol": "query_aware"}  # trials given on the command line wins
    assert suite.task_argv(a, "ruler_vt")[:3] == ["task=ruler_vt", "task.lengths=[4096]", "task.protocol=query_aware"]
    tables = {"t1": [{"policy": "full", "budget": None, "score": 1.0, "trials": 10},
                     {"policy": "snapkv", "budget": 0.5, "score": 0.5, "trials": 10}],
              "t2": [{"policy": "full", "budget": None, "score": 0.8, "trials": 10},
                     {"policy": "snapkv", "budget": 0.5, "score": 0.2, "trials": 10}]}
    avg = suite.average(tables)
    assert [(r["policy"], r["average"]) for r in avg] == [("full", pytest.approx(0.9)), ("snapkv", pytest.approx(0.35))]
    assert (avg[1]["ci_low"], avg[1]["ci_high"]) == pytest.approx(ruler.wilson(7, 20))
    with pytest.raises(suite.ConfigError, match="not a task"):
        suite.parse_args(["tasks=[ruler_vt,nope]"])


def test_query_agnostic_answers_with_fit_store_each_context_at_what_it_kept():
    """Engine(fit=n) on RULER's query-agnostic path (prompt, compress, continue_generate): the same
    answers as the static pool, a fit record per compression (the 32-token contexts), below the
    static pool's bytes."""
    from kvpolicies.memory import tree_nbytes

    pol = kvpolicies.get("kvzap", budget=40, max_new=24, window=4, rule="threshold", threshold=0.0, surrogate="random")
    prompts = [ruler.Sample(np.random.default_rng(i).integers(0, 256, 40).astype(np.int32), ("x",), 32)
               for i in range(2)]
    plain, fit = Engine(MODEL, pol, 64), Engine(MODEL, pol, 64, fit=8)
    assert ruler.answer(fit, prompts, 4, "query_agnostic", None) == ruler.answer(plain, prompts, 4, "query_agnostic", None)
    static = tree_nbytes(plain.init_cache(1))
    assert len(fit.fit_records) == fit.prompts_compressed == plain.prompts_compressed >= 1  # a record per compression
    assert all(r["tokens"] == 32 and r["stored_bytes"] < static * len(prompts) for r in fit.fit_records)
