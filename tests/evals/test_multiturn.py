"""The multi-turn shared-context task (evals/multiturn.py) and the shared-prefix benchmark
(benchmarks/shared_prefix.py).

References: the conversation through `full` against greedy generation from the whole transcript
prefilled at once (`Engine.generate`), built turn by turn here from the template's own rendering;
the benchmark's counts against their closed forms."""

from __future__ import annotations

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


def test_next_turn_closes_the_answer_and_opens_a_user_turn(tok_and_model):
    from evals.multiturn import next_turn

    tok, _ = tok_and_model
    text = tok.decode(next_turn(tok, "What is x?", "x is"))
    whole = tok.apply_chat_template([{"role": "user", "content": "c"}, {"role": "assistant", "content": "A"},
                                     {"role": "user", "content": "What is x?"}], add_generation_prompt=True)
    assert whole.endswith(text.removesuffix("x is")) and text.endswith("x is")
    assert text.index("What is x?") > text.index("user")


@pytest.mark.parametrize("mode", ["once", "every"])
def test_full_conversation_equals_generating_from_the_whole_transcript(tok_and_model, mode):
    """Through `full`, each turn's answer is what greedy decoding from the transcript so far
    (context, then every earlier question and cut answer) prefilled at once gives."""
    from evals.multiturn import conversation, cut_answer
    from models.engine import Engine

    tok, model = tok_and_model
    rng = np.random.default_rng(0)
    context = rng.integers(0, 49152, 60).astype(np.int32)
    turns = [(np.asarray(tok.encode(f" question {i}?"), np.int32), "x") for i in range(3)]
    eng = Engine(model, kvpolicies.get("full"), max_len=160)
    texts, at, held = conversation(eng, tok, context, turns, gen=5, mode=mode, chunk=16)
    assert all(h == 1.0 for h in held if not np.isnan(h))  # full holds every context token
    transcript = context
    ref = Engine(model, kvpolicies.get("full"), max_len=160)
    for (q, _), text, length in zip(turns, texts, at):
        transcript = np.concatenate([transcript, q])
        assert length == transcript.size
        want = tok.decode(list(map(int, ref.generate(transcript[None], 5)[0])))
        assert text == want
        transcript = np.concatenate([transcript, np.asarray(tok.encode(cut_answer(text)), np.int32)])


def test_a_compressor_runs_both_modes_and_compresses_once_or_every_turn(tok_and_model):
    from evals.multiturn import conversation
    from models.engine import Engine

    tok, model = tok_and_model
    context = np.random.default_rng(1).integers(0, 49152, 60).astype(np.int32)
    turns = [(np.asarray(tok.encode(f" question {i}?"), np.int32), "x") for i in range(3)]
    for mode, compressions in (("once", 1), ("every", 3)):
        eng = Engine(model, kvpolicies.get("snapkv", budget=16, obs_window=4, max_new=64), max_len=160)
        conversation(eng, tok, context, turns, gen=4, mode=mode, chunk=16)
        assert eng.prompts_compressed == compressions and eng.prefills == 1


