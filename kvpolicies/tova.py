"""`tova`: Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs") —
a fixed budget of tokens; when over budget, drop the tokens the newest query attends to least.

Shapes: B batch, K kv heads, Kp = 1 (scope "layer") or K (scope "head"), S = budget slots,
T new tokens, V = S + T view slots, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from kvpolicies.base import SlotState
from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptCompressor, PromptPhase
from kvpolicies.scored import Scored, pack, top_mask


@dataclasses.dataclass(frozen=True)
class TOVA(Budgeted, PromptCompressor, Scored):
    """Keeps the `budget` tokens with the most attention from the step's last query.

    scope="layer" (default, the paper's policy): the score of a token is its attention from
    the last query summed over all query heads of the layer (the paper averages over heads),
    so every kv head keeps the same tokens and positions are shared ([B, 1, S]).
    scope="head": scores are summed only over the G query heads of each kv head, which then
    evicts on its own ([B, K, S]), as H2O and SnapKV do; same memory, a per-head choice.

    The prompt (`prompt="dense"`, the default: the authors' reference, schwartz-lab-NLP/TOVA
    `src/tova_cache.py`, `TOVACache.reduce`): a fresh prompt is attended densely (its logits are
    `full`'s), then the cache is cut once to the `budget` tokens with the most attention from
    the prompt's last query (averaged over all query heads for scope "layer"; over the kv
    head's G query heads for scope "head"), then decoding is per token as below.
    `prompt="stream"`: the prompt runs through the per-token rule too (what this library did
    before; streams, `Engine.score`, always do).

    Eviction happens after every token (`per_token`; a prefill chunk is a scan of
    single-token steps), the paper's rule exactly: the new token joins (so the query reads
    budget + 1 tokens), and once over budget the lowest-attended token (possibly the new one;
    no window is protected) leaves. The chunk size never changes the result.
    """

    per_token = True
    budget_field = "budget"

    budget: int = 512
    scope: Literal["layer", "head"] = "layer"
    prompt: Literal["dense", "stream"] = "dense"
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("tova", "budget", self.budget, 1)
        check_choice("tova", "scope", self.scope, ("layer", "head"))
        check_choice("tova", "prompt", self.prompt, ("dense", "stream"))

    def capacity(self, max_len):
        return min(self.budget, max_len)

    def kp(self, kv_heads):
        return 1 if self.scope == "layer" else kv_heads

    def priority(self, slots, scores):
        last = scores[:, :, -1]  # [B, K, V]: attention from the step's last query
        if self.scope == "layer":
            last = last.sum(axis=1, keepdims=True)  # [B, 1, V]
        return jnp.where(slots.pos >= 0, last, -jnp.inf), slots  # [B, Kp, V]

    # -- the authors' prompt protocol (prompt="dense") ------------------------------------------
    def prompt_policy(self):
        if self.prompt == "stream":
            return self
        return PromptPhase(codec=self.codec, of=self, obs_window=1)  # + the last query's attention row

    def after_prompt(self, state):
        if self.prompt == "stream":
            return state
        s = self.capacity(state.slots)
        last = state.rows[:, :, 0]  # [B, K, M]: the last prompt query's attention, summed over G
        if self.scope == "layer":
            last = last.sum(axis=1, keepdims=True)  # [B, 1, M]
        pos = jnp.broadcast_to(state.pos, last.shape)  # [B, Kp, M]
        filled = pos >= 0
        kept = top_mask(jnp.where(filled, last, -jnp.inf), pos, s) & filled
        return pack(SlotState(state.k, state.v, pos), kept, s)
