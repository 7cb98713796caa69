"""Shared machinery of the score-based eviction policies (`h2o`, `tova`, `snapkv`).

Shapes: B batch, K kv heads, Kp = 1 or K (one token set per layer, or one per kv head),
S state slots, T new tokens, V = S + T view slots, D head dim.

A score-based policy keeps a fixed number of slots S. A step appends the T new tokens to the
S old slots (a view of V slots, every old slot visible to every new query), attention returns
the mass each slot received, and `compact` decides which S slots survive (a boolean `kept`
mask over the view) and packs them back into S slots: kept tokens first, in text order, then
empty slots (position -1). Positions are per kv head ([B, K, S]) when the policy evicts per
head, so different heads hold different tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import EMPTY, SlotState, concat, encode_new, take_slots

LAST_KEY = jnp.iinfo(jnp.int32).max  # sort key that puts a slot after every kept one


def init_state(policy, batch: int, kv_heads: int, head_dim: int, dtype: Any, max_len: int,
               kp: int, aux: tuple[str, ...] = ()) -> SlotState:
    """An empty state with positions [B, Kp, S] and float32 aux arrays [B, K, S] (zeros)."""
    s = policy.capacity(max_len)
    shape = (batch, kv_heads, s, head_dim)  # [B, K, S, D]
    return SlotState(
        k=policy.codec.init(shape, dtype),
        v=policy.codec.init(shape, dtype),
        pos=jnp.full((batch, kp, s), EMPTY, jnp.int32),
        aux={n: jnp.zeros((batch, kv_heads, s), jnp.float32) for n in aux},
    )


def append_view(state: SlotState, codec, k: Float[Array, "B K T D"], v: Float[Array, "B K T D"],
                pos: Int[Array, "B T"]) -> SlotState:
    """The old slots followed by the T new tokens (aux of the new slots starts at zero)."""
    view = concat(state, encode_new(codec, k, v, pos))  # [B, K, S + T, ...]
    t = k.shape[2]
    aux = {n: jnp.concatenate([a, jnp.zeros(a.shape[:2] + (t,), a.dtype)], axis=2)  # [B, K, V]
           for n, a in state.aux.items()}
    return dataclasses.replace(view, aux=aux)


def require_scores(name: str, scores):
    if scores is None:
        raise ValueError(f"{name}.compact needs the attention scores (policy.needs_scores is True)")
    return scores


def newest(view: SlotState, n: int) -> Bool[Array, "B Kp V"]:
    """The n newest tokens of the view (the last new token has the largest position)."""
    last = view.pos[:, :, -1:]  # [B, Kp, 1]
    return (view.pos >= 0) & (view.pos > last - n)


def top_mask(prio: Float[Array, "*b V"], tie: Array, n: int) -> Bool[Array, "*b V"]:
    """True for the n slots with the largest `prio`, ties broken by the larger `tie`."""
    order = jnp.lexsort((-tie, -prio), axis=-1)  # best first
    rank = jnp.argsort(order, axis=-1)  # rank of each slot
    return rank < n


def pack(view: SlotState, kept: Bool[Array, "B Kp V"], slots: int) -> SlotState:
    """The kept slots of a view (at most `slots` of them) in text order, then empty slots."""
    key = jnp.where(kept, view.pos, LAST_KEY)  # [B, Kp, V]
    idx = jnp.argsort(key, axis=-1)[..., :slots]  # [B, Kp, S]
    live = take_slots(kept, idx)  # [B, Kp, S]
    pos = jnp.where(live, take_slots(view.pos, idx), EMPTY)  # [B, Kp, S]
    aux = {n: jnp.where(live, take_slots(a, idx), 0.0) for n, a in view.aux.items()}  # [B, K, S]
    return SlotState(
        k=jax.tree.map(lambda x: take_slots(x, idx), view.k),
        v=jax.tree.map(lambda x: take_slots(x, idx), view.v),
        pos=pos,
        aux=aux,
    )