def test_value_held_is_the_fraction_of_the_answers_tokens_each_layer_and_head_holds(tok_and_model):
    """value_positions finds the tokens that spell a value in a context; held_fraction averages,
    over layers and kv heads, the fraction of them `kept_positions` lists: 1 for full, and for a
    window that holds only the value's last tokens, the fraction in the window."""
    from evals.multiturn import held_fraction, value_positions
    from models.engine import Engine

    tok, model = tok_and_model
    words = np.asarray(tok.encode("The special magic number is 4008911 and that is all we know today."), np.int32)
    pieces = [tok.decode([int(i)]) for i in words]
    pos = value_positions(pieces, "4008911")
    assert "".join(pieces[pos[0]:pos[-1] + 1]).strip() == "4008911"
    assert value_positions(pieces, "1234567").size == 0
    filler = np.random.default_rng(3).integers(0, 49152, 40).astype(np.int32)
    ctx = np.concatenate([filler, words])
    at = pos + filler.size
    full = Engine(model, kvpolicies.get("full"), max_len=128)
    assert held_fraction(full, full.compress(full.prompt(ctx[None])), at) == 1.0
    keep = ctx.size - int(at[len(at) // 2])  # a window reaching back to the middle of the value
    win = Engine(model, kvpolicies.get("window", window=keep), max_len=128)
    state = win.compress(win.prompt(ctx[None]))
    assert held_fraction(win, state, at) == pytest.approx(np.mean(at >= ctx.size - keep))
    assert 0 < held_fraction(win, state, at) < 1
    assert np.isnan(held_fraction(full, full.compress(full.prompt(ctx[None])), np.zeros(0, int)))


def test_check_rejects_bad_keys():
    from evals.multiturn import check

    assert check({"name": "multiturn"})["mode"] == "once"
    for bad, match in (({"mode": "never"}, "mode"), ({"turnz": 2}, "unknown"), ({"turns": 0}, "turns")):
        with pytest.raises(ValueError, match=match):
            check({"name": "multiturn", **bad})


def test_shared_prefix_benchmark_counts(tmp_path):
    """Dry run: prefill tokens = prefix + M x suffix (saved (M - 1) x prefix); the shared pool holds
    the prefix's full blocks once and each row's own blocks; every row's logits equal its request
    prefilled alone."""
    import json

    from benchmarks import shared_prefix as sp

    rows = sp.main(["--dry-run", "--requests", "1,3", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == rows
    for r in rows:
        m, p, s, blk = r["requests"], r["prefix"], r["suffix"], r["block"]
        assert r["prefill_tokens_shared"] == p + m * s and r["prefill_tokens_saved"] == (m - 1) * p
        assert r["blocks_shared"] == p // blk + m * -(-(p + s - (p // blk) * blk) // blk)
        assert r["blocks_separate"] == m * -(-(p + s) // blk)
        assert r["bytes_shared"] * r["blocks_separate"] == r["bytes_separate_paged"] * r["blocks_shared"]
        assert r["max_logit_diff_vs_alone"] < 1e-5
    assert rows[0]["bytes_shared"] == rows[0]["bytes_separate_paged"]


def test_shuffled_order_asks_the_same_needles_of_the_same_contexts_in_other_orders(tok_and_model):
    from evals import ruler
    from evals.multiturn import asked, samples

    tok, _ = tok_and_model
    hay = ruler.haystack(tok, "filler", None, 600)
    depth = samples(tok, hay, 512, 4, 0, 4, "numbers")
    shuffled = samples(tok, hay, 512, 4, 0, 4, "numbers", "shuffled")
    orders = []
    for (ctx_d, turns_d), (ctx_s, turns_s) in zip(depth, shuffled, strict=True):
        assert np.array_equal(ctx_d, ctx_s)  # the same contexts: only the order of the questions moves
        values_d = [v for _, v in turns_d]
        assert sorted(values_d) == sorted(v for _, v in turns_s)
        order = [values_d.index(v) for _, v in turns_s]  # turn -> the needle's depth rank
        # the needle's value sits in the context at its depth: depth order = order of first occurrence
        text = tok.decode(ctx_d.tolist())
        assert [text.index(v) for v in values_d] == sorted(text.index(v) for v in values_d)
        orders.append(order)
    assert any(o != sorted(o) for o in orders) and len({tuple(o) for o in orders}) > 1
    assert asked(0, 512, 4, 4, "shuffled").tolist() == orders  # the order `samples` asked in
    assert asked(0, 512, 4, 4, "depth").tolist() == [[0, 1, 2, 3]] * 4


def test_accuracy_per_depth_rank_regroups_the_turns_by_the_needle_each_asked(tmp_path, capsys):
    """per_turn_and_depth / depth_table / `python -m evals.multiturn`: a turn's score counts for the
    depth rank of the needle it asked for (hand-placed scores)."""
    from evals import results as R
    from evals.multiturn import asked, by_depth, main, per_turn_and_depth

    score = np.array([[[1, 0, 0, 1], [0, 1, 1, 1], [1, 1, 0, 0]]], float)  # [lengths, trials, turns]
    ranks = np.array([[[3, 0, 1, 2], [0, 1, 2, 3], [2, 3, 0, 1]]])
    # trial 0: turn 0 asked depth 3 (1), turn 3 depth 2 (1); trial 2: turns 0, 1 asked depths 2, 3
    assert by_depth(score, ranks).tolist() == [[[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]]]
    m = per_turn_and_depth(score, ranks)
    assert [m[f"accuracy_t{i}"] for i in range(4)] == pytest.approx([2 / 3, 2 / 3, 1 / 3, 2 / 3])
    assert [m[f"accuracy_d{i}"] for i in range(4)] == pytest.approx([0, 1 / 3, 1, 1])
    assert m["ci_low_d3"] < 1 == m["accuracy_d3"]
    # a saved row: its ranks recomputed from its task's seed and order
    path = tmp_path / "mt.jsonl"
    task = {"name": "multiturn", "lengths": [512], "trials": 3, "turns": 4, "order": "shuffled"}
    row = {"key": "k1", "policy": {"name": "sink"}, "config": {"task": task, "seed": 0}}
    row["arrays"] = {"score": R.save_array(path, "k1", "score", score)}
    R.append(path, row)
    # a second row, every mode, with the value's tokens held per (length, trial, turn)
    held = np.array([[[1.0, 0.5, 0.25, 0.0], [0.5, 0.2, 0.75, 0.3], [0.0, 0.5, 0.5, 0.6]]])
    row2 = {"key": "k2", "policy": {"name": "kvzap"}, "config": {"task": task | {"mode": "every"}, "seed": 0}}
    row2["arrays"] = {"score": R.save_array(path, "k2", "score", score),
                      "value_held": R.save_array(path, "k2", "value_held", held)}
    R.append(path, row2)
    main([str(path)])
    out = capsys.readouterr().out.strip().splitlines()
    want = per_turn_and_depth(score, asked(0, 512, 3, 4, "shuffled")[None])
    assert out[0].startswith("| policy | mode | order | turn 0") and out[0].endswith("| value held, per turn |")
    assert out[2].startswith("| sink | once | shuffled |") and out[3].startswith("| kvzap | every | shuffled |")
    acc = [f"{want[f'accuracy_{k}{i}']:.2f}" for k in "td" for i in range(4)]
    cells = [c.strip() for c in out[2].strip("|").split("|")][3:]
    assert cells == acc + [""]  # no value_held saved: blank
    cells = [c.strip() for c in out[3].strip("|").split("|")][3:]
    assert cells == acc + ["0.50 / 0.40 / 0.50 / 0.30"]  # each turn's mean over the 3 trials


def test_check_takes_an_order_and_its_default_keeps_the_run_keys():
    from evals import config as C
    from evals import results as R
    from evals.multiturn import check
    from evals.run import run_key

    assert check({"name": "multiturn"})["order"] == "depth"
    assert check({"name": "multiturn", "order": "shuffled"})["order"] == "shuffled"
    with pytest.raises(ValueError, match="order"):
        check({"name": "multiturn", "order": "random"})
    small = ["task=multiturn", "task.lengths=[64]", "task.turns=1", "task.gen=8", "policy=full", "model=tiny_random"]
    conf = C.validate(C.compose(small))
    pol, _ = C.resolve_policy(conf)
    keyed = {k: conf[k] for k in ("model", "data", "policy", "task", "chunk", "seed")}
    keyed["task"] = {k: v for k, v in conf["task"].items() if k not in ("extrapolate", "order")}
    keyed["policy"] = R.policy_record(pol)
    assert run_key(conf, pol) == R.config_key(keyed)  # rows run before `order` existed keep their keys
    shuffled = C.validate(C.compose([*small, "task.order=shuffled"]))
    assert run_key(shuffled, pol) != run_key(conf, pol)


def test_answers_table_sets_each_answer_beside_the_value_its_turn_asked(tmp_path, capsys):
    """`python -m evals.multiturn RESULTS --answers`: the references rebuilt from a saved row's
    config are the values `samples` asked, each answer is marked right, wrong, or wrong and
    ending like an earlier answer of its conversation (`echoes`), with the value's tokens held."""
    from evals import results as R
    from evals import ruler, zoo
    from evals.multiturn import TURN_ROOM, echoes, main, samples

    assert echoes("7155328.", ["9209605.", "9755328."]) and not echoes("1493177.", ["3931053.", "5803276."])
    assert not echoes("53.", ["53."])  # shorter than 4 characters: no claim
    model = {"name": "smollm2", "dtype": "float32"}
    task = {"name": "multiturn", "lengths": [512], "trials": 2, "turns": 2, "haystack": "filler"}
    tok = zoo.load_tokenizer(model)
    refs = [[v for _, v in turns] for _, turns in samples(tok, ruler.haystack(tok, "filler", None, 512 + TURN_ROOM),
                                                          512, 2, 0, 2, "numbers")]
    outs = np.array([[[f" {refs[0][0]}.", f" 12{refs[0][0][-5:]}."], [" 1.", f" {refs[1][1]}.\nmore"]]])
    path = tmp_path / "mt.jsonl"
    row = {"key": "k1", "policy": {"name": "sink"}, "config": {"task": task, "seed": 0, "model": model}}
    row["arrays"] = {"outputs": R.save_array(path, "k1", "outputs", outs),
                     "value_held": R.save_array(path, "k1", "value_held", np.array([[[1.0, 0.5], [0.25, 0.0]]]))}
    R.append(path, row)
    main([str(path), "--answers"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 512")]
    assert lines[0] == (f"| 512 | 0 | {refs[0][0]}. ({refs[0][0]}: right, held 1.00) | "
                        f"12{refs[0][0][-5:]}. ({refs[0][1]}: wrong, echo, held 0.50) |")
    assert lines[1] == f"| 512 | 1 | 1. ({refs[1][0]}: wrong, held 0.25) | {refs[1][1]}. ({refs[1][1]}: right, held 0.00) |"
