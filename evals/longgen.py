"""Long generations under a cache policy, scored against the full cache's own generation.

Shapes: T prompt tokens, n generated tokens.

A prompt of `length` tokens (the chat header, an instruction, a Paul Graham haystack, then an
arithmetic chain of `steps` operations on small integers that the model is asked to work out
one line per step before writing `Answer: <value>`) is followed by `gen` greedy tokens, twice:
under the run's policy and under `full` (the model's own stack: `models.stacks.model_stack`;
remembered per model and prompt, so the jobs of one `evals.compare` generate it once).
A prompt compressor compresses once after the whole prompt (the problem seen: query-aware),
then decodes through its decode policy; a streaming policy (sink, window, h2o, tova...) evicts
while it decodes, as it always does. Nothing is recompressed during generation.

Per trial, against the full cache's generation up to and including its first stop token (its
end-of-sequence or end-of-turn id; all `gen` tokens if it never stops), the "reference span":
  prefix      tokens equal to full's before the first difference (`prefix_tokens`; `prefix_frac`
              of the span);
  agreement   the fraction of the span's positions where the two generations hold the same token;
  length      tokens generated before the first stop token, for the policy and for full
              (`length`, `full_length`): a compressed cache can make an answer longer;
  accuracy    whether the text before the first stop holds `Answer: <the chain's value>`
              (Wilson interval), for the policy and for full (`full_accuracy`).

    python -m evals.run model=qwen task=longgen policy=sink window=512 "task.lengths=[2048]"
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import numpy as np
from tqdm.auto import tqdm

import kvpolicies
from evals import prefills
from evals import retrieval as R
from evals import ruler
from evals.common import Task, TaskContext, TaskResult, lengths_field

DEFAULTS = {"lengths": [2048], "trials": 4, "gen": 512, "steps": 24, "haystack": "pg"}
INSTRUCTION = ("Read the essay below. After it comes an arithmetic problem: solve that problem, "
               "the essay is only there to be read.")
QUESTION = ("Problem: start with {start}. {ops}\nWork it out one step per line, writing the running value "
            "after each step (\"Step 1: ...\"), then give the final value as \"Answer: <value>\".")
PREFIX = "Step 1:"
STOP_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>", "</s>")
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def check(task: dict) -> dict[str, Any]:
    """The validated config (defaults filled in); unknown keys or bad values raise ValueError."""
    return R.known_task(dict(task), "longgen", DEFAULTS, ("trials", "gen", "steps"))


def extent(task: dict) -> tuple[int, int]:
    """(the longest prompt, tokens generated after it)."""
    cfg = check(task)
    return max(cfg["lengths"]), cfg["gen"]


def chain(rng: np.random.Generator, steps: int) -> tuple[int, str, int]:
    """(start, the operations as text, the final value): `steps` additions and subtractions of
    1..9 (the running value stays in 0..99)."""
    start = value = int(rng.integers(10, 60))
    ops = []
    for _ in range(steps):
        k = int(rng.integers(1, 10))
        if value - k >= 0 and (value + k > 99 or rng.random() < 0.5):
            ops.append(f"Subtract {k}.")
            value -= k
        else:
            ops.append(f"Add {k}.")
            value += k
    return start, " ".join(ops), value


def samples(tok: Any, hay: ruler.Haystack, length: int, trials: int, seed: int, steps: int
            ) -> list[tuple[np.ndarray, int]]:
    """Per trial: (the prompt ids, exactly `length` tokens; the chain's final value)."""
    rng = np.random.default_rng([seed, length, 23, steps])
    out = []
    for _ in range(trials):
        start, ops, value = chain(rng, steps)
        head, tail = R.frame(tok, INSTRUCTION, QUESTION.format(start=start, ops=ops), PREFIX)
        off = int(rng.choice(hay.starts))
        p = R.build_prompt(head, tail, hay.ids[off:], hay.ends[off:], length, [], [], str(value))
        out.append((np.asarray(p.tokens, np.int32), value))
    return out


def stop_ids(tok: Any) -> set[int]:
    """The ids that end a generation: the tokenizer's end of sequence and the end-of-turn markers
    it holds as single tokens."""
    ids = {tok.eos_id} if getattr(tok, "eos_id", None) is not None else set()
    for m in STOP_MARKERS:
        enc = tok.encode(m)
        if len(enc) == 1:
            ids.add(int(enc[0]))
    return ids


def stopped(ids: np.ndarray, stops: set[int]) -> int:
    """Tokens before the first stop id (len(ids) if none)."""
    hit = np.flatnonzero(np.isin(ids, list(stops))) if stops else np.zeros(0, int)
    return int(hit[0]) if hit.size else len(ids)


def compare(got: np.ndarray, ref: np.ndarray, stops: set[int]) -> dict[str, float]:
    """One trial's numbers: `got` against the reference `ref` (both [n] ids), over the reference
    span (ref up to and including its first stop)."""
    ref_len = stopped(ref, stops)
    span = min(ref_len + 1, len(ref))
    same = got[:span] == ref[:span]
    prefix = int(np.argmin(same)) if not same.all() else span
    return {"prefix_tokens": prefix, "prefix_frac": prefix / span, "agreement": float(same.mean()),
            "length": stopped(got, stops), "full_length": ref_len, "span": span}


def answer_ok(tok: Any, ids: np.ndarray, stops: set[int], value: int) -> float:
    """1.0 if the text before the first stop holds `Answer: <value>` (its first Answer line)."""
    m = ANSWER.search(tok.decode(list(map(int, ids[:stopped(ids, stops)]))))
    return float(m is not None and int(m.group(1)) == value)


# full's generations, per model, by (prompt ids, gen, chunk): the jobs of one `evals.compare` run in
# one process, so the reference is generated once per prompt, not once per job
_REFERENCE: "weakref.WeakKeyDictionary[Any, dict[tuple, np.ndarray]]" = weakref.WeakKeyDictionary()


class Reference:
    """`full`'s generation of a prompt on the model's own stack (`models.stacks.model_stack`):
    remembered per model, generated by the run's engine itself when it runs that stack, else by
    an engine built on first need."""

    def __init__(self, ctx: TaskContext, max_len: int, engine):
        from models.stacks import model_stack

        self.model, self.max_len = ctx.model, max_len
        self.stack = model_stack(ctx.model.cfg, kvpolicies.get("full"))
        self.engine = engine if tuple(engine.policies) == self.stack else None
        self.memo = _REFERENCE.setdefault(ctx.model, {})

    def __call__(self, prompt: np.ndarray, gen: int, chunk: int) -> np.ndarray:
        key = (prompt.tobytes(), gen, chunk)
        if key not in self.memo:
            if self.engine is None:
                from models.engine import Engine

                self.engine = Engine(self.model, self.stack, self.max_len)
            self.memo[key] = generate(self.engine, prompt, gen, chunk)
        return self.memo[key]


def generate(engine, prompt: np.ndarray, gen: int, chunk: int) -> np.ndarray:
    """`gen` greedy ids [n] after the prompt: compressed once after it (a prompt compressor)."""
    state = engine.compress(prefills.prompted(engine, prompt[None], chunk))
    return np.asarray(engine.continue_generate(state, [], gen)[0])


def run(ctx: TaskContext) -> TaskResult:
    """grid: one cell per length (accuracy with its Wilson interval, and the means of the numbers
    of `compare`); metrics: the same over every trial; arrays: `ids` and `full_ids` [lengths,
    trials, n], `score` [lengths, trials]."""
    cfg = check(ctx.task)
    tok, hay = ruler.task_haystack(ctx, cfg, max(cfg["lengths"]))
    max_len = max(cfg["lengths"]) + cfg["gen"]
    engine = ctx.engine(max_len)
    reference = Reference(ctx, max_len, engine)
    stops = stop_ids(tok)
    grid, ids, full_ids, scores, rows = [], [], [], [], []
    for n in cfg["lengths"]:
        got_l, ref_l, sc, cells = [], [], [], []
        for prompt, value in tqdm(samples(tok, hay, n, cfg["trials"], ctx.seed, cfg["steps"]), desc="longgen",
                                  disable=not ctx.progress, leave=False):
            ref = reference(prompt, cfg["gen"], ctx.chunk)
            got = ref if reference.engine is engine else generate(engine, prompt, cfg["gen"], ctx.chunk)
            cell = compare(got, ref, stops) | {"full_score": answer_ok(tok, ref, stops, value)}
            sc.append(answer_ok(tok, got, stops, value))
            got_l.append(got)
            ref_l.append(ref)
            cells.append(cell)
        grid.append({"length": n} | ruler.accuracy_record(sc) | means(cells))
        ids.append(got_l)
        full_ids.append(ref_l)
        scores.append(sc)
        rows += cells
    all_sc = np.asarray(scores, np.float32)
    metrics = {k: v for k, v in ruler.accuracy_record(all_sc.ravel()).items() if k != "trials"}
    metrics |= means(rows) | ruler.work(engine) | {"contexts": all_sc.size}
    return TaskResult(metrics=metrics, grid=grid, arrays={"ids": np.asarray(ids, np.int32),
                                                          "full_ids": np.asarray(full_ids, np.int32),
                                                          "score": all_sc})


def means(cells: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each number over trials (full's answers as `full_accuracy`)."""
    out = {k: float(np.mean([c[k] for c in cells])) for k in cells[0] if k not in ("span", "full_score")}
    return out | {"full_accuracy": float(np.mean([c["full_score"] for c in cells]))}


TASK = Task(run=run, check=check, extent=lambda task: (lengths_field(task), *extent(task), 1))
