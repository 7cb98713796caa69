"""`kivi`: KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache") — every token is kept, keys quantized per channel, values per token, the newest tokens
in full precision.

Shapes: B batch, K kv heads, S slots (= max_len; slot j holds token j), T new tokens,
D head dim, G group, R residual, Rr = min(R, S) residual slots, Sg = ceil(S / G) key groups,
Dp = D * bits / 8 packed bytes, Gd = D / G value groups, Lp tokens of the key flush buffer.

Quantization is asymmetric round-to-nearest with `bits` bits: over a group, z = min,
s = (max - min) / (2^bits - 1), code = round((x - z) / s) in [0, 2^bits - 1], x' = code s + z.
  keys:   per channel, over groups of G consecutive tokens (scale/zero [Sg, D] per head).
  values: per token, over groups of G consecutive channels (scale/zero [S, Gd] per head).
z is rounded down and s up to `scale_dtype` before the codes are computed, so nothing clips
and |x - x'| <= s / 2 for every element, in every scale dtype.

Residual rule (the paper's Algorithm 1 and the authors' reference code): after n tokens
  keys   j <  R * floor(n / R) are quantized; the rest (n mod R < R tokens) are in full
         precision. When the key residual reaches R tokens, all R of them (R / G groups) are
         quantized at once and the residual empties.
  values j <  n - R are quantized; the newest min(n, R) are in full precision. Each token
         that falls out of the newest R is quantized on its own.
A prompt of n tokens leaves exactly this state too (the reference quantizes X_K[: n - n mod R]
and X_V[: n - R] at prefill), so prefilling in chunks of any size leaves the same state as
feeding tokens one by one (tested). R must be a multiple of G. (transformers' QuantizedCache
instead quantizes the whole prompt at prefill and keeps no residual for it; their issues #34189
and #35185.)

What attention sees. A fresh prompt (`prompt="dense"`, the default: the reference's prefill,
`LlamaAttention_KIVI` in models/llama_kivi.py) is attended in full precision, as `full` does
(its logits are full's), and quantized once afterwards by the rule above (`after_prompt`).
Every later token, and every token of a stream (`Engine.score`), is a decode step (`per_token`:
a chunk is a scan of single-token steps): a query sees the cache as it stood before it
(quantized or residual per the rule above) plus itself in full precision, the reference's decode
step exactly, and the chunk size never changes a result. `prompt="stream"` runs a fresh prompt
through the decode step too (what this library did before): the rule leaves the same state for
the same keys and values (tested), but from layer 1 on the keys and values differ, since the
prompt's own outputs then see the quantized past (the final states are not the same).

Keys are quantized after RoPE, rotated at their token positions, as the reference code does
(`LlamaAttention_KIVI` in the authors' models/llama_kivi.py quantizes the key states after
`apply_rotary_pos_emb`; `after_rope=True`, the default). `after_rope=False` is our named extension: keys quantized before RoPE and cached
un-rotated (KVQuant, Hooper et al. 2024, finds pre-RoPE per-channel key quantization more
accurate; it was this library's kivi before 2026-12-02). One more deliberate difference: storage
is a fixed-capacity buffer (codes for all S slots, plus two Rr-slot full-precision rings), so one
compiled step serves every step.

Bytes per layer and sequence (sb = itemsize(scale_dtype), cb = itemsize(cache dtype)):
    K * [ 2 S Dp                  codes of keys and values (key codes padded to Sg G slots)
        + 2 Sg D sb               key scales and zeros
        + 2 S Gd sb               value scales and zeros
        + 2 Rr D cb ]             the key and value residuals
(key codes: Sg * G * Dp instead of S * Dp when G does not divide S).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.base import EMPTY, Policy, RopePositions, SlotState, View
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Identity, check_scale_dtype, pack_bits, round_down, round_up, unpack_bits
from kvpolicies.full import Full
from kvpolicies.limits import Bounded
from kvpolicies.prompt import PromptCompressor


class KiviKeys(NamedTuple):
    codes: Array  # [B, K, Sg*G, Dp] uint8, per-channel codes of slot j at row j
    scale: Array  # [B, K, Sg, D] scale_dtype, one per channel and group of G tokens
    zero: Array  # [B, K, Sg, D]
    res: Array  # [B, K, Rr, D] cache dtype: token j of the residual at row j mod R


class KiviValues(NamedTuple):
    codes: Array  # [B, K, S, Dp] uint8
    scale: Array  # [B, K, S, Gd] scale_dtype, one per token and group of G channels
    zero: Array  # [B, K, S, Gd]
    res: Array  # [B, K, Rr, D] cache dtype: the newest R tokens, token j at row j mod R


def quantize_asym(x: Float[Array, "... N"], bits: int, sdtype: Any) -> tuple[Array, Array, Array]:
    """Asymmetric quantization over the last axis: (codes uint8 [..., N], scale [...], zero [...])."""
    top = (1 << bits) - 1
    xf = x.astype(jnp.float32)
    z = round_down(xf.min(-1), sdtype)  # [...]
    zf = z.astype(jnp.float32)
    s = round_up((xf.max(-1) - zf) / top, sdtype)  # [...]
    sf = s.astype(jnp.float32)
    q = jnp.clip(jnp.round((xf - zf[..., None]) / jnp.where(sf > 0, sf, 1.0)[..., None]), 0, top)
    return q.astype(jnp.uint8), s, z


def _drop_index(i: Int[Array, "..."], keep: Array, size: int) -> Array:
    return jnp.where(keep, i, size)  # `size` is out of range: the write is dropped


@dataclasses.dataclass(frozen=True)
class Kivi(PromptCompressor, Bounded, Policy):
    """KIVI: all tokens kept (capacity max_len); 2- or 4-bit keys per channel, values per token."""

    per_token = True

    bits: int = 2
    group: int = 32
    residual: int = 128
    scale_dtype: str = "float32"
    after_rope: bool = True  # the reference's order; False: keys quantized before RoPE (module doc)
    prompt: Literal["dense", "stream"] = "dense"  # a fresh prompt in full precision, then quantized

    def __post_init__(self):
        if not isinstance(self.after_rope, bool):
            raise ValueError(f"kivi.after_rope={self.after_rope!r}: must be True or False")
        check_choice("kivi", "prompt", self.prompt, ("dense", "stream"))
        check_choice("kivi", "bits", self.bits, (2, 4))
        check_int("kivi", "group", self.group, 1)
        check_int("kivi", "residual", self.residual, 1)
        if self.residual % self.group:
            raise ValueError(f"kivi.residual={self.residual}: must be a multiple of group={self.group}")
        check_scale_dtype("kivi", self.scale_dtype)
        if not isinstance(self.codec, Identity):
            raise ValueError(f"kivi.codec={self.codec!r}: kivi does its own quantization (use codec='none')")

    @property
    def rotated_keys(self):
        # after RoPE: attention rotates each new key at its position before `extend`, so the
        # residual and the per-channel codes hold rotated keys, and the view's keys are read as
        # they are (text positions, never shifted; only attention reads them)
        return self.after_rope

    def capacity(self, max_len):
        return max_len

    def _check_dim(self, d: int):
        if d % self.group:
            raise ValueError(f"kivi.group={self.group}: must divide head_dim={d} (values are grouped along it)")
        if (d * self.bits) % 8:
            raise ValueError(f"kivi.bits={self.bits}: head_dim={d} must pack into whole bytes")

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        self._check_dim(head_dim)
        b, k, d, s, g = batch, kv_heads, head_dim, self.capacity(max_len), self.group
        sg, dp, rr, sd = -(-s // g), d * self.bits // 8, min(self.residual, s), self.scale_dtype
        z = jnp.zeros
        keys = KiviKeys(
            codes=z((b, k, sg * g, dp), jnp.uint8), scale=z((b, k, sg, d), sd), zero=z((b, k, sg, d), sd),
            res=z((b, k, rr, d), dtype),
        )
        values = KiviValues(
            codes=z((b, k, s, dp), jnp.uint8), scale=z((b, k, s, d // g), sd), zero=z((b, k, s, d // g), sd),
            res=z((b, k, rr, d), dtype),
        )
        return SlotState(k=keys, v=values, pos=jnp.full((b, 1, s), EMPTY, jnp.int32))

    # -- the step ------------------------------------------------------------------------------
    def extend(self, state, k, v, pos):
        """View = the stored state, dequantized, plus the T new tokens in full precision."""
        keys, vals = self.dequantize(state, pos[:, 0], k.dtype)  # [B, K, S, D] x2 (chunks are contiguous)
        cat = lambda a, x: jnp.concatenate([a, x.astype(k.dtype)], axis=2)  # noqa: E731  [B, K, S+T, D]
        slot_pos = jnp.concatenate([state.pos, pos[:, None, :].astype(jnp.int32)], axis=2)  # [B, 1, S+T]
        return View(k=cat(keys, k), v=cat(vals, v), pos=slot_pos, rope=RopePositions(q=pos[..., None], k=slot_pos),
                    carry=(state, k, v, pos))

    def dequantize(self, state: SlotState, n: Int[Array, "B"], dtype) -> tuple[Array, Array]:
        """Keys and values [B, K, S, D] of a stored state holding n tokens, as attention reads them
        (slots >= n hold zeros or stale data; their positions are -1)."""
        kq, vq = state.k, state.v
        s, rr, r = vq.codes.shape[2], kq.res.shape[2], self.residual
        b, kh, _, d = kq.res.shape
        g = self.group
        j = jnp.arange(s)[None, None, :, None]  # [1, 1, S, 1]
        nb = n[:, None, None, None]  # [B, 1, 1, 1]
        ring = jnp.arange(s) % rr  # [S]

        kc = unpack_bits(kq.codes, self.bits).astype(jnp.float32)  # [B, K, Sg*G, D]
        kc = kc.reshape(b, kh, -1, g, d)  # [B, K, Sg, G, D]
        kd = kc * kq.scale.astype(jnp.float32)[:, :, :, None] + kq.zero.astype(jnp.float32)[:, :, :, None]
        kd = kd.reshape(b, kh, -1, d)[:, :, :s]  # [B, K, S, D]
        keys = jnp.where(j < r * (nb // r), kd, kq.res.astype(jnp.float32)[:, :, ring])  # [B, K, S, D]

        vc = unpack_bits(vq.codes, self.bits).astype(jnp.float32).reshape(b, kh, s, d // g, g)  # [B, K, S, Gd, G]
        vd = vc * vq.scale.astype(jnp.float32)[..., None] + vq.zero.astype(jnp.float32)[..., None]
        vals = jnp.where(j < nb - r, vd.reshape(b, kh, s, d), vq.res.astype(jnp.float32)[:, :, ring])  # [B, K, S, D]
        return keys.astype(dtype), vals.astype(dtype)

    def compact(self, view, seen):
        state, knew, vnew, pos = view.carry
        kq, vq = state.k, state.v
        s, t = state.slots, pos.shape[1]
        n0 = pos[:, 0]  # [B] tokens stored before this step (chunks are contiguous)
        knew, vnew = knew.astype(kq.res.dtype), vnew.astype(vq.res.dtype)  # as the residual stores them
        keys = jax.vmap(self._fold_keys)(kq, knew, n0)
        vals = jax.vmap(self._fold_values)(vq, vnew, n0)
        n1 = n0 + t
        slot = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
        return SlotState(k=keys, v=vals, pos=jnp.where(slot < n1[:, None, None], slot, EMPTY))  # pos [B, 1, S]

    # -- folding one sequence's new tokens into its state (vmapped over B) ----------------------
    def _fold_keys(self, kq: KiviKeys, new: Float[Array, "K T D"], n0: Int[Array, ""]) -> KiviKeys:
        """Append T tokens to the key residual and quantize every block of R it completes."""
        r, g = self.residual, self.group
        kh, t, d = new.shape
        rr, rows, sg = kq.res.shape[1], kq.codes.shape[1], kq.scale.shape[1]
        base, r0 = r * (n0 // r), n0 % r  # first token of the residual, tokens in it
        lp = r * ((r - 1 + t) // r + 1)  # static: room for r0 + T tokens in whole blocks, plus one
        buf = jnp.zeros((kh, lp, d), new.dtype).at[:, :rr].set(kq.res)  # [K, Lp, D], residual at 0..r0-1
        buf = jax.lax.dynamic_update_slice_in_dim(buf, new, r0, axis=1)  # tokens base .. n0+T-1
        done = r * ((r0 + t) // r)  # tokens of buf that complete blocks (quantized now)

        q, sc, zr = quantize_asym(buf.reshape(kh, lp // g, g, d).swapaxes(2, 3), self.bits, self.scale_dtype)
        # q [K, Lp/G, D, G] -> codes per row [K, Lp, Dp]; sc, zr [K, Lp/G, D]
        codes = pack_bits(q.swapaxes(2, 3).reshape(kh, lp, d), self.bits)
        i = jnp.arange(lp)
        gi = jnp.arange(lp // g)
        row_at = _drop_index(base + i, i < done, rows)  # [Lp]
        grp_at = _drop_index(base // g + gi, gi * g < done, sg)  # [Lp/G]
        res = jax.lax.dynamic_slice_in_dim(buf, done, rr, axis=1)  # [K, Rr, D]: tokens base+done ..
        res = jnp.where(jnp.arange(rr)[None, :, None] < r0 + t - done, res, 0)  # zero the free rows
        return KiviKeys(
            codes=kq.codes.at[:, row_at].set(codes, mode="drop"),
            scale=kq.scale.at[:, grp_at].set(sc, mode="drop"),
            zero=kq.zero.at[:, grp_at].set(zr, mode="drop"),
            res=res.astype(kq.res.dtype),
        )

    def _fold_values(self, vq: KiviValues, new: Float[Array, "K T D"], n0: Int[Array, ""]) -> KiviValues:
        """Append T tokens to the value ring; quantize every token that leaves the newest R."""
        r, g = self.residual, self.group
        kh, t, d = new.shape
        s, rr = vq.codes.shape[1], vq.res.shape[1]
        n1 = n0 + t
        # token held by ring row i: the one in [n0 - Rr, n0) congruent to i mod Rr (< 0: none)
        ring_tok = n0 - rr + (jnp.arange(rr) - (n0 - rr)) % rr  # [Rr]
        new_tok = n0 + jnp.arange(t)  # [T]
        tok = jnp.concatenate([ring_tok, new_tok])  # [Rr+T]
        x = jnp.concatenate([vq.res, new], axis=1)  # [K, Rr+T, D]
        q, sc, zr = quantize_asym(x.reshape(kh, rr + t, d // g, g), self.bits, self.scale_dtype)  # [K, Rr+T, Gd, G]
        codes = pack_bits(q.reshape(kh, rr + t, d), self.bits)  # [K, Rr+T, Dp]
        quant = (tok >= 0) & (tok >= n0 - r) & (tok < n1 - r)  # leaves the residual in this step
        at = _drop_index(tok, quant, s)
        keep = new_tok >= n1 - r  # new tokens that stay in the residual
        res = vq.res.at[:, _drop_index(new_tok % rr, keep, rr)].set(new, mode="drop")  # [K, Rr, D]
        return KiviValues(
            codes=vq.codes.at[:, at].set(codes, mode="drop"),
            scale=vq.scale.at[:, at].set(sc, mode="drop"),
            zero=vq.zero.at[:, at].set(zr, mode="drop"),
            res=res,
        )

    # -- the reference's prefill (prompt="dense") ------------------------------------------------
    def prompt_policy(self):
        if self.prompt == "stream":
            return self
        return DensePrompt(rotated=self.after_rope, of=self)  # full precision, keys rotated as kivi stores them

    def after_prompt(self, state):
        """A dense prompt state (slot j holds token j, full precision) quantized by the residual
        rule: keys j < R floor(n / R) per channel, values j < n - R per token, the rest residual."""
        if self.prompt == "stream":
            return state
        self._check_dim(state.k.shape[-1])
        n = (state.pos[:, 0] >= 0).sum(axis=-1).astype(jnp.int32)  # [B] prompt tokens
        s = state.slots
        rr = min(self.residual, s)
        keys, vals = jax.vmap(lambda k, v, m: self._quantize_prompt(k, v, m, rr))(state.k, state.v, n)
        return SlotState(k=keys, v=vals, pos=state.pos)

    def _quantize_prompt(self, k: Float[Array, "K S D"], v: Float[Array, "K S D"], n: Int[Array, ""], rr: int
                         ) -> tuple[KiviKeys, KiviValues]:
        r, g = self.residual, self.group
        kh, s, d = k.shape
        sg = -(-s // g)
        # keys: per channel over groups of G tokens; the first R floor(n / R) tokens (whole groups)
        nq = r * (n // r)
        kp = jnp.pad(k, ((0, 0), (0, sg * g - s), (0, 0)))  # [K, Sg*G, D]
        q, sc, zr = quantize_asym(kp.reshape(kh, sg, g, d).swapaxes(2, 3), self.bits, self.scale_dtype)  # [K,Sg,D,G]
        codes = pack_bits(q.swapaxes(2, 3).reshape(kh, sg * g, d), self.bits)  # [K, Sg*G, Dp]
        row_q = (jnp.arange(sg * g) < nq)[None, :, None]
        grp_q = (jnp.arange(sg) * g < nq)[None, :, None]
        tok = nq + jnp.arange(rr)  # [Rr]: residual row i holds token nq + i
        kres = jnp.where((tok < n)[None, :, None], jnp.take(k, jnp.minimum(tok, s - 1), axis=1), 0)  # [K, Rr, D]
        keys = KiviKeys(codes=jnp.where(row_q, codes, 0).astype(jnp.uint8), scale=jnp.where(grp_q, sc, 0).astype(sc.dtype),
                        zero=jnp.where(grp_q, zr, 0).astype(zr.dtype), res=kres.astype(k.dtype))
        # values: per token over groups of G channels; tokens j < n - R, the newest min(n, R) in a ring
        qv, scv, zrv = quantize_asym(v.reshape(kh, s, d // g, g), self.bits, self.scale_dtype)  # [K, S, Gd, G]
        vcodes = pack_bits(qv.reshape(kh, s, d), self.bits)  # [K, S, Dp]
        tok_q = (jnp.arange(s) < n - r)[None, :, None]
        ring_tok = n - rr + (jnp.arange(rr) - (n - rr)) % rr  # [Rr]: the token of [n - Rr, n) at row i
        vres = jnp.where((ring_tok >= 0)[None, :, None], jnp.take(v, jnp.maximum(ring_tok, 0), axis=1), 0)
        vals = KiviValues(codes=jnp.where(tok_q, vcodes, 0).astype(jnp.uint8),
                          scale=jnp.where(tok_q, scv, 0).astype(scv.dtype), zero=jnp.where(tok_q, zrv, 0).astype(zrv.dtype),
                          res=vres.astype(v.dtype))
        return keys, vals


@dataclasses.dataclass(frozen=True)
class DensePrompt(Full):
    """kivi's prompt phase: `full`'s slots (token j in slot j, full precision), keys stored
    rotated iff `rotated` (kivi's `after_rope`), so `after_prompt` quantizes them as kivi stores them.
    `of` (the layer's kivi policy) keeps layers of different kivi settings in different runs, as
    their decode policies are (the engine compresses run by run)."""

    rotated: bool = True
    of: Policy | None = None

    @property
    def rotated_keys(self):
        return self.rotated
