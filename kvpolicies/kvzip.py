"""`kvzip`: KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", NeurIPS 2025; authors' repo snu-mllab/KVzip, kvpress `KVzipPress`) — score each
cached token by the most attention it receives while the model is asked to repeat the context,
then keep the best tokens with head-wise budgets, before any question is known.

Shapes: B batch, K kv heads, G query heads per kv head, M = max_len (the prompt phase's slots),
T new tokens (a repeat input in the reconstruction pass), S = budget + max_new slots per kv head
on average, P = K x S pool slots per layer, V view slots, D head dim.

Protocol (a prompt compressor that needs a second model pass):
  1. prompt phase: the context is held densely (`PromptPhase(obs_window=0)`, the state knorm and
     random use, so one dense prefill serves them all);
  2. reconstruction (run by `models.engine.Engine`, which owns the model): the context is cut into
     chunks of `repeat_chunk` tokens; chunk i is fed after the whole context as
     [repeat prompt, chat suffix, chunk i] (chunk > 0: "...starting with" + the previous chunk's
     last `repeat_tail` tokens), through `Reconstruct` layers that attend over the whole cache
     (the model's forward is unchanged) and score the chunk: a softmax of the repeat queries'
     logits restricted to the first `n_sink` tokens, chunk i's tokens and the repeat input itself
     (causal), maximised over the G query heads and the repeat queries — the cache is not written;
  3. `after_prompt`: each layer keeps K x budget tokens, chosen from the scores of all its kv heads
     together (head-wise budgets), every head keeping the `n_sink` first tokens and the context's
     last token; stored as Ada-KV's head pool (`kvpolicies.adakv`): exactly the bytes of a uniform
     policy with the same slots, the heads holding different numbers of tokens.

Defaults: the authors' (chunk 2000, previous-chunk tail 8, repeat prompts of model/wrapper.py) and
kvpress's n_sink = 4. Deviations, named: (1) layer budgets are uniform (kvpress's
`layerwise=True`); the authors' default ("pair") and kvpress's default threshold all layers'
scores together, which gives layers different sizes — our layers have static shapes, so a
layer-adaptive split would not save memory; (2) the whole prompt is reconstructed and scored,
chat header included (the authors keep a system prompt whole and do not score it; kvpress scores
only after the chat prefix and keeps n_sink); (3) scores are float32 (the authors: the model's
bfloat16); (4) ties keep the newer token. Stream extension (ours; `Engine.score` and generation
beyond `max_new`): no reconstruction is possible mid-stream, so a slot's score is the most
attention any later query gave it (the same statistic, from real queries), and a full pool is
recompressed with the same head-wise rule.

kvpress 0.5.5's `KVzipPress` (`kvpolicies.compat.kvpress("KVzipPress", r)`) is reached with named
fields, all off by default: `ratio` r (its compression ratio: a layer of n context tokens keeps
K n - int(K n r) of them, kvpress's `layerwise=True`), `scope="model"` (its default: the int(L K n
r) lowest scores of ALL layers are removed, so each layer keeps a data-dependent number — stored
at full size, max_len slots per kv head, as kvpress which masks), `keep_last=False` (kvpress does
not force the newest token), `prompts="kvpress"` (its repeat prompts and chat prefix:
`models.reconstruct.repeat_prompts(tok, "kvpress")`) and `repeat_chunk=2048`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import numpy as np
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.adakv import HeadPool, as_rows, pack_by_head, pool_view, prompt_pool
from kvpolicies.base import EMPTY, Policy, SlotState, empty_slots
from kvpolicies.budgets import Budgeted
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import PromptPhase, PromptState, Reconstructor, reconstructs
from kvpolicies.scored import top_mask
from kvpolicies.slots import concat, encode_new, inverse_order, view_of

LOWEST = jnp.finfo(jnp.float32).min


@dataclasses.dataclass(frozen=True)
class KVzip(Budgeted, Reconstructor, Policy):
    """Keep, per layer, the K x budget tokens with the largest context-reconstruction score."""

    observes = ("logits",)
    per_token = True
    budget_field = "budget"

    budget: int = 1024  # tokens per kv head on average after compression (sinks and last token included)
    max_new: int = 256  # free slots per kv head on average for the question and the answer
    n_sink: int = 4
    repeat_chunk: int = 2000
    repeat_tail: int = 8
    ratio: float = 0.0  # kvpress's compression ratio (fraction of the context removed); 0: `budget` sizes
    scope: Literal["layer", "model"] = "layer"  # "model": kvpress's default, one choice over all layers (needs ratio)
    keep_last: bool = True  # the context's newest token is always kept (kvpress: not)
    prompts: Literal["authors", "kvpress"] = "authors"  # the repeat prompts' style (models.reconstruct)
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("kvzip", "n_sink", self.n_sink, 0)
        check_int("kvzip", "budget", self.budget, self.n_sink + 1)
        check_int("kvzip", "max_new", self.max_new, 0)
        check_int("kvzip", "repeat_chunk", self.repeat_chunk, 1)
        check_int("kvzip", "repeat_tail", self.repeat_tail, 0)
        check_choice("kvzip", "scope", self.scope, ("layer", "model"))
        check_choice("kvzip", "prompts", self.prompts, ("authors", "kvpress"))
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise ValueError(f"kvzip.ratio={self.ratio!r}: must be a number in [0, 1) (0: budget sizes)")
        if not self.keep_last and self.n_sink < 1:
            raise ValueError("kvzip.keep_last=False needs n_sink >= 1 (a head's pool segment starts at its sinks)")
        if self.scope == "model" and not self.ratio:
            raise ValueError("kvzip.scope='model' removes a fraction of all layers' tokens: give ratio (e.g. 0.5)")

    def capacity(self, max_len):
        """Slots per kv head on average (the pool holds kv_heads x this many); scope="model":
        max_len (a layer may keep every token)."""
        if self.scope == "model":
            return max_len
        if self.ratio:
            return min(math.ceil(max_len * (1 - self.ratio)) + 1 + self.max_new, max_len)  # >= K n - int(K n r) / K
        return min(self.budget + self.max_new, max_len)

    def kept_for(self, n: int) -> int:
        """Context tokens per kv head, on average, kept of an n-token prompt with `ratio` set (a
        layer keeps K n - int(K n ratio); over the model the same fraction)."""
        return max(n - int(n * self.ratio), min(self.n_sink, n))

    def stream_keep(self, score: Float[Array, "B K V"], pos: Int[Array, "B K V"], s: int) -> Bool[Array, "B K V"]:
        """A full pool of s slots per kv head (streams) cut to K x budget tokens (`ratio`: to its
        slots minus max_new)."""
        per_head = max(s - self.max_new, self.n_sink + 1) if self.ratio else min(self.budget, s)
        return self.keep(score, pos, pos.shape[1] * per_head)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), kv_heads)  # [B, K, S, D]
        return HeadPool(st.k, st.v, st.pos, mass=jnp.zeros(st.pos.shape, jnp.float32))

    # -- the head-wise choice ---------------------------------------------------------------------
    def keep(self, score: Float[Array, "B K V"], pos: Int[Array, "B K V"], n: int | Array) -> Bool[Array, "B K V"]:
        """Per kv head (pos = -1 where a slot is not the head's): the n_sink first tokens (and the
        newest, `keep_last`), then the layer's best-scored tokens of all heads together, n in all
        (a number or [B, 1]; ties to the lower head, then the newer token)."""
        b, kh, v = pos.shape
        filled = pos >= 0
        always = filled & (pos < self.n_sink)
        if self.keep_last:
            always = always | (filled & (pos == pos.max(axis=(1, 2), keepdims=True)))
        prio = jnp.where(always, jnp.inf, jnp.where(filled, score, -jnp.inf))
        return top_mask(prio.reshape(b, kh * v), pos.reshape(b, kh * v), n).reshape(b, kh, v) & filled

    # -- decoding and streams: the pool plus the new token of every head -----------------------------
    def extend(self, state, k, v, pos):
        return pool_view(self.codec, state, k, v, pos)

    def compact(self, view, seen):
        if seen.logits is None:
            raise ValueError(f"KVzip.compact needs the attention logits (observes={self.observes})")
        slots, head, p = view.carry
        kh = seen.logits.shape[1]
        if seen.logits.shape[3] != 1:
            raise ValueError(f"KVzip evicts after every token (per_token): got a step of {seen.logits.shape[3]} tokens")
        s = p // kh
        probs = jax.nn.softmax(seen.logits[:, :, :, 0], axis=-1).max(axis=2)  # [B, K, V] max over G
        score = probs.sum(axis=1, keepdims=True)  # [B, 1, V]: each slot's own head (the others read 0)
        filled = slots.pos >= 0
        mass = jnp.maximum(slots.mass, score)  # the most attention a slot has received
        over = filled.sum(axis=-1, keepdims=True) > p  # [B, 1, 1]
        per_head = head == jnp.arange(kh)[None, :, None]  # [B, K, V]

        def evict():  # the ranking's sorts only on a step where the pool overflows
            kept_h = self.stream_keep(jnp.where(per_head, mass, 0.0), jnp.where(per_head, slots.pos, EMPTY), s)
            return jnp.where(over, kept_h.any(axis=1, keepdims=True) & filled, filled)  # [B, 1, V]

        kept = jax.lax.cond(over.any(), evict, lambda: filled)
        slots = dataclasses.replace(slots, mass=mass)
        return as_rows(pack_by_head(slots, kept, head, p), kh)

    # -- the paper's protocol ---------------------------------------------------------------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=0)

    def reconstruction(self) -> "Reconstruct":
        """The layer's policy while the engine feeds the repeat inputs."""
        return Reconstruct(codec=self.codec, of=self)

    def pass_policy(self, phase: Policy) -> Policy:
        """Another layer in the pass (`recon_policy`): a dense one is read without writing."""
        return recon_policy(phase)

    def scores_in_pass(self, policy: Policy) -> bool:
        return scores_in_pass(policy)

    def before_chunk(self, state: PromptState, lo: int, hi: int, end: int) -> PromptState:
        """The chunk [lo, hi) that the next repeat input scores, its real tokens ending at `end`
        (`extra["zip_range"]`), and the scores so far (`extra["zip"]` [..., B, K, M], zeros at first)."""
        lead = state.pos.shape[:-2]  # [..., B]: e.g. the layers of a run, then the batch
        kh = jax.tree.leaves(state.k)[0].shape[state.pos.ndim - 2]  # k: [..., B, K, M, D]
        zip0 = state.extra.get("zip", jnp.zeros(lead + (kh, state.slots), jnp.float32))  # [..., B, K, M]
        rng = jnp.broadcast_to(jnp.asarray([lo, hi, end], jnp.int32), lead + (3,))  # [..., B, 3]
        return dataclasses.replace(state, extra={**state.extra, "zip": zip0, "zip_range": rng})

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """scope="model" (kvpress's default): one choice over all the kvzip layers' scores
        (`model_scope_keep`), stored as each layer's `extra["zip_kept"]` [B, K, M] for `after_prompt`."""
        wide = {(p.ratio, p.n_sink) for p in reconstructors if p.scope == "model"}
        if not wide:
            return states
        if len(wide) > 1 or len(wide) < len({(p.ratio, p.n_sink, p.scope) for p in reconstructors}):
            raise ValueError("kvzip scope='model': every kvzip layer must share scope, ratio and n_sink")
        (ratio, n_sink), = wide
        runs = [st for st, z in zip(states, scored) if z]
        kept = model_scope_keep(jnp.concatenate([st.extra["zip"] for st in runs]),
                                jnp.concatenate([st.pos for st in runs]), ratio, n_sink)  # [L, B, K, M]
        out, i = [], 0
        for st, z in zip(states, scored):
            if z:
                n = st.pos.shape[0]
                st = dataclasses.replace(st, extra={**st.extra, "zip_kept": kept[i:i + n]})
                i += n
            out.append(st)
        return tuple(out)

    def scoring(self) -> "KVzip":
        """What the reconstruction pass reads of this policy (its scores depend on n_sink, the
        repeat inputs' chunking and style, the codec), what it keeps reset (budget, max_new, ratio,
        scope, keep_last): kvzip at another ratio or budget scores alike (`Engine.reconstruct`)."""
        return dataclasses.replace(self, budget=self.n_sink + 1, max_new=0, ratio=0.0, scope="layer", keep_last=True)

    def after_prompt(self, state: PromptState) -> HeadPool:
        if "zip" not in state.extra:
            raise ValueError("kvzip: the prompt has no reconstruction scores; run it through models.engine.Engine "
                             "(prefill / generate / compress run the reconstruction pass)")
        m = state.slots
        s = self.capacity(m)
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        score = state.extra["zip"]  # [B, K, M]
        filled = pos >= 0
        if self.scope == "model":
            if "zip_kept" not in state.extra:
                raise ValueError("kvzip scope='model': the prompt has no model-wide choice; run it through "
                                 "models.engine.Engine")
            kept = state.extra["zip_kept"] & filled
        elif self.ratio:  # kvpress layerwise: K n - int(K n ratio) of the layer's K n tokens
            table = np.asarray([max(kh * n - int(kh * n * self.ratio), kh * min(self.n_sink, n)) for n in range(m + 1)],
                               np.int32)  # static; the sinks stay (kvpress would prune them past ratio 1 - n_sink / n)
            kept = self.keep(score, pos, jnp.asarray(table)[filled[:, 0].sum(-1)][:, None])
        else:
            over = filled.sum(axis=-1, keepdims=True) > min(self.budget, s)  # [B, K, 1]
            kept = jnp.where(over, self.keep(score, pos, kh * min(self.budget, s)), filled)
        return prompt_pool(state, kept, jnp.where(filled, score, 0.0), kh * s)



