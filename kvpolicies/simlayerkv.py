"""`simlayerkv`: SimLayerKV (Zhang et al. 2024, "SimLayerKV: A Simple Framework for Layer-Level KV
Cache Reduction", arXiv:2410.13846; NVIDIA/kvpress `SimLayerKVPress`) — a layer whose last queries
attend almost only to the first and the most recent tokens is "lazy": after the prompt it keeps
those tokens alone (StreamingLLM's cache); any other layer keeps the whole prompt.

Shapes: B batch, K kv heads, W = n_last observation rows, S slots, V view slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool

from kvpolicies.budgets import Fits
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored, rank_by
from kvpolicies.scored import pack, top_mask
from kvpolicies.slots import head_slots, pad_slot


@dataclasses.dataclass(frozen=True)
class SimLayerKV(Fits, PromptScored):
    """After the prompt, a lazy layer keeps its first `n_initial` tokens and its newest
    `n_recent - n_last`; any other layer keeps every prompt token. The question and the answer are
    appended (kvpress's protocol: compressed once, after the context).

    The rule is kvpress 0.5.5's `SimLayerKVPress` at its defaults (lazy_threshold 1.0, n_last 1,
    n_recent 1024, n_initial 4): the prompt's last `n_last` queries' attention over the keys before
    them, averaged over every query head and those queries, summed over the first `n_initial`
    and the `n_recent` keys before the last `n_last`; the layer is lazy when that sum exceeds
    `lazy_threshold`. A prompt of at most n_initial + n_recent + n_last tokens and lazy_threshold
    1.0 (the default) compress nothing, as in kvpress. kvpress has no compression ratio to give:
    it reports the mean over layers of (n - n_initial - n_recent + 1) / n for lazy layers, 0 for
    the others, after the prefill.

    The paper (Sec. 3) identifies lazy layers the same way (last tokens' attention to the initial
    and recent tokens against a per-model threshold: Llama3 0.9, Llama2 0.65, Mistral 0.8, Qwen 0.85)
    and keeps 4 initial and 1024 recent tokens. Deviations, both kvpress's form: the lazy layer
    keeps n_recent - n_last recent tokens (kvpress's `-n_recent + n_last` slice), and the decision
    is per batch row here (kvpress averages the attention over the batch; the same at batch 1).
    n_recent must exceed n_last (kvpress's slice keeps the whole cache twice at n_recent == n_last).

    Memory: `budget` 0 (the default) sizes every layer for the whole prompt (a non-lazy layer keeps
    it); `Engine(fit=1)` stores each layer at what it kept (`Fits`: a lazy layer at n_initial +
    n_recent - n_last + max_new slots), the bytes kvpress's trimmed caches hold plus the free slots.
    `budget` > 0 keeps at most that many tokens per kv head after the prompt (the sinks, then the
    newest). Streams (`Engine.score`) and generation past `max_new`: on overflow every layer is
    trimmed as a lazy one, the first n_initial tokens and the newest (our extension).
    """

    label = "simlayerkv"

    budget: int = 0  # tokens per kv head after the prompt at most (0: the whole prompt)
    max_new: int = 256
    lazy_threshold: float = 1.0
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.lazy_threshold, bool) or not isinstance(self.lazy_threshold, (int, float)) or not (
                0 <= self.lazy_threshold <= 1):
            raise ValueError(f"simlayerkv.lazy_threshold={self.lazy_threshold!r}: must be a number in [0, 1]")
        check_int(self.label, "n_last", self.n_last, 1)
        check_int(self.label, "n_initial", self.n_initial, 0)
        check_int(self.label, "n_recent", self.n_recent, self.n_last + 1)
        if self.ratio or self.interval:
            raise ValueError(f"simlayerkv: ratio={self.ratio}, interval={self.interval}: SimLayerKV keeps what its "
                             "lazy-layer test decides (no ratio, no compression while decoding)")

    # -- sizes ----------------------------------------------------------------------------------
    def capacity(self, max_len):
        if self.slots:
            return min(self.slots, max_len)
        return min(self.budget + self.max_new, max_len) if self.budget else max_len

    def kept_table(self, max_len):
        return None  # what a layer keeps depends on its attention

    def stream_kept(self, s):
        return min(self.budget, s) if self.budget else max(s - self.max_new, 1)

    def fit(self, tokens_per_head):
        """Room for `tokens_per_head` kept tokens per kv head (every head of a layer keeps the same)."""
        return dataclasses.replace(self, budget=max(1, int(tokens_per_head)))

    def fit_state(self, state, max_len):
        return head_slots(state, min(self.capacity(max_len), state.pos.shape[2]))

    # -- the rule -------------------------------------------------------------------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=self.n_last)

    def lazy(self, state: PromptState) -> Bool[Array, "B"]:
        """Whether the layer is lazy for each batch row: kvpress's `is_lazy` on the last n_last rows."""
        pos = state.pos[:, 0]  # [B, S]
        n = (pos >= 0).sum(axis=-1)  # [B] prompt tokens
        col = state.rows.sum(axis=(1, 2))  # [B, S]: summed over kv heads, their G query heads and the rows
        att = col / jnp.maximum(col.sum(axis=-1, keepdims=True), 1e-30)  # the mean (each row sums to 1 per head)
        j = jnp.arange(pos.shape[-1])
        end = (n - self.n_last)[:, None]  # [B, 1]: kvpress drops the last n_last keys' columns
        counted = (j < self.n_initial) | ((j >= end - self.n_recent) & (j < end))  # [B, S]
        score = jnp.where(counted, att, 0.0).sum(axis=-1)  # [B]
        long = n > self.n_initial + self.n_recent + self.n_last
        return long & (score > self.lazy_threshold) & (self.lazy_threshold < 1.0)

    def rank(self, slots, keys, stats, seen):
        """The stream rule (and a `budget` cap): the first n_initial tokens, then the newest."""
        pos = slots.pos  # [B, K, V]
        return rank_by(jnp.where(pos < self.n_initial, jnp.inf, pos.astype(jnp.float32)), pos)

    def after_prompt(self, state: PromptState, table=None):
        s = self.capacity(state.slots)
        pos = jnp.broadcast_to(state.pos, state.rows.shape[:2] + state.pos.shape[-1:])  # [B, K, S]
        slots, stats = self.from_prompt(state, pos)
        filled = pos >= 0
        n = filled.sum(axis=-1, keepdims=True)  # [B, K, 1]
        trimmed = (pos < self.n_initial) | (pos >= n - (self.n_recent - self.n_last))  # a lazy layer's tokens
        keep = filled & (~self.lazy(state)[:, None, None] | trimmed)  # [B, K, S]
        if self.budget:
            prio, tie = self.rank(slots, None, None, None)
            keep = keep & top_mask(jnp.where(keep, prio, -jnp.inf), tie, min(self.budget, s))
        packed = pack(slots, keep, s)
        return self.join(pad_slot(packed) if self.spare else packed, stats)


def reported_ratio(kept: list[int], n: int, n_initial: int = 4, n_recent: int = 1024) -> float:
    """kvpress's `SimLayerKVPress.compression_ratio` after an n-token prefill whose layers kept
    `kept` tokens (per kv head): (n - n_initial - n_recent + 1) / n for a trimmed layer, 0 for the
    others, averaged over layers (kvpress's formula assumes n_last = 1)."""
    return sum((n - n_initial - n_recent + 1) / n if k < n else 0.0 for k in kept) / len(kept)
