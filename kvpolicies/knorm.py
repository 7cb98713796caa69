"""`knorm`: Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (EMNLP 2024) — keep the tokens whose keys have the *lowest* L2 norm, per kv head.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt_scored import PromptScored, rank_by


@dataclasses.dataclass(frozen=True)
class Knorm(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the lowest key L2 norm.

    As kvpress's `KnormPress` (NVIDIA/kvpress, score = -||k||; the authors' setting): no
    window or sink is protected, `budget` counts every kept token. Norms are of the stored
    keys before RoPE (kvpress caches them after RoPE; a rotation preserves the norm, so the
    ranking is the same up to rounding). Protocol and stream extension: `PromptScored`
    (the prompt is held densely, ranked once; streams recompress on overflow). Ties keep the
    newer token (kvpress: torch.topk's order).
    """

    label = "knorm"

    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    def rank(self, slots, keys, stats, seen):
        norm = jnp.sqrt(jnp.sum(jnp.square(keys.astype(jnp.float32)), axis=-1))  # [B, K, V]
        return rank_by(-norm, slots.pos)
