"""RULER-style synthetic long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", github.com/NVIDIA/RULER, scripts/data/synthetic/),
the query-aware / query-agnostic protocols, and a multi-query task in the spirit of SCBench
(Li et al. 2024, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods").

Shapes: B batch (trials run together), T prompt tokens, n generated tokens.

Tasks (`ctx.task` keys; defaults are the task configs in configs/task/ruler_*.yaml):
  ruler_niah_single     one needle "One of the special magic numbers for KEY is: VALUE." in the
                        Paul Graham essays; keys adjective-noun words, values 7-digit numbers
                        (value_kind=uuid: UUIDs, RULER's niah_single_3); `depths` a list: one cell
                        per (length, depth), the NIAH heatmap; null: a random depth per trial
  ruler_niah_multikey   n_keys needles (distractors), one asked (niah_multikey_1)
  ruler_niah_multivalue one key, n_values needles with its values, all asked (niah_multivalue)
  ruler_niah_multiquery n_keys needles, n_queries keys asked in one question (niah_multiquery)
  ruler_vt              variable tracking: n_chains chains of n_hops assignments "VAR X = VAR Y"
                        in repeated filler sentences; every variable holding the value asked
  ruler_cwe             common-words extraction: a numbered word list, the num_cw words repeated
                        freq_cw times among words repeated freq_ucw times (one solved example first)
  ruler_fwe             frequent-words extraction: coded words drawn from a Zipf law (alpha), the
                        three most frequent asked (the most frequent, "...", is noise)
  multiquery            SCBench's shared context: n_queries needles, ONE context prefilled (and,
                        for a prompt compressor, compressed) once, each question answered from a
                        fork of that same state; accuracy per question index
Common keys: lengths, trials, batch, gen (tokens generated), protocol, haystack (pg | text |
filler), extrapolate (as evals.retrieval).

RULER's own 13 tasks under RULER's names (niah_single_1 ... fwe, qa_1, qa_2: LEADERBOARD_TASKS, the
set kvpress's leaderboard averages) are built by evals/ruler13.py with RULER's exact templates,
haystacks (noise lines, the essays, needles) and key kinds; `check`, `samples`, `check_prompts` and
`run` accept their names, `leaderboard_task(name, length, trials)` gives a checked config and
`score(cfg, pred, refs)` RULER's metric of each (string_match_part for QA). qa_1 / qa_2 are named
but not generated (MISSING: no registry package ships SQuAD or HotpotQA); AVAILABLE lists the 11.
The tasks above keep their own wording (and `filler` stays the passkey filler joined by spaces,
not RULER's noise lines), so their prompts are unchanged.

Exact lengths (RULER's max_seq_length rule, exact instead of "at most"): a prompt of the RULER
tasks has exactly `length - gen` tokens, chat template, instruction, context, question and answer
prefix included, so prompt + answer = `length`. Contexts are built from token ids: haystack text
sliced at a sentence end (evals.retrieval.build_prompt), needles inserted at sentence ends nearest
their depth; word lists (cwe, fwe) are concatenated token pieces, and the last gap smaller than one
list item is filled with newline tokens before the question. For `multiquery`, `length` is the
context (everything before the question); each question and answer come on top.

Protocols (`protocol`, recorded in the run's config and in every grid cell):
  query_aware     the question is in the prompt when the cache is compressed (RULER, SnapKV's
                  paper protocol; `Engine.generate`)
  query_agnostic  the context (chat header, instruction, haystack) is prefilled and compressed
                  first (`Engine.prompt` + `compress`), then the question is fed through the
                  decode policies and answered from the compressed cache (kvpress's protocol)
For a streaming policy (sink, h2o, window...) the two are the same computation; they differ for
prompt compressors (snapkv).

Scoring is RULER's (scripts/eval/synthetic/constants.py): `string_match_all`, the fraction of
the references found (case-insensitive substring) in the prediction, after RULER's
post-processing (control characters to newlines, stripped); the answer is cut at EOS. Every
accuracy comes with a Wilson 95 % interval (`wilson`).

Deviations from RULER: our own prompt wording (same structure and answer prefixes), inside the
model's chat template (RULER too wraps its templates); depths are snapped to sentence ends of the
token sequence (RULER inserts between nltk sentences); the word vocabulary of cwe is the essays'
own words (RULER: the wonderwords lists); vt has no in-context example; generated tokens
default lower than RULER's (128 for niah) to fit CPU budgets (`gen`; the answers fit).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import string
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from evals import prefills
from evals import retrieval as R
from evals.ruler_parts import (PROTOCOLS, Pieces as _Pieces, essay_words as _essay_words,  # noqa: F401
                                 join_keys as _join, needle_values, pad_id as _pad_id, postprocess,
                                 string_match_all, string_match_part, word_keys, zeta_of as _zeta)
from evals.common import (Sample, Task, TaskContext, TaskResult, accuracy_record, answer,  # noqa: F401  (re-exported)
                          lengths_field, wilson)

DEPTH_GRID = np.linspace(0.0, 1.0, 40)  # RULER's 40 depths (0..100 %)
QUESTION_ROOM = 192  # multiquery: the most tokens a question (chat tail included) may take

NIAH_INSTRUCTION = ("Some special magic {kind} are hidden within the following text. Make sure to memorize "
                    "them. I will quiz you about the {kind} afterwards.")
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."  # plural even for one (RULER)
NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_QUESTION_ONE = "What is the special magic {kind_one} for {query} mentioned in the provided text?"
NIAH_PREFIX = "The special magic {kind} for {query} mentioned in the provided text are"
NIAH_PREFIX_ONE = "The special magic {kind_one} for {query} mentioned in the provided text is"
VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are:")
CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")
CWE_QUESTION = "Question: What are the {n} most common words in the above list?"
CWE_PREFIX = "Answer: The top {n} words that appear most often in the list are:"
FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three "
                   "most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"

VALUE_KINDS = {"numbers": ("numbers", "number"), "uuid": ("uuids", "uuid")}

# task name -> (its keys besides the common ones, defaults)
COMMON = {"lengths": [4096, 8192], "trials": 4, "batch": 1, "protocol": "query_aware", "haystack": "pg",
          "extrapolate": False}
TASK_KEYS: dict[str, dict[str, Any]] = {
    "ruler_niah_single": {"gen": 32, "value_kind": "numbers", "depths": None},
    "ruler_niah_multikey": {"gen": 32, "value_kind": "numbers", "n_keys": 4},
    "ruler_niah_multivalue": {"gen": 64, "value_kind": "numbers", "n_values": 4},
    "ruler_niah_multiquery": {"gen": 64, "value_kind": "numbers", "n_keys": 4, "n_queries": 4},
    "ruler_vt": {"gen": 30, "n_chains": 1, "n_hops": 4, "haystack": "filler"},
    "ruler_cwe": {"gen": 120, "num_cw": 10, "freq_cw": 30, "freq_ucw": 3},
    "ruler_fwe": {"gen": 50, "alpha": 2.0, "word_len": 6},
    "multiquery": {"gen": 32, "value_kind": "numbers", "n_queries": 4, "protocol": "query_agnostic"},
}
TASKS = tuple(TASK_KEYS)
RULER_SET = ("ruler_niah_single", "ruler_niah_multikey", "ruler_niah_multivalue", "ruler_niah_multiquery",
             "ruler_vt", "ruler_cwe", "ruler_fwe")


# -- scoring --------------------------------------------------------------------------------------
# -- samples ----------------------------------------------------------------------------------------
def _prompt_sample(p: R.Prompt, refs: Sequence[str]) -> Sample:
    return Sample(p.tokens, tuple(refs), p.haystack[1], p.needle_starts, p.depths)


@dataclasses.dataclass(frozen=True)
class Haystack:
    """Token ids of the haystack, its sentence ends, and where a context may start."""

    ids: np.ndarray
    ends: np.ndarray
    starts: np.ndarray


def haystack(tok: Any, kind: str, text: str | None, n: int) -> Haystack:
    """`pg` (the Paul Graham essays, whatever the run's data), `text` (ctx.text, the run's data),
    both from a random paragraph start, or `filler` (RULER's "noise": the repeated grass/sky/sun sentences)."""
    if kind == "filler":
        ids = R.filler_haystack(tok, n)
        return Haystack(ids, R.sentence_ends(tok, ids), np.zeros(1, np.int64))
    if kind == "pg":
        from evals.data import paul_graham

        text = paul_graham()
    if text is None:
        raise ValueError(f"haystack={kind}: needs the run's text (data=...)")
    ids, ends, starts = R.text_haystack_ids(tok, text, n)
    return Haystack(ids, ends, starts)


def task_haystack(ctx: Any, cfg: dict[str, Any], n: int) -> tuple[Any, Haystack]:
    """(the run's tokenizer, the haystack of `cfg["haystack"]` for prompts up to `n` tokens) of a
    task that builds its own prompts; a missing tokenizer or text raises ValueError."""
    if ctx.tokenizer is None:
        raise ValueError(f"task {cfg['name']} needs a tokenizer")
    if cfg["haystack"] == "text" and ctx.text is None:
        raise ValueError(f"task {cfg['name']} with haystack=text needs a text (data=...)")
    return ctx.tokenizer, haystack(ctx.tokenizer, cfg["haystack"], ctx.text, n)


def niah_samples(tok: Any, hay: Haystack, length: int, trials: int, seed: int, *, n_keys: int = 1,
                 n_values: int = 1, n_queries: int = 1, value_kind: str = "numbers",
                 depth: float | None = None, prompt_tokens: int | None = None) -> list[Sample]:
    """RULER niah prompts of exactly `prompt_tokens` tokens (default `length`): n_keys keys, each
    with n_values needles; n_queries keys asked together; references every value of the asked
    keys. Depths: `depth` for a single needle, else distinct random depths of RULER's 40."""
    n = length if prompt_tokens is None else prompt_tokens
    rng = np.random.default_rng([seed, length, 11, n_keys, n_values, n_queries, 10**7 if depth is None
                                 else int(round(depth * 1e6)), 1 if value_kind == "uuid" else 0])
    plural, one = VALUE_KINDS[value_kind]
    single = n_queries * n_values == 1
    out = []
    for _ in range(trials):
        keys = word_keys(rng, n_keys)
        values = [needle_values(rng, n_values, value_kind) for _ in keys]
        needles = [(k, v) for k, vs in zip(keys, values) for v in vs]
        order = rng.permutation(len(needles))  # RULER shuffles the needles
        needles = [needles[i] for i in order]
        if depth is not None and len(needles) == 1:
            at = [depth]
        else:
            at = list(np.sort(rng.choice(DEPTH_GRID, len(needles), replace=False)))
        asked = sorted(rng.choice(n_keys, n_queries, replace=False).tolist())
        query = _join([keys[i] for i in asked])
        refs = [v for i in asked for v in values[i]]
        q = (NIAH_QUESTION_ONE if single else NIAH_QUESTION).format(kind=plural, kind_one=one, query=query)
        pre = (NIAH_PREFIX_ONE if single else NIAH_PREFIX).format(kind=plural, kind_one=one, query=query)
        head, tail = R.frame(tok, NIAH_INSTRUCTION.format(kind=plural), q, pre)
        ids = [tok.encode(" " + NIAH_NEEDLE.format(kind=plural, key=k, value=v)) for k, v in needles]
        off = int(rng.choice(hay.starts))
        p = R.build_prompt(head, tail, hay.ids[off:], hay.ends[off:], n, ids, at, refs[0])
        out.append(_prompt_sample(p, refs))
    return out


def vt_samples(tok: Any, hay: Haystack, length: int, trials: int, seed: int, n_chains: int = 1,
               n_hops: int = 4) -> list[Sample]:
    """RULER variable tracking: chains `VAR A = 12345`, `VAR B = VAR A`, ... (5-letter names), each
    chain in order at sorted random depths; asked: every variable of the first chain."""
    rng = np.random.default_rng([seed, length, 12, n_chains, n_hops])
    out = []
    for _ in range(trials):
        names: list[str] = []
        while len(names) < n_chains * (n_hops + 1):
            v = "".join(rng.choice(list(string.ascii_uppercase), 5))
            if v not in names:
                names.append(v)
        chains, statements = [], []
        for c in range(n_chains):
            vs = names[c * (n_hops + 1):(c + 1) * (n_hops + 1)]
            value = str(rng.integers(10000, 100000))
            chains.append((vs, value))
            statements.append([f"VAR {vs[0]} = {value}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(n_hops)])
        needles, depths = [], []
        for st in statements:
            d = np.sort(rng.random(len(st)))  # in chain order
            needles += [tok.encode(" " + s) for s in st]
            depths += list(d)
        vs, value = chains[0]
        head, tail = R.frame(tok, VT_INSTRUCTION, VT_QUESTION.format(value=value),
                             VT_PREFIX.format(n=n_hops + 1, value=value))
        off = int(rng.choice(hay.starts))
        p = R.build_prompt(head, tail, hay.ids[off:], hay.ends[off:], length, needles, depths, vs[0])
        out.append(_prompt_sample(p, vs))
    return out


def _numbered(pieces: _Pieces, words: Sequence[str]) -> list[int]:
    return [t for i, w in enumerate(words) for t in pieces(f" {i + 1}.") + pieces(" " + w)]


def _list_sample(tok: Any, head_text: str, question: str, prefix: str, body: list[int], fill: int,
                 refs: Sequence[str], n: int) -> Sample:
    head, tail = R.frame(tok, head_text, question, prefix)
    pad = fill - len(body)
    tokens = np.asarray(list(head) + body + [_pad_id(tok)] * pad + list(tail), np.int32)
    if len(tokens) != n:
        raise ValueError(f"length={n}: too short for this prompt ({len(tokens)} tokens without the list)")
    return Sample(tokens, tuple(refs), n - len(tail))


def cwe_samples(tok: Any, words: Sequence[str], length: int, trials: int, seed: int, num_cw: int = 10,
                freq_cw: int = 30, freq_ucw: int = 3, prompt_tokens: int | None = None) -> list[Sample]:
    """RULER common-words extraction: num_cw words repeated freq_cw times and as many others
    repeated freq_ucw times as fit, shuffled, numbered; one solved example first (RULER's: 40
    words, 10 and 3 repeats; below 4096 tokens RULER's short setting: 20 words 3/1, list 6/1)."""
    n = length if prompt_tokens is None else prompt_tokens
    rng = np.random.default_rng([seed, length, 13, num_cw, freq_cw, freq_ucw])
    pieces = _Pieces(tok)
    ex_words, ex_cw, ex_ucw = (40, 10, 3) if length >= 4096 else (20, 3, 1)
    if length < 4096:
        freq_cw, freq_ucw = 6, 1
    out = []
    for _ in range(trials):
        pick = [words[i] for i in rng.permutation(len(words))]
        ex = pick[:ex_words]
        ex_list = ex[:num_cw] * ex_cw + ex[num_cw:] * ex_ucw
        ex_list = [ex_list[i] for i in rng.permutation(len(ex_list))]
        example = (f"{CWE_INSTRUCTION}\n{' '.join(f'{i + 1}. {w}' for i, w in enumerate(ex_list))}\n"
                   f"{CWE_QUESTION.format(n=num_cw)}\n{CWE_PREFIX.format(n=num_cw)} "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[:num_cw])))
        head_text = f"{example}\n\n{CWE_INSTRUCTION}"
        head, tail = R.frame(tok, head_text, CWE_QUESTION.format(n=num_cw), CWE_PREFIX.format(n=num_cw))
        fill = n - len(head) - len(tail)
        rest = pick[ex_words:]
        common = rest[:num_cw]

        def size(u: int) -> int:  # tokens of the list with u uncommon words (order does not matter)
            count = num_cw * freq_cw + u * freq_ucw
            nums = sum(len(pieces(f" {i + 1}.")) for i in range(count))
            return nums + freq_cw * sum(len(pieces(" " + w)) for w in common) + \
                freq_ucw * sum(len(pieces(" " + w)) for w in rest[num_cw:num_cw + u])

        if size(0) > fill:
            raise ValueError(f"length={length}: too short for {num_cw} words x {freq_cw} and the example in this "
                             f"tokenizer ({size(0)} list tokens, {fill} free): use task.lengths=[{2 * length}] or a "
                             f"lower task.freq_cw")
        lo, hi = 0, len(rest) - num_cw
        while lo < hi:  # the most uncommon words that fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(mid) <= fill else (lo, mid - 1)
        items = common * freq_cw + rest[num_cw:num_cw + lo] * freq_ucw
        items = [items[i] for i in rng.permutation(len(items))]
        out.append(_list_sample(tok, head_text, CWE_QUESTION.format(n=num_cw), CWE_PREFIX.format(n=num_cw),
                                _numbered(pieces, items), fill, common, n))
    return out


def fwe_samples(tok: Any, length: int, trials: int, seed: int, alpha: float = 2.0, word_len: int = 6,
                vocab: int | None = None, prompt_tokens: int | None = None) -> list[Sample]:
    """RULER frequent-words extraction: `vocab` (RULER: length // 50) coded words of `word_len`
    random letters; word k (1-based rank) appears int(N k^-alpha / zeta(alpha)) times, with N the
    largest count of words that fits; rank 1 is "..." (noise); ranks 2-4 are the answer."""
    n = length if prompt_tokens is None else prompt_tokens
    rng = np.random.default_rng([seed, length, 14, int(alpha * 1000), word_len])
    pieces = _Pieces(tok)
    vocab = vocab or max(length // 50, 8)
    out = []
    for _ in range(trials):
        words: list[str] = []
        while len(words) < vocab:
            w = "".join(rng.choice(list(string.ascii_lowercase), word_len))
            if w not in words:
                words.append(w)
        words[0] = "..."
        head, tail = R.frame(tok, FWE_INSTRUCTION, FWE_QUESTION, FWE_PREFIX)
        fill = n - len(head) - len(tail)
        k = np.arange(1, vocab + 1)
        sizes = np.array([len(pieces(" " + w)) for w in words])

        def counts(m: int) -> np.ndarray:
            return (m * k ** -alpha / _zeta(alpha)).astype(int)

        lo, hi = 0, 64 * max(fill, 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if int(counts(mid) @ sizes) <= fill else (lo, mid - 1)
        c = counts(lo)
        items = [w for w, ci in zip(words, c) for _ in range(ci)]
        items = [items[i] for i in rng.permutation(len(items))]
        body = [t for w in items for t in pieces(" " + w)]
        out.append(_list_sample(tok, FWE_INSTRUCTION, FWE_QUESTION, FWE_PREFIX, body, fill, words[1:4], n))
    return out


def multiquery_samples(tok: Any, hay: Haystack, length: int, trials: int, seed: int, n_queries: int = 4,
                       value_kind: str = "numbers") -> list[tuple[Sample, list[tuple[np.ndarray, str]]]]:
    """SCBench-style shared contexts: `length` context tokens (chat header, instruction, haystack
    with n_queries needles at random depths) and n_queries questions, one per key in needle order
    (each: the chat tail ids, its reference)."""
    rng = np.random.default_rng([seed, length, 15, n_queries, 1 if value_kind == "uuid" else 0])
    plural, one = VALUE_KINDS[value_kind]
    out = []
    for _ in range(trials):
        keys = word_keys(rng, n_queries)
        values = needle_values(rng, n_queries, value_kind)
        at = list(np.sort(rng.choice(DEPTH_GRID, n_queries, replace=False)))
        head, _ = R.frame(tok, NIAH_INSTRUCTION.format(kind=plural), "", "")
        questions = []
        for k, v in zip(keys, values):
            q = NIAH_QUESTION_ONE.format(kind_one=one, query=k)
            _, tail = R.frame(tok, NIAH_INSTRUCTION.format(kind=plural), q, NIAH_PREFIX_ONE.format(
                kind_one=one, query=k))
            if len(tail) > QUESTION_ROOM:
                raise ValueError(f"a question takes {len(tail)} tokens > {QUESTION_ROOM}")
            questions.append((np.asarray(tail, np.int32), v))
        needles = [tok.encode(" " + NIAH_NEEDLE.format(kind=plural, key=k, value=v)) for k, v in zip(keys, values)]
        off = int(rng.choice(hay.starts))
        p = R.build_prompt(head, [], hay.ids[off:], hay.ends[off:], length, needles, at, values[0])
        out.append((Sample(p.tokens, tuple(values), length, p.needle_starts, p.depths), questions))
    return out


# -- configuration ------------------------------------------------------------------------------
def check(task: dict, name: str | None = None) -> dict[str, Any]:
    """The validated config of a RULER-style task (defaults filled in); unknown keys or bad values
    raise ValueError naming them."""
    task = dict(task)
    name = name or task.get("name")
    if name in LEADERBOARD_TASKS:
        return ruler13.check(task | {"name": name})
    if name not in TASK_KEYS:
        raise ValueError(f"task name={name!r}: must be one of {sorted(TASK_KEYS)}")
    defaults = COMMON | TASK_KEYS[name]
    unknown = sorted(set(task) - set(defaults) - {"name"})
    if unknown:
        raise ValueError(f"task {name}: unknown key(s) {unknown}; its keys are {sorted(set(defaults) | {'name'})}")
    cfg = {"name": name} | {k: task.get(k, v) for k, v in defaults.items()}
    cfg["lengths"] = R.int_list(cfg, "lengths", None, lo=2)
    for k in ("trials", "batch", "gen", "n_keys", "n_values", "n_queries", "n_chains", "n_hops", "num_cw",
              "freq_cw", "freq_ucw", "word_len"):
        if k in cfg:
            cfg[k] = R.int_list(cfg, k, None)[0]
    cfg["batch"] = min(cfg["batch"], cfg["trials"])
    if cfg["protocol"] not in PROTOCOLS:
        raise ValueError(f"task.protocol={cfg['protocol']!r}: must be one of {list(PROTOCOLS)}")
    if cfg["haystack"] not in ("pg", "text", "filler"):
        raise ValueError(f"task.haystack={cfg['haystack']!r}: must be pg, text or filler")
    if not isinstance(cfg["extrapolate"], bool):
        raise ValueError(f"task.extrapolate={cfg['extrapolate']!r}: must be true or false")
    if "value_kind" in cfg and cfg["value_kind"] not in VALUE_KINDS:
        raise ValueError(f"task.value_kind={cfg['value_kind']!r}: must be one of {sorted(VALUE_KINDS)}")
    if "n_queries" in cfg and "n_keys" in cfg and cfg["n_queries"] > cfg["n_keys"]:
        raise ValueError(f"task.n_queries={cfg['n_queries']}: at most n_keys={cfg['n_keys']}")
    if "alpha" in cfg and (isinstance(cfg["alpha"], bool) or not isinstance(cfg["alpha"], (int, float))
                           or cfg["alpha"] <= 1):
        raise ValueError(f"task.alpha={cfg['alpha']!r}: must be a number > 1 (a Zipf law)")
    if "depths" in cfg and cfg["depths"] is not None:
        d = cfg["depths"]
        d = [d] if isinstance(d, (int, float)) else list(d)
        if not d or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in d):
            raise ValueError(f"task.depths={cfg['depths']!r}: must be null or numbers in [0, 1]")
        cfg["depths"] = [float(x) for x in d]
    return cfg


def extent(task: dict) -> tuple[int, int, int]:
    """(longest prompt, tokens generated after it, batch) of a task config, for evals.config."""
    cfg = check(task)
    n = max(cfg["lengths"])
    if cfg["name"] == "multiquery":
        return n + QUESTION_ROOM, cfg["gen"], cfg["batch"]
    return n - cfg["gen"], cfg["gen"], cfg["batch"]


def samples(cfg: dict[str, Any], tok: Any, text: str | None, length: int, seed: int,
            depth: float | None = None, hay: Haystack | None = None) -> list:
    """The prompts of one (length[, depth]) cell of a checked task config (`text`: the run's data,
    used when haystack=text)."""
    name, trials = cfg["name"], cfg["trials"]
    if name in LEADERBOARD_TASKS:  # RULER's own tasks: their fixed haystacks (`text` unused)
        return ruler13.samples(cfg, tok, length, seed)
    if cfg["haystack"] == "pg" and name == "ruler_cwe":
        from evals.data import paul_graham

        text = paul_graham()
    n = length - cfg["gen"]
    if name == "ruler_cwe":
        words = _essay_words(text) if text is not None else ()
        if len(words) < 1000:
            raise ValueError(f"ruler_cwe: the text has {len(words)} distinct words of 4-10 letters, needs >= 1000 "
                             "(data=pg)")
        return cwe_samples(tok, words, length, trials, seed, cfg["num_cw"], cfg["freq_cw"], cfg["freq_ucw"],
                           prompt_tokens=n)
    if name == "ruler_fwe":
        return fwe_samples(tok, length, trials, seed, cfg["alpha"], cfg["word_len"], prompt_tokens=n)
    hay = hay or haystack(tok, cfg["haystack"], text, max(cfg["lengths"]) + QUESTION_ROOM)
    if name == "ruler_vt":
        return vt_samples(tok, hay, n, trials, seed, cfg["n_chains"], cfg["n_hops"])
    if name == "multiquery":
        return multiquery_samples(tok, hay, length, trials, seed, cfg["n_queries"], cfg["value_kind"])
    kw = {"value_kind": cfg["value_kind"], "n_keys": cfg.get("n_keys", 1), "n_values": cfg.get("n_values", 1),
          "n_queries": cfg.get("n_queries", 1)}
    return niah_samples(tok, hay, length, trials, seed, depth=depth, prompt_tokens=n, **kw)


def check_prompts(task: dict, tok: Any, seed: int) -> None:
    """Build the prompts of the shortest length over a filler haystack so that a length too short
    for the template raises now, before the model loads."""
    cfg = dict(check(task), trials=1)
    if cfg["name"] in LEADERBOARD_TASKS:
        ruler13.samples(cfg, tok, min(cfg["lengths"]), seed)
        return
    cfg["haystack"] = "filler"
    n = min(cfg["lengths"])
    if n > 1 << 15:
        return
    depths = cfg.get("depths") or [None]
    rng = np.random.default_rng(0)
    words = " ".join("".join(rng.choice(list(string.ascii_lowercase), 6)) for _ in range(1200))  # a stand-in list
    samples(cfg, tok, R.PASSKEY_FILLER * 8 + words, n, seed, depths[0])


# -- running --------------------------------------------------------------------------------------
def ids_text(tok: Any, ids: Sequence[int]) -> str:
    return R.decode_until_eos(tok, list(map(int, ids)))


def _metrics(grid: list[dict], lengths: list[int]) -> dict[str, float]:
    scores = [x for g in grid for x in g["_scores"]]
    m = {f"{k}": v for k, v in accuracy_record(scores).items() if k != "trials"}
    for n in lengths:
        rec = accuracy_record([x for g in grid if g["length"] == n for x in g["_scores"]])
        m |= {f"accuracy@{n}": rec["accuracy"], f"ci_low@{n}": rec["ci_low"], f"ci_high@{n}": rec["ci_high"]}
    return m


def work(engine) -> dict[str, int]:
    """What the engine fed: fresh prefills, their tokens, and (kvzip) the reconstruction's repeat
    tokens, the method's prefill overhead."""
    out = {"prefills": engine.prefills, "prefill_tokens": engine.prefill_tokens,
           "prefills_shared": engine.prefills_shared}
    return out | ({"reconstruct_tokens": engine.reconstruct_tokens} if engine.reconstruct_tokens else {})


def run(ctx: TaskContext) -> TaskResult:
    """A RULER-style task (ctx.task["name"] in TASKS) under its protocol: grid cells (length[,
    depth]) with accuracy, Wilson interval and trials; arrays `score` [cells, trials] and the
    decoded `outputs`; metrics accuracy (+ ci_low / ci_high) overall and per length."""
    cfg = check(ctx.task)
    if ctx.tokenizer is None:
        raise ValueError(f"task {cfg['name']} needs a tokenizer")
    if cfg["name"] == "multiquery":
        return run_multiquery(ctx, cfg)
    tok = ctx.tokenizer
    needs_text = cfg["name"] not in ("ruler_fwe",) and cfg.get("haystack") == "text"
    if needs_text and ctx.text is None:
        raise ValueError(f"task {cfg['name']} needs a text (data=pg)")
    hay = None if cfg["name"] in ("ruler_cwe", "ruler_fwe") + LEADERBOARD_TASKS else \
        haystack(tok, cfg["haystack"], ctx.text, max(cfg["lengths"]) + QUESTION_ROOM)
    depths = cfg.get("depths") or [None]
    cells = [(n, d) for n in cfg["lengths"] for d in depths]
    engine = ctx.engine(max(cfg["lengths"]))
    grid, scores, outputs = [], [], []
    for n, d in tqdm(cells, desc=cfg["name"], disable=not ctx.progress, leave=False):
        ss = samples(cfg, tok, ctx.text, n, ctx.seed, d, hay)
        texts = []
        for b in range(0, len(ss), cfg["batch"]):
            texts += [ids_text(tok, x) for x in answer(engine, ss[b:b + cfg["batch"]], cfg["gen"], cfg["protocol"],
                                                    ctx.chunk)]
        sc = [score(cfg, t, s.refs) for t, s in zip(texts, ss)]
        rec = {"length": n, "protocol": cfg["protocol"]} | ({"depth": d} if d is not None else {})
        grid.append(rec | accuracy_record(sc) | {"_scores": sc})
        scores.append(sc)
        outputs.append(texts)
    metrics = _metrics(grid, cfg["lengths"]) | work(engine)
    for g in grid:
        g.pop("_scores")
    return TaskResult(metrics=metrics, grid=grid, arrays={"score": np.asarray(scores, np.float32),
                                                          "outputs": np.asarray(outputs)})


def run_multiquery(ctx: TaskContext, cfg: dict[str, Any]) -> TaskResult:
    """SCBench-style: per trial ONE prefill of the context; query_agnostic: compressed once, each
    question from a fork of the compressed state; query_aware: each question extends a fork of
    the (dense) prompt-phase state and is compressed with its question seen. grid: one cell per
    (length, question index); metrics accuracy overall and accuracy_q<i> per question index."""
    tok = ctx.tokenizer
    if ctx.text is None and cfg["haystack"] == "text":
        raise ValueError("task multiquery with haystack=text needs a text (data=...)")
    hay = haystack(tok, cfg["haystack"], ctx.text, max(cfg["lengths"]) + QUESTION_ROOM)
    engine = ctx.engine(max(cfg["lengths"]) + QUESTION_ROOM + cfg["gen"])
    nq = cfg["n_queries"]
    grid, scores, outputs = [], [], []
    for n in cfg["lengths"]:
        sc = np.zeros((cfg["trials"], nq))
        outs = np.empty((cfg["trials"], nq), object)
        for t, (sample, questions) in enumerate(tqdm(multiquery_samples(tok, hay, n, cfg["trials"], ctx.seed, nq,
                                                                        cfg["value_kind"]),
                                                     desc="multiquery", disable=not ctx.progress, leave=False)):
            state = prefills.prompted(engine, sample.tokens[None], ctx.chunk)  # the one prefill of this context
            shared = engine.compress(state) if cfg["protocol"] == "query_agnostic" else None
            for i, (q, ref) in enumerate(questions):
                if shared is not None:
                    ids = engine.continue_generate(shared, q[None], cfg["gen"], chunk=ctx.chunk)
                else:
                    ids = engine.continue_generate(engine.compress(engine.extend_prompt(state, q[None], ctx.chunk)),
                                                   [], cfg["gen"])
                outs[t, i] = ids_text(tok, ids[0])
                sc[t, i] = string_match_all(outs[t, i], [ref])
        for i in range(nq):
            grid.append({"length": n, "question": i, "protocol": cfg["protocol"]} | accuracy_record(sc[:, i]))
        scores.append(sc)
        outputs.append(outs.astype(str))
    all_sc = np.stack(scores)  # [lengths, trials, questions]
    metrics = {k: v for k, v in accuracy_record(all_sc.ravel()).items() if k != "trials"}
    for i in range(nq):
        rec = accuracy_record(all_sc[:, :, i].ravel())
        metrics |= {f"accuracy_q{i}": rec["accuracy"], f"ci_low_q{i}": rec["ci_low"], f"ci_high_q{i}": rec["ci_high"]}
    metrics |= work(engine) | {"contexts": len(cfg["lengths"]) * cfg["trials"]}
    return TaskResult(metrics=metrics, grid=grid, arrays={"score": all_sc.astype(np.float32),
                                                          "outputs": np.stack(outputs)})


# -- one dense prefill shared by several prompt compressors ---------------------------------------------
def shared_prefill(engines: Sequence, prompts: Sequence[Sample], n: int, protocol: str, chunk: int | None
                   ) -> tuple[list[list[list[int]]], dict[str, int]]:
    """Answers of every engine (one per policy stack, same model and max_len) to every prompt,
    with ONE prefill per prompt for each group of engines that share a prompt phase
    (`Engine.shares_prompt`: snapkv at any budget, and full beside it), through
    `evals.prefills.sharing()`: prompt compressors run first, the first of a group prefills each
    context, every later member compresses its own fork and answers. A streaming policy (sink,
    h2o...) prefills on its own. Returns (answers[engine][prompt],
    {"prefills": done, "prefills_unshared": what one run per policy would do})."""
    order = sorted(range(len(engines)), key=lambda i: not engines[i].compresses)  # compressors lead
    out: list[list[Any]] = [[None] * len(prompts) for _ in engines]
    with prefills.sharing() as store:
        for i in order:
            for k, s in enumerate(prompts):
                out[i][k] = answer(engines[i], [s], n, protocol, chunk)[0]
    return out, {"prefills": store.prefills, "prefills_unshared": len(engines) * len(prompts)}


def check_text(conf: dict, tokenizer, text: str | None) -> None:
    """The shortest prompt fits its template and question (`check_prompts`)."""
    try:
        check_prompts(conf["task"], tokenizer, conf["seed"])
    except ValueError as e:
        raise ValueError(f"{lengths_field(conf['task'])}: {e}") from None


# every task of TASKS, as evals.run asks it (evals.common.Task)
TASK = Task(run=run, check=check, extent=lambda task: (lengths_field(task), *extent(task)), check_text=check_text)

# RULER's 13 tasks under their own names (kvpress's leaderboard), built in evals/ruler13.py
from evals import ruler13  # noqa: E402  (it imports this module)
from evals.ruler13 import AVAILABLE, LEADERBOARD_TASKS, MISSING, leaderboard_task, score  # noqa: E402,F401


def _named_task(name: str) -> Task:
    """`evals.run task=<RULER's name>`: this module's Task with the name's defaults (RULER's gen and
    metric, 4,096 tokens, kvpress's query-agnostic protocol; qa_1 / qa_2: `task.qa_file=` needed)."""
    spec = ruler13.SPECS[name]
    gen = ruler13.TEMPLATES[spec["task"]][2]
    base = {"lengths": [4096], "trials": 1, "batch": 1, "gen": gen, "protocol": "query_agnostic",
            "extrapolate": False, "metric": ruler13.METRICS[name]}
    return dataclasses.replace(TASK, defaults=base | ({"qa_file": None} if spec["task"] == "qa" else {}))


NAMED_TASKS = {name: _named_task(name) for name in LEADERBOARD_TASKS}
