"""`adakv`: Ada-KV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", NeurIPS 2025; authors' repo FFY0/AdaKV, kvpress
`AdaKVPress`) over SnapKV's scores — the kv heads of a layer share one budget of K x budget
prompt tokens, each head keeping as many as its scores win, with real per-head memory.

Shapes: B batch, K kv heads, S = budget + obs_window + max_new slots per kv head on average,
P = K x S pool slots per layer, T new tokens, V = P + K x T view slots, M = max_len (the
prompt phase's slots), D head dim.

Storage: one pool of P slots per layer shared by the K kv heads, stored as K rows of S slots
(leaves [B, K, S, ...], the shapes of snapkv's state) and read as one flat pool [B, 1, P, ...]
(a free reshape, so the `Kp = 1` slot machinery applies); row r is pool slots r*S..r*S+S-1,
not head r. Head h's slots form one contiguous segment of the pool, sorted by position;
segments follow in head order, empty slots last. The segment boundaries are not
stored: every kv head always holds the newest token (it is inside every head's observation
window), so a segment ends at the slot holding the largest position, and the head of a slot is
the number of such markers before it. The state is therefore exactly SnapKV's at the same
budget: K x S slots of keys and values, one int32 position and one float32 observation mass
per slot — stored bytes equal, while the heads hold different numbers of tokens. `extend`
builds the transient view in which every kv head reads the whole pool through the mask
`head(slot) == h` (K times the pool's compute at attention time, never stored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import EMPTY, Policy, RopePositions, View, empty_slots
from kvpolicies.budgets import Budgeted, Fits  # noqa: F401  (Fits: re-exported, it lived here)
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.prompt import KeptTable, PromptCompressor, PromptPhase, PromptState
from kvpolicies.scored import LAST_KEY, Accumulated, stable_order, top_mask
from kvpolicies.slots import QuietChunks, concat, encode_new, take_slots
from kvpolicies.snapkv import SnapKV


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadPool(Accumulated):
    """A layer's pool of P = K x S slots shared by its kv heads (see the module docstring).

    k, v: codec leaves [B, K, S, ...]; pos: [B, K, S] int32 (-1 empty); mass: [B, K, S] float32,
    the observation mass of each slot (for the re-compression of a stream, as snapkv's); all as
    K rows of one flat pool of P slots, grouped by head (rows are not heads).
    """

    def held(self, row, kv_heads, policy):
        """Each head's segment of the pool (`head_of`'s rule: a head starts where the position
        stops growing); heads past the last segment hold nothing."""
        flat = np.asarray(self.pos[row]).reshape(-1)  # [K * S]
        flat = flat[flat >= 0]
        heads = np.split(flat, np.flatnonzero(np.diff(flat) <= 0) + 1) if flat.size else []
        return [np.sort(h).astype(np.int64) for h in heads] + [np.zeros(0, np.int64)] * (kv_heads - len(heads))


def snapkv_scores(pol: "AdaKV", window: Float[Array, "B K V"], pos: Int[Array, "B K V"],
                  cand: Bool[Array, "B K V"]) -> tuple[Float[Array, "B K V"], Float[Array, "B K V"]]:
    """SnapKV's ranking of the candidates of each kv head: (priority, tie-break), -inf elsewhere.
    Priority: the observation mass max-pooled over `kernel` neighbouring candidates; tie-break:
    the raw observation mass (as kvpolicies.snapkv)."""
    snap = SnapKV(budget=pol.budget, obs_window=pol.obs_window, kernel=pol.kernel, max_new=pol.max_new,
                  pooling=pol.pooling)
    return snap.pool(window, pos, cand), jnp.where(cand, window, -jnp.inf)


# scorer name -> fn(policy, window mass [B, K, V], positions [B, K, V], candidates [B, K, V])
#                -> (priority, tie-break) [B, K, V], -inf for non-candidates
SCORERS: dict[str, Callable] = {"snapkv": snapkv_scores}


def head_of(pos: Int[Array, "B 1 V"], kv_heads: int) -> Int[Array, "B 1 V"]:
    """The kv head of each pool slot (K for empty slots). Each head's segment is in text order, so
    a head starts where the position does not grow: the previous head ended at the newest token
    (adakv, kvzip) or this one starts at a sink (kvpress's kvzip, which does not force the newest)."""
    prev = jnp.concatenate([jnp.full(pos.shape[:-1] + (1,), -2, pos.dtype), pos[..., :-1]], axis=-1)
    marks = ((pos >= 0) & (pos <= prev)).astype(jnp.int32)  # [B, 1, V]: a segment starts here
    return jnp.where(pos >= 0, jnp.cumsum(marks, axis=-1), kv_heads).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AdaKV(Budgeted, KeptTable, PromptCompressor, QuietChunks, Policy):
    """SnapKV with head-adaptive budgets: a layer keeps K x budget candidates in all.

    Compression (after the prompt, and again on overflow for streams, as `snapkv`): every kv head
    keeps its `obs_window` newest tokens; of the other tokens ("candidates"), ranked by the
    `scorer` (default SnapKV's max-pooled observation mass, ties by the raw mass), each head first
    keeps its top floor(alpha_safeguard x b) (the safeguard), then the layer keeps the top
    K x b of the remaining candidates of all heads together (flattened [K, candidates], ties
    to the lower head, then the earlier token), b = min(budget + obs_window, S) - obs_window.
    This is kvpress's AdaKVPress rule (reviewed by Ada-KV's first author): the safeguard
    candidates get the largest score, then a top-k over the flattened layer scores. Decoded
    tokens are appended to every head (max_new free slots per head on average).

    Defaults: the authors' Ada-SnapKV setting (observation window 32, max-pool kernel 7,
    floor_alpha = alpha_safeguard = 0.2) and our snapkv's budget 1024 and max_new 256.

    Deviations: (1) the authors' repo (adaptive_snapkv/monkeypatch/snapkv_utils.py) counts each
    head's share c_h of the flattened top K x b, then keeps round(c_h (1 - alpha) + floor(alpha b))
    per head, which can exceed K x b by rounding; we keep kvpress's rule, whose total is exactly
    K x b (a fixed pool). (2) Scores are the observation queries' attention summed over each kv
    head's G query heads (the authors average over the window and support GQA on a branch; a
    common factor does not change the ranking). (3) Streams are re-compressed on overflow as
    our snapkv (the paper compresses only the prompt). (4) Attention reads the pool through a
    per-head mask (K x the pool's attention compute); the authors use a varlen flash kernel.
    """

    observes = ("scores",)
    per_token = True
    budget_field = "budget"

    budget: int = 1024
    obs_window: int = 32
    kernel: int = 7
    max_new: int = 256
    alpha_safeguard: float = 0.2
    scorer: str = "snapkv"
    pooling: str = "max"  # the scorer's pooling (snapkv's field): "avg" is kvpress's
    ratio: float = 0.0  # kvpress's compression ratio (0: `budget` sizes); see `kept_for`
    safeguard_window: bool = False  # kvpress: the safeguard is int(alpha x n_kept), window included
    codec: Codec = Identity()
    # a shape class's slots per kv head (`KeptTable`; 0: sized by ratio or budget); set by the engine
    slots: int = dataclasses.field(default=0, metadata={"engine": True})

    def __post_init__(self):
        check_int("adakv", "budget", self.budget, 0)
        check_int("adakv", "obs_window", self.obs_window, 1)
        check_int("adakv", "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"adakv.kernel={self.kernel}: must be an odd int >= 1")
        check_int("adakv", "max_new", self.max_new, 0)
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"adakv.alpha_safeguard={a!r}: must be a number in [0, 1]")
        check_choice("adakv", "scorer", self.scorer, tuple(SCORERS))
        check_choice("adakv", "pooling", self.pooling, ("max", "avg"))
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ValueError(f"adakv.ratio={r!r}: must be a number in [0, 1) (0: off)")
        check_int("adakv", "slots", self.slots, 0)

    def kept_for(self, n: int) -> int:
        """Tokens per kv head on average kept of an n-token prompt when `ratio` is set (kvpress's
        n_kept = max(1, int(n (1 - ratio))), the window included)."""
        return max(1, int(n * (1 - self.ratio)))

    def _safe(self, b):
        """Candidates each head is guaranteed, b candidates per head on average: floor(alpha b)
        (the authors'), or kvpress's max(1, int(alpha (b + w))) minus the w window tokens it
        counts (`safeguard_window`)."""
        if not self.safeguard_window:
            return int(self.alpha_safeguard * b)
        n = b + self.obs_window
        n_safe = max(1, int(n * self.alpha_safeguard)) if self.alpha_safeguard > 0 and n > 0 else 0
        return max(n_safe - self.obs_window, 0)

    @classmethod
    def for_tokens(cls, n, **kw):
        """n prompt tokens per kv head on average: budget = n - obs_window (as snapkv)."""
        return cls(budget=max(n - kw.get("obs_window", cls.obs_window), 0), **kw)

    def capacity(self, max_len):
        """Slots per kv head on average (the pool holds kv_heads x this many)."""
        if self.slots:
            return min(self.slots, max_len)
        if self.ratio:
            return min(self.kept_for(max_len) + self.max_new, max_len)
        return min(self.budget + self.obs_window + self.max_new, max_len)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, self.capacity(max_len), kv_heads)  # [B, K, S, D]
        return HeadPool(st.k, st.v, st.pos, mass=jnp.zeros(st.pos.shape, jnp.float32))

    # -- one decode step: the pool plus the new token in every head -----------------------------
    def extend(self, state, k, v, pos):
        return pool_view(self.codec, state, k, v, pos)

    def compact(self, view, seen):
        if seen.scores is None:
            raise ValueError(f"AdaKV.compact needs the attention scores (observes={self.observes})")
        slots, head, p = view.carry
        kh, t = seen.scores.shape[1], seen.scores.shape[2]
        s, w = p // kh, self.obs_window
        score = seen.scores.sum(axis=1)  # [B, T, V]: each query's attention to each slot of its own head
        filled = slots.pos >= 0  # [B, 1, V]
        n = filled.sum(axis=-1, keepdims=True)  # [B, 1, 1] slots in the view (K x tokens per head on average)
        saw = n[:, 0] - kh * (t - 1 - jnp.arange(t))  # [B, T]: the view of query i of the step (T > 1: a
        # chunk that evicts nothing, `appends_quietly`; else one token)
        obs = slots.mass + jnp.where((saw >= kh * (s + 2 - w))[..., None], score, 0.0).sum(axis=1, keepdims=True)
        over = n > p  # [B, 1, 1]
        per_head = head == jnp.arange(kh)[None, :, None]  # [B, K, V]

        def evict():  # the ranking's sorts only on a step where the pool overflows
            kept_h = self._compress(jnp.where(per_head, obs, 0.0), jnp.where(per_head, slots.pos, EMPTY), s)
            return jnp.where(over, kept_h.any(axis=1, keepdims=True) & filled, filled)  # [B, 1, V]

        kept = jax.lax.cond(over.any(), evict, lambda: filled)
        slots = dataclasses.replace(slots, mass=jnp.where(over, 0.0, obs))
        return as_rows(pack_by_head(slots, kept, head, p), kh)

    def _compress(self, window: Float[Array, "B K V"], pos: Int[Array, "B K V"], s: int, b=None,
                  safe_n=None) -> Bool[Array, "B K V"]:
        """Per kv head (pos = -1 where a slot is not the head's): the obs_window newest tokens and
        the layer's K x b candidates, each head guaranteed floor(alpha_safeguard x b) (`_safe`; b
        and safe_n: [B, 1, 1] arrays when the prompt sizes them, `ratio`)."""
        b_, kh, v = pos.shape
        w = self.obs_window
        filled = pos >= 0
        recent = filled & (pos > pos.max(axis=(1, 2), keepdims=True) - w)  # [B, K, V]
        cand = filled & ~recent
        prio, tie = SCORERS[self.scorer](self, window, pos, cand)  # [B, K, V]
        if b is None:
            b = (self.kept_for(s - self.max_new) if self.ratio else max(s - self.max_new, 1) if self.slots else
                 min(self.budget + w, s)) - w
            b = max(b, 0)  # candidates per head on average
            safe_n = self._safe(b)
        safe = top_mask(prio, tie, safe_n) & cand  # [B, K, V]
        prio = jnp.where(safe, jnp.inf, prio)
        total = kh * b if isinstance(b, int) else (kh * b)[:, :, 0]  # [B, 1] when sized by the prompt
        chosen = top_mask(prio.reshape(b_, kh * v), tie.reshape(b_, kh * v), total).reshape(b_, kh, v) & cand
        return recent | chosen

    # -- the paper's protocol: the whole prompt densely, then one compression --------------------
    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=self.obs_window)

    def appends_quietly(self, state, t):
        """No pool overflows within the t tokens (each adds a slot to every head)."""
        kh = state.pos.shape[1]
        n = (state.pos >= 0).sum(axis=(1, 2))  # [B] filled slots of the pool
        return ~(n + kh * t > kh * state.pos.shape[2]).any()

    @property
    def appends_only(self):
        """A shape class (`slots`): its engine refuses chunks past the free slots after the compression."""
        return bool(self.slots)

    def kept_table(self, max_len: int) -> np.ndarray | None:
        """[2, max_len + 1]: tokens per kv head on average kept after an n-token prompt (window
        included) and the candidates each head is guaranteed (`KeptTable`)."""
        if self.slots:
            return None
        s, w = self.capacity(max_len), self.obs_window
        if self.ratio:
            n_kept = np.minimum([self.kept_for(n) for n in range(max_len + 1)], s)
        else:
            n_kept = np.full(max_len + 1, min(self.budget + w, s))
        safe = [self._safe(int(b)) for b in np.maximum(n_kept - w, 0)]
        return np.stack([n_kept, safe]).astype(np.int32)

    def shape_class(self, slots: int) -> "AdaKV":
        return dataclasses.replace(self, ratio=0.0, budget=0, slots=slots)

    def after_prompt(self, state: PromptState, table: Array | None = None) -> HeadPool:
        m = state.slots  # max_len
        s = self.capacity(m)
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        window = state.rows.sum(axis=2)  # [B, K, M]: the last obs_window queries' attention
        filled = pos >= 0
        count = filled.sum(axis=-1, keepdims=True)  # [B, K, 1]
        if self.slots and table is None:
            raise ValueError(f"adakv(slots={self.slots}): a shape class keeps the counts it is given: "
                             "after_prompt(state, table)")
        if table is not None or self.ratio:  # kvpress's sizing: from the prompt's length (tables over every length)
            n_kept, safe = jnp.asarray(self.kept_table(m) if table is None else table)  # [M + 1] each
            nb = jnp.maximum(n_kept - self.obs_window, 0)[count[:, :1]]  # [B, 1, 1]
            ns = safe[count[:, :1]]  # [B, 1, 1]
            over = count > n_kept[count]
            kept = jnp.where(over, self._compress(window, pos, s, nb, ns) & filled, filled)
        else:
            over = count > min(self.budget + self.obs_window, s)  # [B, K, 1]
            kept = jnp.where(over, self._compress(window, pos, s) & filled, filled)  # [B, K, M]
        return prompt_pool(state, kept, jnp.zeros((b, kh, m), jnp.float32), kh * s)


