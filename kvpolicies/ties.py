"""Exact ties broken as torch.topk breaks them on the CPU (`PromptScored(ties="torch_cpu")`, off by default).

A prompt scorer keeps its `n` best-ranked tokens; where the n-th score is tied, which of the tied
tokens survive is not part of any method. Ours keep the newer token (`scored.top_mask`). kvpress keeps
what `scores.topk(n)` leaves, and on the CPU torch's top-k (ATen's `topk_impl_loop`) calls
libstdc++'s `std::nth_element` on the row's (score, index) pairs in index order when k * 64 > n
(else `std::partial_sort`), comparing scores only: its kept set among ties is whatever that
introselect leaves in the first k places. That is deterministic, and this module replays it: median-of-
three pivot moved to the front, the unguarded Hoare partition, the range narrowed to the side holding
the n-th place until at most 3 remain, then an insertion sort (stable) of those.

Where it differs from torch: (1) libstdc++ switches to a heap selection after 2 floor(log2 n)
partitions (a median-of-three killer input); this keeps partitioning, so the kept set may differ on
such inputs. (2) k * 64 <= n (kvpress's ratios above 0.984) runs `std::partial_sort`, not replayed:
the same introselect is used. (3) torch on a GPU selects otherwise; this replays the CPU kernel only.
Used by `PromptScored.after_prompt` and by the wrappers ChunkKV and EntropyChunkKV (`kvpolicies.compat`) for
their own top-k calls; a policy that breaks its ties elsewhere refuses the rule (`PromptScored.ties_decided_here`).
Tests: tests/kvpolicies/test_ties.py (torch.topk itself on tie-heavy rows, and every prompt scorer's
choice unchanged without ties). Cost: a `while_loop` of about 2-3 n scalar steps per row, every row at
once (`vmap`).

Shapes: R rows (any leading axes), V slots (the row's first `n` hold its scores in index order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

TIES = ("newer", "torch_cpu")


def _swap(v: Array, ix: Array, a: Array, b: Array) -> tuple[Array, Array]:
    va, vb, ia, ib = v[a], v[b], ix[a], ix[b]
    return v.at[a].set(vb).at[b].set(va), ix.at[a].set(ib).at[b].set(ia)


def _median_to_first(v: Array, ix: Array, first: Array, last: Array) -> tuple[Array, Array]:
    """libstdc++'s `__move_median_to_first(first, first + 1, mid, last - 1)` with comp(x, y) = x > y."""
    a, b, c = first + 1, first + (last - first) // 2, last - 1
    ab, bc, ac = v[a] > v[b], v[b] > v[c], v[a] > v[c]
    pick = jnp.where(ab, jnp.where(bc, b, jnp.where(ac, c, a)), jnp.where(ac, a, jnp.where(bc, c, b)))
    return _swap(v, ix, first, pick)


def _partition(v: Array, ix: Array, first: Array, last: Array) -> tuple[Array, Array, Array]:
    """libstdc++'s `__unguarded_partition(first + 1, last, pivot=first)`: (v, ix, cut)."""
    p = v[first]

    def body(c):  # the scans are bounded by [first, last): a no-op for the real algorithm (the median of three
        v, ix, f, l, _ = c  # and the pivot are its sentinels), an end for a row that `vmap` runs past its end
        f = jax.lax.while_loop(lambda f: (f < last - 1) & (v[f] > p), lambda f: f + 1, f)
        l = jax.lax.while_loop(lambda l: (l > first) & (p > v[l]), lambda l: l - 1, l - 1)
        stop = f >= l
        v, ix = _swap(v, ix, f, jnp.where(stop, f, l))
        return v, ix, jnp.where(stop, f, f + 1), l, stop

    v, ix, cut, _, _ = jax.lax.while_loop(lambda c: ~c[4], body, (v, ix, first + 1, last, jnp.asarray(False)))
    return v, ix, cut


def _row(prio: Float[Array, "V"], n: Int[Array, ""], k: Int[Array, ""]) -> Bool[Array, "V"]:
    """The k slots of prio[:n] that torch.topk(prio[:n], k) keeps on the CPU (k <= n)."""
    nth = k - 1
    ix = jnp.arange(prio.shape[0])

    def body(c):
        v, ix, first, last = c
        v, ix = _median_to_first(v, ix, first, last)
        v, ix, cut = _partition(v, ix, first, last)
        return v, ix, jnp.where(cut <= nth, cut, first), jnp.where(cut <= nth, last, cut)

    v, ix, first, last = jax.lax.while_loop(lambda c: c[3] - c[2] > 3, body,
                                            (prio, ix, jnp.asarray(0, n.dtype), n))
    # the insertion sort of [first, last) (at most 3 places): a stable sort by descending score
    j = first + jnp.arange(3)
    live = j < last
    w = v[jnp.minimum(j, prio.shape[0] - 1)]  # [3]
    ahead = (w[None, :] > w[:, None]) | ((w[None, :] == w[:, None]) & (jnp.arange(3)[None, :] < jnp.arange(3)[:, None]))
    place = first + (ahead & live[None, :]).sum(axis=1)  # [3]: each one's place after the sort
    at = jnp.arange(prio.shape[0])
    kept = at < first  # places before the range: kept (they hold the n-th place's betters)
    tail = jnp.zeros_like(kept).at[jnp.where(live, j, prio.shape[0])].set(place <= nth, mode="drop")
    return jnp.zeros_like(kept).at[ix].set(kept | tail)


def torch_cpu_top_mask(prio: Float[Array, "*r V"], n: Int[Array, "*r"], k: Int[Array, "*r"]) -> Bool[Array, "*r V"]:
    """True for the k of each row's first n slots that torch.topk keeps on the CPU (exact ties as its
    introselect leaves them; module docstring); the slots from n on are never kept. k <= n."""
    lead = prio.shape[:-1]
    flat = prio.reshape((-1, prio.shape[-1]))
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), lead).reshape(-1)
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), lead).reshape(-1)
    return jax.vmap(_row)(flat, n, k).reshape(prio.shape)
