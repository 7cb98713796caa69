"""Exact bytes of a policy's cache state, and the closed form they are checked against.

Exact bytes are the sum of the state's array nbytes, computed with `jax.eval_shape` (nothing
is allocated, so 128K-token contexts of large models cost nothing to plan). They split into
`kv` (the encoded keys and values, codes plus any scales) and `meta` (slot positions and
policy bookkeeping such as accumulated scores), reported separately so that the closed form
2 x layers x kv_heads x head_dim x slots x bytes can be compared with the `kv` part exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpolicies.base import Policy, SlotState


def tree_nbytes(tree) -> int:
    """Bytes of all array leaves of a concrete or abstract (`jax.eval_shape`) pytree."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def meta_fields(state: SlotState) -> dict[str, Any]:
    """Everything a state stores besides its encoded keys and values (positions, bookkeeping)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in ("k", "v")}


@dataclasses.dataclass(frozen=True)
class StateBytes:
    kv: int  # encoded keys and values (codes + scales)
    meta: int  # positions and policy bookkeeping

    @property
    def total(self) -> int:
        return self.kv + self.meta

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(self.kv + other.kv, self.meta + other.meta)


def tree_bytes(state) -> StateBytes:
    """Bytes of a concrete or abstract state (one layer, or any stack of layers)."""
    return StateBytes(kv=tree_nbytes((state.k, state.v)), meta=tree_nbytes(meta_fields(state)))


def state_bytes(
    policy: Policy,
    *,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    n_layers: int = 1,
    batch: int = 1,
    dtype=jnp.bfloat16,
) -> StateBytes:
    """Exact bytes of `n_layers` layers of `policy`'s state for sequences up to `max_len`."""
    shape = jax.eval_shape(lambda: policy.init(batch, kv_heads, head_dim, dtype, max_len))
    one = tree_bytes(shape)
    return StateBytes(kv=one.kv * n_layers, meta=one.meta * n_layers)


def stack_bytes(
    policies: Sequence[Policy], *, kv_heads: int, head_dim: int, max_len: int, batch: int = 1, dtype=jnp.bfloat16
) -> StateBytes:
    """Exact bytes of a per-layer policy stack (one policy per layer)."""
    total = StateBytes(0, 0)
    for p in policies:
        total = total + state_bytes(p, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len, batch=batch, dtype=dtype)
    return total


def closed_form_bytes(
    *, n_layers: int, kv_heads: int, head_dim: int, slots: int, bytes_per_elem: float, batch: int = 1
) -> float:
    """2 x layers x kv_heads x head_dim x slots x bytes (x batch): keys and values of every slot."""
    return 2 * n_layers * kv_heads * head_dim * slots * bytes_per_elem * batch


@dataclasses.dataclass(frozen=True)
class StepBytes:
    stored: StateBytes  # the whole state, as `state_bytes`
    read: StateBytes  # what one decode step reads: keys/values and metadata


def bytes_read_per_step(
    policy: Policy,
    *,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    context: int,
    n_layers: int = 1,
    batch: int = 1,
    dtype=jnp.bfloat16,
) -> StepBytes:
    """Bytes stored, and bytes read by the decode step of the query at position `context`
    (`decode_reads`: every filled slot by default; Quest its selected pages)."""
    if context < 0 or context >= max_len:
        raise ValueError(f"context={context}: must be in [0, {max_len - 1}] (a query position below max_len)")
    shape = jax.eval_shape(lambda: policy.init(batch, kv_heads, head_dim, dtype, max_len))
    kv, meta = decode_reads(policy, shape, context)
    scale = lambda sb: StateBytes(kv=sb.kv * n_layers, meta=sb.meta * n_layers)  # noqa: E731
    return StepBytes(stored=scale(tree_bytes(shape)), read=scale(StateBytes(kv=kv, meta=meta)))


def decode_reads(policy: Policy, state: SlotState, context: int) -> tuple[int, int]:
    """(kv bytes, meta bytes) of `state` (concrete or abstract) that the decode step of the query at
    position `context` reads. By default every filled slot: min(S, context + 1) of the S slots. A
    policy that reads less (quest's selected pages) or stores its slots otherwise (duo's two
    groups, paged's blocks) says so with a method of the same name, `decode_reads(state, context)`,
    which this function calls instead."""
    own = getattr(policy, "decode_reads", None)
    if own is not None:
        return own(state, context)
    s = state.slots
    filled = min(s, context + 1)
    kv, meta = tree_nbytes((state.k, state.v)), tree_nbytes(meta_fields(state))
    return kv * filled // s, meta * filled // s


def filled_bytes(cache) -> int:
    """The bytes a cache (one state per run of layers) holds: its per-slot leaves (those with the
    slot axis of `pos` where `pos` has it: keys, values, positions, scores) in the fraction of slots
    that hold a token (`pos >= 0`), every other leaf (per-layer statistics) whole. Against
    `tree_nbytes(cache)`, what it allocates: a shape class (`models.engine.Engine(slots=)`) or a
    state with free slots allocates more than it stores."""
    out = 0
    for st in cache:
        pos = np.asarray(st.pos)
        axis, s = pos.ndim - 1, pos.shape[-1]
        frac = float((pos >= 0).mean()) if pos.size else 0.0
        for x in jax.tree.leaves(st):
            n = tree_nbytes(x)
            out += round(n * frac) if len(x.shape) > axis and x.shape[axis] == s else n
    return out
