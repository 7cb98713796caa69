"""RULER's 13 tasks as kvpress's leaderboard runs them (evals/ruler13.py), for the SmolLM2 and
Qwen2.5 tokenizers at 4,096 tokens: RULER's template strings (written out here from
NVIDIA/RULER scripts/data/synthetic/constants.py and niah.py's singular rewrite), exact lengths,
needles and haystacks as synthetic.yaml configures them, the answers recomputed from the text
(vt's chain followed, cwe / fwe words recounted), and RULER's metrics on hand-computed cases."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from evals import retrieval as R
from evals import ruler
from evals.data import paul_graham

LENGTH = 4096
GEN = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate (kvpress's max_new_tokens)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER's templates: (user text with {context}, answer prefix), the singular rewrite written out
NIAH_ONE = ("A special magic {t} is hidden within the following text. Make sure to memorize it. I will quiz you "
            "about the {t} afterwards.\n{context}\nWhat is the special magic {t} for {query} mentioned in the "
            "provided text? ", "The special magic {t} for {query} mentioned in the provided text is")
NIAH_ALL = ("Some special magic {t} are hidden within the following text. Make sure to memorize it. I will quiz "
            "you about the {t} afterwards.\n{context}\nWhat are all the special magic {t} for {query} mentioned in "
            "the provided text? ", "The special magic {t} for {query} mentioned in the provided text are")
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
      "Question: Find all variables that are assigned the value {query} in the text above. ",
      "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned the "
      "value {query}, they are: ")
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list? ",
       "Answer: The top 10 words that appear most often in the list are:")
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
       "What are the three most frequently appeared words in the above coded text? ",
       "Answer: According to the coded text above, the three most frequently appeared words are:")
WORD, NUMBER = r"[a-z]+-[a-z]+", r"\d{7}"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
# synthetic.yaml: (haystack, key pattern, value kind, keys, values per key, keys asked)
NIAH = {"niah_single_1": ("noise", WORD, "numbers", 1, 1, 1), "niah_single_2": ("essay", WORD, "numbers", 1, 1, 1),
        "niah_single_3": ("essay", WORD, "uuids", 1, 1, 1), "niah_multikey_1": ("essay", WORD, "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", WORD, "numbers", 1, 1, 1), "niah_multikey_3": ("needle", UUID, "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", WORD, "numbers", 1, 4, 1), "niah_multiquery": ("essay", WORD, "numbers", 4, 1, 4)}


@pytest.fixture(scope="module", params=["smollm2", "qwen", "gemma3"])
def made(request):
    """(tokenizer, {task: two samples at 4096}) for the SmolLM2 / Qwen2.5 / Gemma 3 tokenizer."""
    from evals import zoo

    tok = zoo.load_tokenizer({"name": request.param, "dtype": "float32"})
    return tok, {name: ruler.samples(ruler.leaderboard_task(name, LENGTH, 2), tok, None, LENGTH, 0)
                 for name in ruler.AVAILABLE}


def _turn(tok, content: str) -> str:
    """The user turn `content` as the prompt is built: in the chat template with the generation
    header, or, for a tokenizer without one (Gemma 3 270M's GGUF), the content and a newline."""
    if tok.chat_template is None:
        return content + "\n"
    return tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _parts(tok, sample, template: tuple[str, str], **fields) -> str:
    """The context of a sample, after checking that the prompt is RULER's template (with these
    fields) in the chat template, the answer prefix after the assistant header, and that the
    question starts at `split`."""
    user, prefix = template
    before, after = user.format(context="\x00", **fields).split("\x00")
    head, tail = _turn(tok, before + "\x00" + after).split("\x00")
    text = tok.decode(list(map(int, sample.tokens)))
    tail += prefix.format(**fields)
    assert text.startswith(head) and text.endswith(tail), (text[:300], text[-300:])
    question = after.lstrip("\n")
    assert tok.decode(list(map(int, sample.tokens[sample.split:]))) == tail[len(after) - len(question):]
    return text[len(head):len(text) - len(tail)] + after[:len(after) - len(question)]


def test_the_api_names_rulers_tasks_with_its_generation_lengths_and_metrics():
    assert ruler.LEADERBOARD_TASKS == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                       "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
                                       "vt", "cwe", "fwe", "qa_1", "qa_2")
    assert ruler.AVAILABLE == ruler.LEADERBOARD_TASKS[:11] and set(ruler.MISSING) == {"qa_1", "qa_2"}
    for name in ruler.AVAILABLE:
        cfg = ruler.leaderboard_task(name, 4096, 3)
        assert cfg == ruler.check(cfg)  # what ruler.check returns, and accepts again
        assert (cfg["lengths"], cfg["trials"], cfg["gen"], cfg["metric"]) == \
            ([4096], 3, GEN[name.split("_")[0]], "string_match_all")
    assert ruler.check({"name": "vt", "gen": 16, "protocol": "query_aware"})["gen"] == 16
    with pytest.raises(ValueError, match="SQuAD"):
        ruler.leaderboard_task("qa_1")
    with pytest.raises(ValueError, match="HotpotQA"):
        ruler.check({"name": "qa_2"})
    with pytest.raises(ValueError, match="unknown key"):
        ruler.check({"name": "niah_single_1", "haystack": "pg"})  # RULER's arguments are fixed
    with pytest.raises(ValueError, match="string_match_all"):
        ruler.check({"name": "cwe", "metric": "string_match_part"})


