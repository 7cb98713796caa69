"""What every eval task receives and returns (the contract between evals.run and the tasks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
