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

import jax
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import check_int, take_slots
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.scored import LAST_KEY, Accumulated, Scored, pack, top_mask


@dataclasses.dataclass(frozen=True)
class SnapKV(Scored):
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

    per_token = True
    budget_field = "budget"

    budget: int = 1024
    obs_window: int = 32
    kernel: int = 7
    max_new: int = 256
    codec: Codec = Identity()

    accumulates = True

    def __post_init__(self):
        check_int("snapkv", "budget", self.budget, 0)
        check_int("snapkv", "obs_window", self.obs_window, 1)
        check_int("snapkv", "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv.kernel={self.kernel}: must be an odd int >= 1")
        check_int("snapkv", "max_new", self.max_new, 0)

    @classmethod
    def for_tokens(cls, n, **kw):
        """n prompt tokens kept: budget = n - obs_window, plus the window (max_new comes on top)."""
        return cls(budget=max(n - kw.get("obs_window", cls.obs_window), 0), **kw)

    def capacity(self, max_len):
        return min(self.budget + self.obs_window + self.max_new, max_len)

    def pool(self, score, pos, cand):
        """Max of `score` over candidates within kernel // 2 text positions ([B, K, V]; -inf
        for non-candidates). Candidates are sorted by position, so text neighbours within r
        positions are within r sorted places."""
        r = self.kernel // 2
        score = jnp.where(cand, score, -jnp.inf)  # [B, K, V]
        if r == 0:
            return score
        order = jnp.argsort(jnp.where(cand, pos, LAST_KEY), axis=-1)  # candidates first, by position
        sp, ss, sc = (take_slots(x, order) for x in (pos, score, cand))  # [B, K, V] each
        n = sp.shape[-1]
        idx = jnp.arange(n)
        pooled = ss
        for d in [*range(1, r + 1), *range(-r, 0)]:
            nb = lambda x, d=d: jnp.roll(x, -d, axis=-1)  # noqa: E731  neighbour i + d
            ok = nb(sc) & (jnp.abs(nb(sp) - sp) <= r) & (idx + d >= 0) & (idx + d < n)  # [B, K, V]
            pooled = jnp.maximum(pooled, jnp.where(ok, nb(ss), -jnp.inf))
        pooled = take_slots(pooled, jnp.argsort(order, axis=-1))  # back to view order
        return jnp.where(cand, pooled, -jnp.inf)

    def keep(self, slots, scores, s):
        w = self.obs_window  # one token per step (per_token): scores [B, K, 1, V]
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K] tokens in the view (equal for every head)
        # decode observation: the query is among the last w before the cache overflows
        obs = slots.mass + jnp.where((count >= s + 2 - w)[..., None], scores[:, :, 0], 0.0)  # [B, K, V]
        over = count > s  # [B, K]
        kept = jnp.where(over[..., None], self._compress(obs, slots.pos, s) & filled, filled)  # [B, K, V]
        obs = jnp.where(over[..., None], 0.0, obs)  # a compression starts a new observation
        return kept, dataclasses.replace(slots, mass=obs)

    def _compress(self, window: Float[Array, "B K V"], pos: Int[Array, "B K V"], s: int) -> Bool[Array, "B K V"]:
        """The obs_window newest tokens and the `budget` candidates with the largest pooled
        observation score (at most s in all)."""
        w = self.obs_window
        filled = pos >= 0
        recent = filled & (pos > pos.max(axis=-1, keepdims=True) - w)  # [B, K, V]
        cand = filled & ~recent
        prio = jnp.where(recent, jnp.inf, self.pool(window, pos, cand))  # [B, K, V]
        return top_mask(prio, jnp.where(cand, window, -jnp.inf), min(self.budget + w, s))

    # -- the paper's protocol: the whole prompt densely, then one compression --------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=self.obs_window)

    def after_prompt(self, state: PromptState) -> Accumulated:
        s = self.capacity(state.slots)  # decode slots (the prompt state has max_len slots)
        kh = jax.tree.leaves(state.k)[0].shape[1]  # kv heads (codec leaves are [B, K, S, ...])
        pos = jnp.broadcast_to(state.pos, (state.pos.shape[0], kh, state.slots))  # [B, K, max_len]
        window = state.rows.sum(axis=2)  # [B, K, max_len]: the last obs_window queries' attention
        filled = pos >= 0
        over = filled.sum(axis=-1) > min(self.budget + self.obs_window, s)  # [B, K]
        kept = jnp.where(over[..., None], self._compress(window, pos, s) & filled, filled)
        slots = Accumulated(state.k, state.v, pos, mass=jnp.zeros(pos.shape, jnp.float32))
        return pack(slots, kept, s)
