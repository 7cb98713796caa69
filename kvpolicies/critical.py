"""`critical`: CriticalKV (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective", arXiv:2502.03805; authors' repo FFY0/AdaKV, branch of CriticalKV; kvpress
`CriticalKVPress`, `CriticalAdaKVPress`) — an inner prompt scorer's ranking in two stages: the first
`first_stage_ratio` of the budget by the inner score alone, the rest by the score times what the token's
value adds to the layer's output, ||v W_o||_1 (the output perturbation bound of the paper).

Shapes: B batch, T new tokens, K kv heads, G query heads per kv head, N = K G query heads, D head dim,
d model width, M = max_len (the prompt phase's slots), S slots per kv head (on average, for the head pool).

W_o is the layer's output projection, which a policy does not hold: the prompt phase (`CriticalPhase`)
has the `ReadsValues` capability (`kvpolicies.base`), so the model hands it each step's values and its
layer's `wo` (`models.llama.block`), and it stores one float per prompt token and kv head,
`extra["vo"]` [B, K, M]: ||v W_o^(n)||_1 averaged over the kv head's G query heads n (kvpress's
`vwl1norm`), computed once per token as it is prefilled. A policy that does not ask compiles as before.

The rule (kvpress 0.5.5, `criticalkv_press.py`): `press` scores every prompt token (kvpress's units: SnapKV's
window rows averaged over the window, the kernel and G; tokens the press always keeps at the layer's
max + 1, as kvpress pads them), then
  CriticalKV:   the top max(1, int((1 - r) n fsr)) by score are kept (stage 1), the others ranked by
                (score + epsilon) x vo, and the layer keeps kvpress's n_kept = max(1, int(n (1 - r))) per
                kv head (stage 2);
  CriticalAdaKV: Ada-KV's budgets first (each head's top max(1, int(alpha n_kept)) safeguarded, the layer's
                K n_kept best over all heads: head h wins b_h), then per head the two stages within b_h:
                its top int(b_h fsr) by the safeguarded score, then (score + epsilon) x vo. Stored in
                `adascored`'s counted head pool (kvpress masks: every head keeps n tokens in memory).
The paper's own form is the same two stages over SnapKV / Ada-SnapKV attention scores (first stage
half the budget); kvpress's defaults are ours. Deviations: (1) streams and generation past `max_new`
take the inner press's own stream rule on overflow (critical's value norms are read in the prompt
phase only); CriticalAdaKV over SnapKV ranks an overflow by the overflowing query's attention (a head pool
keeps no accumulated mass: `SnapOnce`); (2) exact ties are broken by the newer token (kvpress:
torch.topk's order): where stage 1 is shorter than SnapKV's window (a short prompt at a high ratio), the
window's tokens tie at max + 1 and kvpress keeps torch's choice of them; (3) kvpress's max + 1 is the batch's and
its CriticalAdaKV counts head budgets over the whole batch, ours are per batch row (the same for one prompt).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.adascored import AdaScored, CountedPool, allocate
from kvpolicies.adakv import prompt_pool
from kvpolicies.base import ReadsValues
from kvpolicies.expected import Expected
from kvpolicies.keydiff import KeyDiff
from kvpolicies.knorm import Knorm
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored, rank_by
from kvpolicies.scored import top_mask
from kvpolicies.snapkv import SnapKV
from kvpolicies.wrapped import Delegating


def value_norms(v: Float[Array, "B T K D"], wo: Float[Array, "ND d"]) -> Float[Array, "B K T"]:
    """||v W_o^(n)||_1 of each token's value through each query head n's rows of the output projection,
    averaged over the G query heads of its kv head (kvpress's `CriticalKVPress.vwl1norm`), float32."""
    kh, d = v.shape[2], v.shape[3]
    w = wo.astype(jnp.float32).reshape(kh, wo.shape[0] // (kh * d), d, wo.shape[-1])  # [K, G, D, d]
    out = jnp.einsum("BTKD,KGDE->BKGTE", v.astype(jnp.float32), w)  # [B, K, G, T, d]
    return jnp.abs(out).sum(axis=-1).mean(axis=2)  # [B, K, T]


@dataclasses.dataclass(frozen=True)
class CriticalPhase(PromptPhase, ReadsValues):
    """A prompt phase (the inner press's: rows, column sums, query statistics) that also stores each
    prompt token's value norm through W_o, `extra["vo"]` [B, K, M] (`read_values`, called by the model)."""

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return dataclasses.replace(st, extra={**st.extra, "vo": jnp.zeros((batch, kv_heads, max_len), jnp.float32)})

    def read_values(self, state: PromptState, v: Float[Array, "B T K D"], pos: Int[Array, "B T"],
                    wo: Float[Array, "ND d"]) -> PromptState:
        """The state with the step's tokens' value norms written at their positions (a prompt step's
        positions are contiguous from pos[:, 0])."""
        vo = jax.vmap(lambda z, x, p: jax.lax.dynamic_update_slice_in_dim(z, x, p, axis=1))(
            state.extra["vo"], value_norms(v, wo), pos[:, 0])  # [B, K, M]
        return dataclasses.replace(state, extra={**state.extra, "vo": vo})


def critical_phase(phase: PromptPhase, of) -> CriticalPhase:
    """The inner press's prompt phase `phase`, collecting the value norms too."""
    if type(phase) is not PromptPhase:
        raise ValueError(f"critical: the inner press's prompt phase is a {type(phase).__name__} (a plain PromptPhase "
                         "needed: snapkv, expected, keydiff, knorm)")
    return CriticalPhase(codec=phase.codec, of=of, obs_window=phase.obs_window, columns=phase.columns,
                         query_sink=phase.query_sink)


def kvpress_units(press: PromptScored, state: PromptState, prio: Float[Array, "B K M"],
                  filled: Bool[Array, "B K M"]) -> Float[Array, "B K M"]:
    """`press`'s prompt priorities as kvpress's `press.score` returns them (its epsilon is added to them):
    snapkv's sums over the window's rows, the kernel and G averaged (as `Delegating.kvpress_scores`),
    tokens the press always keeps (+inf here) at the layer's largest score + 1 (kvpress pads them so), -inf
    for empty slots."""
    if isinstance(press, SnapKV):
        g = state.rows[:, :1].sum(axis=-1).max(axis=-1)[:, :, None]  # [B, 1, 1]: G (a full row sums to G)
        prio = prio / (g * press.obs_window * (press.kernel if press.pooling == "avg" else 1))
    always = jnp.isposinf(prio) & filled
    top = jnp.max(jnp.where(filled & ~always, prio, -jnp.inf), axis=(1, 2), keepdims=True)  # [B, 1, 1]
    return jnp.where(filled, jnp.where(always, top + 1, prio), -jnp.inf)


def _check(label: str, epsilon, first_stage_ratio) -> None:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon >= 0:
        raise ValueError(f"{label}.epsilon={epsilon!r}: must be a number >= 0")
    f = first_stage_ratio
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
        raise ValueError(f"{label}.first_stage_ratio={f!r}: must be a number in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Critical(Delegating):
    """kvpress's `CriticalKVPress(press, epsilon, first_stage_ratio)` (see the module docstring): after the
    prompt, the top max(1, int((1 - r) n first_stage_ratio)) tokens by `press`'s score, then the best by
    (score + epsilon) ||v W_o||_1, to kvpress's n_kept per kv head (`budget` without a ratio). Streams:
    `press`'s rule on overflow (`Delegating`)."""

    label = "critical"
    takes = (SnapKV, Expected, KeyDiff, Knorm)

    press: PromptScored = SnapKV()
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        _check(self.label, self.epsilon, self.first_stage_ratio)

    def first_for(self, n: int) -> int:
        """Stage 1's tokens of an n-token prompt: kvpress's max(1, int((1 - r) n fsr)) (0 if fsr is 0);
        without a ratio, of the budget kept."""
        if not self.first_stage_ratio:
            return 0
        kept = (1 - self.ratio) * n if self.ratio else min(self.kept(), n)
        return max(1, int(kept * self.first_stage_ratio))

    table_rows = 2  # kept_table: the kept counts, then stage 1's

    def kept_table(self, max_len):
        """[2, M + 1] int32: the kept counts and stage 1's (`first_for`), per prompt length: what a shape class
        is given as data."""
        return None if self.interval or self.slots else np.stack([self._counts(max_len), self._firsts(max_len)])

    def _firsts(self, max_len: int) -> np.ndarray:
        return np.asarray([self.first_for(i) for i in range(max_len + 1)], np.int32)

    def prompt_policy(self):
        return critical_phase(self.press.prompt_policy(), self)

    def ties_decided_here(self):
        return False  # its first stage is a top-k of its own

    def prompt_rank(self, state, slots, keys, stats):
        return self.rank_given(state, slots, keys, stats, jnp.asarray(self._firsts(slots.pos.shape[-1]))[None])

    def rank_given(self, state, slots, keys, stats, rows):
        prio, tie = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        pos = slots.pos
        filled = pos >= 0
        score = kvpress_units(self.press, state, prio, filled)
        n = filled.sum(axis=-1, keepdims=True)  # [B, K, 1] prompt tokens
        first = rows[0][n]  # [B, K, 1] stage 1's tokens
        stage1 = top_mask(score, tie, first) & filled  # [B, K, M]
        stage2 = (score + self.epsilon) * state.extra["vo"]  # [B, K, M]
        return rank_by(jnp.where(stage1, jnp.inf, stage2), pos)


@dataclasses.dataclass(frozen=True)
class SnapOnce(SnapKV):
    """SnapKV's prompt ranking for a head pool (`CriticalAda`, whose pool keeps no per-slot mass): on a
    stream's overflow, SnapKV's rule over the overflowing query's attention alone (window 1 of the stream)."""

    label = "snap-once"
    accumulates = False
    observe = PromptScored.observe
    restart = PromptScored.restart

    def rank(self, slots, keys, stats, seen):
        return self._rank(seen.scores.sum(axis=2), slots.pos)  # [B, K, V]: the step's one query


@dataclasses.dataclass(frozen=True)
class CriticalAda(AdaScored):
    """kvpress's `CriticalAdaKVPress(press, alpha_safeguard, epsilon, first_stage_ratio)` (see the module
    docstring): Ada-KV's head budgets b_h over `press`'s scores, then within each head the two stages of
    CriticalKV. Storage and streams are `AdaScored`'s: each head's share in a counted pool of
    K x (n_kept + max_new) slots; on overflow Ada-KV's rule over `press`'s stream rule. `press`: a prompt
    scorer without per-slot statistics (SnapKV as `SnapOnce`)."""

    press: PromptScored = SnapOnce(ratio=0.5)
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        _check("critical-ada", self.epsilon, self.first_stage_ratio)

    def prompt_policy(self):
        return critical_phase(self.press.prompt_policy(), self)

    def after_prompt(self, state: PromptState, table=None) -> CountedPool:
        m = state.slots  # max_len
        s = self.capacity(m)
        counts = self._table(m, table)  # [M + 1]: kvpress's n_kept (a shape class's, given)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, M, D]
        b, kh = keys.shape[:2]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        slots, stats = self.press.from_prompt(state, pos)
        prio, tie = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        filled = pos >= 0
        score = kvpress_units(self.press, state, prio, filled)
        n = filled.sum(axis=-1, keepdims=True)[:, :1]  # [B, 1, 1] prompt tokens (every head holds them)
        n_kept = counts[n]  # [B, 1, 1]
        n_safe = self._safe(n_kept)
        budget = allocate(score, tie, filled, n_kept, n_safe).sum(axis=-1, keepdims=True)  # [B, K, 1] b_h
        safe = top_mask(score, tie, n_safe) & filled  # [B, K, M]
        guarded = jnp.where(safe, jnp.inf, score)
        # kvpress: (head_budgets * first_stage_ratio).to(int64), a float32 product
        first = jnp.floor(budget.astype(jnp.float32) * jnp.float32(self.first_stage_ratio)).astype(jnp.int32)
        stage1 = (top_mask(guarded, tie, first) & filled) | safe
        stage2 = jnp.where(stage1, jnp.inf, (score + self.epsilon) * state.extra["vo"])
        kept = top_mask(stage2, pos, budget) & filled  # [B, K, M]: b_h per head
        pool = prompt_pool(state, kept, jnp.zeros((b, kh, m), jnp.float32), kh * s)
        return CountedPool(pool.k, pool.v, pool.pos, counts=kept.sum(axis=-1, dtype=jnp.int32), stats=stats)
