"""The long-generation task (evals/longgen.py).

References: each generation against `Engine.generate` of the whole prompt through the same policy
(and through `full`, the reference), on a tiny random model with SmolLM2's tokenizer; the
agreement numbers against hand-counted arrays; the chain's value by re-applying its operations as
written."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvpolicies


@pytest.fixture(scope="module")
def tok_and_model():
    from evals import zoo
    from models.config import LlamaConfig
    from models.llama import Llama

    tok = zoo.load_tokenizer({"name": "smollm2", "dtype": "float32"})
    cfg = LlamaConfig(vocab_size=49152, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
    return tok, Llama(cfg)


def test_agreement_numbers_are_counted_over_full_s_span():
    from evals.longgen import compare

    stops = {9}
    ref = np.array([1, 2, 3, 4, 9, 7, 7, 7])  # full stops after 4 tokens: its span is 5 (the stop included)
    assert compare(ref.copy(), ref, stops) == {"prefix_tokens": 5, "prefix_frac": 1.0, "agreement": 1.0,
                                                "length": 4, "full_length": 4, "span": 5}
    got = np.array([1, 2, 3, 5, 9, 1, 1, 1])  # one difference at position 3, then the same stop
    assert compare(got, ref, stops) == {"prefix_tokens": 3, "prefix_frac": 0.6, "agreement": 0.8,
                                        "length": 4, "full_length": 4, "span": 5}
    got = np.array([0, 2, 3, 4, 5, 6, 7, 8])  # never stops: longer than full's answer
    r = compare(got, ref, stops)
    assert (r["prefix_tokens"], r["agreement"], r["length"]) == (0, 0.6, 8)
    r = compare(got, got, set())  # no stop id at all: the whole generation is the span
    assert (r["span"], r["prefix_frac"], r["length"]) == (8, 1.0, 8)


def test_chain_value_is_its_operations_applied():
    from evals.longgen import chain

    rng = np.random.default_rng(3)
    for steps in (1, 5, 40):
        start, ops, value = chain(rng, steps)
        v = start
        for op, k in re.findall(r"(Add|Subtract) (\d)\.", ops):
            v += int(k) if op == "Add" else -int(k)
            assert 0 <= v <= 99
        assert len(re.findall(r"(Add|Subtract)", ops)) == steps and v == value


def test_answer_is_read_from_the_first_answer_line_before_the_stop(tok_and_model):
    from evals.longgen import answer_ok, stop_ids

    tok, _ = tok_and_model
    stops = stop_ids(tok)
    assert tok.eos_id in stops and tok.encode("<|im_end|>")[0] in stops
    ids = lambda s: np.asarray(tok.encode(s), np.int32)  # noqa: E731
    assert answer_ok(tok, ids("Step 1: 12\nAnswer: 42\nAnswer: 7"), stops, 42) == 1.0
    assert answer_ok(tok, ids("Step 1: 12\nAnswer: 7\nAnswer: 42"), stops, 42) == 0.0
    after_stop = np.concatenate([ids("Step 1: 12"), [tok.eos_id], ids("Answer: 42")])
    assert answer_ok(tok, after_stop, stops, 42) == 0.0


def test_prompts_have_their_length_and_end_with_the_problem(tok_and_model):
    from evals import ruler
    from evals.longgen import PREFIX, samples

    tok, _ = tok_and_model
    hay = ruler.haystack(tok, "pg", None, 400)
    out = samples(tok, hay, 300, 2, 0, 6)
    assert [p.size for p, _ in out] == [300, 300]
    for p, value in out:
        text = tok.decode(list(map(int, p)))
        assert "Problem: start with" in text[-600:] and text.endswith(PREFIX)
        assert f"Answer: {value}" not in text


@pytest.mark.parametrize("policy", ["full", "sink", "snapkv"])
def test_generations_equal_engine_generate_of_the_whole_prompt(tok_and_model, policy):
    """The run's ids are `Engine.generate` of each prompt under the policy (a prompt compressor:
    prompt, compress, generate), its `full_ids` those under `full`, and the metrics are
    `compare`'s means; through `full` itself the reference engine is the run's."""
    from evals import longgen
    from evals.common import TaskContext
    from models.engine import Engine

    tok, model = tok_and_model
    pol = {"full": kvpolicies.get("full"), "sink": kvpolicies.get("sink", n_sink=4, window=32),
           "snapkv": kvpolicies.get("snapkv", budget=48, obs_window=8, max_new=64)}[policy]
    task = {"name": "longgen", "lengths": [200], "trials": 2, "gen": 20, "steps": 4}
    ctx = TaskContext(model=model, tokenizer=tok, policies=pol, task=task, chunk=64, progress=False)
    res = longgen.run(ctx)
    prompts = longgen.samples(tok, longgen.ruler.haystack(tok, "pg", None, 200), 200, 2, 0, 4)
    for i, (p, _) in enumerate(prompts):
        eng = Engine(model, pol, max_len=220)
        if policy == "snapkv":
            want = eng.continue_generate(eng.compress(eng.prompt(p[None])), [], 20)[0]
        else:
            want = eng.generate(p[None], 20)[0]
        ref = Engine(model, kvpolicies.get("full"), max_len=220).generate(p[None], 20)[0]
        np.testing.assert_array_equal(res.arrays["ids"][0, i], want)
        np.testing.assert_array_equal(res.arrays["full_ids"][0, i], ref)
    cells = [longgen.compare(res.arrays["ids"][0, i], res.arrays["full_ids"][0, i], longgen.stop_ids(tok))
             for i in range(2)]
    assert res.metrics["agreement"] == pytest.approx(np.mean([c["agreement"] for c in cells]))
    assert res.metrics["prefix_tokens"] == pytest.approx(np.mean([c["prefix_tokens"] for c in cells]))
    assert res.metrics["contexts"] == 2 and res.grid[0]["trials"] == 2
    if policy == "full":
        assert res.metrics["agreement"] == 1.0 and res.metrics["prefix_frac"] == 1.0
        assert res.metrics["prefills"] <= 2  # the run's engine is the reference: no second generation
    again = longgen.run(ctx)  # full's generations are remembered per model and prompt
    np.testing.assert_array_equal(again.arrays["full_ids"], res.arrays["full_ids"])
    if policy == "full":
        assert again.metrics["prefills"] == 0


def test_check_rejects_bad_keys():
    from evals.longgen import check

    assert check({"name": "longgen"})["gen"] == 512
    for bad in ({"gen": 0}, {"haystack": "x"}, {"turns": 3}, {"lengths": []}):
        with pytest.raises(ValueError):
            check({"name": "longgen", **bad})
