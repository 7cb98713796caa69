"""What every eval task receives and returns (the contract between evals.run and the tasks)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

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

    def engine(self, max_len: int) -> Engine:
        """An engine for sequences up to max_len tokens (reuse it: it holds the compiled steps);
        with kvzip's repeat prompts in this tokenizer's ids when a policy reconstructs."""
        pols = (self.policies,) if isinstance(self.policies, Policy) else tuple(self.policies)
        repeat = None
        if self.tokenizer is not None and any(p.reconstructs for p in pols):
            from models.reconstruct import repeat_prompts

            repeat = repeat_prompts(self.tokenizer)
        return Engine(self.model, self.policies, max_len, repeat=repeat)


@dataclasses.dataclass
class TaskResult:
    """metrics: flat scalars for tables; arrays: saved beside the results (e.g. per-token NLL);
    grid: one record per cell (e.g. {"length", "depth", "accuracy"}); curves: named series."""

    metrics: dict[str, float]
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    grid: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    curves: dict[str, list[float]] = dataclasses.field(default_factory=dict)


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
