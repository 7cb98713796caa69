"""`cam`: CaM (Zhang et al. 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
https://openreview.net/forum?id=LCTmppB165; NVIDIA/kvpress `CAMPress`) — compression while decoding:
every `interval` decoded tokens the cache goes back to `target` tokens, and before the evicted tokens
leave, their values are merged, each with a Bernoulli draw, into the kept tokens that follow them.

Shapes: B batch, K kv heads, S slots (`Decoding`'s), T new tokens of a step, V = S + T view slots, D head dim,
N = V + 1 rank bins.

kvpress 0.5.5's rule (`CAMPress(base_press=KnormPress(), compression_interval, target_size,
merge_budget=32)`, a `DecodingPress`), per layer, at a compression of a cache of V tokens:

1. the base press scores every token, averaged over the kv heads; the V - target lowest are evicted
   (the same tokens in every head), the target best kept;
2. merge candidates: the k best-scored evicted tokens (ties: the later position), k the decode steps
   since the last compression (`interval` on schedule: every evicted token then);
3. each candidate's window: the `merge_budget` kept tokens that follow it in text order (fewer at the end);
4. per kv head, p = clamp(A_i / mean of A over the window, 0, 1), A the attention each token has received
   from the decode queries so far (their softmax over the cache, averaged over a kv head's query heads;
   kept across compressions); 0 / 0 counts 0, x / 0 counts 1;
5. a Bernoulli draw of p; where it succeeds, v_i / (window size) is added to the value of every token of
   the window (so merged values are merged again later);
6. the evicted tokens leave.

Ours is that rule on kvpress's decoding schedule (`kvpolicies.decoding.Decoding`: forward steps counted as
kvpress counts them, a q-token question one step; the prompt kept whole, or a prefilling press's choice)
over the base presses whose score reads the cache alone (`Decoding.takes`: KnormPress, KeyDiffPress). A
step's attention is its last query's (kvpress: `attentions[:, :, -1:]`, or the current token's softmax over
the cache). The draw is ours: u < p with u a hash of (seed, kv head, position)
(`kvpolicies.random_keep.uniform_hash`); torch's `torch.bernoulli` cannot be reproduced, so the merged
values differ from kvpress's run by run (the evicted tokens do not). Stored: ordinary slots (the merged
values are the kept tokens' values; `Decoding`'s slots: the whole prompt and max_new, or target + interval
- 1), plus the attention received (float32 per slot and kv head). The paper's original per-step form is
interval 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import SlotState
from kvpolicies.checks import check_int
from kvpolicies.decoding import Decoding, DecodingState
from kvpolicies.random_keep import uniform_hash
from kvpolicies.scored import LAST_KEY, Accumulated, pack, top_mask
from kvpolicies.slots import concat, inverse_order, take_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CAMState(DecodingState):
    """`DecodingState` plus the attention each slot has received from the decode steps' last queries,
    summed over a kv head's query heads (the merge probability is a ratio: the mean's 1/G cancels).

    mass: [B, K, S] float32.
    """

    mass: Float[Array, "B K S"]


@dataclasses.dataclass(frozen=True)
class CAM(Decoding):
    """kvpress's `CAMPress(base_press=press, compression_interval=interval, target_size=target,
    merge_budget)`: `Decoding`'s compressions, the evicted tokens the same in every head (the base score
    averaged over the kv heads), their values merged into the next `merge_budget` kept tokens by our draw
    (module docstring)."""

    label = "cam"
    accumulates = True  # new slots carry `mass` (zeros)

    merge_budget: int = 32
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_int("cam", "merge_budget", self.merge_budget, 1)
        check_int("cam", "seed", self.seed, 0, 2**32 - 1)
        if self.target_ratio:
            raise ValueError(f"cam.target_ratio={self.target_ratio!r}: CAMPress has a target_size (0)")

    @property
    def observes(self):
        return tuple(dict.fromkeys(("scores",) + self.press.observes))

    def split(self, state):
        return Accumulated(state.k, state.v, state.pos, mass=state.mass), state.steps

    def join(self, slots, stats):
        mass = slots.mass if isinstance(slots, Accumulated) else jnp.zeros(slots.pos.shape, jnp.float32)
        return CAMState(slots.k, slots.v, slots.pos, steps=stats, mass=mass)

    def rank(self, slots, keys, stats, seen):
        """The base press's score averaged over the kv heads (kvpress's mean_scores), the same in every head."""
        prio, _ = self.press.rank(SlotState(slots.k, slots.v, slots.pos), keys, None, seen)  # [B, K, V]
        filled = slots.pos >= 0
        mean = jnp.where(filled, prio, 0.0).sum(axis=1, keepdims=True) / prio.shape[1]  # [B, 1, V]
        return jnp.where(filled, mean, -jnp.inf), slots.pos

    def compact(self, view, seen):
        (old, new), steps = view.carry
        slots = concat(old, new)  # [B, K, V, ...]: the stored slots, then the step's T tokens
        slots = dataclasses.replace(slots, mass=slots.mass + seen.scores[:, :, -1])  # the step's last query
        s = old.slots
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K] tokens in the view
        k = steps + 1  # [B]: this step counted; the merge candidates (kvpress: layer_step_counts)
        target = self._target(new.pos.max(axis=(1, 2)) + 1)  # [B]
        due = (k >= self.interval) | (new.pos.shape[-1] >= target)  # [B]: kvpress's compression step
        n = jnp.minimum(jnp.where(due[:, None], target[:, None], s), s)  # [B, 1]
        over = (due[:, None] & (count > target[:, None])) | (count > s)  # [B, K]
        prio, tie = self.rank(slots, view.k, None, seen)  # [B, K, V]
        kept = jnp.where(over[..., None], top_mask(prio, tie, n[..., None]) & filled, filled)
        v = merged(slots.v, slots.mass, slots.pos, prio, kept, over[..., None], k, self.merge_budget, self.seed)
        return self.join(pack(dataclasses.replace(slots, v=v), kept, s), jnp.where(due, 0, k))


def merged(v: Float[Array, "B K V D"], mass: Float[Array, "B K V"], pos: Int[Array, "B K V"],
           prio: Float[Array, "B K V"], kept: Bool[Array, "B K V"], over: Bool[Array, "B K 1"], k: Int[Array, "B"],
           merge_budget: int, seed: int) -> Float[Array, "B K V D"]:
    """The values after CaM's merges where `over` (module docstring, steps 2-5): the k best-priority evicted
    tokens merged, each where its draw succeeds, into the `merge_budget` kept tokens after it in text order.
    Every head holds the same positions (row 0's are read)."""
    b, kh, n, d = v.shape
    p0 = pos[:, 0]  # [B, V]
    order = jnp.argsort(jnp.where(p0 >= 0, p0, LAST_KEY), axis=-1)  # [B, V]: text order, empty slots last
    sort = lambda x: take_slots(x, jnp.broadcast_to(order[:, None], (b, x.shape[1], n)))  # noqa: E731  [B, H, V, ...]
    sp, keep, pr = sort(pos), sort(kept & over), sort(prio)  # [B, K, V]
    ev = sort((pos >= 0) & ~kept & over)  # [B, K, V] evicted now
    cand = top_mask(jnp.where(ev, pr, -jnp.inf), sp, k[:, None, None]) & ev  # [B, K, V]: the k best evicted
    kf = keep.astype(jnp.int32)
    start = jnp.cumsum(kf, axis=-1) - kf  # [B, K, V]: kept tokens before each slot (the window's first rank)
    n_kept = kf.sum(axis=-1, keepdims=True)  # [B, K, 1]
    end = jnp.minimum(start + merge_budget, n_kept)  # [B, K, V]
    size = jnp.maximum(end - start, 0)  # the window's tokens
    rank_of = jnp.where(keep, start, n)  # [B, K, V]: each kept token's rank (others: bin n, dropped)
    a = sort(mass)  # [B, K, V] attention received
    by_rank = jnp.zeros((b, kh, n + 1), jnp.float32).at[
        jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None], rank_of].add(a)  # [B, K, N]
    prefix = jnp.concatenate([jnp.zeros((b, kh, 1)), jnp.cumsum(by_rank, axis=-1)], axis=-1)  # [B, K, N + 1]
    window = jnp.take_along_axis(prefix, end, -1) - jnp.take_along_axis(prefix, jnp.minimum(start, n), -1)
    mean = window / jnp.maximum(size, 1)  # [B, K, V] kvpress: actual_budget.clamp(min=1)
    ratio = a / jnp.where(mean > 0, mean, 1.0)
    prob = jnp.clip(jnp.where(mean > 0, ratio, jnp.where(a > 0, 1.0, 0.0)), 0.0, 1.0)  # x / 0: 1, 0 / 0: 0
    draw = uniform_hash(seed, jnp.arange(kh)[None, :, None], sp) < prob  # [B, K, V] torch.bernoulli's role
    w = jnp.where(cand & draw & (size > 0), 1.0 / jnp.maximum(size, 1), 0.0)  # [B, K, V]
    c = sort(v).astype(jnp.float32) * w[..., None]  # [B, K, V, D] each merge token's share
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None]
    diff = jnp.zeros((b, kh, n + 1, d), jnp.float32).at[bi, hi, jnp.minimum(start, n)].add(c).at[bi, hi, end].add(-c)
    add = jnp.cumsum(diff, axis=2)  # [B, K, N, D]: what each kept rank receives
    got = jnp.take_along_axis(add, jnp.minimum(rank_of, n)[..., None], axis=2)  # [B, K, V, D] in text order
    got = jnp.where(keep[..., None], got, 0.0)
    back = inverse_order(order)  # [B, V]
    delta = take_slots(got, jnp.broadcast_to(back[:, None], (b, kh, n)))  # [B, K, V, D] slot order
    return (v.astype(jnp.float32) + delta).astype(v.dtype)
