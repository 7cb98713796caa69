"""Retrieval tasks: exact prompt lengths, needles where asked, answer parsing, scoring through the
task functions (with an oracle engine and a tiny random Llama; the recall task on the trained recall
model is in tests/evals/test_recall_model.py, beside its fixture) and one SmolLM2 passkey check (slow)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvpolicies
from evals import retrieval as R
from evals import ruler
from evals.common import TaskContext
from models.config import LlamaConfig
from models.llama import Llama
from tests.refs.texts import TEXT, TOK


# -- answers --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    (" 71432. Remember it.", "71432"),
    ("The pass key is 71432", "71432"),
    ("12345 and 67890", "12345"),
    ("123456 then 54321.", "54321"),  # a 6-digit number is not a 5-digit key
    ("1234", None),
    ("no digits here", None),
])
def test_parse_passkey(text, want):
    assert R.parse_passkey(text) == want


@pytest.mark.parametrize("text, answer, want", [
    (" 4829301.", "4829301", True),
    ("is 4829301", "4829301", True),
    ("48293011", "4829301", False),  # glued to another digit
    ("14829301", "4829301", False),
    ("482930", "4829301", False),
])
def test_contains_answer(text, answer, want):
    assert R.contains_answer(text, answer) is want


# -- prompt construction --------------------------------------------------------------------
@pytest.mark.parametrize("length", [400, 533, 1500])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(length, depth):
    prompts = R.passkey_prompts(TOK, length, depth, trials=3, seed=7)
    for p in prompts:
        assert len(p.tokens) == length
        text = TOK.decode(p.tokens)
        needle = " " + R.PASSKEY_NEEDLE.format(key=p.answer)
        (start,) = p.needle_starts
        assert TOK.decode(p.tokens[start:start + len(needle)]) == needle
        assert text.count(p.answer) == 2  # only the needle holds the key
        assert text.startswith("<system>") and text.endswith("</user>\n<assistant>" + R.PASSKEY_PREFIX)
        lo, hi = p.haystack
        fill = hi - lo - len(needle)
        assert abs((start - lo) - depth * fill) <= R.SNAP
        assert p.depths[0] == pytest.approx((start - lo) / fill)
        # the needle follows a sentence end (or the start of the haystack), the question a sentence end
        assert start == lo or TOK.decode(p.tokens[start - 1:start]) in ". \n"
        assert TOK.decode(p.tokens[hi - 1:hi]) == "."
    assert len({p.answer for p in prompts}) == 3


def test_depth_snapping_is_tight_in_filler():
    """Filler sentences are short: the needle lands within one sentence of the asked depth."""
    for depth in np.linspace(0, 1, 11):
        (p,) = R.passkey_prompts(TOK, 2000, float(depth), trials=1, seed=0)
        assert abs(p.depths[0] - depth) < 22 / 2000 + 1e-9


def test_prompts_are_deterministic_given_seed():
    a = R.passkey_prompts(TOK, 400, 0.5, 4, seed=3)
    b = R.passkey_prompts(TOK, 400, 0.5, 4, seed=3)
    c = R.passkey_prompts(TOK, 400, 0.5, 4, seed=4)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert [x.answer for x in a] != [x.answer for x in c]


def test_passkey_in_a_text_haystack(text_haystack):
    ids, ends, starts = text_haystack
    prompts = R.passkey_prompts(TOK, 700, 0.5, 3, 0, ids, ends, starts)
    assert all(len(p.tokens) == 700 for p in prompts)
    bodies = [TOK.decode(p.tokens[p.haystack[0]:p.haystack[1]]) for p in prompts]
    assert all("Paragraph" in b and f"The pass key is {p.answer}." in b for b, p in zip(bodies, prompts))
    assert len(set(bodies)) == 3  # random starting points in the text


def test_too_short_length_raises():
    with pytest.raises(ValueError, match="length=50"):
        R.passkey_prompts(TOK, 50, 0.5, 1, seed=0)


@pytest.fixture(scope="module")
def text_haystack():
    return R.text_haystack_ids(TOK, TEXT, 1200)


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_niah_prompt(text_haystack, depth):
    ids, ends, starts = text_haystack
    prompts = R.needle_prompts(TOK, 900, [depth], 1, "", 4, 0, ids, ends, starts, multi=False)
    for p in prompts:
        assert len(p.tokens) == 900
        text = TOK.decode(p.tokens)
        m = re.search(r"The special magic number for (\w+) is (\d{7})\.", text)
        assert m and m.group(2) == p.answer
        assert text.endswith(R.NIAH_PREFIX.format(key=m.group(1)))
        assert f"What is the special magic number for {m.group(1)} mentioned" in text
        lo, hi = p.haystack
        needle_len = len(TOK.encode(" " + R.NIAH_NEEDLE.format(key=m.group(1), value=p.answer)))
        assert abs((p.needle_starts[0] - lo) - depth * (hi - lo - needle_len)) <= R.SNAP
        assert "Paragraph" in TOK.decode(p.tokens[lo:hi])  # the haystack is the text


@pytest.mark.parametrize("kind, pattern", [("words", r"[a-z]+-[a-z]+"),
                                           ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")])
def test_multikey_prompt(text_haystack, kind, pattern):
    ids, ends, starts = text_haystack
    prompts = R.needle_prompts(TOK, 1100, None, 5, kind, 4, 1, ids, ends, starts, multi=True)
    for p in prompts:
        assert len(p.tokens) == 1100
        text = TOK.decode(p.tokens)
        found = re.findall(rf"One of the special magic numbers for ({pattern}) is: (\d{{7}})\.", text)
        assert len(found) == 5 and len({k for k, _ in found}) == 5
        asked = re.search(rf"What is the special magic number for ({pattern}) mentioned", text).group(1)
        assert dict(found)[asked] == p.answer
        # needle_starts[0] is the asked needle
        start = p.needle_starts[0]
        assert TOK.decode(p.tokens[start:start + 100]).startswith(f" One of the special magic numbers for {asked}")
        assert len(p.depths) == 5 and all(0 <= d <= 1 for d in p.depths)


def test_check_rejects_bad_config():
    with pytest.raises(ValueError, match="unknown key"):
        R.check({"name": "passkey", "lenghts": [100]})
    with pytest.raises(ValueError, match="depths"):
        R.check({"name": "niah", "depths": [1.5]})
    with pytest.raises(ValueError, match="key_kind"):
        R.check({"name": "multikey", "key_kind": "emoji"})
    assert R.check({"name": "recall", "n_pairs": 8})["n_pairs"] == [8]


# -- scoring through the task functions -------------------------------------------------------
class OracleEngine:
    """Answers with the needle it finds in the prompt, but only if the needle is in the first
    half of the prompt (a stand-in for a model whose cache forgot the second half)."""

    def __init__(self, tok, pattern):
        self.tok, self.pattern, self.calls = tok, pattern, []

    def generate(self, prompts, n, chunk=None):
        self.calls.append(prompts.shape)
        out = np.zeros((prompts.shape[0], n), np.int32)
        for b, row in enumerate(prompts):
            text = self.tok.decode(row)
            m = re.search(self.pattern, text)
            ans = m.group(1) if m and m.start() < len(text) / 2 else "00000"
            ids = self.tok.encode(" " + ans + ".")[:n]
            out[b, :len(ids)] = ids
        return out


def _ctx(task, engine=None, model=None, tok=TOK, text=TEXT):
    ctx = TaskContext(model=model, tokenizer=tok, policies=kvpolicies.get("full"), task=task, text=text,
                      progress=False, chunk=64)
    if engine is not None:
        ctx.engine = lambda max_len: engine
    return ctx


def test_passkey_scoring_grid():
    eng = OracleEngine(TOK, r"The pass key is (\d{5})")
    res = R.passkey(_ctx({"name": "passkey", "lengths": [400, 800], "depths": [0.1, 0.9], "trials": 5,
                          "batch": 2}, eng))
    acc = {(g["length"], g["depth"]): g["accuracy"] for g in res.grid}
    assert acc == {(400, 0.1): 1.0, (400, 0.9): 0.0, (800, 0.1): 1.0, (800, 0.9): 0.0}
    assert all(g["trials"] == 5 for g in res.grid)
    lo, hi = ruler.wilson(5, 10)  # 10 trials per length, 5 found; 20 in all, 10 found
    lo2, hi2 = ruler.wilson(10, 20)
    assert res.metrics == pytest.approx({"accuracy": 0.5, "ci_low": lo2, "ci_high": hi2, "accuracy@400": 0.5,
                                         "ci_low@400": lo, "ci_high@400": hi, "accuracy@800": 0.5,
                                         "ci_low@800": lo, "ci_high@800": hi})
    assert (res.grid[0]["ci_low"], res.grid[0]["ci_high"]) == pytest.approx(ruler.wilson(5, 5))
    assert all(g["protocol"] == "query_aware" for g in res.grid)
    assert res.arrays["correct"].shape == (2, 2, 5)
    assert eng.calls == [(2, 400)] * 6 + [(2, 800)] * 6  # 5 trials in padded batches of 2, per cell


def test_niah_scoring_grid():
    eng = OracleEngine(TOK, r"The special magic number for \w+ is (\d{7})")
    res = R.niah(_ctx({"name": "niah", "lengths": [700], "depths": [0.0, 0.2, 1.0], "trials": 3}, eng))
    assert [g["accuracy"] for g in res.grid] == [1.0, 1.0, 0.0]
    assert res.metrics["accuracy@700"] == pytest.approx(2 / 3)


def test_multikey_scoring_uses_the_asked_needle():
    asked = {}

    class AskedOracle(OracleEngine):
        def generate(self, prompts, n, chunk=None):
            out = np.zeros((prompts.shape[0], n), np.int32)
            for b, row in enumerate(prompts):
                text = self.tok.decode(row)
                key = re.search(r"What is the special magic number for (\S+) mentioned", text).group(1)
                val = re.search(rf"numbers for {re.escape(key)} is: (\d{{7}})", text).group(1)
                asked[val] = True
                ids = self.tok.encode(" " + val)[:n]
                out[b, :len(ids)] = ids
            return out

    res = R.multikey(_ctx({"name": "multikey", "lengths": [800, 1000], "n_keys": 3, "trials": 4}, AskedOracle(TOK, "")))
    assert res.metrics["accuracy"] == 1.0 and len(asked) == 8
    assert res.arrays["depth"].shape == (2, 4)


def test_passkey_through_a_real_engine():
    """A tiny random byte-level Llama through the real Engine: shapes, padding and chunking work
    and a random model does not find the key."""
    cfg = LlamaConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
    res = R.passkey(_ctx({"name": "passkey", "lengths": [400], "depths": [0.5], "trials": 3, "batch": 2},
                         model=Llama(cfg)))
    assert [g["trials"] for g in res.grid] == [3]
    assert res.metrics["accuracy"] == 0.0


def test_query_agnostic_niah_feeds_the_question_after_the_compressed_haystack():
    """protocol=query_agnostic: the engine prefills and compresses the prompt up to the haystack's
    end, then answers after the question (recorded in every cell)."""
    calls = []

    class Staged:
        def prompt(self, tokens, chunk=None):
            calls.append(("prompt", TOK.decode(tokens[0])))
            return tokens

        def compress(self, state):
            calls.append(("compress",))
            return state

        def continue_generate(self, state, tokens, n, chunk=None):
            calls.append(("question", TOK.decode(tokens[0])))
            ans = re.search(r"The special magic number for \w+ is (\d{7})", TOK.decode(state[0])).group(1)
            return np.array([TOK.encode(" " + ans)[:n]] * state.shape[0], np.int32)

    res = R.niah(_ctx({"name": "niah", "lengths": [700], "depths": [0.5], "trials": 2, "batch": 1,
                       "protocol": "query_agnostic"}, Staged()))
    assert res.metrics["accuracy"] == 1.0 and res.grid[0]["protocol"] == "query_agnostic"
    assert [c[0] for c in calls] == ["prompt", "compress", "question"] * 2
    assert "What is the special magic number" not in calls[0][1]
    assert calls[2][1].startswith("\n\nWhat is the special magic number")


def test_text_tasks_need_a_tokenizer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        R.passkey(_ctx({"name": "passkey"}, tok=None))


@pytest.mark.slow
def test_smollm2_passkey_full_vs_window():
    """SmolLM2-135M-Instruct finds a 512-token passkey at depth 0.5 with the full cache, not with
    a 64-token window (the key is ~250 tokens before the question)."""
    from models.loading import load_default_model

    model, tok = load_default_model()
    task = {"name": "passkey", "lengths": [512], "depths": [0.5], "trials": 2}
    full = R.passkey(TaskContext(model, tok, kvpolicies.get("full"), task, progress=False))
    win = R.passkey(TaskContext(model, tok, kvpolicies.get("window", window=64), task, progress=False))
    assert full.metrics["accuracy"] == 1.0
    assert win.metrics["accuracy"] == 0.0
