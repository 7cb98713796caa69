"""`kvcompose`: KVCompose (Akulov et al., "KVCompose: Efficient Structured KV Cache Compression
with Composite Tokens", arXiv:2509.05165; kvpress 0.5.5 `KVComposePress`) — score each context
token by the attention it receives when the model reads the context a second time, then give
each layer a data-dependent number of tokens from one top-k over all layers' composite scores,
every KV head of a layer keeping that many (its own tokens: a "composite token" per rank).

Shapes: B batch, K kv heads, G query heads per kv head, M = max_len (the prompt phase's slots,
slot j holds token j), T new tokens, L layers (the model's), S slots per kv head after the
compression (M, or what the layer kept + max_new once fitted), V view slots, D head dim.

Protocol (kvpress's, a prompt compressor with a second model pass, run by `models.engine.Engine`):
  1. prompt phase: the context of n tokens held densely (`PromptPhase(obs_window=0)`);
  2. the pass (`models.reconstruct`, prompt style "none"): the context itself is fed again after
     the context, at positions n..2n-1, through `ComposePass` layers that attend over the whole
     cache (nothing is written); each query head's score of context token j is its attention
     (the softmax over every column its query sees, the second copy's own columns included)
     aggregated over the n queries (`agg_task`: max, or mean), then over the G query heads of
     the kv head (`agg_group`: mean, or max): `extra["compose"]` [B, K, M];
  3. after the pass, over all layers at once (`compose_keep`): each layer's scores plus their
     mean over its kv heads (`add_mean_across_heads`; `add_v_norm`: times ||v||), each head's
     scores sorted, the layer's composite score at rank r the mean (`agg_head`) over its heads
     of their r-th best, the first `keep_token_lower_bound` ranks + 1e9, layer 0's composite
     replaced by the maximum over layers at each rank; the max(1, int(L n (1 - ratio))) best
     composites of all layers give each layer its count c_l (at least max(1, lower bound)),
     and every kv head of layer l keeps its own c_l best tokens: `extra["compose_kept"]`;
  4. `after_prompt`: the kept tokens, packed in text order; decoding appends after them.

Memory: each layer keeps a data-dependent c_l tokens per kv head, so a static state must allow
for c_l = n (S = max_len); with `Engine(..., fit=1)` (`Fits`: `Engine.fitted`) each layer is
stored at c_l + max_new slots per kv head, what it kept: kvpress's structured cache holds c_l
per head too (it truncates each layer's tensors; it does not mask). Under a token budget
(`budget`, ratio 0: `kvpolicies.budgets`, the same stored bytes for every policy) the layers are
uniform: each kv head keeps its `budget` best by the pass's scores (+ their layer mean), no
composite allocation.

kvpress's `structured=False` (each head its own count; kvpress masks through its attention patch) is
`KVComposeHeads` below (compat only): a counted head pool holds each head's share.

Deviations, named: (1) batch rows are scored and chosen each on its own (kvpress's
aggregators take the maximum over the batch too, and its unstructured form needs batch 1);
(2) ties keep the earlier layer in the top-k over layers and the newer token within a head
(kvpress: torch.topk's and torch.argsort's order); (3) `add_v_norm=True` multiplies by the
norms of the context's n values (kvpress 0.5.5 multiplies n scores by the 2n values of its
cache after the pass and raises); (4) the pass feeds the context itself, kvpress's default (its
`register_prompt_ids`, other probe prompts whose attention `agg_task` aggregates, is not reached by its
pipeline and not reproduced). Stream extension (ours; `Engine.score` and generation past
`max_new`): a slot's `mass` is its score from the pass, raised by the most attention a later
query gives it averaged over the G query heads (per query, so a chunk of queries gives what they
give one by one), and a full kv head keeps its S - max_new best by mass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.adakv import prompt_pool
from kvpolicies.adascored import AdaScored, CountedPool
from kvpolicies.base import Policy, SlotState, empty_slots
from kvpolicies.budgets import Fits
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptCompressor, PromptPhase, PromptState, Reconstructor
from kvpolicies.prompt_scored import PromptScored, chunked, rank_by
from kvpolicies.scored import Accumulated, pack, top_mask
from kvpolicies.slots import concat, encode_new, head_slots, view_of

LOWEST = jnp.finfo(jnp.float32).min
AGGREGATORS = ("max", "mean")


@dataclasses.dataclass(frozen=True)
class KVCompose(Fits, Reconstructor, PromptScored):
    """Keep, per layer, a count of tokens chosen over all layers' composite scores; every kv head
    of the layer keeps its own best tokens (kvpress's structured KVCompose)."""

    label = "kvcompose"
    observes = ("logits",)
    accumulates = True
    # the pass (models.reconstruct): the context itself, whole, after the context
    repeat_chunk: ClassVar[int] = 1 << 30
    repeat_tail: ClassVar[int] = 0
    prompts: ClassVar[str] = "none"

    budget: int = 1024  # ratio 0: every kv head of every layer keeps its `budget` best (uniform layers, see Memory)
    max_new: int = 256
    agg_task: str = "max"  # over the pass's queries
    agg_group: str = "mean"  # over the G query heads of a kv head
    agg_head: str = "mean"  # over a layer's kv heads, rank by rank (the composite)
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    # tokens per kv head this layer is stored for (`fit`, set by `Engine.fitted`; 0: every token, max_len slots)
    fitted: int = dataclasses.field(default=0, metadata={"engine": True})
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        for name in ("agg_task", "agg_group", "agg_head"):
            check_choice(self.label, name, getattr(self, name), AGGREGATORS)
        check_int(self.label, "keep_token_lower_bound", self.keep_token_lower_bound, 0)
        check_int(self.label, "fitted", self.fitted, 0)
        if self.interval or self.slots:
            raise ValueError("kvcompose: interval/target and slots are not supported (its layers keep "
                             "data-dependent counts)")

    def capacity(self, max_len):
        """Slots per kv head: with `ratio`, max_len (a layer may keep every token) or, once fitted, what
        it kept + max_new; without, budget + max_new."""
        if self.fitted:
            return min(self.fitted + self.max_new, max_len)
        return max_len if self.ratio else min(self.budget + self.max_new, max_len)

    def kept_table(self, max_len):
        return None  # the counts depend on the content: no shape class

    def composite_kept(self, n: int, n_layers: int) -> int:
        """With `ratio`, composite tokens kept over all layers of an n-token context (kvpress's
        compute_n_kept of L n); without, the tokens every layer keeps (its budget)."""
        if self.ratio:
            return max(1, int(n_layers * n * (1 - self.ratio)))
        return min(self.budget, n)

    # -- Fits: stored at what each layer kept --------------------------------------------------------
    def fit(self, tokens_per_head: int) -> "KVCompose":
        return dataclasses.replace(self, fitted=max(int(tokens_per_head), 1))

    def fit_state(self, state: Accumulated, max_len: int) -> Accumulated:
        """A compressed state (packed: kept slots first) cut to this policy's slots."""
        return head_slots(state, min(self.capacity(max_len), state.pos.shape[-1]))

    # -- the pass --------------------------------------------------------------------------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=0)

    def reconstruction(self) -> "ComposePass":
        return ComposePass(codec=self.codec, of=self)

    def pass_policy(self, phase: Policy) -> Policy:
        from kvpolicies.kvzip import recon_policy

        return recon_policy(phase)

    def scores_in_pass(self, policy: Policy) -> bool:
        return isinstance(policy, ComposePass)

    def scoring(self) -> "KVCompose":
        """What the pass reads of this policy (kvcompose at another ratio scores alike)."""
        return dataclasses.replace(self, budget=1024, max_new=0, ratio=0.0, fitted=0,
                                   add_v_norm=False, add_mean_across_heads=True, agg_head="mean",
                                   keep_token_lower_bound=0)

    def before_chunk(self, state: PromptState, lo: int, hi: int, end: int) -> PromptState:
        lead = state.pos.shape[:-2]  # [..., B]
        kh = jax.tree.leaves(state.k)[0].shape[state.pos.ndim - 2]
        score = jnp.zeros(lead + (kh, state.slots), jnp.float32)  # [..., B, K, M]
        end = jnp.broadcast_to(jnp.asarray(end, jnp.int32), lead)  # [..., B]
        return dataclasses.replace(state, extra={**state.extra, "compose": score, "compose_end": end})

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """One choice over every layer (`compose_keep`), stored as each layer's `extra["compose_kept"]`."""
        if len(set(reconstructors)) > 1 or not all(scored):
            raise ValueError("kvcompose chooses over all layers at once: every layer must run the same kvcompose "
                             f"policy, got {sorted({type(p).__name__ for p in reconstructors})} on "
                             f"{sum(scored)} of {len(scored)} runs")
        pol = reconstructors[0]
        score = jnp.concatenate([st.extra["compose"] for st in states])  # [L, B, K, M]
        pos = jnp.concatenate([st.pos for st in states])  # [L, B, 1, M]
        vnorm = None
        if pol.add_v_norm:
            v = jnp.concatenate([pol.codec.decode(st.v, jnp.float32, in_basis=True)
                                 for st in states])  # [L, B, K, M, D]
            vnorm = jnp.sqrt(jnp.sum(v * v, axis=-1))  # [L, B, K, M]
        m, n_layers = score.shape[-1], score.shape[0]
        table = np.asarray([pol.composite_kept(n, n_layers) for n in range(m + 1)], np.int32)
        kept = compose_keep(score, pos, vnorm, jnp.asarray(table), pol.agg_head, pol.add_mean_across_heads,
                            pol.keep_token_lower_bound, not pol.ratio)  # [L, B, K, M]
        out, i = [], 0
        for st in states:
            n = st.pos.shape[0]
            out.append(dataclasses.replace(st, extra={**st.extra, "compose_kept": kept[i:i + n]}))
            i += n
        return tuple(out)

    def after_prompt(self, state: PromptState, table: Array | None = None) -> Accumulated:
        if "compose_kept" not in state.extra:
            raise ValueError("kvcompose: the prompt has no pass scores; run it through models.engine.Engine "
                             "(prefill / generate / compress run the pass)")
        m = state.slots
        kh = jax.tree.leaves(state.k)[0].shape[1]
        pos = jnp.broadcast_to(state.pos, (state.pos.shape[0], kh, m))  # [B, K, M]
        filled = pos >= 0
        slots = Accumulated(state.k, state.v, pos, mass=jnp.where(filled, state.extra["compose"], 0.0))
        return pack(slots, state.extra["compose_kept"] & filled, self.capacity(m))

    # -- decoding and streams (PromptScored: append; recompress on overflow) -------------------------
    @chunked
    def observe(self, slots, stats, view, seen, count, s):
        probs = jax.nn.softmax(seen.logits, axis=-1).mean(axis=2).max(axis=2)  # [B, K, V]: mean over G, max over T
        return dataclasses.replace(slots, mass=jnp.maximum(slots.mass, probs)), stats

    def stream_kept(self, s: int) -> int:
        """A full layer keeps its S - max_new best by mass (each kv head)."""
        return max(s - self.max_new, 1)

    def rank(self, slots, keys, stats, seen):
        return rank_by(slots.mass, slots.pos)


@dataclasses.dataclass(frozen=True)
class ComposePass(Policy):
    """A kvcompose layer during the pass: attention over the dense prompt state and the second
    copy of the context (not stored); each kv head's score of the context's slots written into
    `extra["compose"]` [B, K, M] (queries at positions >= `extra["compose_end"]` are pads of the
    engine's length bucket and score nothing)."""

    of: KVCompose = None
    observes = ("logits",)

    def capacity(self, max_len):
        return max_len

    def scoring(self) -> "ComposePass":
        return dataclasses.replace(self, of=self.of.scoring())

    def extend(self, state: PromptState, k, v, pos):
        slots = concat(SlotState(state.k, state.v, state.pos), encode_new(self.codec, k, v, pos))  # [B, 1, M + T]
        return view_of(self.codec, slots, pos, k.dtype, carry=(state, pos))

    def compact(self, view, seen):
        state, qpos = view.carry
        m = state.slots
        probs = jax.nn.softmax(seen.logits, axis=-1)[..., :m]  # [B, K, G, T, M]: the whole row's softmax
        real = (qpos < state.extra["compose_end"][:, None])[:, None, None, :, None]  # [B, 1, 1, T, 1]
        if self.of.agg_task == "max":
            task = jnp.where(real, probs, 0.0).max(axis=3)  # [B, K, G, M]
        else:
            task = jnp.where(real, probs, 0.0).sum(axis=3) / jnp.maximum(real.sum(axis=3), 1)  # [B, K, G, M]
        score = task.mean(axis=2) if self.of.agg_group == "mean" else task.max(axis=2)  # [B, K, M]
        return dataclasses.replace(state, extra={**state.extra, "compose": score})


def _in_order_mean(x: Float[Array, "L B K M"]) -> Float[Array, "L B 1 M"]:
    """The mean over K summed head by head, as kvpress's aggregators add (float32 rounding alike)."""
    acc = x[:, :, :1]
    for i in range(1, x.shape[2]):
        acc = acc + x[:, :, i:i + 1]
    return acc / x.shape[2]


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def compose_keep(score: Float[Array, "L B K M"], pos: Int[Array, "L B 1 M"], vnorm: Float[Array, "L B K M"] | None,
                 table: Int[Array, "M1"], agg_head: str = "mean", add_mean: bool = True, lower_bound: int = 0,
                 uniform: bool = False) -> Bool[Array, "L B K M"]:
    """kvpress's structured KVCompose choice over all layers (see the module docstring, step 3):
    the slots each (layer, kv head) keeps. `table[n]`: composite tokens kept of n context tokens
    (`uniform`: the tokens each layer keeps, no composite)."""
    n_layers, b, kh, m = score.shape
    filled = jnp.broadcast_to(pos >= 0, score.shape)  # [L, B, K, M]
    if vnorm is not None:
        score = score * vnorm
    if add_mean:
        score = score + _in_order_mean(score)
    ranked = -jnp.sort(-jnp.where(filled, score, -jnp.inf), axis=-1)  # [L, B, K, M] best first, -inf past n
    comp = _in_order_mean(ranked)[:, :, 0] if agg_head == "mean" else ranked.max(axis=2)  # [L, B, M]
    comp = comp.at[..., :lower_bound].add(1e9)
    comp = comp.at[0].set(comp.max(axis=0))  # layer 0 the largest at every rank
    n = filled[0, :, 0].sum(-1)  # [B] context tokens
    flat = jnp.moveaxis(comp, 0, 1).reshape(b, n_layers * m)  # [B, L*M] layer-major
    live = jnp.moveaxis(jnp.arange(m)[None, None] < n[None, :, None], 0, 1).reshape(b, 1, m)  # [B, 1, M]
    live = jnp.broadcast_to(live, (b, n_layers, m)).reshape(b, n_layers * m)
    tie = jnp.broadcast_to(-jnp.arange(n_layers * m), flat.shape)  # ties: the earlier layer
    chosen = top_mask(jnp.where(live, flat, -jnp.inf), tie, table[n][:, None]) & live
    count = jnp.maximum(chosen.reshape(b, n_layers, m).sum(-1), max(1, lower_bound))  # [B, L]
    count = jnp.minimum(jnp.moveaxis(count, 0, 1), n[None])[:, :, None, None]  # [L, B, 1, 1]
    if uniform:
        count = jnp.broadcast_to(table[n][None, :, None, None], count.shape)
    prio = jnp.where(filled, score, -jnp.inf)  # [L, B, K, M]
    return top_mask(prio, jnp.broadcast_to(pos, score.shape), count) & filled


@dataclasses.dataclass(frozen=True)
class KVComposeHeads(Fits, Reconstructor, PromptCompressor, Policy):
    """kvpress's `KVComposePress(structured=False)` (`kvpolicies.compat.kvpress("KVComposePress", r,
    structured=False)`; not registered): kvcompose's pass and scores, then each (layer, kv head) its own count
    from one top-k over every layer's and head's sorted scores (no composite, no layer-0 rule, no floor: a
    head may keep nothing), each head keeping its own best tokens (`compose_keep_heads`). kvpress masks the
    others (its cache keeps every token, the pass's second copy included); we store each head's share in a
    counted head pool (`kvpolicies.adascored.CountedPool`) of K x max_len slots per layer, or, fitted
    (`Engine(..., fit=1)`), K x (what the layer kept / K + max_new). Decoding appends to every head; our
    stream extension (generation past max_new): a full pool keeps the layer's K x (S - max_new) slots the
    overflowing query attends most (averaged over the G query heads), over all heads together."""

    observes = ("logits",)
    per_token = True
    repeat_chunk: ClassVar[int] = 1 << 30
    repeat_tail: ClassVar[int] = 0
    prompts: ClassVar[str] = "none"

    ratio: float = 0.5
    max_new: int = 256
    agg_task: str = "max"
    agg_group: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    fitted: int = dataclasses.field(default=0, metadata={"engine": True})
    codec: Codec = Identity()

    def __post_init__(self):
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
            raise ValueError(f"kvcompose-heads.ratio={r!r}: must be a number in (0, 1)")
        check_int("kvcompose-heads", "fitted", self.fitted, 0)
        self.scorer()  # the shared fields' checks

    def scorer(self) -> KVCompose:
        """The structured policy with these fields: its pass scores alike (`ComposePass`)."""
        return KVCompose(ratio=self.ratio, max_new=self.max_new, agg_task=self.agg_task, agg_group=self.agg_group,
                         add_v_norm=self.add_v_norm, add_mean_across_heads=self.add_mean_across_heads,
                         keep_token_lower_bound=self.keep_token_lower_bound, codec=self.codec)

    def capacity(self, max_len):
        """Slots per kv head on average: max_len (a head may keep every token) or, fitted, what the layer kept
        per kv head + max_new."""
        return min(self.fitted + self.max_new, max_len) if self.fitted else max_len

    def fit(self, tokens_per_head: int) -> "KVComposeHeads":
        return dataclasses.replace(self, fitted=max(int(tokens_per_head), 1))

    def fit_state(self, state: CountedPool, max_len: int) -> CountedPool:
        """A packed pool cut to this policy's slots per row (every kept slot is in the first K x slots)."""
        kh, s = state.pos.shape[1], min(self.capacity(max_len), state.pos.shape[2])
        cut = lambda x: x.reshape((x.shape[0], 1, -1) + x.shape[3:])[:, :, :kh * s].reshape(  # noqa: E731
            (x.shape[0], kh, s) + x.shape[3:])
        return dataclasses.replace(state, k=jax.tree.map(cut, state.k), v=jax.tree.map(cut, state.v),
                                   pos=cut(state.pos))

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), kv_heads)
        return CountedPool(st.k, st.v, st.pos, counts=jnp.zeros((batch, kv_heads), jnp.int32))

    # -- the pass: kvcompose's ---------------------------------------------------------------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=0)

    def reconstruction(self) -> ComposePass:
        return ComposePass(codec=self.codec, of=self.scorer())

    def pass_policy(self, phase: Policy) -> Policy:
        from kvpolicies.kvzip import recon_policy

        return recon_policy(phase)

    def scores_in_pass(self, policy: Policy) -> bool:
        return isinstance(policy, ComposePass)

    before_chunk = KVCompose.before_chunk

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """One choice over every layer and kv head (`compose_keep_heads`): `extra["compose_kept"]` per layer."""
        if len(set(reconstructors)) > 1 or not all(scored):
            raise ValueError("kvcompose (structured=False) chooses over all layers at once: every layer must run the "
                             f"same policy, got {sorted({type(p).__name__ for p in reconstructors})} on "
                             f"{sum(scored)} of {len(scored)} runs")
        score = jnp.concatenate([st.extra["compose"] for st in states])  # [L, B, K, M]
        pos = jnp.concatenate([st.pos for st in states])  # [L, B, 1, M]
        vnorm = None
        if self.add_v_norm:
            v = jnp.concatenate([self.codec.decode(st.v, jnp.float32, in_basis=True) for st in states])
            vnorm = jnp.sqrt(jnp.sum(v * v, axis=-1))  # [L, B, K, M]
        m, n_layers, kh = score.shape[-1], score.shape[0], score.shape[2]
        table = np.asarray([max(1, int(n_layers * kh * n * (1 - self.ratio))) for n in range(m + 1)], np.int32)
        kept = compose_keep_heads(score, pos, vnorm, jnp.asarray(table), self.add_mean_across_heads,
                                  self.keep_token_lower_bound)  # [L, B, K, M]
        out, i = [], 0
        for st in states:
            n = st.pos.shape[0]
            out.append(dataclasses.replace(st, extra={**st.extra, "compose_kept": kept[i:i + n]}))
            i += n
        return tuple(out)

    def after_prompt(self, state: PromptState) -> CountedPool:
        if "compose_kept" not in state.extra:
            raise ValueError("kvcompose: the prompt has no pass scores; run it through models.engine.Engine "
                             "(prefill / generate / compress run the pass)")
        m = state.slots
        kh = jax.tree.leaves(state.k)[0].shape[1]
        kept = state.extra["compose_kept"] & (state.pos >= 0)  # [B, K, M]
        pool = prompt_pool(state, kept, jnp.zeros(kept.shape, jnp.float32), kh * self.capacity(m))
        return CountedPool(pool.k, pool.v, pool.pos, counts=kept.sum(axis=-1, dtype=jnp.int32))

    # -- decoding: the pool plus the new token of every head ---------------------------------------------
    extend = AdaScored.extend
    store_kept = AdaScored.store_kept

    def compact(self, view, seen):
        slots, head, p, stats = view.carry  # [B, 1, V] flat slots, their heads, P
        b, kh = view.k.shape[:2]
        if seen.logits.shape[3] != 1:
            raise ValueError(f"kvcompose (structured=False) evicts after every token: got a step of "
                             f"{seen.logits.shape[3]} tokens")
        filled = slots.pos >= 0  # [B, 1, V]
        mine = (head == jnp.arange(kh)[None, :, None]) & filled  # [B, K, V]
        over = filled.sum(axis=-1, keepdims=True) > p  # [B, 1, 1]

        def evict():  # the ranking's sort only on a step where the pool overflows
            probs = jax.nn.softmax(seen.logits[:, :, :, 0], axis=-1).mean(axis=2)  # [B, K, V]: mean over G
            prio = jnp.where(mine, probs, -jnp.inf).reshape(b, kh * probs.shape[-1])
            tie = jnp.broadcast_to(slots.pos, mine.shape).reshape(prio.shape)
            kept = top_mask(prio, tie, kh * max(p // kh - self.max_new, 1)).reshape(mine.shape) & mine
            return jnp.where(over, kept.any(axis=1, keepdims=True), filled)  # [B, 1, V]

        kept = jax.lax.cond(over.any(), evict, lambda: filled)
        return self.store_kept(slots, kept, head, p, kh, stats)


@functools.partial(jax.jit, static_argnums=(4, 5))
def compose_keep_heads(score: Float[Array, "L B K M"], pos: Int[Array, "L B 1 M"],
                       vnorm: Float[Array, "L B K M"] | None, table: Int[Array, "M1"], add_mean: bool = True,
                       lower_bound: int = 0) -> Bool[Array, "L B K M"]:
    """kvpress's unstructured KVCompose choice: the scores (times the value norms, plus the layer's mean over
    its kv heads), each head's sorted, its first `lower_bound` ranks + 1e9; the table[n] best ranks over all
    (layer, kv head, rank) of an n-token context (ties: the earlier layer, head, rank) give each head its
    count, and it keeps its own best tokens (ties: the newer)."""
    n_layers, b, kh, m = score.shape
    filled = jnp.broadcast_to(pos >= 0, score.shape)  # [L, B, K, M]
    if vnorm is not None:
        score = score * vnorm
    if add_mean:
        score = score + _in_order_mean(score)
    ranked = -jnp.sort(-jnp.where(filled, score, -jnp.inf), axis=-1)  # [L, B, K, M] best first, -inf past n
    ranked = ranked.at[..., :lower_bound].add(1e9)
    n = filled[0, :, 0].sum(-1)  # [B] context tokens
    flat = jnp.moveaxis(ranked, 1, 0).reshape(b, n_layers * kh * m)  # [B, L*K*M] layer-major
    live = jnp.broadcast_to(jnp.arange(m) < n[:, None, None, None], (b, n_layers, kh, m)).reshape(flat.shape)
    tie = jnp.broadcast_to(-jnp.arange(flat.shape[1]), flat.shape)  # ties: the earlier layer, head, rank
    chosen = top_mask(jnp.where(live, flat, -jnp.inf), tie, table[n][:, None]) & live
    count = jnp.moveaxis(chosen.reshape(b, n_layers, kh, m).sum(-1), 0, 1)[..., None]  # [L, B, K, 1]
    prio = jnp.where(filled, score, -jnp.inf)  # [L, B, K, M]
    return top_mask(prio, jnp.broadcast_to(pos, score.shape), count) & filled
