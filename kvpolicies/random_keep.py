"""`random`: keep a seeded random subset of the tokens (kvpress's `RandomPress`), the sanity
floor every scorer should beat.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt_scored import PromptScored, rank_by

_M = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x85EBCA6B, 0xC2B2AE35)  # odd multipliers (golden ratio, murmur3)


def uniform_hash(seed: int, head: Int[Array, "*b"], pos: Int[Array, "*b"]) -> Float[Array, "*b"]:
    """A uniform number in [0, 1) that depends only on (seed, kv head, position): murmur3's
    32-bit finalizer of a mix of the three, top 24 bits. The same token gets the same number
    in every step, chunk and protocol (so chunk never changes the subset)."""
    u = jnp.uint32
    x = pos.astype(u) * u(_M[0]) ^ head.astype(u) * u(_M[1]) ^ u(seed) * u(_M[2])
    x = x ^ (x >> 16)
    x = x * u(_M[3])
    x = x ^ (x >> 13)
    x = x * u(_M[4])
    x = x ^ (x >> 16)
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


@dataclasses.dataclass(frozen=True)
class RandomKeep(PromptScored):
    """After the prompt, keep per kv head `budget` tokens chosen uniformly at random.

    kvpress's `RandomPress` draws torch.rand per (batch, head, token) with an optional seed;
    ours draws a number per (seed, kv head, position) with a counter-based hash
    (`uniform_hash`), so a row's subset does not depend on its batch index or on the chunk,
    and the stream extension (`PromptScored`: recompress on overflow) keeps each token's draw.
    `budget` counts every kept token.
    """

    label = "random"

    budget: int = 1024
    max_new: int = 256
    seed: int = 0
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("random", "seed", self.seed, 0, 2**32 - 1)

    def rank(self, slots, keys, stats, seen):
        head = jnp.arange(keys.shape[1])[None, :, None]  # [1, K, 1]
        return rank_by(uniform_hash(self.seed, head, slots.pos), slots.pos)
