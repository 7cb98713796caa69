"""`multires` (alias `hier`): a mean-pooled multi-resolution cache — the newest tokens in full, older tokens averaged
into summary slots in levels whose reach grows geometrically (fixed capacity, reach ~ M b^L tokens).

This library's own baseline, not a published method: no paper's protocol is reproduced and none
should be cited for it. Its parts have precedents: mean-pooling merged tokens, and the log(count)
logit bias of a merged token, ToMe's proportional attention (Bolya et al. 2023, "Token Merging:
Your ViT But Faster"). Measured on SmolLM2 it is far behind `sink` at equal memory (docs/results/quality.md).

Shapes: B batch, T new tokens, K kv heads, S slots, D head dim, L levels, M slots per level,
b branch factor, E summaries one step creates, C b children of a summary, R raw ring slots.

Tokens form aligned blocks of b (block i = tokens [i b, (i+1) b)). A level-l summary with index
i stands for the b^l tokens [i b^l, (i+1) b^l): it stores the mean of its b children's
un-rotated keys and values (level 0 = raw tokens), its newest token as its slot position, and
its count b^l in the state's `count`; attention adds log(count) to its logit, so its softmax mass
stands for all its tokens (exactly so when they all had the same logit).

The configuration seen by query p is a closed-form function of p (so a chunk of queries is
processed exactly as one by one, each query masking what it would not have seen):
  * raw tokens of blocks i >= n(p) = max(0, floor((p - W + 1) / b)) are visible: every block
    with a token among the newest W is kept whole, so between W and W + b - 1 raw tokens
    (a ring of R = W + b - 1 slots); the blocks i < n(p) have entered level 1;
  * level l has received h_l summaries: h_1 = n, h_{l+1} = max(0, ceil((h_l - M) / b)) — a level
    that receives a summary while full first merges its oldest b summaries into one summary of
    the next level; it holds indices [f_l, h_l) with f_l = b h_{l+1};
  * the top level, when full, evicts its oldest summary: f_L = max(0, h_L - M), and tokens
    older than its oldest summary are forgotten. With W + b - 1 + L M slots the cache reaches
    back about W + M (b + b^2 + ... + b^L) tokens (`reach(p)` gives the exact oldest token).
Level l's summary i lives in slot i mod M of that level, raw token j in ring slot j mod R.
Summaries are created in `compact` for the next query (decode) or, for a chunk, in `extend`
(all the summaries any of its queries sees are appended to the view, E <= ~T/(b-1)). The view
carries the visibility mask, the log(count) bias and the RoPE positions, all from the slots.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import Policy, RopePositions, SlotState
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.slots import concat, encode_new, scatter, view_of


def _div(a: Int[Array, "*s"], b) -> Int[Array, "*s"]:
    """Floor division of non-negative ints (lax.div truncates; far fewer ops than jnp's //)."""
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def _mod(a: Int[Array, "*s"], b) -> Int[Array, "*s"]:
    """a mod b for non-negative ints."""
    return jax.lax.rem(a, jnp.asarray(b, a.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MultiResState(SlotState):
    """Slots plus how many tokens each stands for.

    count: [B, 1, S] int32: 1 for a raw token, b^l for a level-l summary, 0 for an empty slot.
    """

    count: Int[Array, "B 1 S"]


@dataclasses.dataclass(frozen=True)
class MultiRes(Policy):
    """Raw ring of the newest W..W+b-1 tokens + `levels` levels of `slots_per_level` summaries
    (mean-pooled multi-resolution cache with a log-count bias; ours, not a published method).

    positions="mean": a summary is rotated at the mean position of its tokens (fractional when
    b^l is even; RoPE takes float positions). positions="cache": every visible slot is rotated
    by its rank in the cache as the query sees it (oldest summary 0, ..., query last), so
    distances stay below the cache size; exact for chunks too, with one RoPE segment per level.
    """


    window: int = 1024
    branch: int = 4
    slots_per_level: int = 64
    levels: int = 3
    positions: Literal["mean", "cache"] = "mean"
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("multires", "window", self.window, 1)
        check_int("multires", "branch", self.branch, 2)
        check_int("multires", "levels", self.levels, 1)
        check_int("multires", "slots_per_level", self.slots_per_level, self.branch)  # merges take the oldest b
        check_choice("multires", "positions", self.positions, ("mean", "cache"))
        if self.branch**self.levels > 2**30:
            raise ValueError(f"multires.levels={self.levels}: branch**levels must be <= 2**30 (int32 counts)")

    # -- layout --------------------------------------------------------------------------
    @property
    def ring(self) -> int:
        return self.window + self.branch - 1

    def capacity(self, max_len):
        # Sequences that fit in the window never summarize: a plain cache of max_len slots.
        return max_len if max_len <= self.window else self.ring + self.levels * self.slots_per_level

    def _ring_of(self, cap: int) -> int:
        return cap if cap <= self.window else self.ring

    def _has_levels(self, cap: int) -> bool:
        return cap > self.window

    def _made_sizes(self, t: int) -> tuple[int, ...]:
        """Static bound on the summaries per level that t consecutive positions create."""
        sizes, e = [], t
        for _ in range(self.levels):
            e = -(-e // self.branch)  # ceil
            sizes.append(e)
        return tuple(sizes)

    # -- the closed-form configuration ----------------------------------------------------
    def blocks_done(self, p: Int[Array, "*b"]) -> Int[Array, "*b"]:
        """n(p): blocks that have entered level 1 by the time query p attends."""
        return _div(jnp.maximum(0, p - self.window + 1), self.branch)

    def alive(self, n: Int[Array, "*b"]) -> tuple[Int[Array, "*b L"], Int[Array, "*b L"]]:
        """(h, f): level l holds summary indices [f_l, h_l) after n blocks (see module doc)."""
        b, m = self.branch, self.slots_per_level
        h = [n]
        for _ in range(self.levels - 1):
            h.append(_div(jnp.maximum(0, h[-1] - m) + b - 1, b))
        f = [b * x for x in h[1:]] + [jnp.maximum(0, h[-1] - m)]
        return jnp.stack(h, -1), jnp.stack(f, -1)

    def _slot_ids(self, view: MultiResState) -> tuple[Int[Array, "B 1 S"], Int[Array, "B 1 S"], Int[Array, "B 1 S"]]:
        """(level, count b^level, index at that level) of every slot; raw tokens are level 0."""
        count = jnp.maximum(view.count, 1)  # [B, 1, S]
        level = sum((count >= self.branch**l).astype(jnp.int32) for l in range(1, self.levels + 1))
        return level, count, _div(view.pos + 1, count) - 1

    # -- state ---------------------------------------------------------------------------
    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return MultiResState(st.k, st.v, st.pos, count=jnp.zeros(st.pos.shape, jnp.int32))  # [B, 1, S]

    def extend(self, state, k, v, pos):
        ring = self._ring_of(state.slots)
        raw = encode_new(self.codec, k, v, pos)
        new = MultiResState(raw.k, raw.v, raw.pos, count=jnp.ones_like(raw.pos))  # [B, 1, T]
        if new.slots == 1:  # decode: write the ring slot in place (summaries are made in compact)
            slots = scatter(state, new, _mod(pos, ring))
            carry = (slots, None, None)
        else:  # a chunk: append its tokens and every summary any of its queries sees
            slots, made = concat(state, new), None
            if self._has_levels(state.slots):
                made = self._grow(slots, state.slots, pos[:, 0], self.blocks_done(pos[:, 0]),
                                  self.blocks_done(pos[:, -1] + 1), self._made_sizes(new.slots))
                slots = concat(slots, made)
            carry = (state, new, made)
        return view_of(self.codec, slots, pos, k.dtype, carry, mask=self._visible(pos, slots),
                       bias=jnp.log(jnp.maximum(slots.count, 1).astype(jnp.float32)),  # [B, 1, S]
                       rope=self._rope(pos, slots))

    def _take(self, st: SlotState, slots: Int[Array, "B E C"]) -> tuple[Float[Array, "B K E C D"], ...]:
        """Decoded (float32) keys and values of the given slots."""
        b, e, c = slots.shape
        idx = jnp.clip(slots, 0, st.slots - 1).reshape(b, e * c)  # [B, E*C]

        def take(x):  # [B, K, S, ...] -> [B, K, E*C, ...]
            return jax.vmap(lambda y, i: y[:, i])(x, idx)

        kk = self.codec.decode(jax.tree.map(take, st.k), jnp.float32)  # [B, K, E*C, D]
        vv = self.codec.decode(jax.tree.map(take, st.v), jnp.float32)
        return kk.reshape(kk.shape[:2] + (e, c) + kk.shape[3:]), vv.reshape(vv.shape[:2] + (e, c) + vv.shape[3:])

    def _grow(self, view: MultiResState, cap: int, first: Int[Array, "B"], n0: Int[Array, "B"], n1: Int[Array, "B"],
              sizes: tuple[int, ...]) -> MultiResState:
        """The summaries created while the block count goes from n0 to n1, level by level.

        Raw token j is in the view's ring (j mod R) or, from position `first` on, among the
        appended tokens (slot cap + j - first). A child summary is either in the view's old
        level slots (indices < h(n0)) or among those just made one level below.
        """
        b, m, ring = self.branch, self.slots_per_level, self._ring_of(cap)
        h0, _ = self.alive(n0)  # [B, L]
        h1, _ = self.alive(n1)
        made: list[MultiResState] = []
        for lv in range(self.levels):  # level lv + 1
            idx = h0[:, lv, None] + jnp.arange(sizes[lv])  # [B, E]
            valid = idx < h1[:, lv, None]  # [B, E]
            child = idx[..., None] * b + jnp.arange(b)  # [B, E, C] indices one level below
            if lv == 0:
                f = first[:, None, None]
                kc, vc = self._take(view, jnp.where(child >= f, cap + child - f, _mod(child, ring)))
            else:
                old = (child < h0[:, lv - 1, None, None])[:, None, :, :, None]  # [B, 1, E, C, 1]
                ko, vo = self._take(view, ring + (lv - 1) * m + _mod(child, m))
                kn, vn = self._take(made[-1], child - h0[:, lv - 1, None, None])
                kc, vc = jnp.where(old, ko, kn), jnp.where(old, vo, vn)  # [B, K, E, C, D]
            keep = valid[:, None, :, None]  # [B, 1, E, 1]
            km = jnp.where(keep, kc.mean(axis=3), 0.0)  # [B, K, E, D]
            vm = jnp.where(keep, vc.mean(axis=3), 0.0)
            cast = lambda enc, ref: jax.tree.map(lambda x, r: x.astype(r.dtype), enc, ref)  # noqa: E731
            made.append(MultiResState(
                k=cast(self.codec.encode(km), view.k),
                v=cast(self.codec.encode(vm), view.v),
                pos=jnp.where(valid, (idx + 1) * b ** (lv + 1) - 1, -1)[:, None].astype(jnp.int32),  # [B, 1, E]
                count=jnp.where(valid, b ** (lv + 1), 0)[:, None].astype(jnp.int32),  # [B, 1, E]
            ))
        out = made[0]
        for x in made[1:]:
            out = concat(out, x)
        return out

    def compact(self, view, seen):
        state, new, made = view.carry  # (written state, None, None) at decode
        cap = state.slots
        ring = self._ring_of(cap)
        p_last = view.pos.max(axis=(1, 2))  # [B] the newest token of this step
        if new is None:  # decode: the ring was written in place
            if not self._has_levels(cap):
                return state
            made = self._grow(state, cap, p_last + 1, self.blocks_done(p_last), self.blocks_done(p_last + 1),
                              self._made_sizes(1))
        else:
            # Fold the raw tokens into the ring: each slot keeps its newest writer.
            pos = new.pos[:, 0]  # [B, T]
            state = scatter(state, new, jnp.where(pos > p_last[:, None] - ring, _mod(pos, ring), cap))  # cap = dropped
            if not self._has_levels(cap):
                return state
        # Write the summaries made: in each level's ring, the newest M ever created win.
        h1, _ = self.alive(self.blocks_done(p_last + 1))  # [B, L]
        level, _, idx = self._slot_ids(made)  # [B, 1, E]
        lv0 = jnp.clip(level[:, 0] - 1, 0, self.levels - 1)  # [B, E]
        newest = idx[:, 0] >= jnp.take_along_axis(h1, lv0, axis=1) - self.slots_per_level
        target = ring + lv0 * self.slots_per_level + _mod(jnp.maximum(idx[:, 0], 0), self.slots_per_level)
        target = jnp.where((made.pos[:, 0] >= 0) & newest, target, cap)  # cap = dropped
        return scatter(state, made, target)

    # -- what attention sees -------------------------------------------------------------
    def _rope(self, q_pos: Int[Array, "B T"], view: MultiResState) -> RopePositions:
        level, count, idx = self._slot_ids(view)  # [B, 1, S] each
        if self.positions == "mean":
            return RopePositions(q=q_pos[..., None], k=view.pos.astype(jnp.float32) - (count - 1) / 2)
        # Rank of a level-l summary i as query p sees it, counted back from the query:
        # (h_l - i) + (summaries alive below level l) + (p - n b); segment l pairs it with
        # query position h_l + S_l + p - n b and key position i.
        n = self.blocks_done(q_pos)  # [B, T]
        h, f = self.alive(n)  # [B, T, L]
        a = h - f
        below = jnp.cumsum(a, axis=-1) - a  # [B, T, L] summaries alive at lower levels
        q_lv = h + below + (q_pos - n * self.branch)[..., None]  # [B, T, L]
        return RopePositions(
            q=jnp.concatenate([q_pos[..., None], q_lv], axis=-1),  # [B, T, L + 1]
            k=jnp.where(level == 0, view.pos, idx),  # [B, 1, S]
            seg=level,
        )

    def _visible(self, q_pos: Int[Array, "B T"], view: MultiResState) -> Bool[Array, "B 1 T S"]:
        """Query p sees raw tokens of blocks >= n(p) and level-l summaries i in [f_l, h_l)."""
        level, _, idx = self._slot_ids(view)
        n = self.blocks_done(q_pos)  # [B, T]
        h, f = self.alive(n)  # [B, T, L]
        lv, i = level[:, :, None, :], idx[:, :, None, :]  # [B, 1, 1, S]
        ok = (lv == 0) & (view.pos[:, :, None, :] >= (n * self.branch)[:, None, :, None])  # [B, 1, T, S]
        for l in range(self.levels):
            lo, hi = f[:, None, :, l, None], h[:, None, :, l, None]  # [B, 1, T, 1]
            ok = ok | ((lv == l + 1) & (i >= lo) & (i < hi))
        return ok  # [B, 1, T, S]

    def reach(self, p: int) -> int:
        """Oldest token position still represented for query p (0 until the top level evicts)."""
        _, f = self.alive(self.blocks_done(jnp.asarray(p)))
        return int(f[-1]) * self.branch**self.levels