def pool_view(codec: Codec, state: HeadPool, k: Float[Array, "B K T D"], v: Float[Array, "B K T D"],
              pos: Int[Array, "B T"], head: Int[Array, "B 1 P"] | None = None) -> View:
    """The view of a head pool plus the T new tokens of every head: [B, 1, V = P + K x T] slots
    (new tokens head-major), each kv head reading its own slots through the mask; carry =
    (slots [B, 1, V], head of each slot [B, 1, V], P). `head`: the pool slots' heads when the
    pool stores them (`kvpolicies.adascored`'s counts; None: `head_of`'s rule)."""
    b, kh, t, _ = k.shape
    flat = lambda x: x.reshape(b, 1, kh * t, x.shape[-1])  # noqa: E731  [B, K, T, D] -> [B, 1, K*T, D]
    new = encode_new(codec, flat(k), flat(v), jnp.tile(pos, (1, kh)))  # head-major
    new = HeadPool(new.k, new.v, new.pos, mass=jnp.zeros(new.pos.shape, jnp.float32))
    pool = _map(_flat, state)  # [B, 1, P, ...]
    slots = concat(pool, new)  # [B, 1, V]
    head = jnp.concatenate([head_of(pool.pos, kh) if head is None else head,
                            jnp.broadcast_to(jnp.repeat(jnp.arange(kh, dtype=jnp.int32), t), (b, 1, kh * t))],
                           axis=-1)  # [B, 1, V]
    mask = head[:, :, None, :] == jnp.arange(kh)[None, :, None, None]  # [B, K, 1, V]
    dec = lambda x: jnp.broadcast_to(x, (b, kh) + x.shape[2:])  # noqa: E731  [B, 1, V, D] -> [B, K, V, D]
    return View(k=dec(codec.decode(slots.k, k.dtype)), v=dec(codec.decode(slots.v, k.dtype)),
                pos=slots.pos, rope=RopePositions(q=pos[..., None], k=slots.pos),
                mask=jnp.broadcast_to(mask, (b, kh, t, mask.shape[-1])), carry=(slots, head, pool.slots))


