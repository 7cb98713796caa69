"""Rotary position embedding (RoPE), applied by `kvpolicies.attend` at the positions a view gives.

Shapes: L positions, D head dim (rotate-half layout: channel i pairs with i + D/2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding (rotate-half layout), with optional Llama-3 frequency scaling."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] | None = None

    def inv_freq(self) -> np.ndarray:
        """[D/2] float32 inverse frequencies (a trace-time constant)."""
        d = self.head_dim
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
        inv = inv.astype(np.float32)
        sc = dict(self.scaling) if self.scaling else None
        if sc is None or sc.get("rope_type", sc.get("type", "default")) == "default":
            return inv
        kind = sc.get("rope_type", sc.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
        # Llama 3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        ramp = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return np.where(medium, ramp, scaled).astype(np.float32)

    def apply(self, x: Float[Array, "*b L D"], pos: Int[Array, "*b L"]) -> Float[Array, "*b L D"]:
        """Rotate x at positions pos (pos broadcasts against x's leading axes)."""
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq())  # [*b, L, D/2]
        cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
        x1, x2 = jnp.split(x, 2, axis=-1)  # [*b, L, D/2] each
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
