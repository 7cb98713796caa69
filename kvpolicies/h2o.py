"""`h2o`: Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models") — keep the `recent` newest tokens plus the
`heavy` tokens with the largest accumulated attention, chosen per kv head.

Shapes: B batch, K kv heads, S = heavy + recent slots, T new tokens, V = S + T view slots,
D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptCompressor, PromptPhase
from kvpolicies.scored import Accumulated, Scored, newest, pack, top_mask


@dataclasses.dataclass(frozen=True)
class H2O(Budgeted, PromptCompressor, Scored):
    """Keeps `heavy` heavy hitters + the `recent` newest tokens (S = heavy + recent slots).

    The prompt (`prompt="dense"`, the default: the authors' real-drop path, FMInference/H2O
    `h2o_hf/utils_real_drop/modify_llama.py`, `H2OKVCache_LayerWise`): a fresh prompt is
    attended densely (its logits are `full`'s), every token's score is the attention it
    received from every prompt query (summed over the G query heads of its kv head; the
    authors sum over the batch and the query axis per head), and once after the prompt the
    cache is cut to the `recent` newest tokens plus the `heavy` best-scored older ones; the
    scores of the kept tokens carry on into decoding, which is per token as below.
    `prompt="stream"`: the prompt runs through the per-token rule below too (what this library
    did before; streams, `Engine.score`, always do).

    Every slot accumulates the attention it has received from every query since it entered
    the cache (summed over the G query heads of its kv head; the state's `mass`, [B, K, S] float32).
    Eviction happens after every token (`per_token`): a prefill chunk is run as a scan of
    single-token steps inside the compiled step, the way the authors' code simulates
    per-token eviction over the prompt with its heavy-hitter mask. At each token, every slot's
    accumulated mass grows by the attention the token's query gave it; then, per kv head, the
    `recent` newest tokens are kept and the other slots compete: the `heavy` ones with the
    largest accumulated mass survive (ties keep the newer token). Once the cache is full, one
    token, the lowest-scoring non-recent one, leaves per step. The chunk size never changes
    the result (tested for chunks 1, 7, 64).

    The state holds S tokens between steps; a query reads them and the new tokens up to
    itself (as in the paper, the new token joins before the eviction), so heavy=0 is a
    sliding window of recent + 1 tokens (tested); recent=0 is pure heavy-hitter eviction.
    Ties (equal scores) keep the newer token (the authors: torch.topk's order).
    """

    per_token = True
    budget_field = "heavy"

    heavy: int = 256
    recent: int = 256
    prompt: Literal["dense", "stream"] = "dense"
    codec: Codec = Identity()

    accumulates = True

    def __post_init__(self):
        check_int("h2o", "heavy", self.heavy, 0)
        check_int("h2o", "recent", self.recent, 0)
        check_choice("h2o", "prompt", self.prompt, ("dense", "stream"))
        if self.heavy + self.recent < 1:
            raise ValueError(f"h2o.heavy + h2o.recent = {self.heavy + self.recent}: must be >= 1")

    @classmethod
    def for_tokens(cls, n, **kw):
        """n tokens in all, split as the paper does: recent = n // 2, heavy = n - recent."""
        kw.setdefault("recent", n // 2)
        return cls(heavy=n - kw["recent"], **kw)

    def capacity(self, max_len):
        return min(self.heavy + self.recent, max_len)

    def priority(self, slots, scores):
        acc = slots.mass + scores.sum(axis=2)  # [B, K, V]: mass received so far
        filled = slots.pos >= 0  # [B, K, V]
        prio = jnp.where(newest(slots.pos, self.recent), jnp.inf, jnp.where(filled, acc, -jnp.inf))  # [B, K, V]
        return prio, dataclasses.replace(slots, mass=acc)

    # -- the authors' prompt protocol (prompt="dense") ------------------------------------------
    def prompt_policy(self):
        if self.prompt == "stream":
            return self
        return PromptPhase(codec=self.codec, of=self, obs_window=0, columns=True)  # + column sums

    def after_prompt(self, state):
        if self.prompt == "stream":
            return state
        s = self.capacity(state.slots)  # decode slots (the prompt state has max_len slots)
        mass = state.extra["mass"]  # [B, K, M]: attention received from every prompt query
        pos = jnp.broadcast_to(state.pos, mass.shape)  # [B, K, M]
        return pack(Accumulated(state.k, state.v, pos, mass=mass), keep_heavy_recent(mass, pos, s, self.recent), s)


def keep_heavy_recent(mass, pos, s: int, recent: int):
    """[B, K, M] True for the `recent` newest filled slots and the best-scored others, s in all
    (every filled slot when there are at most s; ties keep the newer token)."""
    filled = pos >= 0
    last = pos.max(axis=-1, keepdims=True)  # [B, K, 1]: the last prompt token
    prio = jnp.where(filled & (pos > last - recent), jnp.inf, jnp.where(filled, mass, -jnp.inf))
    return top_mask(prio, pos, s) & filled
