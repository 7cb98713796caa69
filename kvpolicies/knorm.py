"""`knorm`: Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (EMNLP 2024) — keep the tokens whose keys have the *lowest* L2 norm, per kv head.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.full import Full
from kvpolicies.presets import Preset
from kvpolicies.prompt_scored import PromptScored, rank_by


@dataclasses.dataclass(frozen=True)
class Knorm(Preset, PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the lowest key L2 norm.

    The score is kvpress's `KnormPress` (NVIDIA/kvpress, score = -||k||) and the authors'
    (alessiodevoto/l2compress `cache.py`, `l2_compress`: keys sorted by L2 norm, the lowest
    kept): no window or sink is protected, `budget` counts every kept token. Norms are of the
    stored keys before RoPE (both cache them after RoPE; a rotation preserves the norm, so the
    ranking is the same up to rounding). Protocol and stream extension: `PromptScored` (the
    prompt is held densely, ranked once; streams recompress on overflow). Ties keep the newer
    token (kvpress: torch.topk's order).

    A model-level preset (`stack(n_layers)`, which `Engine` applies to a bare policy): the first
    `dense_layers` layers keep every token (`full`), the authors' setting (`skip_layers=[0, 1]`
    in their README and code; their needle and passkey scripts skip layer 12 of Llama-2-7B as
    well, a model-specific choice we do not default to). `dense_layers=0` is kvpress's rule
    (every layer compressed). Used alone (one layer) it is the compressor.
    """

    label = "knorm"

    budget: int = 1024
    max_new: int = 256
    dense_layers: int = 2
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("knorm", "dense_layers", self.dense_layers, 0)

    def stack(self, n_layers):
        dense = min(self.dense_layers, n_layers)
        return (Full(codec=self.codec),) * dense + (self,) * (n_layers - dense)

    def rank(self, slots, keys, stats, seen):
        norm = jnp.sqrt(jnp.sum(jnp.square(keys.astype(jnp.float32)), axis=-1))  # [B, K, V]
        return rank_by(-norm, slots.pos)
