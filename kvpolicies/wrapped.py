"""`Wrapped`, `Delegating`: the bases of kvpress's wrappers over an inner prompt scorer (`kvpolicies.compat`'s
Chunked, Blocked, ChunkKV, EntropyChunkKV, Rerotated; `kvpolicies.critical`), below both so that neither
imports the other.

Shapes: B batch, K kv heads, V view slots, M = max_len (the prompt phase's slots).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array

from kvpolicies.codecs import Codec, Identity
from kvpolicies.expected import Expected
from kvpolicies.keydiff import KeyDiff
from kvpolicies.knorm import Knorm
from kvpolicies.lagkv import LagKV
from kvpolicies.prompt import PromptState
from kvpolicies.prompt_scored import PromptScored, chunked
from kvpolicies.random_keep import RandomKeep
from kvpolicies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class Wrapped(PromptScored):
    """A kvpress wrapper over a prompt scorer `press` whose ranking reads only the slots it is given
    (knorm, keydiff, lagkv, random): `prompt_rank` ranks subsets of the prompt (`press` sees the
    others as empty slots); streams (and generation past `max_new`) take `press`'s own rule on overflow."""

    press: PromptScored = None
    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    takes: ClassVar[tuple[type, ...]] = (Knorm, KeyDiff, LagKV, RandomKeep)  # what `press` may be

    def __post_init__(self):
        super().__post_init__()
        if type(self.press) not in self.takes:
            raise ValueError(f"{self.label}.press={self.press!r}: must be one of "
                             f"{[c.__name__ for c in self.takes]} (a prompt scorer that ranks any subset of the prompt)")

    @property
    def observes(self):
        return self.press.observes

    @property
    def collects(self):
        return self.press.collects

    def rank(self, slots, keys, stats, seen):
        return self.press.rank(slots, keys, stats, seen)

    def shape_class(self, slots: int) -> "Wrapped":
        """The wrapper's shape class over `press`'s (whose ratio it never reads: `press` only ranks), so that
        the wrapper's ratios share one policy."""
        return dataclasses.replace(super().shape_class(slots), press=self.press.shape_class(slots))

    def subset_rank(self, state: PromptState, slots, keys, stats, subset: Array) -> Array:
        """`press`'s priority of the slots in `subset` [B, K, V] ranked among themselves (-inf elsewhere)."""
        sub = dataclasses.replace(slots, pos=jnp.where(subset, slots.pos, -1))
        prio, _ = self.press.prompt_rank(state, sub, keys, stats)
        return jnp.where(subset, prio, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class Delegating(Wrapped):
    """A kvpress wrapper whose inner `press` ranks the whole prompt (not a subset): it may also keep
    statistics for its stream rule (snapkv's observation mass, expected's query sums), which this
    wrapper keeps and updates as `press` does; its prompt phase is `press`'s (snapkv's rows)."""

    takes = (Knorm, KeyDiff, LagKV, RandomKeep, SnapKV, Expected)

    @property
    def accumulates(self):
        return self.press.accumulates

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        slots = super().init(batch, kv_heads, head_dim, dtype, max_len)  # `accumulates`: with the mass
        shapes = jax.eval_shape(lambda: self.press.split(self.press.init(batch, kv_heads, head_dim, dtype, 1))[1])
        return self.join(slots, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))

    @chunked  # the inner presses' observe all take a step's T queries (`chunked`)
    def observe(self, slots, stats, view, seen, count, s):
        return self.press.observe(slots, stats, view, seen, count, s)

    def restart(self, slots, over):
        return self.press.restart(slots, over)

    def split(self, state):
        return self.press.split(state)

    def join(self, slots, stats):
        return self.press.join(slots, stats)

    def from_prompt(self, state, pos):
        return self.press.from_prompt(state, pos)

    def prompt_policy(self):
        return dataclasses.replace(self.press.prompt_policy(), of=self)

    def kvpress_scores(self, state: PromptState, prio: Array) -> Array:
        """`press`'s prompt priorities [B, K, M] in the units of kvpress's `press.score` where they differ
        by a factor: snapkv sums the window's rows over the G query heads and the kernel, kvpress averages
        (G read from the rows: each filled row of a kv head sums to G)."""
        if type(self.press) is not SnapKV:
            return prio
        g = state.rows[:, :1].sum(axis=-1).max(axis=-1)[:, :, None]  # [B, 1, 1]: G (a full row sums to G)
        kernel = self.press.kernel if self.press.pooling == "avg" else 1
        return prio / (g * self.press.obs_window * kernel)
