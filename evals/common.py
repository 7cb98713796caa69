"""What every eval task receives, returns and answers (`Task`: the contract between evals.run and the
tasks), and what the retrieval tasks share: Wilson intervals, a prompt split into context and question, greedy answers."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from evals import prefills
from kvpolicies.base import Policy
from models.engine import Engine
from models.llama import Llama


@dataclasses.dataclass
class TaskContext:
    """Everything a task needs: the model, its tokenizer, the policy stack, the task's config."""

    model: Llama
    tokenizer: Any  # models.tokenizer.Tokenizer, or None for synthetic-token models
    policies: Policy | Sequence[Policy]
    task: dict[str, Any]  # the task config group as a plain dict
    text: str | None = None  # the long text (haystack / perplexity stream)
    seed: int = 0
    chunk: int = 512
    progress: bool = True
    fit: int = 0  # `Engine(fit=)`: generate stores each prompt's layers at what they kept

    def engine(self, max_len: int) -> Engine:
        """An engine for sequences up to max_len tokens (reuse it: it holds the compiled steps);
        kvzip's repeat prompts come from this tokenizer (in its layers' style)."""
        return Engine(self.model, self.policies, max_len, repeat=self.tokenizer, fit=self.fit)


@dataclasses.dataclass
class TaskResult:
    """metrics: flat scalars for tables; arrays: saved beside the results (e.g. per-token NLL);
    grid: one record per cell (e.g. {"length", "depth", "accuracy"}); curves: named series."""

    metrics: dict[str, float]
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    grid: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    curves: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def grid_cells(task: dict[str, Any]) -> int:
    """The sequences of a task's longest extent a run computes: one per (length, depth, trial) of
    its config (a key it does not have counts once)."""
    n = max(1, int(task.get("trials") or 1))
    for key in ("lengths", "depths"):
        n *= max(1, len(task.get(key) or [1]))
    return n


def lengths_field(task: dict[str, Any]) -> str:
    """`task.lengths=[a, b]`: how errors and estimates name a task's lengths."""
    v = task.get("lengths")
    return "task.lengths=" + ("[" + ", ".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v))


@dataclasses.dataclass(frozen=True)
class Task:
    """An eval task, as `evals.run` asks it: `run` does the work, the other hooks answer before any
    weights load. `evals.config.TASKS` maps each task name to its Task (or to "module:NAME", imported
    when a run needs it); the task's config is configs/task/<name>.yaml, or `defaults` when there is
    no such file. Calling a Task runs it. Each hook takes the task's config (a dict with its `name`).

    - `run(ctx)`: the task on a `TaskContext`, returning a `TaskResult`.
    - `check(task)`: raises ValueError naming a bad key or value (every job is checked first).
    - `extent(task)`: (the config field that sets it, prompt or stream tokens, tokens generated
      after them, batch) of the run's longest sequence, or None: it sizes budgets and ratios,
      checks the trained length and the memory, and estimates the run.
    - `cells(task)`: how many sequences of that extent the run computes (the estimate's factor).
    - `check_text(conf, tokenizer, text)`: the checks that need the tokenizer (`conf`: the run's
      whole config; the text's length, prompt templates), raising ValueError with the whole message.
    - `later_keys`: keys added after saved rows were keyed, with their defaults: at its default
      such a key is left out of the run key, so those rows keep theirs (resume finds them).
    - `defaults`: the config when configs/task/<name>.yaml does not exist.
    """

    run: Callable[[TaskContext], TaskResult]
    check: Callable[[dict[str, Any]], Any] | None = None
    extent: Callable[[dict[str, Any]], tuple[str, int, int, int] | None] | None = None
    cells: Callable[[dict[str, Any]], int] = grid_cells
    check_text: Callable[[dict[str, Any], Any, str | None], None] | None = None
    later_keys: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] | None = None

    def __call__(self, ctx: TaskContext) -> TaskResult:
        return self.run(ctx)


# JAX's compile phases (tracing, lowering, XLA compilation): their time spans, merged, are a run's
# compile time, reported apart from its throughput.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


@dataclasses.dataclass
class CompileTime:
    """The compile-phase time spans seen inside `compile_time()`; `seconds` is their union (nested
    spans, a trace inside a trace, count once)."""

    spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    @property
    def seconds(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


@contextlib.contextmanager
def compile_time() -> Iterator[CompileTime]:
    """Collect the compile time spent inside the block (`jax.monitoring` time spans of COMPILE_EVENTS)."""
    import jax.monitoring as mon

    out = CompileTime()

    def listen(event: str, start: float, end: float, **_: object) -> None:
        if event in COMPILE_EVENTS:
            out.spans.append((start, end))

    mon.register_event_time_span_listener(listen)
    try:
        yield out
    finally:
        mon.unregister_event_time_span_listener(listen)


# -- shared by the tasks: intervals, prompts split into context and question, greedy answers ---------
def wilson(successes: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval for a binomial proportion (95 % by default). A fractional count
    (the sum of partial scores of string_match_all) is taken as is: approximate for those."""
    if n <= 0:
        return float("nan"), float("nan")
    p = successes / n
    d = 1 + z * z / n
    center = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # the interval holds p (exactly at p = 0 or 1, where the rounding of center -/+ half may not)
    return min(p, max(0.0, center - half)), max(p, min(1.0, center + half))


def accuracy_record(scores: Sequence[float]) -> dict[str, float]:
    """{"accuracy", "ci_low", "ci_high", "trials"} of per-trial scores in [0, 1]."""
    s = np.asarray(scores, float)
    lo, hi = wilson(float(s.sum()), len(s))
    return {"accuracy": float(s.mean()) if len(s) else float("nan"), "ci_low": lo, "ci_high": hi, "trials": len(s)}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt: ids [T], the references, the index where the question starts (the context is
    tokens[:split]), and each needle's start and actual depth (empty for the list tasks)."""

    tokens: np.ndarray
    refs: tuple[str, ...]
    split: int
    needle_starts: tuple[int, ...] = ()
    depths: tuple[float, ...] = ()


def answer(engine, group: Sequence[Sample], n: int, protocol: str, chunk: int) -> list[list[int]]:
    """Greedy answers to prompts of equal length. The prompt phase gets the whole prompt
    (query-aware: what `Engine.generate` does) or the context only (query-agnostic: the question
    follows the compression); rows with equal split run together. The prefill goes through
    `evals.prefills.prompted`: inside `sharing()`, one prefill serves every engine that can
    compress it."""
    out: dict[int, list[int]] = {}
    cut = [len(s.tokens) if protocol == "query_aware" else s.split for s in group]
    for sp in sorted(set(cut)):
        idx = [i for i, c in enumerate(cut) if c == sp]
        toks = np.stack([group[i].tokens for i in idx])
        state = engine.compress(prefills.prompted(engine, toks[:, :sp], chunk))
        ids = engine.continue_generate(state, toks[:, sp:], n, chunk=chunk)
        out.update({i: list(map(int, r)) for i, r in zip(idx, ids)})
    return [out[i] for i in range(len(group))]