def prompt_pool(state: PromptState, kept: Bool[Array, "B K M"], mass: Float[Array, "B K M"], p: int) -> HeadPool:
    """A dense prompt state's kept tokens ([B, K, M] per kv head) as a head pool of p slots
    (K rows), each kept slot with its `mass`."""
    b, kh, m = kept.shape
    pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
    flat = lambda x: x.reshape((b, 1, kh * m) + x.shape[3:])  # noqa: E731  head-major [B, 1, K*M, ...]
    slots = HeadPool(jax.tree.map(flat, state.k), jax.tree.map(flat, state.v), flat(pos), mass=flat(mass))
    head = flat(jnp.broadcast_to(jnp.arange(kh, dtype=jnp.int32)[None, :, None], (b, kh, m)))
    return as_rows(pack_by_head(slots, flat(kept), head, p), kh)


def _flat(x: Array) -> Array:
    """[B, K, S, ...] rows -> [B, 1, K*S, ...] pool (a free reshape)."""
    return x.reshape((x.shape[0], 1, x.shape[1] * x.shape[2]) + x.shape[3:])


def _rows(x: Array, kv_heads: int) -> Array:
    """[B, 1, K*S, ...] pool -> [B, K, S, ...] rows (row r holds pool slots r*S..r*S+S-1, not head r)."""
    return x.reshape((x.shape[0], kv_heads, x.shape[2] // kv_heads) + x.shape[3:])


def _map(fn, state: HeadPool) -> HeadPool:
    return HeadPool(*(jax.tree.map(fn, getattr(state, f.name)) for f in dataclasses.fields(state)))


def as_rows(pool: HeadPool, kv_heads: int) -> HeadPool:
    """A flat pool [B, 1, P, ...] stored as its K rows [B, K, S, ...] (a free reshape; row r holds
    pool slots r*S..r*S+S-1, not head r)."""
    return _map(lambda x: _rows(x, kv_heads), pool)


def fit_pool(pool: HeadPool, slots: int) -> HeadPool:
    """A packed head pool (leaves [B, K, S, ...]: kept slots first, grouped by head, as
    `pack_by_head` leaves them) cut to `slots` slots per row: the first K x slots slots of the
    flat pool, as K rows [B, K, slots, ...]. Every filled slot must be among them (the caller
    checks the counts on the host: `Engine.fitted`, through `kvpolicies.budgets.Fits.fit_state`)."""
    kh, s = pool.pos.shape[1], pool.pos.shape[2]
    if not 0 < slots <= s:
        raise ValueError(f"fit_pool: slots={slots} per row, the pool has {s}")
    return as_rows(_map(lambda x: _flat(x)[:, :, :kh * slots], pool), kh)


def pack_by_head(slots: HeadPool, kept: Bool[Array, "B 1 V"], head: Int[Array, "B 1 V"], p: int) -> HeadPool:
    """The kept slots (at most p) grouped by head, each head's in text order, then empty slots."""
    idx = stable_order((jnp.where(kept, head, LAST_KEY), jnp.where(kept, slots.pos, LAST_KEY)), p)  # [B, 1, P]
    live = take_slots(kept, idx)  # [B, 1, P]
    return HeadPool(k=jax.tree.map(lambda y: take_slots(y, idx), slots.k),
                    v=jax.tree.map(lambda y: take_slots(y, idx), slots.v),
                    pos=jnp.where(live, take_slots(slots.pos, idx), EMPTY).astype(jnp.int32),
                    mass=jnp.where(live, take_slots(slots.mass, idx), 0.0).astype(jnp.float32))