def test_rulers_metrics_on_hand_computed_cases():
    # RULER (scripts/eval/synthetic/constants.py): string_match_all = mean over samples of the fraction
    # of references found (case-insensitive substring); string_match_part = 1 if any is found; x 100
    preds = ["The numbers are 1234567 and 7654321.", "nothing here", "KZP, yrh and GNJ"]
    refs = [["1234567", "7654321", "1111111"], ["1"], ["kzp", "YRH", "gnj", "DFX"]]
    per = [ruler.score("niah_multivalue", p, r) for p, r in zip(preds, refs)]
    assert per == pytest.approx([2 / 3, 0.0, 3 / 4])
    assert round(100 * sum(per) / 3, 2) == 47.22  # (66.67 + 0 + 75) / 3
    assert ruler.score(ruler.leaderboard_task("vt"), "kzp\x00yrh", ["KZP", "YRH"]) == 1.0  # control chars
    assert ruler.score("qa_1", "It was in Paris, France.", ["London", "paris"]) == 1.0  # any reference: part
    assert ruler.score("qa_2", "Rome", ["London", "Paris"]) == 0.0
    assert ruler.score("qa_1", "London and Paris", ["London", "Paris", "Rome"]) == 1.0  # all would give 2/3
    assert ruler.score("ruler_niah_single", "12345678", ["1234567"]) == 1.0  # the RULER-style tasks: all


# kvpress's evaluation/benchmarks/ruler/create_huggingface_dataset.py: where its question starts (the
# last match) and where its answer prefix starts
QUESTION = {"niah": r"What (?:is|are all) the special magic", "vt": r"Question: Find all variables that are assigned "
            r"the value", "cwe": r"Question: What are the 10 most common words in the above list\?",
            "fwe": r"Question: Do not provide any explanation\."}
ANSWER = {"niah": r"The special magic", "vt": r"Answer:", "cwe": r"Answer:", "fwe": r"Answer:"}


def test_every_task_has_the_exact_length_and_rulers_template(made):
    tok, out = made
    for name, ss in out.items():
        for s in ss:
            assert len(s.tokens) == LENGTH - GEN[name.split("_")[0]], name  # prompt + answer = 4096
            q = tok.decode(list(map(int, s.tokens[s.split:])))
            text = tok.decode(list(map(int, s.tokens)))
            kind = name.split("_")[0]
            assert list(re.finditer(QUESTION[kind], text))[-1].start() == len(text) - len(q), name  # kvpress's split
            answer = q[re.search(ANSWER[kind], q).start():]  # kvpress's answer prefix: after the assistant header
            header = _turn(tok, "\x00").split("\x00")[1]  # after the user's content: the assistant header, or "\n"
            assert "\n" not in answer and q[:-len(answer)].endswith(header), name
            if name in NIAH:
                one = NIAH[name][4] * NIAH[name][5] == 1
                t = NIAH[name][2][:-1] if one else NIAH[name][2]
                query = re.search(r"magic \w+ for (.*) mentioned", q).group(1)
                _parts(tok, s, NIAH_ONE if one else NIAH_ALL, t=t, query=query)
            elif name == "vt":
                _parts(tok, s, VT, query=re.search(r"value (\d{5}) in", q).group(1), n=5)
            else:
                _parts(tok, s, CWE if name == "cwe" else FWE)


def _needles(context: str, kind: str) -> list[tuple[str, str]]:
    return re.findall(rf"One of the special magic {kind} for (\S+) is: (\S+)\.", context)


