"""How cache slots are stored. A codec is a field on any policy, so storage composes with eviction.

Shapes: B batch, K kv heads, S slots, D head dim. Every leaf of an encoded tree has layout
[B, K, S, ...] so that slot operations (write, concatenate, gather) apply to all leaves alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class Codec:
    """Protocol: `init` allocates, `encode` packs new tokens, `decode` unpacks inside attention."""

    name: str = "codec"

    def init(self, shape: tuple[int, int, int, int], dtype: Any) -> Any:
        raise NotImplementedError

    def encode(self, x: Float[Array, "B K T D"]) -> Any:
        raise NotImplementedError

    def decode(self, enc: Any, dtype: Any) -> Float[Array, "B K S D"]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
    """Slots stored as plain arrays in the cache dtype given to `init`."""

    name: str = "none"

    def init(self, shape, dtype):
        return jnp.zeros(shape, dtype)  # [B, K, S, D]

    def encode(self, x):
        return x

    def decode(self, enc, dtype):
        return enc.astype(dtype)


CODECS: dict[str, type[Codec]] = {"none": Identity}


def get_codec(name: str | Codec, **kwargs) -> Codec:
    """A codec by registry name (`none`, ...)."""
    if isinstance(name, Codec):
        return name
    if name not in CODECS:
        raise ValueError(f"codec={name!r}: must be one of {sorted(CODECS)}")
    return CODECS[name](**kwargs)
