"""What an engine's cache carries besides its layers' states: its extent (the next position of
each row) and its maker (the engine layout that built it), so that every entry point continues a
state where it ends, or refuses one it did not make, on the host, before anything is traced.

Shapes: B batch.

`EngineCache` is what `Engine.init_cache`, `prefill`, `step` and `score(return_cache=True)` return:
a registered dataclass (a pytree: its `length` is an array leaf, so it travels through `jit` and
`jax.tree.map`; its `maker` is static) that reads as the model's `Cache`, the tuple of one stacked
state per run of layers (`cache[0]`, `len(cache)`, iteration). `Engine.prompt`'s `Prompted`
carries the same two facts (`length`, `maker`). A `Maker` is compared whole (a static value); a
bare tuple of states, which carries neither, is checked against the engine's own shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Int


@dataclasses.dataclass(frozen=True)
class Maker:
    """The engine layout a cache was built for: its per-layer policies (the prompt phase's for a
    prompt-phase cache), max_len, the model's shapes and the cache dtype."""

    policies: tuple
    max_len: int
    model: tuple  # (n_layers, n_heads, n_kv_heads, head_dim, d_model, vocab_size)
    dtype: str

    def difference(self, other: "Maker") -> str:
        """The first way `other` (the state's maker) differs from this one (the engine's), in words."""
        if other.model != self.model:
            names = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "vocab_size")
            i = next(i for i, (a, b) in enumerate(zip(other.model, self.model)) if a != b)
            return f"a model of {names[i]}={other.model[i]} there, {self.model[i]} here"
        if other.max_len != self.max_len:
            return f"max_len={other.max_len} there, {self.max_len} here"
        if other.policies != self.policies:
            i = next(i for i, (a, b) in enumerate(zip(other.policies, self.policies)) if a != b)
            return f"layer {i}'s policy {_name(other.policies[i])} there, {_name(self.policies[i])} here"
        return f"cache dtype {other.dtype} there, {self.dtype} here"


def _name(policy: Any) -> str:
    text = repr(policy)
    return text if len(text) <= 120 else text[:117] + "..."


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class EngineCache(Sequence):
    """An engine's cache: the model's `Cache` (`runs`: one stacked state per run of layers), the
    next position of each row (`length` [B] int32) and the layout that built it (`maker`, static).
    Indexing, `len` and iteration read `runs`."""

    runs: tuple
    length: Int[Array, "B"]
    maker: Maker = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, i):
        return self.runs[i]

    def __len__(self) -> int:
        return len(self.runs)


def refused(what: str, maker: Maker, want: Maker) -> ValueError:
    """The one error for a state another engine layout made."""
    return ValueError(f"{what}: the state was made by another engine ({want.difference(maker)}); continue it "
                      "with the engine that made it, or start one here (Engine.prompt / prefill / init_cache)")


def bare_shapes(cache: Any, want: Any, what: str) -> None:
    """A bare tuple of run states (no maker) against the engine's own empty cache `want` of the
    step's batch (`jax.eval_shape` of it): the same runs, state types and shapes, or ValueError."""
    if not isinstance(cache, (tuple, list)) or len(cache) != len(want):
        raise ValueError(f"{what}: expected the cache an Engine returned (init_cache, prefill, step) or its "
                         f"{len(want)} run states, got {type(cache).__name__}"
                         + (f" of {len(cache)}" if isinstance(cache, (tuple, list)) else ""))
    for i, (got, exp) in enumerate(zip(cache, want)):
        ok = type(got) is type(exp) and jax.tree.structure(got) == jax.tree.structure(exp)
        if not ok or any(tuple(np.shape(a)) != tuple(b.shape) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exp))):
            raise ValueError(f"{what}: run {i} of the cache is not this engine's for this batch (another policy, "
                             "max_len, model or batch); pass a cache this engine made (init_cache, prefill, step)")