def test_niah_needles_keys_values_and_haystacks_as_rulers_config(made):
    tok, out = made
    essay = re.sub(r"\s+", " ", paul_graham())
    for name, (hay, key_re, kind, n_keys, n_values, n_asked) in NIAH.items():
        for s in out[name]:
            q = tok.decode(list(map(int, s.tokens[s.split:])))
            one = n_values * n_asked == 1
            query = re.search(r"magic \w+ for (.*) mentioned", q).group(1)
            asked = query.replace(", and ", ", ").split(", ")
            context = _parts(tok, s, NIAH_ONE if one else NIAH_ALL, t=kind[:-1] if one else kind, query=query)
            found = _needles(context, kind)
            real = [(k, v) for k, v in found if k in asked or (n_keys > 1 and n_asked == 1 and hay == "essay")]
            val_re = UUID if kind == "uuids" else NUMBER
            assert len(asked) == n_asked and all(re.fullmatch(key_re, k) for k in asked), name
            assert all(re.fullmatch(val_re, v) and re.fullmatch(key_re, k) for k, v in found), name
            assert sorted(v for k, v in found if k in asked) == sorted(s.refs), name  # every asked value, once
            assert len(s.refs) == n_asked * n_values and len(s.needle_starts) == n_keys * n_values, name
            if hay == "essay":
                assert len(found) == len(real) == n_keys * n_values  # 4 distinct keys (multikey_1 / multiquery)
                assert len({k for k, _ in found}) == n_keys
                rest = context
                for k, v in found:
                    rest = rest.replace(f" One of the special magic {kind} for {k} is: {v}.", "")
                assert rest.strip("\n")[1:] in essay  # the essays, whitespace collapsed, needles removed
            elif hay == "noise":
                lines = context.split("\n")[:-1]
                assert (NOISE + "\n").endswith(lines[0] + "\n") and len(lines) > 100  # a partial line first
                assert sorted(lines[1:]).count(NOISE) == len(lines) - 2  # all noise but the needle's line
            else:  # a haystack of needles, one per line, none with the asked key
                lines = context.split("\n")[1:-1]
                assert len(lines) > 30 and len(found) >= len(lines)
                assert [k for k, _ in found].count(asked[0]) == 1


def test_needles_sit_at_their_stated_depths(made):
    tok, out = made
    for name, (hay, *_rest) in NIAH.items():
        for s in out[name]:
            text = [tok.decode([int(t)]) for t in s.tokens]
            for start, depth in zip(s.needle_starts, s.depths):
                at = tok.decode(list(map(int, s.tokens[start:start + 12])))
                assert at.lstrip(" ").startswith("One of the special magic"), (name, at)
                if hay == "essay":  # RULER's depth grid, snapped to a sentence end within SNAP tokens
                    fill = s.split - len(_head_ids(tok, s))
                    grid = np.round(np.linspace(0, 100, num=40)) / 100  # niah.py: whole percentages
                    assert np.min(np.abs(grid - depth)) <= (R.SNAP + 1) / (fill - 200)
                    assert text[start - 1].rstrip(" ").endswith((".", "!", "?", "\n", '."', '?"'))
                    head = len(_head_ids(tok, s))
                    needle = r" One of the special magic \w+ for \S+ is: \S+\."
                    essay = re.sub(needle, "", tok.decode(list(map(int, s.tokens[head:s.split]))))
                    before = re.sub(needle, "", tok.decode(list(map(int, s.tokens[head:start]))))
                    assert abs(len(before) / len(essay) - depth) < 0.01  # the essay text before it
                else:  # a whole line: after a newline, at a depth of whole lines
                    assert text[start - 1].endswith("\n")
                    head = len(_head_ids(tok, s))
                    hay_lines = [x for x in tok.decode(list(map(int, s.tokens[head:s.split]))).split("\n")
                                 if not any(r in x for r in s.refs)]  # RULER's needles taken out
                    before = tok.decode(list(map(int, s.tokens[head:start]))).split("\n")
                    before = sum(len(x) for x in before if not any(r in x for r in s.refs))
                    assert 0 < depth < 1 and abs(before / sum(map(len, hay_lines)) - depth) < 0.02


def _head_ids(tok, s) -> list[int]:
    """The ids up to the end of the instruction line (the context starts after it)."""
    text = ""
    for i, t in enumerate(s.tokens):
        text += tok.decode([int(t)])
        if "afterwards.\n" in text:
            return list(s.tokens[:i + 1])
    raise AssertionError("no instruction")


def _chain(text: str) -> tuple[str, list[str]]:
    """(value, the variables holding it) recomputed from "VAR X = 12345" / "VAR Y = VAR X" lines."""
    (first, value), = re.findall(r"^VAR ([A-Z]+) = (\d+)$", text, re.M)
    held, links = [first], dict(re.findall(r"^VAR ([A-Z]+) = VAR ([A-Z]+) $", text, re.M))
    while any(src == held[-1] for src in links.values()):
        held.append(next(dst for dst, src in links.items() if src == held[-1]))
    return value, held


