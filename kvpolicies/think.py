"""`think`: ThinK (Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning",
arXiv:2407.21018; SalesforceAIResearch/ThinK; NVIDIA/kvpress `ThinKPress`) — after the prompt, prune
the key channels of every kv head that the last queries use least, and store only the others.

Shapes: B batch, K kv heads, Kp = 1 or K position rows (K with a token press), G query heads per kv
head, T new tokens, M prompt slots (max_len, or the token press's slots), R whole slots
(= min(max_new, max_len)), S = M + R slots, W query window, D head dim, C = D - int(D * ratio) kept channels.

The score of channel j of a kv head is kvpress's: the mean over the last `window` prompt queries
(after RoPE, averaged over the head's G query heads) of q_j^2, times the mean over the prompt's keys
(after RoPE) of k_j^2 (the paper's ||Q[-W:, j] K[:, j]^T||_F up to the square root and the constant
factors, which rank alike). The int(D * ratio) lowest are pruned, per (batch row, layer, kv head).

What is stored: the prompt's keys are rotated (RoPE at their text positions, as kvpress caches
them: ThinK prunes channels of rotated keys) and only their C kept channels are stored,
[B, K, M, C], with the head's channel order `chan` [B, K, D] (the C kept channels ascending, then
the pruned ones). Values are stored whole. Tokens appended after the compression (the question, the
answer) are stored whole in R slots of their own, as kvpress and the authors do (the new keys are
never pruned). kvpress zeroes the pruned channels of a cache of the same size (its docstring: "no
memory gain"); ours holds C of the D key channels of the prompt.

How attention reads it: `extend` decodes the stored keys to D channels with zeros at the pruned
ones (a gather, exact), so q.k over D equals q.k over the kept channels, as kvpress's zeroed keys
give; like a codec's view it is transient. (Attention over the kept channels alone, gathering q's
channels instead, would need a per-part query transform in `kvpolicies.attention`.)

With a token press (`press`, kvpress's `ComposedPress([press, ThinKPress])`): the press compresses the
prompt first (its own prompt phase's observations, collected by ThinK's), then the channels are scored on
the keys it kept (kvpress's keys_norm over the cache it leaves) and the same window queries; each head's
kept tokens are stored with C channels (positions per kv head).

Deviations: the authors' code (ThinK_flash, `think_utils`) leaves the newest `window` prompt keys
unpruned; kvpress prunes every prompt key, and so do we (the parity target).

Our stream extension (ThinK alone): tokens are appended whole to the R slots; a token that finds them full
attends to them, then they fold into the next prompt slots with their kept channels (`ThinK.fold`) and the
token joins the emptied whole slots, so max_len tokens always
fit (`Bounded` at max_len, as `full`). A stream never compressed (`Engine.score`, no prompt phase) chooses its
channels at its first fold, by ThinK's score over the R whole keys and that step's query. Decoding is token by
token (`per_token`) where a fold may come, so the chunk never changes a result; a chunk that fits the free
whole slots attends in one piece (`QuietChunks`). With a token press the whole slots do not fold: R tokens
fit after the prompt (`Bounded` there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import EMPTY, Policy, RopePositions, SlotState, View
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.keydiff import rotated
from kvpolicies.limits import Bounded, concrete
from kvpolicies.prompt import PromptCompressor, PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored
from kvpolicies.slots import QuietChunks, write_rows


class ThinKeys(NamedTuple):
    kept: Float[Array, "B K M C"]  # the prompt's rotated keys, their kept channels (in `chan`'s order)
    whole: Float[Array, "B K R D"]  # tokens appended after the compression, rotated, every channel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ThinKState(SlotState):
    """k: `ThinKeys`; v [B, K, S, D] (the M prompt slots, then the R whole ones); pos [B, Kp, S]
    (alone: slot j < M holds prompt token j; with a token press, each head's kept tokens); chan [B, K, D]
    int32: each head's kept channels ascending, then its pruned ones; chosen [B] bool: the channels were
    chosen (after a prompt, or at a stream's first fold)."""

    chan: Int[Array, "B K D"]
    chosen: Bool[Array, "B"]


def n_kept(head_dim: int, ratio: float) -> int:
    """Key channels kept of `head_dim` (kvpress: int(head_dim * ratio) pruned)."""
    return head_dim - int(head_dim * ratio)


def decode_keys(kept: Float[Array, "B K M C"], chan: Int[Array, "B K D"]) -> Float[Array, "B K M D"]:
    """The stored keys at their D channels, zeros at the pruned ones (an exact gather)."""
    b, k, m, c = kept.shape
    d = chan.shape[-1]
    padded = jnp.concatenate([kept, jnp.zeros((b, k, m, d - c), kept.dtype)], axis=-1)  # [B, K, M, D] chan order
    inv = jnp.argsort(chan, axis=-1)  # [B, K, D]: where each channel lies in `chan`'s order
    return jnp.take_along_axis(padded, inv[:, :, None, :], axis=-1)  # [B, K, M, D]


def channel_order(q_sq: Float[Array, "B K D"], k_sq: Float[Array, "B K D"], pruned: int) -> Int[Array, "B K D"]:
    """kvpress's rule: the `pruned` channels of lowest q_sq * k_sq are pruned (stable: ties prune
    the lower channel). [B, K, D]: the kept channels ascending, then the pruned ones ascending."""
    d = q_sq.shape[-1]
    order = jnp.argsort(q_sq * k_sq, axis=-1, stable=True)  # [B, K, D] lowest first
    drop = jnp.argsort(order, axis=-1) < pruned  # [B, K, D]: each channel's rank among the lowest
    key = jnp.where(drop, d, 0) + jnp.arange(d)  # kept first, each group ascending
    return jnp.argsort(key, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ThinKPhase(PromptPhase):
    """ThinK's prompt phase: the prompt densely (a `PromptPhase`; `obs_window` rows for a token
    press composed with it), plus the squares of the newest `window` queries after RoPE, summed
    over each kv head's G query heads, extra["q_win"] [B, K, W, D] (row p mod W holds query p),
    "win_pos" [B, W], and RoPE's frequencies "inv_freq" [D/2]."""

    window: int = 32

    def __post_init__(self):
        super().__post_init__()
        check_int("think", "window", self.window, 1)

    @property
    def observes(self):
        return tuple(dict.fromkeys(super().observes + ("q", "rope")))

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        extra = {**st.extra, "q_win": jnp.zeros((batch, kv_heads, self.window, head_dim), jnp.float32),
                 "win_pos": jnp.full((batch, self.window), EMPTY, jnp.int32)}
        return dataclasses.replace(st, extra=extra)

    def compact(self, view, seen):
        st = super().compact(view, seen)
        pos = view.carry[2]  # [B, T]
        w = self.window
        m = min(pos.shape[1], w)  # only the chunk's last min(T, W) queries can be among the newest W
        last = pos[:, -m:]  # [B, m]
        q = seen.rope.apply(seen.q[:, :, :, -m:].astype(jnp.float32), last[:, None, None, :])  # [B, K, G, m, D]
        sq = jnp.sum(q * q, axis=2)  # [B, K, m, D]
        row = jnp.where(last > pos[:, -1:] - w, last % w, w)  # w: dropped
        extra = dict(st.extra)
        extra["q_win"] = jax.vmap(lambda r, i, x: r.at[:, i].set(x, mode="drop"))(extra["q_win"], row, sq)
        extra["win_pos"] = jax.vmap(lambda r, i, x: r.at[i].set(x, mode="drop"))(extra["win_pos"], row, last)
        extra["inv_freq"] = jnp.asarray(seen.rope.inv_freq())  # [D/2]
        return dataclasses.replace(st, extra=extra)


@dataclasses.dataclass(frozen=True)
class ThinK(PromptCompressor, QuietChunks, Bounded, Policy):
    """After the prompt, each kv head keeps C = D - int(D * ratio) key channels (kvpress's
    `ThinKPress(key_channel_compression_ratio=ratio, window_size=window)`); every token is kept.
    Stored: the prompt's C kept channels of rotated keys and their order, whole values, and
    `max_new` whole slots for the tokens that follow (module docstring)."""

    rotated_keys = True  # RoPE at text positions; only attention reads stored keys
    per_token = True  # a token that finds the whole slots full folds them first (`fold`): chunks as single tokens
    observes = ("q", "rope")  # the query that chooses a stream's channels at its first fold

    ratio: float = 0.5  # key_channel_compression_ratio: the fraction of key channels pruned
    window: int = 32  # window_size: the newest prompt queries that score the channels
    max_new: int = 256  # whole slots for the tokens appended after the compression
    codec: Codec = Identity()
    # a token press applied first (a prompt scorer with max_new=0 whose prompt phase is a plain
    # PromptPhase: snapkv, knorm, keydiff, expected, ...); None: every token kept
    press: Policy | None = None

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise ValueError(f"think.ratio={self.ratio!r}: must be a number in [0, 1) (the key channels pruned)")
        check_int("think", "window", self.window, 1)
        check_int("think", "max_new", self.max_new, 1)
        if not isinstance(self.codec, Identity):
            raise ValueError(f"think.codec={self.codec!r}: think stores its own key channels (use codec='none')")
        if self.press is not None:
            if not isinstance(self.press, PromptScored) or type(self.press.prompt_policy()) is not PromptPhase:
                raise ValueError(f"think.press={self.press!r}: must be a prompt scorer whose prompt phase is a plain "
                                 "PromptPhase (snapkv, knorm, keydiff, expected, ...)")
            if self.press.max_new != 0 or self.press.interval:
                raise ValueError(f"think.press: max_new={self.press.max_new}, interval={self.press.interval} must be 0 "
                                 "(think stores the tokens after the prompt in its own whole slots)")

    def kept_channels(self, head_dim: int) -> int:
        """C: the key channels each kv head keeps of `head_dim`."""
        return n_kept(head_dim, self.ratio)

    def whole_slots(self, max_len: int) -> int:
        return min(self.max_new, max_len)

    def prompt_slots(self, max_len: int) -> int:
        """M: every prompt token, or what the token press keeps of a max_len-token prompt."""
        return max_len if self.press is None else self.press.capacity(max_len)

    def capacity(self, max_len):
        return self.prompt_slots(max_len) + self.whole_slots(max_len)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        m, r, c = self.prompt_slots(max_len), self.whole_slots(max_len), n_kept(head_dim, self.ratio)
        kp = 1 if self.press is None else kv_heads
        keys = ThinKeys(kept=jnp.zeros((batch, kv_heads, m, c), dtype),
                        whole=jnp.zeros((batch, kv_heads, r, head_dim), dtype))
        chan = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32), (batch, kv_heads, head_dim))
        return ThinKState(k=keys, v=jnp.zeros((batch, kv_heads, m + r, head_dim), dtype),
                          pos=jnp.full((batch, kp, m + r), EMPTY, jnp.int32), chan=chan,
                          chosen=jnp.zeros((batch,), bool))

    def limit(self, state):
        """Alone: max_len tokens (full whole slots fold into the M = max_len prompt slots); with a token
        press: up to the compressed prompt's end plus the R whole slots."""
        m = state.k.kept.shape[2]
        if self.press is None:
            return int(m)
        last = state.pos[:, :, :m].max(axis=(1, 2), initial=-1).min() + 1 + state.k.whole.shape[2]
        return int(last) if concrete(state) else last

    def extend(self, state, k, v, pos):
        stored = decode_keys(state.k.kept, state.chan).astype(k.dtype)  # [B, K, M, D] zeros at the pruned channels
        keys = jnp.concatenate([stored, state.k.whole.astype(k.dtype), k], axis=2)  # [B, K, S + T, D]
        vals = jnp.concatenate([state.v.astype(v.dtype), v], axis=2)  # [B, K, S + T, D]
        new = jnp.broadcast_to(pos[:, None, :], (pos.shape[0], state.pos.shape[1], pos.shape[1]))  # [B, Kp, T]
        kpos = jnp.concatenate([state.pos, new.astype(jnp.int32)], axis=2)  # [B, Kp, S + T]
        return View(k=keys, v=vals, pos=kpos, rope=RopePositions(q=pos[..., None], k=kpos), carry=(state, k, v, pos))

    def appends_quietly(self, state, t):
        """The t tokens fit in the free whole slots (no fold): the chunk attends in one piece."""
        m, r = state.k.kept.shape[2], state.k.whole.shape[2]
        if t > r:  # never: token by token
            return None
        return ((state.pos[:, 0, m:] >= 0).sum(axis=-1) + t <= r).all()

    def compact(self, view, seen):
        state, k, v, pos = view.carry
        m, r = state.k.kept.shape[2], state.k.whole.shape[2]
        at = (state.pos[:, 0, m:] >= 0).sum(axis=-1)  # [B] the first free whole slot (filled in order, every head)
        if self.press is None:  # a single token (per_token) that finds the whole slots full folds them first
            full = at + k.shape[2] > r  # [B]
            state = jax.lax.cond(full.any(), lambda: self.fold(state, seen, pos[:, -1], full), lambda: state)
            at = jnp.where(full, 0, at)
        whole = write_rows(state.k.whole, k, at)  # [B, K, R, D]
        vals = write_rows(state.v, v, m + at)  # [B, K, S, D]
        kpos = write_rows(state.pos, pos[:, None, :], m + at)  # [B, 1, S]
        return dataclasses.replace(state, k=ThinKeys(state.k.kept, whole), v=vals, pos=kpos)

    def fold(self, state: ThinKState, seen: Any, qpos: Int[Array, "B"], rows: Bool[Array, "B"]) -> ThinKState:
        """Our stream extension (ThinK alone): the R whole tokens of `rows` move to the next prompt slots
        with their kept channels. Channels not chosen yet (a stream, no prompt compression) are chosen
        first by ThinK's score over the whole tokens' keys and the step's query (the window that exists)."""
        m = state.k.kept.shape[2]
        d = state.chan.shape[-1]
        c = n_kept(d, self.ratio)
        whole = state.k.whole.astype(jnp.float32)  # [B, K, R, D] rotated
        live = state.pos[:, :, m:] >= 0  # [B, 1, R]
        k_sq = jnp.where(live[..., None], whole * whole, 0.0).sum(axis=2)  # [B, K, D] (a sum: the ranking's scale)
        q = seen.rope.apply(seen.q[:, :, :, -1:].astype(jnp.float32), qpos[:, None, None, None])  # [B, K, G, 1, D]
        # (the step's query at its position qpos [B])
        q_sq = jnp.sum(q * q, axis=(2, 3))  # [B, K, D]
        chan = jnp.where(state.chosen[:, None, None], state.chan, channel_order(q_sq, k_sq, d - c))  # [B, K, D]
        n_p = (state.pos[:, 0, :m] >= 0).sum(axis=-1)  # [B] filled prompt slots
        kept = write_rows(state.k.kept, jnp.take_along_axis(state.k.whole, chan[:, :, None, :c], axis=-1), n_p)
        vals = write_rows(state.v, state.v[:, :, m:], n_p)  # [B, K, S, D]
        kpos = write_rows(state.pos, state.pos[:, :, m:], n_p)  # [B, Kp, S]
        kpos = kpos.at[:, :, m:].set(EMPTY)
        pick = lambda new, old: jnp.where(rows.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
        return ThinKState(k=ThinKeys(pick(kept, state.k.kept), state.k.whole), v=pick(vals, state.v),
                          pos=pick(kpos, state.pos), chan=pick(chan, state.chan), chosen=state.chosen | rows)

    # -- the paper's protocol: the whole prompt densely, then one compression ----------------------
    def prompt_policy(self):
        if self.press is None:
            return ThinKPhase(codec=self.codec, obs_window=0, window=self.window)
        p = self.press.prompt_policy()  # what the token press observes, plus the window's queries
        return ThinKPhase(codec=p.codec, obs_window=p.obs_window, columns=p.columns, query_sink=p.query_sink,
                          window=self.window)

    def after_prompt(self, state: PromptState) -> ThinKState:
        slots = state if self.press is None else self.press.after_prompt(state)  # the press's kept tokens
        keys = slots.k.astype(jnp.float32)  # [B, K, M, D] before RoPE
        b, kh, m, d = keys.shape
        pos = jnp.broadcast_to(slots.pos, (b, kh, m))  # [B, K, M]
        filled = (pos >= 0)[..., None]  # [B, K, M, 1]
        k_rot = jnp.where(filled, rotated(keys, pos, state.extra["inv_freq"]), 0.0)  # [B, K, M, D]
        return compressed(self, state, k_rot, slots.v, slots.pos, slots.k.dtype)


def channel_scores(state: PromptState, k_rot: Float[Array, "B K M D"], keep: Any) -> tuple[Array, Array]:
    """(mean squared window query [B, K, D], mean squared key over the kept tokens [B, K, D]): kvpress's
    queries_norm (the last window's queries after RoPE, averaged over the G heads) and keys_norm."""
    n = jnp.maximum(keep.sum(axis=-1), 1)[..., None].astype(jnp.float32)  # [B, K, 1]
    k_sq = jnp.where(keep[..., None], k_rot * k_rot, 0.0).sum(axis=2) / n  # [B, K, D]
    w = jnp.maximum((state.extra["win_pos"] >= 0).sum(axis=-1), 1).astype(jnp.float32)  # [B]
    q_sq = state.extra["q_win"].sum(axis=2) / w[:, None, None]  # [B, K, D], summed over G
    return q_sq, k_sq


def compressed(policy: ThinK, state: PromptState, k_rot: Float[Array, "B K M D"], v: Float[Array, "B K M D"],
               pos: Int[Array, "B Kp M"], dtype: Any) -> ThinKState:
    """The decode state of the prompt tokens whose rotated keys are k_rot (their values v, positions pos;
    `state`: the prompt phase's, for the window's queries), each head's C best channels stored."""
    b, kh, m, d = k_rot.shape
    q_sq, k_sq = channel_scores(state, k_rot, jnp.broadcast_to(pos, (b, kh, m)) >= 0)
    chan = channel_order(q_sq, k_sq, d - n_kept(d, policy.ratio))  # [B, K, D]
    kept = jnp.take_along_axis(k_rot, chan[:, :, None, :n_kept(d, policy.ratio)], axis=-1)  # [B, K, M, C]
    r = policy.whole_slots(state.pos.shape[-1])  # the prompt phase holds max_len slots
    # the whole slots as zeros computed from k_rot (finite: empty slots hold 0), so that a mesh's split of
    # the kv heads carries over to them (fresh zeros, a constant, would be replicated)
    whole = jnp.broadcast_to(k_rot[:, :, :1] * 0, (b, kh, r, d)).astype(dtype)  # [B, K, R, D]
    keys = ThinKeys(kept=kept.astype(dtype), whole=whole)
    vals = jnp.concatenate([v, jnp.zeros((b, kh, r, d), v.dtype)], axis=2)  # [B, K, S, D]
    kpos = jnp.concatenate([pos, jnp.full((b, pos.shape[1], r), EMPTY, jnp.int32)], axis=2)  # [B, Kp, S]
    chosen = kpos[:, 0, 0] >= EMPTY  # [B] True, computed from the positions: a mesh's batch split carries over
    return ThinKState(k=keys, v=vals, pos=kpos, chan=chan, chosen=chosen)
