"""`LUKV`: kvpress's `LUKVPress` (LU-KV, Tang et al. 2026, "Predicting Future Utility: Global Combinatorial
Optimization for Task-Agnostic KV Cache Eviction", arXiv:2602.08585): per-(layer, kv head) budgets read from
an offline budget curve, around a prompt scorer (kvpress's default: ExpectedAttentionPress(epsilon=0.02)).

Shapes: B batch, K kv heads, M = max_len (the prompt phase's slots), S slots per kv head on average,
L layers, R = 99 ratios of a curve.

The curve ([R, L, K] prune ratios, row i for a global compression ratio (i + 1) / 100) is given, as a .npy
file or nested lists (`curve=`): kvpress downloads the authors' one curve, for Llama-3.1-8B; the authors
compute curves offline by profiling (their repository's `generate_curve.sh`), which is not reproduced here
(docs/guide/kvpress.md, "Not done yet"). After an n-token prompt, layer l, ratio r: row
max(0, min(98, round(100 r) - 1)); head h's ideal keep (1 - p_h) n (clipped to [0, n], float32), the layer
keeps round(sum of them) (within [K, K n]): each head its floor, the remainder one more to the heads of
the largest fractional parts, every head at least 1; each head keeps its best by the inner press's score,
its first `sink` and last `window` tokens first (kvpress's max + 1), ties to the older token (kvpress's
stable sort). kvpress masks the others (every head still stores n tokens); we store a head pool
(`adascored.CountedPool`: each head's share and count), of K x (ceil(kept / K) + max_new) slots per layer,
kept the layer's most at max_len. Decoding: appends; a full pool recompresses by Ada-KV's rule over the
inner press's stream rule (`AdaScored`, ours).

A `KeptTable`: a layer's counts for every prompt length are its table ([K, max_len + 1]), so an engine with
`slots` runs every layer and ratio as one shape class (one policy, one set of compiled steps; the per-layer
policies compile a step per layer, each ratio its own), the counts given as data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.adakv import prompt_pool
from kvpolicies.adascored import AdaScored, CountedPool
from kvpolicies.checks import check_int
from kvpolicies.presets import Preset
from kvpolicies.scored import top_mask


def load_curve(curve: Any) -> np.ndarray:
    """[R, L, K] float32 prune ratios from a .npy path or nested lists."""
    arr = np.load(curve, allow_pickle=False) if isinstance(curve, (str, bytes)) or hasattr(curve, "__fspath__") \
        else np.asarray(curve, np.float32)
    if arr.ndim != 3 or arr.shape[0] != 99:
        raise ValueError(f"lukv.curve: must be [99, layers, kv heads] prune ratios, got shape {arr.shape}")
    return arr.astype(np.float32)


def head_counts(prune: Float[Array, "K"], n: Int[Array, "B 1"]) -> Int[Array, "B K"]:
    """kvpress's LUKVPress keep counts of an n-token prompt from one layer's K prune ratios."""
    kh = prune.shape[0]
    ideal = jnp.clip(1.0 - prune, 0.0, 1.0)[None, :] * n.astype(jnp.float32)  # [B, K]
    total = jnp.clip(jnp.round(ideal.sum(axis=-1, keepdims=True)).astype(jnp.int32), kh, kh * n)  # [B, 1]
    base = jnp.floor(ideal).astype(jnp.int32)  # [B, K]
    rem = total - base.sum(axis=-1, keepdims=True)  # [B, 1]
    head = jnp.broadcast_to(-jnp.arange(kh), base.shape)  # ties: the lower head (torch.topk's order, assumed)
    extra = top_mask(ideal - base, head, jnp.clip(rem, 0, kh)) & (rem > 0)  # [B, K]
    return jnp.clip(base + extra, 1, n)


@functools.lru_cache(maxsize=512)
def _head_table(prune: tuple, max_len: int) -> np.ndarray:
    """[K, max_len + 1] int32: `head_counts` of one layer's prune ratios for every prompt length n (the same
    float32 operations, evaluated once on the host, also while a step is traced)."""
    with jax.ensure_compile_time_eval():
        n = jnp.arange(max_len + 1, dtype=jnp.int32)[:, None]  # [M + 1, 1]
        return np.asarray(head_counts(jnp.asarray(prune, jnp.float32), n)).T.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class LUKV(Preset, AdaScored):
    """LU-KV's head-wise budgets from `curve` around the prompt scorer `press` (a `kvpolicies.compat.kvpress`
    result at this `ratio`); `stack(n_layers)` gives each layer its row (`prune`)."""

    curve: Any = None  # [99, L, K] prune ratios: a .npy path or nested lists (the preset's)
    prune: tuple = ()  # this layer's K prune ratios (set by `stack`)
    sink: int = 4
    window: int = 1
    alpha_safeguard: float = 0.0  # Ada-KV's safeguard in the stream rule only (LU-KV has none)

    def __post_init__(self):
        super().__post_init__()
        check_int("lukv", "sink", self.sink, 0)
        check_int("lukv", "window", self.window, 0)
        if self.curve is None and not self.prune and not self.slots:
            raise ValueError("lukv: give curve= ([99, layers, kv heads] prune ratios: a .npy file or nested lists)")

    def row(self) -> int:
        return max(0, min(98, int(round(self.ratio * 100)) - 1))

    def stack(self, n_layers):
        if self.prune or self.slots:
            return (self,) * n_layers
        arr = load_curve(self.curve)
        if arr.shape[1] != n_layers:
            raise ValueError(f"lukv.curve has {arr.shape[1]} layers, the model {n_layers}")
        return tuple(dataclasses.replace(self, curve=None, prune=tuple(float(x) for x in arr[self.row(), i]))
                     for i in range(n_layers))

    def capacity(self, max_len):
        if self.slots:
            return min(self.slots, max_len)
        if not self.prune:
            raise ValueError("lukv: a layer's policy comes from stack(n_layers) (each layer its curve row)")
        kh = len(self.prune)
        keep = sum(min(max(1.0 - p, 0.0), 1.0) for p in self.prune) * max_len  # the layer's most kept tokens
        return min(max_len, math.ceil((round(keep) + kh) / kh) + self.max_new)

    def kept_table(self, max_len: int) -> np.ndarray | None:
        """[K, max_len + 1] int32: each kv head's count kept after an n-token prompt (`head_counts` of this
        layer's row, computed once for every n), or None for a shape class (`KeptTable`)."""
        if self.slots:
            return None
        if not self.prune:
            raise ValueError("lukv: a layer's policy comes from stack(n_layers) (each layer its curve row)")
        return _head_table(self.prune, max_len)

    def shape_class(self, slots: int) -> "LUKV":
        return dataclasses.replace(self, ratio=0.0, curve=None, prune=(), slots=slots,
                                   press=self.press.shape_class(slots))

    def after_prompt(self, state, table=None):
        m = state.slots  # max_len
        s = self.capacity(m)
        table = self._table(m, table)  # [K, M + 1]: the layer's head counts (a shape class's, given)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, M, D]
        b, kh = keys.shape[:2]
        if table.shape[0] != kh:
            raise ValueError(f"lukv: the curve's row has {table.shape[0]} kv heads, the model {kh}")
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        slots, stats = self.press.from_prompt(state, pos)
        prio, _ = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        filled = pos >= 0
        n = filled.sum(axis=-1)[:, :1]  # [B, 1] prompt tokens
        guard = (pos < self.sink) | (pos >= n[..., None] - self.window)  # [B, K, M]: kvpress's max + 1
        prio = jnp.where(filled, jnp.where(guard, jnp.inf, prio), -jnp.inf)
        counts = table[:, n[:, 0]].T  # [B, K]
        kept = top_mask(prio, -pos, counts[..., None]) & filled  # [B, K, M]: ties to the older token
        pool = prompt_pool(state, kept, jnp.zeros((b, kh, m), jnp.float32), kh * s)
        return CountedPool(pool.k, pool.v, pool.pos, counts=kept.sum(axis=-1, dtype=jnp.int32), stats=stats)


