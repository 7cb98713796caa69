"""`cam`: CaM (Zhang et al. 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024,
https://openreview.net/forum?id=LCTmppB165; NVIDIA/kvpress `CAMPress`) — compression while decoding:
every `interval` decoded tokens the cache goes back to `target` tokens, and before the evicted tokens
leave, their values are merged, each with a Bernoulli draw, into the kept tokens that follow them.

Shapes: B batch, K kv heads, S = target + interval - 1 slots, V view slots, D head dim, N = V + 1 rank bins.

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

Ours is that rule over the base score of `Knorm` (the keys' norms, all kvpress's CAMPress can use without
hidden states beyond the current one). The draw is ours: u < p with u a hash of (seed, kv head, position)
(`kvpolicies.random_keep.uniform_hash`); torch's `torch.bernoulli` cannot be reproduced, so the merged
values differ from kvpress's run by run (the evicted tokens do not). Stored: ordinary slots (the merged
values are the kept tokens' values), S = target + interval - 1 slots per kv head, plus the attention
received (float32 per slot and kv head).

The schedule is `PromptScored`'s `interval` / `target`: the cache is compressed when a decoded token makes it
hold target + interval tokens, kvpress's step after a prompt of `target` tokens (kvpress counts forward
steps from the end of the prefill: a q-token question is one step there, q tokens here). After the prompt
the cache keeps up to `target` tokens: a longer prompt is first cut to `target` by the base score without
merging (kvpress keeps it whole until `interval` steps later). The paper's original per-step form is
interval 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by
from kvpolicies.random_keep import uniform_hash
from kvpolicies.scored import LAST_KEY, append_packed, pack, top_mask
from kvpolicies.slots import Spare, concat, inverse_order, take_slots


@dataclasses.dataclass(frozen=True)
class CAM(PromptScored):
    """Every `interval` decoded tokens, back to `target` tokens per kv head by the keys' norms (the same
    tokens in every head), the evicted values merged into the next `merge_budget` kept ones (module
    docstring). `budget` is unused: `target` sizes the cache."""

    label = "cam"
    observes = ("scores",)
    accumulates = True

    budget: int = 0
    max_new: int = 0
    interval: int = 512  # kvpress's compression_interval
    target: int = 2048  # kvpress's target_size
    merge_budget: int = 32
    seed: int = 0
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("cam", "interval", self.interval, 1)
        check_int("cam", "target", self.target, 1)
        check_int("cam", "merge_budget", self.merge_budget, 1)
        check_int("cam", "seed", self.seed, 0, 2**32 - 1)
        if self.ratio:
            raise ValueError(f"cam.ratio={self.ratio!r}: CaM compresses while decoding only (0)")
        if not isinstance(self.codec, Identity):
            raise ValueError(f"cam.codec={self.codec!r}: merged values are stored as they are (use codec='none')")

    def kept(self):
        return self.target

    def rank(self, slots, keys, stats, seen):
        """Minus the key norm averaged over the kv heads (kvpress's mean_scores), the same in every head."""
        norm = jnp.sqrt(jnp.sum(jnp.square(keys.astype(jnp.float32)), axis=-1))  # [B, K, V]
        score = jnp.where(slots.pos >= 0, -norm, 0.0).mean(axis=1, keepdims=True)  # [B, 1, V]
        return rank_by(jnp.broadcast_to(score, norm.shape), slots.pos)

    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        """The attention every slot receives from the step's queries (summed over a kv head's G query
        heads: the merge probability is a ratio, G cancels)."""
        return dataclasses.replace(slots, mass=slots.mass + seen.scores.sum(axis=2)), stats

    def compact(self, view, seen):
        if isinstance(view.carry[0], Spare):  # a shape class's decode step appends only
            return super().compact(view, seen)
        (old, new), stats = view.carry
        slots = concat(old, new)  # [B, K, V, ...]
        s = old.slots
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K]
        slots, stats = self.observe(slots, stats, view, seen, count, s)
        over = self.overflows(count, s)  # [B, K, 1]

        def evict():
            prio, tie = self.rank(slots, view.k, stats, seen)
            kept = jnp.where(over, top_mask(prio, tie, self.stream_kept(s)) & filled, filled)
            v = merged(slots.v, slots.mass, slots.pos, prio, kept, over, self.interval, self.merge_budget, self.seed)
            return pack(dataclasses.replace(slots, v=v), kept, s)

        appends = ~over.any() & (new.pos >= 0).all()
        return self.join(jax.lax.cond(appends, lambda: append_packed(slots, s), evict), stats)


def merged(v: Float[Array, "B K V D"], mass: Float[Array, "B K V"], pos: Int[Array, "B K V"],
           prio: Float[Array, "B K V"], kept: Bool[Array, "B K V"], over: Bool[Array, "B K 1"], k: int,
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
    cand = top_mask(jnp.where(ev, pr, -jnp.inf), sp, k) & ev  # [B, K, V]: the k best evicted, ties the later
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