def test_vt_chain_recomputed_from_the_text_and_rulers_solved_example(made):
    tok, out = made
    for s in out["vt"]:
        q = tok.decode(list(map(int, s.tokens[s.split:])))
        value = re.search(r"value (\d{5}) in", q).group(1)
        instruction = VT[0].split("{context}")[0]
        context = _parts(tok, s, VT, query=value, n=5)  # RULER puts its solved example before the template
        example, main = context.split("\n\n" + instruction)
        example = instruction + example
        assert _chain(main) == (value, list(s.refs)) and all(re.fullmatch(r"[A-Z]{5}", v) for v in s.refs)
        lines = main.split("\n")[1:-1]
        assert sum(x == NOISE for x in lines) == len(lines) - 5  # 1 chain of 4 hops among the noise lines
        # the example: RULER's template and prefix with its own answer, 3-letter names, <= 500 tokens
        ex_value, ex_vars = _chain(example)
        assert len(ex_vars) == 5 and all(len(v) == 3 for v in ex_vars)
        assert example.endswith(VT[1].format(n=5, query=ex_value) + " " + " ".join(ex_vars))
        assert example.startswith("Memorize and track") and len(tok.encode(example.rsplit(" Answer:", 1)[0])) < 500


def test_cwe_and_fwe_answers_are_the_recounted_most_frequent_words(made):
    tok, out = made
    for s in out["cwe"]:
        instruction = CWE[0].split("{context}")[0]
        example, main = _parts(tok, s, CWE).split("\n" + instruction)  # RULER's solved example first
        example = instruction + example
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", main))
        top = [w for w, c in counts.items() if c == 30]
        assert sorted(top) == sorted(s.refs) and len(top) == 10  # 10 words x 30
        assert set(counts.values()) == {30, 3} and len(counts) > 40  # the others x 3, as many as fit
        numbers = [int(x) for x in re.findall(r"(\d+)\. [a-z]+", main)]
        assert numbers == list(range(1, len(numbers) + 1))
        ex_list, ex_answer = example.split("Question: What are the 10 most common words")
        ex_counts = Counter(re.findall(r"\d+\. ([a-z]+)", ex_list.split("most often.\n", 1)[1]))
        assert sorted(ex_counts.values()) == [3] * 30 + [10] * 10  # RULER's example: 40 words, 10 x 10, 30 x 3
        assert sorted(re.findall(r"\d+\. ([a-z]+)", ex_answer)) == sorted(w for w, c in ex_counts.items() if c == 10)
    for s in out["fwe"]:
        words = _parts(tok, s, FWE).split()
        counts = Counter(words)
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == "..." and sorted(ranked[1:4]) == sorted(s.refs)
        assert counts[ranked[3]] > counts[ranked[4]]  # no tie at the cut
        assert len(counts) <= (LENGTH - 50) // 50 and all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
        n = counts["..."]  # Zipf, alpha 2: rank k holds int(N k^-2 / zeta(2)); rank 1 has int(N / zeta(2))
        assert counts[s.refs[0]] in (n // 4 - 1, n // 4, n // 4 + 1)


def test_samples_are_deterministic_and_independent_of_how_many_are_asked():
    from evals import zoo

    tok = zoo.load_tokenizer({"name": "smollm2", "dtype": "float32"})
    for name in ("niah_multikey_2", "vt", "fwe"):
        three = ruler.samples(ruler.leaderboard_task(name, 2048, 3), tok, None, 2048, 5)
        one = ruler.samples(ruler.leaderboard_task(name, 2048, 1), tok, None, 2048, 5)
        other = ruler.samples(ruler.leaderboard_task(name, 2048, 1), tok, None, 2048, 6)
        assert np.array_equal(one[0].tokens, three[0].tokens) and one[0].refs == three[0].refs
        assert len({s.refs for s in three}) == 3 and other[0].refs != one[0].refs
    cfg = ruler.leaderboard_task("niah_single_2", 200)
    with pytest.raises(ValueError, match="too short"):
        ruler.check_prompts(cfg, tok, 0)  # the template does not fit: raised before any model loads


def test_ruler_run_scores_rulers_task_with_its_metric():
    """evals.ruler.run on one of RULER's names: its samples, answers cut at EOS, RULER's metric."""
    import kvpolicies
    from evals.common import TaskContext
    from models.config import LlamaConfig
    from models.llama import Llama
    from tests.refs.texts import TOK  # the byte tokenizer with a chat template

    task = {"name": "fwe", "lengths": [700], "trials": 2, "batch": 2, "gen": 3}
    assert ruler.extent(task) == (697, 3, 2) and ruler.extent({"name": "vt"}) == (4066, 30, 1)
    model = Llama(LlamaConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32))
    ctx = TaskContext(model=model, tokenizer=TOK, policies=kvpolicies.get("full"), text=None, progress=False,
                      chunk=700, task=task)
    res = ruler.run(ctx)
    ss = ruler.samples(ruler.check(task), TOK, None, 700, ctx.seed)
    want = [ruler.score("fwe", t, s.refs) for t, s in zip(res.arrays["outputs"][0], ss)]
    assert res.arrays["score"].tolist() == [want] and res.grid[0]["protocol"] == "query_agnostic"
    assert res.metrics["accuracy"] == pytest.approx(np.mean(want)) and res.metrics["prefills"] == 1