@dataclasses.dataclass(frozen=True)
class Reconstruct(Policy):
    """A kvzip layer during the reconstruction pass: attention over the dense prompt state and the
    repeat input (not stored), and the scores of the chunk `extra["zip_range"]` = [lo, hi, end)
    written into `extra["zip"]` [B, K, M] (see the module docstring); repeat queries at positions
    >= end are pads (`Engine` buckets the input's length) and score nothing. With `of=None`, a dense
    layer of another policy (full, a prompt phase) read without writing or scoring; `rotated`:
    that layer stores its keys rotated (`Policy.rotated_keys`, e.g. full); `phase`: that layer's
    prompt-phase policy, which only keeps layers of different prompt phases in different runs of
    the pass, as they are in the prompt cache.
    """

    of: KVzip | None = None
    rotated: bool = False
    phase: Policy | None = None

    @property
    def observes(self):
        return ("logits",) if self.of is not None else ()

    @property
    def rotated_keys(self):
        return self.rotated

    def capacity(self, max_len):
        return max_len

    def scoring(self) -> "Reconstruct":
        """This layer of the pass with its kvzip policy's `scoring` (equal for kvzip at any ratio)."""
        return self if self.of is None else dataclasses.replace(self, of=self.of.scoring())

    def extend(self, state: PromptState, k, v, pos):
        slots = concat(SlotState(state.k, state.v, state.pos), encode_new(self.codec, k, v, pos))  # [B, 1, M + T]
        return view_of(self.codec, slots, pos, k.dtype, carry=state)

    def compact(self, view, seen):
        state = view.carry
        if self.of is None:
            return state
        m = state.slots
        lo, hi, end = (state.extra["zip_range"][:, i, None, None] for i in (0, 1, 2))  # [B, 1, 1]
        p = view.pos  # [B, 1, M + T]
        repeat = jnp.arange(p.shape[-1]) >= m  # the repeat input's own slots
        scored = ((p >= 0) & (p < self.of.n_sink)) | ((p >= lo) & (p < hi)) | repeat  # [B, 1, M + T]
        lg = jnp.where(scored[:, :, None, None, :], seen.logits, LOWEST)  # [B, K, G, T, M + T]
        probs = jax.nn.softmax(lg, axis=-1)[..., :m]  # [B, K, G, T, M]
        real = (p[..., m:] < end)[:, :, None, :, None]  # [B, 1, 1, T, 1]: not a pad of the repeat input
        score = jnp.where(real, probs, 0.0).max(axis=(2, 3))  # [B, K, M]: max over G and real queries
        chunk = (state.pos >= lo) & (state.pos < hi)  # [B, 1, M]
        return dataclasses.replace(state, extra={**state.extra, "zip": jnp.where(chunk, score, state.extra["zip"])})