def from_kvpress(r: float, max_new: int, n_layers: int | None, fields: dict, kvpress: Callable[..., Any]) -> Any:
    """`kvpolicies.compat.kvpress("LUKVPress", r, budget_curves=..., press=..., sink=4, window=1)`: kvpress's
    fields, `press` by class name (its fields among `fields`) or a `kvpress(...)` result at r (default:
    ExpectedAttentionPress(epsilon=0.02), kvpress's); `budget_curves` the curve kvpress downloads ([99, L, K]:
    a .npy path or an array). compression_ratio 0 is kvpress's no-op: `full`. Given `n_layers`, the stack.
    `kvpress`: compat's front door (handed over by compat: this module does not import it)."""
    from kvpolicies.full import Full

    curve = fields.pop("budget_curves", None)
    if curve is None:
        raise ValueError("kvpress('LUKVPress'): give budget_curves= ([99, layers, kv heads] prune ratios, a .npy file "
                         "or an array: kvpress downloads the authors' one curve, for Llama-3.1-8B)")
    curve = str(curve) if isinstance(curve, (str, bytes)) or hasattr(curve, "__fspath__") else \
        tuple(tuple(tuple(float(x) for x in h) for h in layer) for layer in load_curve(curve))
    own = {k: fields.pop(k) for k in ("sink", "window") if k in fields}
    inner = fields.pop("press", None)
    if inner is None:
        inner = kvpress("ExpectedAttentionPress", r, max_new=max_new, epsilon=2e-2) if r else None
    elif isinstance(inner, str):
        inner = kvpress(inner, r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
    elif getattr(inner, "ratio", None) != r:
        raise ValueError(f"kvpress('LUKVPress', {r}): the inner press has compression_ratio "
                         f"{getattr(inner, 'ratio', None)} (give it at the same ratio)")
    if fields:
        raise ValueError(f"kvpress('LUKVPress'): unknown field(s) {sorted(fields)}")
    if r == 0:
        return Full()
    out = LUKV(press=inner, ratio=r, curve=curve, max_new=max_new, **own)
    return out.stack(n_layers) if n_layers is not None else out
