"""Rotary position embedding (RoPE), applied by `kvpolicies.attend` at the positions a view gives.

Shapes: L positions, D head dim (rotate-half layout: channel i pairs with i + D/2), n tabulated
positions.

`Rope.apply` computes cos/sin of the angles at every call: on XLA's CPU backend that trigonometry
was most of a decode step's cache cost (every layer rotates every slot's key at every step;
measured: docs/results/speed.md, "Numbers behind comments in the code"). `RopeTable` is the same
rotation with cos/sin read from a table of positions [0, n) computed once on the host
(`Rope.table`) and passed to the step as an array; the angles are the same float32 products, so
results agree with `Rope.apply` to the last bit or so (numpy's float32 cos/sin vs XLA's).
Positions outside the table take `Rope.apply`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding (rotate-half layout), with optional Llama-3 frequency scaling."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, Any], ...] | None = None

    def __post_init__(self):
        d = self.head_dim
        if not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_)) or d < 2 or d % 2:
            raise ValueError(f"Rope head_dim={d!r}: must be an even int >= 2 (channels rotate in pairs)")
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float, np.number)) \
                or not math.isfinite(self.theta) or self.theta <= 1:
            raise ValueError(f"Rope theta={self.theta!r}: must be a finite number > 1 (the RoPE base, e.g. 10000.0)")

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

    def cos_sin(self, pos: Int[Array, "*b L"]) -> tuple[Float[Array, "*b L H"], Float[Array, "*b L H"]]:
        """cos and sin of the angles at positions pos (float32, H = D/2)."""
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq())  # [*b, L, D/2]
        return jnp.cos(ang), jnp.sin(ang)

    def apply(self, x: Float[Array, "*b L D"], pos: Int[Array, "*b L"]) -> Float[Array, "*b L D"]:
        """Rotate x at positions pos (pos broadcasts against x's leading axes)."""
        return _rotate(x, *self.cos_sin(pos))

    def table(self, n: int) -> "RopeTable":
        """This rotation with cos/sin tabulated (float32, on the host) for positions [0, n)."""
        ang = np.arange(n, dtype=np.int64).astype(np.float32)[:, None] * self.inv_freq()  # [n, D/2] float32
        return RopeTable(jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang)), self)


def _rotate(x, cos, sin):
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [*b, L, D/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTable:
    """`rope` with cos/sin read from tables of positions [0, n) (arrays: pass it into a jitted
    step as an argument). A step whose positions all lie in the table gathers; any other takes
    `rope.apply` (lax.cond), as do fractional positions. A negative position reads |p| with the
    sine negated.

    `cond_angles` (static; the same numbers either way) places that cond. False: the cond holds
    the rotation, which is faster inside the layer `lax.scan` (otherwise XLA:CPU fuses the
    rotation with the slice of the stacked cache into one slow loop). True: the cond picks cos/sin
    and the rotation follows it, which is faster in a straight-line program such as one layer's
    decode step (`models.engine`'s layer-by-layer generation), where a cond holding the rotation
    copies x in and the rotated x out (both measured: docs/results/speed_history.md, RoPE tables)."""

    cos: Float[Array, "n H"]
    sin: Float[Array, "n H"]
    rope: Rope = dataclasses.field(metadata=dict(static=True))
    cond_angles: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def inv_freq(self) -> np.ndarray:
        return self.rope.inv_freq()

    def apply(self, x: Float[Array, "*b L D"], pos: Int[Array, "*b L"]) -> Float[Array, "*b L D"]:
        if not jnp.issubdtype(pos.dtype, jnp.integer):  # fractional positions (multires summaries)
            return self.rope.apply(x, pos)
        a = jnp.abs(pos)

        def gathered():
            sin = jnp.take(self.sin, a, axis=0, mode="clip")  # [*b, L, D/2]
            return jnp.take(self.cos, a, axis=0, mode="clip"), jnp.where((pos < 0)[..., None], -sin, sin)

        inside = jnp.max(a) < self.cos.shape[0]
        if self.cond_angles:
            return _rotate(x, *jax.lax.cond(inside, gathered, lambda: self.rope.cos_sin(pos)))
        return jax.lax.cond(inside, lambda: _rotate(x, *gathered()), lambda: self.rope.apply(x, pos))
