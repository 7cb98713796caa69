"""`snapkv`: SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation") — at the end of the prompt, keep per kv head the `budget` prompt tokens the last
`obs_window` queries attend to most (scores max-pooled over `kernel` neighbouring tokens),
plus the observation window itself; decoded tokens are appended.

Shapes: B batch, K kv heads, S = budget + obs_window + max_new slots, T new tokens,
V = S + T view slots, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored, chunked
from kvpolicies.scored import LAST_KEY, compaction, stable_order
from kvpolicies.slots import inverse_order, take_slots


@dataclasses.dataclass(frozen=True)
class SnapKV(PromptScored):
    """Prompt compression to budget + obs_window tokens per kv head, then append-only decode.

    Slots: S = budget + obs_window + max_new (capped by max_len). Compression keeps the
    `obs_window` newest tokens and, of the others ("candidates"), the `budget` with the
    largest pooled observation score; ties (frequent after max-pooling) keep the larger raw
    score. The observation score of a slot is the attention mass (summed over the G query
    heads of its kv head) it received from the observation queries; pooling replaces it by the
    maximum over the candidates within kernel // 2 text positions (the paper's max_pool1d over
    the prompt; after an earlier compression, gaps count as text distance).

    The paper's protocol (retrieval, `Engine.generate`/`prefill` of a fresh prompt): the whole
    prompt, question included, is held densely (`prompt_policy()`: every token plus the
    attention rows of its last obs_window queries, whatever the prefill chunk size), then
    `after_prompt` compresses it once to budget + obs_window tokens per kv head (if longer),
    observing those last obs_window queries. Decoding appends into the max_new free slots.

    Our extension, for streams (`Engine.score`) and for generation beyond `max_new`: decoding
    is token by token (`per_token`), and when a token finds no free slot (n > S tokens in the
    view, every max_new + 1 tokens once full) the cache is compressed again by the same rule,
    observing the last obs_window queries since the last compression (their attention is
    accumulated in the state's `mass`, [B, K, S] float32, from the queries at which the view
    holds >= S + 2 - obs_window tokens). Memory is fixed whatever the length, and the chunk
    size never changes a result.
    """

    label = "snapkv"
    observes = ("scores",)
    accumulates = True

    budget: int = 1024
    obs_window: int = 32
    kernel: int = 7
    max_new: int = 256
    pooling: str = "max"  # "max": the paper's max_pool1d; "avg": kvpress's avg_pool1d (zero padding)
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("snapkv", "obs_window", self.obs_window, 1)
        check_int("snapkv", "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv.kernel={self.kernel}: must be an odd int >= 1")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"{self.label}.pooling={self.pooling!r}: must be 'max' or 'avg'")

    @classmethod
    def for_tokens(cls, n, **kw):
        """n prompt tokens kept: budget = n - obs_window, plus the window (max_new comes on top)."""
        return cls(budget=max(n - kw.get("obs_window", cls.obs_window), 0), **kw)

    def kept(self):
        return self.budget + self.obs_window

    def pool(self, score, pos, cand, in_order: bool = False):
        """Max (`pooling="avg"`: sum) of `score` over candidates within kernel // 2 text positions
        ([B, K, V]; -inf for non-candidates). Candidates are sorted by position, so text neighbours within r
        positions are within r sorted places. `in_order`: their positions already increase with the slot
        index (a prompt state's), so ordered by counts (`kvpolicies.scored.compaction`), not by a sort."""
        r = self.kernel // 2
        score = jnp.where(cand, score, -jnp.inf)  # [B, K, V]
        if r == 0:
            return score
        key = jnp.where(cand, pos, LAST_KEY)  # candidates first, by position
        order = compaction(cand, pos.shape[-1]) if in_order else stable_order((key,), pos.shape[-1])
        sp, ss, sc = (take_slots(x, order) for x in (pos, score, cand))  # [B, K, V] each
        n = sp.shape[-1]
        idx = jnp.arange(n)
        pooled = ss
        for d in [*range(1, r + 1), *range(-r, 0)]:
            nb = lambda x, d=d: jnp.roll(x, -d, axis=-1)  # noqa: E731  neighbour i + d
            ok = nb(sc) & (jnp.abs(nb(sp) - sp) <= r) & (idx + d >= 0) & (idx + d < n)  # [B, K, V]
            if self.pooling == "avg":  # the sum over the kernel (the mean's order; absent neighbours count 0)
                pooled = pooled + jnp.where(ok, nb(ss), 0.0)
            else:
                pooled = jnp.maximum(pooled, jnp.where(ok, nb(ss), -jnp.inf))
        pooled = take_slots(pooled, inverse_order(order))  # back to view order
        return jnp.where(cand, pooled, -jnp.inf)

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        """Decode observation: a query among the last obs_window before the cache overflows
        adds its attention to `mass` (a step's query i of T saw count - T + i + 1 tokens)."""
        t = seen.scores.shape[2]
        saw = count[..., None] - t + 1 + jnp.arange(t)  # [B, K, T]
        obs = jnp.where((saw >= s + 2 - self.obs_window)[..., None], seen.scores, 0.0)  # [B, K, T, V]
        return dataclasses.replace(slots, mass=slots.mass + obs.sum(axis=2)), stats  # one token: its row

    def restart(self, slots, over):
        return dataclasses.replace(slots, mass=jnp.where(over, 0.0, slots.mass))  # a new observation

    def rank(self, slots, keys, stats, seen):
        return self._rank(slots.mass, slots.pos)

    def prompt_rank(self, state: PromptState, slots, keys, stats):
        # the last obs_window queries' attention; a prompt state's slots are in text order
        return self._rank(state.rows.sum(axis=2), slots.pos, in_order=True)

    def _rank(self, window: Float[Array, "B K V"], pos: Int[Array, "B K V"], in_order: bool = False
              ) -> tuple[Array, Array]:
        """The obs_window newest tokens first, then the candidates by pooled observation score,
        ties by the raw score."""
        w = self.obs_window
        filled = pos >= 0
        recent = filled & (pos > pos.max(axis=-1, keepdims=True) - w)  # [B, K, V]
        cand = filled & ~recent
        prio = jnp.where(recent, jnp.inf, self.pool(window, pos, cand, in_order))  # [B, K, V]
        return prio, jnp.where(cand, window, -jnp.inf)

    # -- the paper's protocol: the whole prompt densely, then one compression --------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=self.obs_window)
