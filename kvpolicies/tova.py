"""`tova`: Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs") —
a fixed budget of tokens; when over budget, drop the tokens the newest query attends to least.

Shapes: B batch, K kv heads, Kp = 1 (scope "layer") or K (scope "head"), S = budget slots,
T new tokens, V = S + T view slots, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from kvpolicies.base import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.scored import Scored


@dataclasses.dataclass(frozen=True)
class TOVA(Scored):
    """Keeps the `budget` tokens with the most attention from the step's last query.

    scope="layer" (default, the paper's policy): the score of a token is its attention from
    the last query summed over all query heads of the layer (the paper averages over heads),
    so every kv head keeps the same tokens and positions are shared ([B, 1, S]).
    scope="head": scores are summed only over the G query heads of each kv head, which then
    evicts on its own ([B, K, S]), as H2O and SnapKV do; same memory, a per-head choice.

    Eviction happens after every token (`per_token`; a prefill chunk is a scan of
    single-token steps), the paper's rule exactly: the new token joins (so the query reads
    budget + 1 tokens), and once over budget the lowest-attended token (possibly the new one;
    no window is protected) leaves. The chunk size never changes the result.
    """

    per_token = True
    budget_field = "budget"

    budget: int = 512
    scope: Literal["layer", "head"] = "layer"
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("tova", "budget", self.budget, 1)
        check_choice("tova", "scope", self.scope, ("layer", "head"))

    def capacity(self, max_len):
        return min(self.budget, max_len)

    def kp(self, kv_heads):
        return 1 if self.scope == "layer" else kv_heads

    def priority(self, slots, scores):
        last = scores[:, :, -1]  # [B, K, V]: attention from the step's last query
        if self.scope == "layer":
            last = last.sum(axis=1, keepdims=True)  # [B, 1, V]
        return jnp.where(slots.pos >= 0, last, -jnp.inf), slots  # [B, Kp, V]