QA = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
      "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
      "Only give me the answer and do not output any other words.\n\nQuestion: {query} ", "Answer:")


def _qa_files(tmp_path):
    """Tiny files in RULER's formats: SQuAD 2.0 (articles of paragraphs, unanswerable questions
    flagged) and HotpotQA's distractor setting (each question with its titled paragraphs)."""
    import json

    rng = np.random.default_rng(0)

    def para(a, p):
        return f"Article {a} paragraph {p} says that " + " ".join(rng.choice(["red", "sea", "tall", "old"], 30)) + "."
    squad = {"data": [{"title": f"A{a}", "paragraphs": [
        {"context": para(a, p), "qas": [
            {"question": f"What does article {a} paragraph {p} say?", "is_impossible": False,
             "answers": [{"text": f"answer {a}.{p}"}, {"text": f"ans {a}-{p}"}]},
            {"question": "Unanswerable?", "is_impossible": True, "answers": []}]} for p in range(4)]}
        for a in range(12)]}
    hotpot = [{"question": f"Which {q}?", "answer": f"yes {q}",
               "context": [[f"Title {q}-{c}", [f"Sentence one of {q}-{c}. ", "Sentence two."]] for c in range(3)]}
              for q in range(20)]
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    (tmp_path / "hotpotqa.json").write_text(json.dumps(hotpot))
    return str(tmp_path / "squad.json"), str(tmp_path / "hotpotqa.json")


def test_qa_from_rulers_own_files_gold_among_distractors(tmp_path):
    from evals import zoo

    tok = zoo.load_tokenizer({"name": "smollm2", "dtype": "float32"})
    squad, hotpot = _qa_files(tmp_path)
    for name, path in (("qa_1", squad), ("qa_2", hotpot)):
        cfg = ruler.leaderboard_task(name, 1024, 3, qa_file=path)
        assert (cfg["gen"], cfg["metric"]) == (32, "string_match_part")
        for i, s in enumerate(ruler.samples(cfg, tok, None, 1024, 0)):
            assert len(s.tokens) == 1024 - 32
            q = tok.decode(list(map(int, s.tokens[s.split:])))
            query = re.search(r"Question: (.*) <\|im_end\|>", q).group(1)
            context = _parts(tok, s, QA, query=query).rstrip("\n")
            docs = re.split(r"\n+Document \d+:\n", "\n" + context)[1:]
            assert re.findall(r"Document (\d+):", context) == [str(j + 1) for j in range(len(docs))]
            if name == "qa_1":  # RULER's question i: its paragraph, then its article's, then others
                a, p = divmod(i, 4)
                assert query == f"What does article {a} paragraph {p} say?" and s.refs == (f"answer {a}.{p}",
                                                                                          f"ans {a}-{p}")
                assert sum(d.startswith(f"Article {a} paragraph {p} says") for d in docs) == 1
                assert sum(d.startswith(f"Article {a} ") for d in docs) == 4 and len(docs) > 6
                assert len(set(docs)) == len(docs)
            else:  # every paragraph given with the question, titled, among the others
                assert query == f"Which {i}?" and s.refs == (f"yes {i}",)
                assert {f"Title {i}-{c}\nSentence one of {i}-{c}. Sentence two." for c in range(3)} <= set(docs)
                assert len(docs) > 10
    assert ruler.score("qa_1", "It is ans 0-1, I think", ("answer 0.1", "ans 0-1")) == 1.0
    with pytest.raises(ValueError, match="not RULER's squad file"):
        ruler.samples(ruler.leaderboard_task("qa_1", 1024, 1, qa_file=hotpot), tok, None, 1024, 0)
    with pytest.raises(ValueError, match="no such file"):
        ruler.leaderboard_task("qa_2", qa_file=str(tmp_path / "nope.json"))