def model_scope_keep(scores: Float[Array, "L B K M"], pos: Int[Array, "L B 1 M"], ratio: float, n_sink: int
                     ) -> Bool[Array, "L B K M"]:
    """kvpress's default KVzip choice over every layer at once (`KVzipPress.compress_post`, not
    layerwise): the first `n_sink` tokens score above everything, then the int(L K n ratio)
    lowest-scored (layer, kv head, token) of the n context tokens are removed (ties: the earlier
    layer, head, token first). Deviation: the sinks are never removed (kvpress removes them too
    past ratio 1 - n_sink / n; every head keeps a token, which the head pool's layout needs)."""
    n_layers, b, kh, m = scores.shape
    table = np.asarray([min(int(n_layers * kh * n * ratio), n_layers * kh * max(n - n_sink, 0)) for n in range(m + 1)],
                       np.int32)  # tokens removed for n context tokens (host: a ratio is data to the compiled choice)
    return _model_scope_keep(scores, pos, jnp.asarray(table), n_sink)


@functools.partial(jax.jit, static_argnums=3)
def _model_scope_keep(scores: Float[Array, "L B K M"], pos: Int[Array, "L B 1 M"], table: Int[Array, "M1"],
                      n_sink: int) -> Bool[Array, "L B K M"]:
    """`model_scope_keep` compiled once per shape (every ratio: `table`)."""
    n_layers, b, kh, m = scores.shape
    pos = jnp.broadcast_to(pos, scores.shape)
    filled = pos >= 0
    top = jnp.where(filled, scores, -jnp.inf).max(axis=(0, 2, 3))[None, :, None, None]  # [1, B, 1, 1]
    s = jnp.where(filled & (pos < n_sink), top + 1.0, jnp.where(filled, scores, jnp.inf))
    flat = jnp.moveaxis(s, 1, 0).reshape(b, n_layers * kh * m)  # [B, L*K*M] layer-major
    n_pruned = table[filled[0, :, 0].sum(-1)][:, None]  # [B, 1]
    order = jnp.lexsort((jnp.broadcast_to(jnp.arange(flat.shape[1]), flat.shape), flat), axis=-1)  # lowest first
    pruned = inverse_order(order) < n_pruned
    return filled & ~jnp.moveaxis(pruned.reshape(b, n_layers, kh, m), 0, 1)


def recon_policy(p: Policy) -> Policy:
    """A layer's policy in the reconstruction pass (the engine's prompt-phase policy `p`): a kvzip
    layer scores; a dense layer (full, another compressor's prompt phase) is read without
    writing; any other policy runs as it is (its writes are discarded)."""
    from kvpolicies.full import Full

    if isinstance(p, PromptPhase) and p.of is not None and reconstructs(p.of):
        return p.of.reconstruction()
    if isinstance(p, (PromptPhase, Full)):
        return Reconstruct(codec=p.codec, rotated=p.rotated_keys, phase=p)  # runs as the prompt cache's
    return p


def scores_in_pass(p: Policy) -> bool:
    """Whether a reconstruction-pass policy (`recon_policy`) scores its layer."""
    return isinstance(p, Reconstruct) and p.of is not None
