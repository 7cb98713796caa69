"""How cache slots are stored. A codec is a field on any policy, so storage composes with eviction.

Shapes: B batch, K kv heads, S slots (T when encoding new tokens), D head dim, Gd = D / group
(scale groups along the head dim), D/2 (or D*bits/8) packed bytes. Every leaf of an encoded
tree has layout [B, K, S, ...] so that slot operations (write, concatenate, scatter, take_slots)
apply to all leaves alike: a quantized slot is its codes plus its own scales, nothing shared.

Codecs (all symmetric round-to-nearest, scales computed from each new token as it is written;
registry name -> class: none `Identity`, int8 and fp8 `Absmax`, int4 `Int4`):

    none   the cache dtype as is.
    int8   per token and kv head: s = absmax_D / 127, codes round(x / s) in [-127, 127].
    int4   Hadamard-rotated groups (QuaRot-inspired): per token, kv head and group of `group`
           channels: y = H x (orthonormal Hadamard within the group, rotation="hadamard", the
           default) or y = x, s = absmax(y) / 7, codes round(y / s) in [-7, 7] stored as
           code + 8, two per uint8 (channel 2i in the low nibble, 2i + 1 in the high one);
           decode x' = H (code s).
    fp8    per token and kv head: s = absmax_D / 448, codes x / s cast to float8_e4m3fn.
int8 and fp8 are one codec, `Absmax`, whose `name` picks the code format (dtype and qmax).
Keys are encoded *before* RoPE by every codec (this library caches un-rotated keys), unless
`after_rope=True` (registry names `int8_after_rope`, `int4_after_rope`, `fp8_after_rope`): then a
policy that keeps its keys at their text positions (full, window, sink, duo) encodes them rotated,
as deployed caches do, and a decode step reads them without rotating them.

Reading in the codec's basis (`Codec.basis`, `View.basis`): int4 decodes a group to H y (y =
code x scale), and attention is linear in the values and in the keys' dot products, so it reads
the values as y and rotates each output by H once (sum_s p_s H y_s = H sum_s p_s y_s); keys
encoded after RoPE likewise, with each query rotated into the basis (q . H y = (H q) . y). Keys
encoded before RoPE must be decoded in full (RoPE, applied after decoding, does not commute with
H). The same numbers up to float32 rounding; H then multiplies one query and one output per
step instead of every slot read (measured: docs/results/speed.md, "Codecs after RoPE").

What these are not:
    int4 is not QuaRot's KV cache (Ashkboos et al. 2024). QuaRot rotates each head's keys by a
         full-head Hadamard *after* RoPE (and values through the fused W_v / W_o rotation),
         then quantizes asymmetrically (scale and zero point) in groups of 128 channels (the
         whole head) with a clipping ratio below 1. Ours: a Hadamard within each group of
         32 channels, on pre-RoPE keys and on values alike, symmetric with 15 levels
         ([-7, 7], no zero point), absmax scales without clipping, computed per token online.
    fp8  scales every token and kv head separately (one scale per slot). Deployed fp8 KV caches
         (vLLM's kv_cache_dtype="fp8", TensorRT-LLM) use one scale per tensor (per layer, for
         keys and for values, 1.0 or calibrated offline) and store no per-token scales; ours is
         more accurate and stores sb more bytes per slot.

Scales are stored in `scale_dtype` (float32 by default; bfloat16/float16 halve their bytes).
A scale is rounded *up* to that dtype before the codes are computed with it, so no code
clips and the error bounds hold in every scale dtype (s = the stored scale):
    int8            |x - x'| <= s / 2 per element
    int4            ||x - x'||_2 <= sqrt(group) s / 2 per group (|.| <= s / 2 per element
                    without rotation; H is orthonormal, so the L2 error is the rotated one)
    fp8             |x - x'| <= 2^-4 |x| (e4m3 normal range, |x| >= 2^-6 s), else <= 2^-10 s
Bytes per slot and kv head (keys or values), sb = itemsize(scale_dtype):
    int8 D + sb,    int4 D/2 + (D/group) sb,    fp8 D + sb.

Why symmetric int4 with a rotation: SmolLM2's un-rotated keys have outlier channels, and a
group scale that follows an outlier wastes the 15 levels of the other channels; rotating each
group spreads an outlier over it, and a rotated group is close to symmetric, so a zero point
(twice the metadata) buys little. A rotation within groups of 32 did as well as one over the
whole head (the perplexities of the variants: docs/results/quality.md, "Codecs"). (`kivi`,
kvpolicies/kivi.py, handles key outliers the other way: per-channel scales.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from kvpolicies.checks import SCALE_DTYPES, check_choice, check_int, check_scale_dtype  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class Codec:
    """Protocol: `init` allocates, `encode` packs new tokens, `decode` unpacks inside attention.

    after_rope: encode keys after RoPE, rotated at their token positions, as deployed caches do
    (vLLM's fp8 cache, QuaRot's KV cache, KIVI's code), instead of before (the default). Only
    for a policy whose keys keep their text positions once written and are read only by
    attention (`Policy.rotated_keys`: full, window, sink, duo); a decode step then reads the
    decoded keys as they are instead of rotating every slot. Values are the same either way.
    """

    name: str = "codec"
    after_rope: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.after_rope, bool):
            raise ValueError(f"{self.name}.after_rope={self.after_rope!r}: must be True or False")

    def record(self) -> dict[str, Any]:
        """The codec as plain data (results records): its fields, `after_rope` only when set (so
        that runs recorded before the field keep their keys)."""
        out = dataclasses.asdict(self)
        if not self.after_rope:
            del out["after_rope"]
        return out

    def init(self, shape: tuple[int, int, int, int], dtype: Any) -> Any:
        raise NotImplementedError

    def encode(self, x: Float[Array, "B K T D"]) -> Any:
        raise NotImplementedError

    def decode(self, enc: Any, dtype: Any, in_basis: bool = False) -> Float[Array, "B K S D"]:
        """The stored slots as values of `dtype`; in_basis=True (only where `basis`): R x' instead
        of x', the decoded slots still in the codec's orthonormal basis (its last rotation skipped)."""
        raise NotImplementedError

    # A codec whose decode ends with an orthonormal rotation (x' = R^T y', y' the dequantized codes)
    # may leave it to attention: q . x' = (R q) . y' and sum_s p_s x'_s = R^T (sum_s p_s y'_s), so
    # rotating one query and one output per step replaces rotating every slot read (`View.basis`).
    @property
    def basis(self) -> bool:
        """Whether `decode(..., in_basis=True)` skips a rotation R (`to_basis`, `from_basis`)."""
        return False

    def to_basis(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """R x over the head dim (e.g. a query, to be dotted with keys decoded in the basis)."""
        return x

    def from_basis(self, y: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """R^T y over the head dim (e.g. an attention output over values decoded in the basis)."""
        return y


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
    """Slots stored as plain arrays in the cache dtype given to `init`."""

    name: str = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.after_rope:  # nothing is quantized: where keys are stored rotated is the policy's choice
            raise ValueError("none.after_rope=True: the identity codec quantizes nothing (a policy that can "
                             "stores its keys rotated without a codec: Policy.rotated_keys)")

    def init(self, shape, dtype):
        return jnp.zeros(shape, dtype)  # [B, K, S, D]

    def encode(self, x):
        return x

    def decode(self, enc, dtype, in_basis=False):
        return enc.astype(dtype)


class Quantized(NamedTuple):
    """Codes and per-slot scales; both leaves are [B, K, S, ...]."""

    codes: Array  # [B, K, S, D] int8 / float8, or [B, K, S, D/2] uint8 (int4)
    scale: Array  # [B, K, S, 1] or [B, K, S, Gd] in scale_dtype


# -- shared helpers (also used by kivi.py) --------------------------------------------------


def round_up(x: Float[Array, "..."], dtype: Any) -> Array:
    """Nearest value of `dtype` that is >= x (x float32, finite)."""
    y = x.astype(dtype)
    return jnp.where(y.astype(jnp.float32) < x, jnp.nextafter(y, jnp.asarray(jnp.inf, dtype)), y)


def round_down(x: Float[Array, "..."], dtype: Any) -> Array:
    """Nearest value of `dtype` that is <= x (x float32, finite)."""
    y = x.astype(dtype)
    return jnp.where(y.astype(jnp.float32) > x, jnp.nextafter(y, jnp.asarray(-jnp.inf, dtype)), y)


def pack_bits(codes: UInt8[Array, "... D"], bits: int) -> UInt8[Array, "... Dp"]:
    """Pack unsigned `bits`-bit codes along the last axis, 8/bits per byte, little end first:
    code 8/bits*i + j sits at bits j*bits.. of byte i. D must be a multiple of 8/bits."""
    per = 8 // bits
    c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // per, per))  # [..., Dp, per]
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8)  # [..., Dp] (bit fields are disjoint)


def unpack_bits(packed: UInt8[Array, "... Dp"], bits: int) -> UInt8[Array, "... D"]:
    per = 8 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    c = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)  # [..., Dp, per]
    return c.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))  # [..., D]


def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal Sylvester Walsh-Hadamard matrix [n, n] (n a power of two), float32:
    H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]], scaled by 1 / sqrt(n). Symmetric, its own inverse."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def hadamard(x: Float[Array, "... N"]) -> Float[Array, "... N"]:
    """x @ H for the orthonormal Sylvester Walsh-Hadamard matrix H (N a power of two), as one
    float32 matmul (exact products at any precision setting: `highest`, so no TF32 on a GPU).
    log2(N) butterfly stages do N log N work instead of N^2, but XLA:CPU writes each stage out,
    and the one matmul was the faster (measured: docs/results/speed.md, "Codecs after RoPE")."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))  # float32: computed in float32 whatever x's dtype
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def _symmetric_scale(absmax: Array, qmax: float, dtype: Any) -> tuple[Array, Array]:
    """(stored scale in `dtype`, float32 divisor): s = absmax / qmax rounded up; 0 if absmax is 0."""
    s = round_up(absmax.astype(jnp.float32) / qmax, dtype)
    sf = s.astype(jnp.float32)
    return s, jnp.where(sf > 0, sf, 1.0)


# -- codecs ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Absmax(Codec):
    """Symmetric codes with one absmax scale per token and kv head; `name` is the code format:
    int8 (qmax 127, codes rounded to nearest) or fp8 (float8 e4m3: 3 mantissa bits, qmax 448,
    rounded to nearest even by the cast), e.g. Absmax("fp8", scale_dtype="bfloat16").
    Per-token scales, not the per-tensor scale of deployed fp8 caches (see the module doc)."""

    name: Literal["int8", "fp8"] = "int8"
    scale_dtype: str = "float32"

    FORMATS: ClassVar[dict[str, tuple[Any, float]]] = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}

    def __post_init__(self):
        super().__post_init__()
        check_choice("absmax", "name", self.name, tuple(self.FORMATS))
        check_scale_dtype(self.name, self.scale_dtype)

    def init(self, shape, dtype):
        b, k, s, d = shape
        codes = jnp.zeros(shape, self.FORMATS[self.name][0])  # [B, K, S, D]
        return Quantized(codes, jnp.zeros((b, k, s, 1), self.scale_dtype))  # scale [B, K, S, 1]

    def encode(self, x: Float[Array, "B K T D"]) -> Quantized:
        code, qmax = self.FORMATS[self.name]
        xf = x.astype(jnp.float32)
        s, div = _symmetric_scale(jnp.abs(xf).max(-1, keepdims=True), qmax, self.scale_dtype)  # [B, K, T, 1]
        y = xf / div  # [B, K, T, D]
        if jnp.issubdtype(code, jnp.integer):
            y = jnp.round(y)  # a float code rounds in the cast below
        return Quantized(jnp.clip(y, -qmax, qmax).astype(code), s)  # [B, K, T, D]

    def decode(self, enc: Quantized, dtype, in_basis=False) -> Float[Array, "B K S D"]:
        return (enc.codes.astype(jnp.float32) * enc.scale.astype(jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Int4(Codec):
    """Hadamard-rotated groups (QuaRot-inspired): symmetric int4 with one absmax scale per
    `group` consecutive channels; 2 codes per byte.

    rotation="hadamard" (default) quantizes H x instead of x, H the orthonormal Walsh-Hadamard
    matrix of each group, and decodes with H again (H = H^T = H^-1): an outlier channel is
    spread over its group, so the group's scale no longer follows it. `group` must then be a
    power of two. The idea is QuaRot's (Ashkboos et al. 2024), the codec is not: QuaRot rotates
    the whole head after RoPE and quantizes asymmetrically in groups of 128 with clipping; we
    rotate within groups of 32, before RoPE, symmetric with 15 levels, no clipping (module doc).
    """

    name: str = "int4"
    group: int = 32
    rotation: Literal["hadamard", "none"] = "hadamard"
    scale_dtype: str = "float32"

    def __post_init__(self):
        super().__post_init__()
        check_int("int4", "group", self.group, 2)
        check_choice("int4", "rotation", self.rotation, ("hadamard", "none"))
        if self.group % 2:
            raise ValueError(f"int4.group={self.group}: must be even (two codes per byte)")
        if self.rotation == "hadamard" and self.group & (self.group - 1):
            raise ValueError(f"int4.group={self.group}: must be a power of two with rotation='hadamard'")
        check_scale_dtype("int4", self.scale_dtype)

    def _check(self, d: int):
        if d % self.group:
            raise ValueError(f"int4.group={self.group}: must divide head_dim={d}")

    def _rotate(self, xg: Float[Array, "... group"]) -> Float[Array, "... group"]:
        return hadamard(xg) if self.rotation == "hadamard" else xg

    def init(self, shape, dtype):
        b, k, s, d = shape
        self._check(d)
        codes = jnp.zeros((b, k, s, d // 2), jnp.uint8)  # [B, K, S, D/2]
        return Quantized(codes, jnp.zeros((b, k, s, d // self.group), self.scale_dtype))  # scale [B, K, S, Gd]

    def encode(self, x: Float[Array, "B K T D"]) -> Quantized:
        *lead, d = x.shape
        self._check(d)
        xg = self._rotate(x.astype(jnp.float32).reshape(*lead, d // self.group, self.group))  # [B, K, T, Gd, group]
        s, div = _symmetric_scale(jnp.abs(xg).max(-1), 7.0, self.scale_dtype)  # [B, K, T, Gd]
        q = jnp.clip(jnp.round(xg / div[..., None]), -7, 7) + 8  # [B, K, T, Gd, group] in [1, 15]
        return Quantized(pack_bits(q.reshape(*lead, d), 4), s)  # [B, K, T, D/2], [B, K, T, Gd]

    def decode(self, enc: Quantized, dtype, in_basis=False) -> Float[Array, "B K S D"]:
        q = unpack_bits(enc.codes, 4).astype(jnp.float32) - 8  # [B, K, S, D]
        *lead, d = q.shape
        yg = q.reshape(*lead, d // self.group, self.group) * enc.scale.astype(jnp.float32)[..., None]  # [B, K, S, Gd, group]
        return (yg if in_basis else self._rotate(yg)).reshape(*lead, d).astype(dtype)

    @property
    def basis(self):
        return self.rotation == "hadamard"

    def _grouped(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        *lead, d = x.shape
        self._check(d)
        return self._rotate(x.reshape(*lead, d // self.group, self.group)).reshape(*lead, d)

    def to_basis(self, x):  # H per group: H = H^T, so to_basis and from_basis are the same map
        return self._grouped(x)

    def from_basis(self, y):
        return self._grouped(y)


# Registry name -> the codec with its default fields; get_codec(name, **fields) replaces fields.
CODECS: dict[str, Codec] = {"none": Identity(), "int8": Absmax("int8"), "int4": Int4(), "fp8": Absmax("fp8")}
CODECS |= {f"{n}_after_rope": dataclasses.replace(c, after_rope=True) for n, c in list(CODECS.items()) if n != "none"}


def get_codec(name: str | Codec, **kwargs) -> Codec:
    """A codec by registry name (`none`, `int8`, `int4`, `fp8`, and `<name>_after_rope`), e.g.
    get_codec("int4", group=64)."""
    if isinstance(name, Codec):
        if kwargs:
            raise ValueError(f"codec {name!r} is already built; got extra fields {sorted(kwargs)}")
        return name
    if name not in CODECS:
        raise ValueError(f"codec={name!r}: must be one of {sorted(CODECS)}")
    default = CODECS[name]
    fields = {f.name for f in dataclasses.fields(default)} - {"name"}
    bad = sorted(set(kwargs) - fields)
    if bad:
        raise ValueError(f"codec {name!r} has no field(s) {bad}; its fields are {sorted(fields)}")
    return dataclasses.replace(default, **kwargs)  # a new instance: __post_init__ validates the fields
