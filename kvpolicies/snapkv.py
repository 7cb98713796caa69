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

from kvpolicies.base import check_int, take_slots
from kvpolicies.codecs import Codec, Identity
from kvpolicies.scored import LAST_KEY, Scored, newest, top_mask


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

    When it compresses, at the end of a step whose view holds n tokens:
    - a prompt chunk (T > 1) compresses when n > budget + obs_window, observing its own last
      min(obs_window, T) queries. A prompt given as one chunk is therefore exactly SnapKV.
      A prompt given in several chunks is compressed at the end of each chunk (each chunk is
      treated as the end of a prompt); its later chunks see the compressed earlier ones.
    - a decode step (T = 1) appends the token into a free slot; when none is left (n > S, after
      `max_new` decoded tokens) the cache is compressed again by the same rule, observing the
      last obs_window queries since the last compression. Their attention is accumulated in
      the state's `mass` ([B, K, S] float32) from the queries that will be among the last obs_window
      before the cache overflows (those at which the view holds >= S + 2 - obs_window tokens).
    So memory is fixed whatever the generation length, one-by-one feeding is well defined
    (it compresses every max_new + 1 tokens, observing the last queries), and generating up to
    `max_new` tokens after a one-chunk prompt is exactly the paper's method.
    """

    budget_field = "budget"
    run_keys = {"budget": "budget"}

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
        t, w = scores.shape[2], self.obs_window  # scores [B, K, T, V]
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K] tokens in the view (equal for every head)
        # decode observation: queries at which the view holds >= S + 2 - w tokens
        at = (count - t)[..., None] + jnp.arange(1, t + 1)  # [B, K, T] view size seen by each query
        obs = slots.mass + jnp.einsum("BKT,BKTV->BKV", (at >= s + 2 - w).astype(scores.dtype), scores)
        if t > 1:
            window = scores[:, :, -w:].sum(axis=2)  # [B, K, V]: the chunk's last queries
            over = count > min(self.budget + w, s)  # [B, K]
        else:
            window = obs
            over = count > s
        recent = newest(slots.pos, w)  # [B, K, V]
        cand = filled & ~recent
        prio = jnp.where(recent, jnp.inf, self.pool(window, slots.pos, cand))  # [B, K, V]
        comp = top_mask(prio, jnp.where(cand, window, -jnp.inf), min(self.budget + w, s)) & filled
        kept = jnp.where(over[..., None], comp, filled)  # [B, K, V]
        obs = jnp.where(over[..., None], 0.0, obs)  # a compression starts a new observation
        return kept, dataclasses.replace(slots, mass=obs)
