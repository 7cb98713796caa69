"""Retrieval evals: passkey, needle in a haystack, multi-key NIAH and synthetic associative recall.

Shapes: B batch (trials run together), T prompt tokens, n generated tokens.

A text prompt is built from token ids, so its length is exact: `length` counts every token fed to
the model (chat template, instruction, haystack, needles, question and answer prefix), which is
what the cache holds when generation starts. The haystack is tokenized once and sliced; needles
are tokenized on their own and inserted at sentence boundaries (the nearest one to the asked
depth, within `SNAP` tokens). With a chat template (SmolLM2 is an instruct model) the prompt is

    <system> <|im_start|>user INSTRUCTION\\n\\n HAYSTACK-with-NEEDLES \\n\\nQUESTION<|im_end|>
    <|im_start|>assistant ANSWER_PREFIX

and a tokenizer without one (e.g. the byte tokenizer of model=tiny_random) gets the same text
without the template. Answers are greedy; a trial is correct when the first standalone 5-digit
number (passkey) is the key, or the needle's value appears as a standalone number (niah,
multikey; RULER's string match). Every prompt is a function of (task config, seed).

Tasks (TaskContext -> TaskResult; `ctx.task` keys, defaults in brackets):
  passkey   lengths, depths, trials [4], batch [4], haystack ["filler" | "text"]
            (Mohtashami & Jaggi 2023, "Landmark Attention": a key in repeated filler sentences)
  niah      lengths, depths, trials [4], batch [4] (Kamradt's needle in a haystack; the haystack
            is ctx.text from a random paragraph start)
  multikey  lengths, n_keys [4], key_kind ["words" | "uuid"], trials [4], batch [4]
            (RULER's niah_multikey, Hsieh et al. 2024: n_keys needles at random depths, one asked)
  recall    n_pairs [32] (int or list), trials [256], n_keys/n_values [the training layout]:
            associative recall on the synthetic model of evals/recall_model.py (token ids, no text)
passkey, niah and multikey also take `extrapolate` [false]: evals.run refuses lengths past the
model's trained context length unless it is true (it changes no number, so not the run key), and
`protocol` ["query_aware" | "query_agnostic": the haystack compressed before the question is fed;
see evals/ruler.py]. Accuracies come with Wilson 95 % intervals (ci_low / ci_high).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from evals.common import Sample, Task, TaskContext, TaskResult, answer, lengths_field, wilson

SNAP = 48  # a needle moves at most this many tokens from the asked depth to reach a sentence end

PASSKEY_INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                       "Find it and memorize it. I will quiz you about it.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# SmolLM2-135M-Instruct, 1024 tokens, depth 0.1: this question with no answer prefix finds 4/4
# keys; "What is the pass key?" with the assistant turn primed by "The pass key is" finds 0/4
# (it continues "the name of the pass key").
PASSKEY_QUESTION = "What is the pass key? Answer with the 5-digit number only."
PASSKEY_PREFIX = ""

NIAH_INSTRUCTION = ("Some special magic numbers are hidden inside the following text. Make sure to memorize "
                    "them. I will quiz you about the numbers afterwards.")
NIAH_NEEDLE = "The special magic number for {key} is {value}."
NIAH_QUESTION = "What is the special magic number for {key} mentioned in the text?"
NIAH_PREFIX = "The special magic number for {key} mentioned in the text is"

NAMES = ("Sarah", "David", "Maria", "James", "Aisha", "Kenji", "Olga", "Pedro", "Fatima", "Liam", "Chloe",
         "Omar", "Ingrid", "Raj", "Elena", "Tomas", "Mei", "Hugo", "Zara", "Felix", "Nadia", "Victor",
         "Lucia", "Arjun", "Greta", "Samuel", "Yara", "Boris", "Leila", "Marco", "Hana", "Oscar")
ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faded", "gentle", "hollow", "icy", "jolly",
              "keen", "lucky", "misty", "noble", "olive", "plain", "quiet", "rusty", "silent", "tidy",
              "urban", "vivid", "windy", "young", "zesty", "bold", "crisp", "dark", "early", "fierce")
NOUNS = ("anchor", "badger", "canyon", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
         "umbrella", "valley", "walnut", "yogurt", "zipper", "bridge", "castle", "desert", "forest", "glacier")

PASSKEY_TOKENS = 12  # generated: "The pass key is 71432." is 11 SmolLM2 tokens (digits are single tokens)
NEEDLE_TOKENS = 16  # generated for niah / multikey (7-digit values)
_PASSKEY_RE = re.compile(r"(?<!\d)(\d{5})(?!\d)")


# -- answers ----------------------------------------------------------------------------------
def parse_passkey(text: str) -> str | None:
    """The first standalone 5-digit number in `text`, or None."""
    m = _PASSKEY_RE.search(text)
    return m.group(1) if m else None


def contains_answer(text: str, answer: str) -> bool:
    """Whether `answer` occurs in `text` not glued to other digits (RULER's string match)."""
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", text) is not None


# -- prompt construction ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ids [T], the expected answer, where each needle starts in `tokens`, the haystack
    span [start, end) in `tokens`, and each needle's actual depth (fraction of haystack before it)."""

    tokens: np.ndarray
    answer: str
    needle_starts: tuple[int, ...]
    haystack: tuple[int, int]
    depths: tuple[float, ...]


def has_chat_template(tok: Any) -> bool:
    return getattr(tok, "chat_template", None) is not None and hasattr(tok, "apply_chat_template")


def frame(tok: Any, instruction: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack: (chat header + instruction, question + assistant
    header + answer prefix). The chat template is rendered once around a sentinel and split."""
    sentinel = "\x00HAYSTACK\x00"
    content = f"{instruction}\n\n{sentinel}\n\n{question}"
    if has_chat_template(tok):
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    else:
        text = content + "\n"
    head, tail = text.split(sentinel)
    return tok.encode(head), tok.encode(tail + answer_prefix)


def _token_flags(tok: Any, ids: np.ndarray, pred) -> np.ndarray:
    """[len(ids)] bool: pred(decoded text of token i), decoding each distinct id once."""
    uniq, inv = np.unique(np.asarray(ids), return_inverse=True)
    flags = np.array([pred(tok.decode([int(u)])) for u in uniq], bool)
    return flags[inv.reshape(-1)]


def sentence_ends(tok: Any, ids: np.ndarray) -> np.ndarray:
    """[len(ids)] bool: token i ends a sentence or a line (a needle may follow it)."""
    return _token_flags(tok, ids, lambda t: t.rstrip(" ").endswith((".", "!", "?", "\n", '."', ".'", '?"', '!"')))


def _snap(target: int, n: int, ends: np.ndarray) -> int:
    """The insertion index in [0, n] nearest `target` that follows a sentence end (or is 0 or n),
    within SNAP tokens; `target` itself when there is none."""
    lo, hi = max(0, target - SNAP), min(n, target + SNAP)
    cand = np.arange(lo, hi + 1)
    ok = (cand == 0) | (cand == n) | ends[np.maximum(cand - 1, 0)]
    if not ok.any():
        return target
    cand = cand[ok]
    return int(cand[np.argmin(np.abs(cand - target))])


def build_prompt(head: Sequence[int], tail: Sequence[int], haystack: np.ndarray, ends: np.ndarray,
                 length: int, needles: Sequence[Sequence[int]], depths: Sequence[float], answer: str) -> Prompt:
    """head + haystack[:F] with `needles` inserted at `depths` (fractions of F) + tail, with F chosen
    so the prompt has exactly `length` tokens. `ends` marks sentence ends of `haystack`."""
    fill = length - len(head) - len(tail) - sum(len(n) for n in needles)
    if fill < 0:
        raise ValueError(f"length={length}: too short for this prompt, which needs at least "
                         f"{length - fill} tokens without any haystack")
    if len(haystack) < fill:
        raise ValueError(f"haystack of {len(haystack)} tokens is shorter than the {fill} needed")
    # start up to SNAP tokens later so that the haystack ends at a sentence end (the question follows)
    shift = [s for s in range(min(SNAP, len(haystack) - fill) + 1) if fill == 0 or ends[s + fill - 1]]
    if shift:
        haystack, ends = haystack[shift[0]:], ends[shift[0]:]
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth={d}: must be in [0, 1]")
    at = [_snap(int(round(d * fill)), fill, ends) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: (at[i], i))
    parts, starts, prev = [np.asarray(head, np.int64)], [0] * len(needles), 0
    cursor = len(head)
    for i in order:
        parts.append(haystack[prev:at[i]])
        cursor += at[i] - prev
        starts[i] = cursor
        parts.append(np.asarray(needles[i], np.int64))
        cursor += len(needles[i])
        prev = at[i]
    parts += [haystack[prev:fill], np.asarray(tail, np.int64)]
    tokens = np.concatenate(parts).astype(np.int32)
    assert len(tokens) == length
    span = (len(head), length - len(tail))
    return Prompt(tokens, answer, tuple(starts), span, tuple(a / max(fill, 1) for a in at))


def filler_haystack(tok: Any, n: int) -> np.ndarray:
    """At least n tokens of the repeated passkey filler (tokenized once, periodic)."""
    one = tok.encode(PASSKEY_FILLER * 8)
    reps = -(-n // max(len(one), 1)) + 1
    return np.tile(np.asarray(one, np.int64), reps)


def text_tokens(tok: Any, text: str, n: int) -> np.ndarray:
    """Token ids of a prefix of `text` holding at least 4n tokens when the text is long enough
    (room for random starting points), repeated when the whole text is shorter than n."""
    chars = 4 * n * 8
    ids = np.asarray(tok.encode(text[:chars]), np.int64)
    if len(ids) < 4 * n and chars < len(text):
        ids = np.asarray(tok.encode(text), np.int64)
    if len(ids) < n:
        ids = np.tile(ids, -(-n // max(len(ids), 1)) + 1)
    return ids


def _paragraph_starts(tok: Any, ids: np.ndarray, limit: int) -> np.ndarray:
    """Offsets < limit where a haystack may start: after a newline token (else any offset)."""
    starts = np.flatnonzero(_token_flags(tok, ids[:limit], lambda t: t.endswith("\n"))) + 1
    starts = starts[starts < limit]
    return starts if len(starts) else np.arange(max(limit, 1))


# -- running prompts ---------------------------------------------------------------------------
def generate(engine, prompts: Sequence[np.ndarray], n: int, batch: int, chunk: int) -> list[list[int]]:
    """Greedy continuations of equal-length prompts, `batch` at a time (the last batch is padded by
    repeating a prompt, so every call has the same shape and the steps compile once)."""
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch):
        group = list(prompts[s:s + batch])
        real = len(group)
        group += [group[-1]] * (batch - real)
        ids = engine.generate(np.stack(group), n, chunk=chunk)  # [B, n]
        out += [list(map(int, row)) for row in np.asarray(ids)[:real]]
    return out


def decode_until_eos(tok: Any, ids: list[int]) -> str:
    eos = getattr(tok, "eos_id", None)
    if eos is not None and eos in ids:
        ids = ids[:ids.index(eos)]
    return tok.decode(ids)


KEYS = {
    "passkey": {"name", "lengths", "depths", "trials", "batch", "haystack", "extrapolate", "protocol"},
    "niah": {"name", "lengths", "depths", "trials", "batch", "extrapolate", "protocol"},
    "multikey": {"name", "lengths", "n_keys", "key_kind", "trials", "batch", "extrapolate", "protocol"},
    "recall": {"name", "n_pairs", "trials", "n_keys", "n_values"},
}


def int_list(task: dict, key: str, default: Any, lo: int = 1) -> list[int]:
    v = task.get(key, default)
    vals = [v] if isinstance(v, (int, str)) or not hasattr(v, "__iter__") else list(v)
    if not vals or any(not isinstance(x, int) or isinstance(x, bool) or x < lo for x in vals):
        raise ValueError(f"task.{key}={v!r}: must be an int >= {lo} or a non-empty list of them")
    return [int(x) for x in vals]


def known_task(task: dict, name: str, defaults: dict[str, Any], ints: Sequence[str]) -> dict[str, Any]:
    """A task config with `defaults` filled in, unknown keys refused, `lengths` a list of ints >= 2,
    each of `ints` one int >= 1, and `haystack` (when a default) one of pg, text, filler."""
    unknown = sorted(set(task) - set(defaults) - {"name"})
    if unknown:
        raise ValueError(f"task {name}: unknown key(s) {unknown}; its keys are {sorted(set(defaults) | {'name'})}")
    cfg = {"name": name} | {k: task.get(k, v) for k, v in defaults.items()}
    cfg["lengths"] = int_list(cfg, "lengths", None, lo=2)
    for k in ints:
        cfg[k] = int_list(cfg, k, None)[0]
    if "haystack" in defaults and cfg["haystack"] not in ("pg", "text", "filler"):
        raise ValueError(f"task.haystack={cfg['haystack']!r}: must be pg, text or filler")
    return cfg


def check(task: dict, name: str | None = None) -> dict[str, Any]:
    """The validated config of a retrieval task (defaults filled in); unknown keys or bad values
    raise ValueError naming them."""
    task = dict(task)
    name = name or task.get("name")
    if name not in KEYS:
        raise ValueError(f"task name={name!r}: must be one of {sorted(KEYS)}")
    unknown = sorted(set(task) - KEYS[name])
    if unknown:
        raise ValueError(f"task {name}: unknown key(s) {unknown}; its keys are {sorted(KEYS[name])}")
    out: dict[str, Any] = {"name": name}
    if name == "recall":
        out["n_pairs"] = int_list(task, "n_pairs", 32)
        out["trials"] = int_list(task, "trials", 256)[0]
        for k in ("n_keys", "n_values"):
            if k in task:
                out[k] = int_list(task, k, None)[0]
        return out
    out["lengths"] = int_list(task, "lengths", [512], lo=2)
    out["extrapolate"] = task.get("extrapolate", False)
    if not isinstance(out["extrapolate"], bool):
        raise ValueError(f"task.extrapolate={out['extrapolate']!r}: must be true or false")
    out["trials"] = int_list(task, "trials", 4)[0]
    out["batch"] = min(int_list(task, "batch", 4)[0], out["trials"])
    out["protocol"] = task.get("protocol", "query_aware")
    if out["protocol"] not in ("query_aware", "query_agnostic"):
        raise ValueError(f"task.protocol={out['protocol']!r}: must be query_aware or query_agnostic")
    if name in ("passkey", "niah"):
        depths = task.get("depths", [0.1, 0.5, 0.9])
        depths = list(depths) if not isinstance(depths, (int, float)) else [depths]
        if not depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1
                             for d in depths):
            raise ValueError(f"task.depths={task.get('depths')!r}: must be numbers in [0, 1]")
        out["depths"] = [float(d) for d in depths]
    if name == "passkey":
        out["haystack"] = task.get("haystack", "filler")
        if out["haystack"] not in ("filler", "text"):
            raise ValueError(f"task.haystack={out['haystack']!r}: must be 'filler' or 'text'")
    if name == "multikey":
        out["n_keys"] = int_list(task, "n_keys", 4)[0]
        out["key_kind"] = task.get("key_kind", "words")
        if out["key_kind"] not in ("words", "uuid"):
            raise ValueError(f"task.key_kind={out['key_kind']!r}: must be 'words' or 'uuid'")
        if out["key_kind"] == "words" and out["n_keys"] > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"task.n_keys={out['n_keys']}: at most {len(ADJECTIVES) * len(NOUNS)} word keys")
    return out


def check_prompts(task: dict, tok: Any, seed: int) -> None:
    """Build the prompts of the shortest length (every depth and trial, the haystack repeated
    filler) so that a length too short for the template, needles and question raises its
    ValueError now, once the tokenizer is there and before the model loads."""
    cfg = check(task)
    n = min(cfg["lengths"])
    if n > 1 << 16:  # room for any template and needles: the run itself checks the rest
        return
    ids = filler_haystack(tok, n)
    ends, starts = sentence_ends(tok, ids), np.zeros(1, np.int64)
    if cfg["name"] == "passkey":
        for d in cfg["depths"]:
            passkey_prompts(tok, n, d, cfg["trials"], seed, ids, ends)
    elif cfg["name"] == "niah":
        for d in cfg["depths"]:
            needle_prompts(tok, n, [d], 1, "names", cfg["trials"], seed, ids, ends, starts, multi=False)
    else:
        needle_prompts(tok, n, None, cfg["n_keys"], cfg["key_kind"], cfg["trials"], seed, ids, ends, starts,
                       multi=True)


def _need_text_model(ctx: TaskContext, name: str, text: bool):
    if ctx.tokenizer is None:
        raise ValueError(f"task {name} needs a tokenizer (this model has none: use task=recall for model=tiny_recall)")
    if text and ctx.text is None:
        raise ValueError(f"task {name} needs a text (ctx.text) for its haystack")


def _metrics(grid: list[dict], lengths: list[int], key: str = "length") -> dict[str, float]:
    """Accuracy overall and per length, each with its Wilson 95 % interval (ci_low / ci_high);
    cells count equally (they have equal trials)."""
    def rec(cells: list[dict]) -> tuple[float, float, float]:
        k = sum(g["accuracy"] * g["trials"] for g in cells)
        n = sum(g["trials"] for g in cells)
        return (float(np.mean([g["accuracy"] for g in cells])), *wilson(k, n))

    acc, lo, hi = rec(grid)
    m = {"accuracy": acc, "ci_low": lo, "ci_high": hi}
    for n in lengths:
        acc, lo, hi = rec([g for g in grid if g[key] == n])
        m |= {f"accuracy@{n}": acc, f"ci_low@{n}": lo, f"ci_high@{n}": hi}
    return m


# -- tasks ------------------------------------------------------------------------------------
def passkey_prompts(tok: Any, length: int, depth: float, trials: int, seed: int,
                    haystack: np.ndarray | None = None, ends: np.ndarray | None = None,
                    starts: np.ndarray | None = None) -> list[Prompt]:
    """`trials` passkey prompts of exactly `length` tokens with the key at `depth`. Keys (and text
    offsets, for a text haystack) depend only on (seed, length, depth)."""
    rng = np.random.default_rng([seed, length, int(round(depth * 1e6)), 1])
    head, tail = frame(tok, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, PASSKEY_PREFIX)
    if haystack is None:
        haystack = filler_haystack(tok, length)
        ends = sentence_ends(tok, haystack)
    out = []
    for _ in range(trials):
        key = str(rng.integers(10000, 100000))
        off = int(rng.choice(starts)) if starts is not None else 0
        needle = tok.encode(" " + PASSKEY_NEEDLE.format(key=key))
        out.append(build_prompt(head, tail, haystack[off:], ends[off:], length, [needle], [depth], key))
    return out


def needle_prompts(tok: Any, length: int, depths: Sequence[float] | None, n_keys: int, key_kind: str,
                   trials: int, seed: int, ids: np.ndarray, ends: np.ndarray, starts: np.ndarray,
                   multi: bool) -> list[Prompt]:
    """NIAH (multi=False: one needle per depth in `depths`, keyed by a name) or multi-key (n_keys
    needles at uniform random depths, keys words or UUIDs) prompts of exactly `length` tokens."""
    tag = [seed, length, 2 if multi else 3] + ([int(round(depths[0] * 1e6))] if depths else [])
    rng = np.random.default_rng(tag)
    template = "One of the special magic numbers for {key} is: {value}." if multi else NIAH_NEEDLE
    out = []
    for _ in range(trials):
        if not multi:
            keys = [NAMES[int(rng.integers(len(NAMES)))]]
            at = list(depths)
        elif key_kind == "uuid":
            keys = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n_keys)]
            at = list(rng.random(n_keys))
        else:
            pick = rng.choice(len(ADJECTIVES) * len(NOUNS), n_keys, replace=False)
            keys = [f"{ADJECTIVES[i // len(NOUNS)]}-{NOUNS[i % len(NOUNS)]}" for i in pick]
            at = list(rng.random(n_keys))
        values = [str(v) for v in rng.integers(1_000_000, 10_000_000, len(keys))]
        ask = int(rng.integers(len(keys)))
        head, tail = frame(tok, NIAH_INSTRUCTION, NIAH_QUESTION.format(key=keys[ask]),
                           NIAH_PREFIX.format(key=keys[ask]))
        needles = [tok.encode(" " + template.format(key=k, value=v)) for k, v in zip(keys, values)]
        off = int(rng.choice(starts))
        p = build_prompt(head, tail, ids[off:], ends[off:], length, needles, at, values[ask])
        # the queried needle first, so p.depths[0] / p.needle_starts[0] describe it
        order = [ask] + [i for i in range(len(keys)) if i != ask]
        out.append(dataclasses.replace(p, needle_starts=tuple(p.needle_starts[i] for i in order),
                                       depths=tuple(p.depths[i] for i in order)))
    return out


def text_haystack_ids(tok: Any, text: str, max_len: int):
    ids = text_tokens(tok, text, max_len)
    ends = sentence_ends(tok, ids)
    starts = _paragraph_starts(tok, ids, max(len(ids) - max_len - SNAP, 1))
    return ids, ends, starts


def _score(ctx: TaskContext, cells: list[tuple[dict, list[Prompt]]], n_gen: int, batch: int, score,
           lengths: list[int], desc: str, shape: tuple[int, ...] | None = None,
           arrays: dict[str, np.ndarray] | None = None, protocol: str = "query_aware") -> TaskResult:
    """The scoring path of the text retrieval tasks: greedy answers to every cell's prompts (one
    engine for all), each scored by `score(text, answer)`. grid: each cell's record with its
    accuracy and trials; arrays: `correct` [cells, trials] and the decoded `outputs`, both reshaped
    to `shape` if given, with the task's own `arrays` between them; metrics: by length."""
    max_len = max(len(p.tokens) for _, ps in cells for p in ps) + n_gen
    engine = ctx.engine(max_len)
    grid, correct, outputs = [], [], []
    for rec, prompts in tqdm(cells, desc=desc, disable=not ctx.progress, leave=False):
        rec = rec | {"protocol": protocol}
        if protocol == "query_aware":
            ids = generate(engine, [p.tokens for p in prompts], n_gen, batch, ctx.chunk)
        else:  # the context (everything before the question) compressed first
            samples = [Sample(p.tokens, (p.answer,), p.haystack[1]) for p in prompts]
            ids = [x for b in range(0, len(samples), batch)
                   for x in answer(engine, samples[b:b + batch], n_gen, protocol, ctx.chunk)]
        texts = [decode_until_eos(ctx.tokenizer, x) for x in ids]
        ok = [score(t, p.answer) for t, p in zip(texts, prompts)]
        lo, hi = wilson(float(np.sum(ok)), len(ok))
        grid.append(rec | {"accuracy": float(np.mean(ok)), "trials": len(prompts), "ci_low": lo, "ci_high": hi})
        correct.append(ok)
        outputs.append(texts)
    correct, outputs = np.array(correct), np.array(outputs)  # [cells, trials]
    if shape is not None:
        correct, outputs = correct.reshape(shape), outputs.reshape(shape)
    return TaskResult(metrics=_metrics(grid, lengths), grid=grid,
                      arrays={"correct": correct, **(arrays or {}), "outputs": outputs})


def passkey(ctx: TaskContext) -> TaskResult:
    """Passkey retrieval over lengths x depths (exact match of the first 5-digit number)."""
    cfg = check(ctx.task, "passkey")
    _need_text_model(ctx, "passkey", cfg["haystack"] == "text")
    tok = ctx.tokenizer
    if cfg["haystack"] == "text":
        ids, ends, starts = text_haystack_ids(tok, ctx.text, max(cfg["lengths"]))
    else:
        ids = filler_haystack(tok, max(cfg["lengths"]))
        ends, starts = sentence_ends(tok, ids), None
    cells = [({"length": n, "depth": d}, passkey_prompts(tok, n, d, cfg["trials"], ctx.seed, ids, ends, starts))
             for n in cfg["lengths"] for d in cfg["depths"]]
    shape = (len(cfg["lengths"]), len(cfg["depths"]), cfg["trials"])
    return _score(ctx, cells, PASSKEY_TOKENS, cfg["batch"], lambda t, a: parse_passkey(t) == a, cfg["lengths"],
                  "passkey", shape, protocol=cfg["protocol"])


def niah(ctx: TaskContext) -> TaskResult:
    """Needle in a haystack of real text over lengths x depths (the needle's number in the answer)."""
    cfg = check(ctx.task, "niah")
    _need_text_model(ctx, "niah", True)
    tok = ctx.tokenizer
    ids, ends, starts = text_haystack_ids(tok, ctx.text, max(cfg["lengths"]))
    cells = [({"length": n, "depth": d},
              needle_prompts(tok, n, [d], 1, "names", cfg["trials"], ctx.seed, ids, ends, starts, multi=False))
             for n in cfg["lengths"] for d in cfg["depths"]]
    shape = (len(cfg["lengths"]), len(cfg["depths"]), cfg["trials"])
    return _score(ctx, cells, NEEDLE_TOKENS, cfg["batch"], contains_answer, cfg["lengths"], "niah", shape,
                  protocol=cfg["protocol"])


def multikey(ctx: TaskContext) -> TaskResult:
    """RULER multi-key NIAH: n_keys needles at random depths, one asked for, per length."""
    cfg = check(ctx.task, "multikey")
    _need_text_model(ctx, "multikey", True)
    tok = ctx.tokenizer
    ids, ends, starts = text_haystack_ids(tok, ctx.text, max(cfg["lengths"]))
    cells = [({"length": n, "n_keys": cfg["n_keys"], "key_kind": cfg["key_kind"]},
              needle_prompts(tok, n, None, cfg["n_keys"], cfg["key_kind"], cfg["trials"], ctx.seed, ids, ends,
                             starts, multi=True))
             for n in cfg["lengths"]]
    depth = np.array([[p.depths[0] for p in ps] for _, ps in cells]).astype(np.float32)  # [lengths, trials]
    return _score(ctx, cells, NEEDLE_TOKENS, cfg["batch"], contains_answer, cfg["lengths"], "multikey",
                  arrays={"depth": depth}, protocol=cfg["protocol"])


def recall(ctx: TaskContext) -> TaskResult:
    """Associative recall on the synthetic model (evals/recall_model.py): `BOS p1 .. pN q` (one
    token per key-value pair) -> the value paired with q. curves["by_pair@N"][i] is the accuracy
    when pair i is asked (0 = the first pair, N - i tokens before the query; NaN if never asked)."""
    from evals.recall_model import RecallTask
    cfg = check(ctx.task, "recall")
    layout = {k: cfg[k] for k in ("n_keys", "n_values") if k in cfg}
    task = RecallTask(n_pairs=1, n_queries=1, **layout)
    if task.vocab_size > ctx.model.cfg.vocab_size:
        raise ValueError(f"recall layout needs vocab {task.vocab_size} > the model's {ctx.model.cfg.vocab_size}")
    engine = ctx.engine(max(cfg["n_pairs"]) + 2)
    grid, curves, arrays = [], {}, {}
    for n in cfg["n_pairs"]:
        tokens, answers, which = task.prompts(ctx.seed, cfg["trials"], n)
        logits, _ = engine.prefill(tokens, chunk=ctx.chunk)  # [B, V]
        correct = np.asarray(logits).argmax(-1) == answers  # [B]
        grid.append({"n_pairs": n, "accuracy": float(correct.mean()), "trials": cfg["trials"]}
                    | dict(zip(("ci_low", "ci_high"), wilson(float(correct.sum()), cfg["trials"]))))
        curves[f"by_pair@{n}"] = [float(correct[which == i].mean()) if (which == i).any() else float("nan")
                                  for i in range(n)]
        arrays[f"correct@{n}"], arrays[f"pair@{n}"] = correct, which
    metrics = _metrics(grid, cfg["n_pairs"], key="n_pairs") | {"chance": 1.0 / task.n_values}
    return TaskResult(metrics=metrics, arrays=arrays, grid=grid, curves=curves)


# -- the tasks, as evals.run asks them (evals.common.Task) --------------------------------------------
def extent(task: dict) -> tuple[str, int, int, int]:
    """(field, longest prompt, tokens generated, batch) of passkey, niah or multikey."""
    t = check(task)
    gen = PASSKEY_TOKENS if task["name"] == "passkey" else NEEDLE_TOKENS
    return lengths_field(t), max(t["lengths"]), gen, t["batch"]


def check_text(conf: dict, tokenizer, text: str | None) -> None:
    """The shortest prompt fits its template, needles and question (`check_prompts`)."""
    try:
        check_prompts(conf["task"], tokenizer, conf["seed"])
    except ValueError as e:
        raise ValueError(f"{lengths_field(conf['task'])}: {e}") from None


# `protocol` came after the first rows were keyed: at query_aware they keep their keys
_NEEDLES = dict(check=check, extent=extent, check_text=check_text, later_keys={"protocol": "query_aware"})
PASSKEY = Task(run=passkey, **_NEEDLES)
NIAH = Task(run=niah, **_NEEDLES)
MULTIKEY = Task(run=multikey, **_NEEDLES)
RECALL = Task(run=recall, check=check)
