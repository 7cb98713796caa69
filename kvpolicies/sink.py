"""`sink`: StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention
Sinks") — the first `n_sink` tokens plus the newest `window` tokens, n_sink + window slots."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from kvpolicies.base import Policy, RopePositions, keys_rotated
from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.limits import Ring
from kvpolicies.ring import ring_compact, ring_extend


@dataclasses.dataclass(frozen=True)
class Sink(Ring, Budgeted, Policy):
    """Query p sees keys j with j < n_sink or j > p - window (the window includes p itself).

    positions="cache" rotates keys by their rank in the cache and the query by its own rank
    (StreamingLLM's re-indexing): window keys keep their distance p - j, and once tokens have
    been evicted a sink j is at distance (n_sink + window - 1) - j. This is computed exactly
    for every query of a chunk with two RoPE segments.

    `window=W` counts the query itself (query p sees tokens p-W+1..p besides the sinks). In
    StreamingLLM's perplexity script (examples/eval_long_ppl.py, which trims the cache to
    start_size + recent_size after each step) that is recent_size = W - 1; in its streaming demo
    (evict_for_space before each step) it is recent_size = W.
    """

    budget_field = "window"

    n_sink: int = 4
    window: int = 4096
    positions: Literal["original", "cache"] = "cache"
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("sink", "n_sink", self.n_sink, 0)
        check_int("sink", "window", self.window, 1)
        check_choice("sink", "positions", self.positions, ("original", "cache"))

    @classmethod
    def for_tokens(cls, n, **kw):
        """n tokens in all: the sinks and a window of n - n_sink (at least 1)."""
        return cls(window=max(n - kw.get("n_sink", cls.n_sink), 1), **kw)

    @property
    def rotated_keys(self):
        # Keys are rotated at their text positions in both modes (cache mode's second RoPE segment
        # rotates the queries that pair with the sinks, not the keys), and only attention reads
        # them: stored rotated, as `full` and `window` (a codec: only after RoPE).
        return keys_rotated(self.codec)

    def capacity(self, max_len):
        return min(self.n_sink + self.window, max_len)

    def _slot(self, pos, capacity):
        # The ring first, then the sinks (slots ring .. ring + n_sink - 1): every block of a chunk's
        # blocked attention (`Tuning.block` slots from slot 0) then holds window keys only, read with
        # one query rotation instead of a logits matmul per RoPE segment and a select. Token p of
        # the window is in ring slot p mod ring (the live window is `ring` consecutive tokens, so
        # they never share a slot), so chunks at multiples of a block start at a block's edge.
        ring = max(capacity - self.n_sink, 0)
        return jnp.where(pos < self.n_sink, ring + pos, pos % max(ring, 1))

    def extend(self, state, k, v, pos):
        view = ring_extend(self.codec, state, k, v, pos, self._slot(pos, state.slots))
        kp = view.pos[:, :, None, :]  # [B, Kp, 1, S + T]
        mask = (kp < self.n_sink) | (kp > pos[:, None, :, None] - self.window)  # [B, Kp, T, S + T]
        return dataclasses.replace(view, mask=mask, rope=self._rope(pos, view.pos))

    def _rope(self, q_pos, k_pos):
        if self.positions == "original" or self.n_sink == 0:
            return RopePositions(q=q_pos[..., None], k=k_pos)
        q_sink = jnp.minimum(q_pos, self.n_sink + self.window - 1)
        return RopePositions(
            q=jnp.stack([q_pos, q_sink], axis=-1),  # [B, T, 2]: segment 0 window, 1 sinks
            k=k_pos,
            seg=(k_pos < self.n_sink).astype(jnp.int32),  # [B, Kp, S]
        )

    def compact(self, view, seen):
        return ring_compact(
            view.carry, self._slot, lambda pos: (pos < self.n_sink) | (pos > pos[:, -1:] - self.window)
        )
