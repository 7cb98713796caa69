"""What a state can hold, checked: the positions and shapes `attend` is called with, a fixed
capacity, a paged pool's exhaustion (docs/guide/checks.md).

Policies fall in three kinds:

- bounded (`Bounded`: full, quest, kivi, duo's retrieval heads, paged's `full` layout, a
  prompt phase): slot i holds token i, so a state of S slots holds positions [0, S) only; a
  position past them would overwrite a slot that another token holds.
- rings (`Ring`: window, sink, paged with a window): a new token overwrites the slot of one
  that no later query sees. That is their design: a ring takes any position, past its
  capacity included.
- evictors (every other policy: h2o, snapkv, kvzip...): they keep a fixed number of slots by
  evicting, so every position fits.

`check_step` runs on the host when `attend` runs eagerly (concrete arrays): one ValueError per
kind of mistake (shapes; a negative, repeated or out-of-order position; a position past a
bounded state's slots; an exhausted pool after the step). Inside a caller's `jax.jit` the
positions are not known on the host: `poison` then makes the outputs of every query at a bad
position NaN (negative, not increasing within the chunk, past a bounded state's slots), and a
paged pool poisons every later view once exhausted. `check_cache` raises for an exhausted pool
in a concrete cache (the engine calls it after each of its steps on a cache that can exhaust).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


class Bounded:
    """Capability: slot i holds token i, so a state holds positions below `limit(state)` only.
    The default reads the slot count of `state.pos` ([B, Kp, S]); a state whose layout differs
    (paged's block table) overrides it. None: no limit (a policy that is a ring in this setting)."""

    def limit(self, state: Any) -> int | None:
        return int(state.pos.shape[-1])


class Ring:
    """Marker: a ring buffer (window, sink). A new token overwrites the slot of a token no later
    query sees, so any position fits; positions past the capacity are the design, not an error."""

    ring_buffer = True


def is_ring(policy: Any) -> bool:
    """Whether the policy stores its slots in a ring (no capacity error past its slots)."""
    return bool(getattr(policy, "ring_buffer", False))


def limit(policy: Any, state: Any) -> int | None:
    """The first position the state cannot hold (None: every position fits)."""
    return policy.limit(state) if isinstance(policy, Bounded) else None


def _name(policy: Any) -> str:
    return type(policy).__name__.lower()


def concrete(*xs: Any) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def check_shapes(q: Array, k: Array, v: Array, pos: Array) -> None:
    """One ValueError for each way q [B, T, N, D], k, v [B, T, K, D] and pos [B, T] disagree."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("pos", pos, 2)):
        if np.ndim(x) != rank:
            want = "[B, T]" if rank == 2 else "[B, T, heads, head_dim]"
            raise ValueError(f"attend: {name} must have shape {want}, got shape {tuple(np.shape(x))}")
    if k.shape != v.shape:
        raise ValueError(f"attend: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or pos.shape[0] != q.shape[0]:
        raise ValueError(f"attend: batch differs: q {q.shape[0]}, k/v {k.shape[0]}, pos {pos.shape[0]}")
    if q.shape[1] != k.shape[1] or pos.shape[1] != q.shape[1]:
        raise ValueError(f"attend: T (new tokens) differs: q {q.shape[1]}, k/v {k.shape[1]}, pos {pos.shape[1]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attend: head_dim differs: q {q.shape[3]}, k/v {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"attend: q's {q.shape[2]} heads are not a multiple of k/v's {k.shape[2]} kv heads")
    if not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"attend: pos must hold integer positions, got dtype {pos.dtype}")


def state_batch(state: Any) -> int:
    """Rows of a state: its block table's (paged) or its positions' leading axis."""
    table = getattr(state, "table", None)
    return int((table if table is not None else state.pos).shape[0])


def check_state(policy: Any, state: Any, k: Array) -> None:
    """ValueError if the state was made for another batch, kv-head count or head_dim than k's
    [B, T, K, D]: compared leaf by leaf with the (abstract) state `policy.init` makes for them."""
    b, _, kh, d = k.shape
    if state_batch(state) != b:
        raise ValueError(f"attend: the state holds batch {state_batch(state)}, the step batch {b}")
    dtype = jax.tree.leaves(state.k)[0].dtype if jax.tree.leaves(state.k) else k.dtype
    dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32  # a codec's codes: shapes only
    want = jax.eval_shape(lambda: policy.init(b, kh, d, dtype, 256))
    got, ref = jax.tree.leaves(state.k), jax.tree.leaves(want.k)
    if len(got) != len(ref):
        raise ValueError(f"attend: the state's keys are not a {_name(policy)} state ({len(got)} leaves, "
                         f"{len(ref)} expected)")
    for g, r in zip(got, ref):
        if g.ndim != r.ndim:
            raise ValueError(f"attend: the state's keys {tuple(g.shape)} are not a {_name(policy)} state's "
                             f"{tuple(r.shape)}")
        if g.shape[1] != r.shape[1]:
            raise ValueError(f"attend: kv heads differ: the step's k/v have {kh}, the state was made for another "
                             f"count (state keys {tuple(g.shape)}, {r.shape[1]} heads on axis 1 expected)")
        if g.shape[-1] != r.shape[-1]:
            raise ValueError(f"attend: the state was made for another head_dim than the step's {d} "
                             f"(state keys {tuple(g.shape)}, expected [..., {r.shape[-1]}])")


def check_positions(policy: Any, state: Any, pos: Array) -> None:
    """ValueError for a negative, repeated or decreasing position, one not after every position
    the state holds (rows of a state with per-row positions), or one past a bounded state's slots."""
    p = np.asarray(pos)
    if (p < 0).any():
        raise ValueError(f"attend: negative position {int(p.min())} (positions are token indices >= 0)")
    if p.shape[1] > 1 and (np.diff(p, axis=1) <= 0).any():
        b, t = np.argwhere(np.diff(p, axis=1) <= 0)[0]
        raise ValueError(f"attend: positions must increase within a step: row {b} has {p[b, t]} then {p[b, t + 1]}")
    cap = limit(policy, state)
    if cap is not None:
        if p.shape[1] > 1 and (np.diff(p, axis=1) != 1).any():
            b = int(np.argwhere((np.diff(p, axis=1) != 1).any(axis=1))[0, 0])
            raise ValueError(f"attend: {_name(policy)} (slot i holds token i) needs consecutive positions in a "
                             f"step; row {b} has {p[b].tolist()}")
        if p.max() >= cap:
            raise ValueError(f"attend: position {int(p.max())} is past the capacity of this {_name(policy)} state "
                             f"({cap} slots: positions 0..{cap - 1}); make the state with a larger max_len")
    held = np.asarray(state.pos)
    if held.ndim >= 2 and held.shape[0] == p.shape[0] and getattr(state, "table", None) is None:
        last = held.reshape(held.shape[0], -1).max(axis=1, initial=-1)  # [B] newest stored position
        bad = p[:, 0] <= last
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"attend: out of order: row {b} feeds position {int(p[b, 0])} but the state already "
                             f"holds position {int(last[b])} (feed each position once, in order)")


def check_args(policy: Any, state: Any, q: Any, k: Any, v: Any, pos: Any, rope: Any) -> None:
    """What `attend` is given, before any shape: a Policy, a state, arrays, a RoPE of the step's
    head_dim; at least one row, one token and one channel. One ValueError naming the argument."""
    from kvpolicies.base import Policy

    if not isinstance(policy, Policy):
        hint = f" (build it: kvpolicies.get({policy!r}))" if isinstance(policy, str) else ""
        raise ValueError(f"attend: policy must be a kvpolicies.Policy, got {type(policy).__name__} {policy!r}{hint}")
    if state is None or isinstance(state, (str, bytes, int, float, dict)) or not jax.tree.leaves(state):
        raise ValueError(f"attend: state must be the policy's state (policy.init(batch, kv_heads, head_dim, dtype, "
                         f"max_len)), got {type(state).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("pos", pos)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"attend: {name} must be an array, got {type(x).__name__} (wrap it: jnp.asarray({name}))")
    if not (hasattr(rope, "apply") and hasattr(rope, "inv_freq")):
        raise ValueError(f"attend: rope must be a kvpolicies.Rope (or its table), got {type(rope).__name__}")
    if np.ndim(q) == 4:
        b, t, _, d = q.shape
        for name, n in (("batch B", b), ("new tokens T", t), ("head_dim D", d)):
            if n == 0:
                raise ValueError(f"attend: q has shape {tuple(q.shape)}: {name} must be >= 1")


def check_step(policy: Any, state: Any, q: Array, k: Array, v: Array, pos: Array, rope: Any) -> None:
    """The host checks of one `attend` call: its arguments (`check_args`) and shapes always (they
    are static), then the state's layout and the positions when the arrays are concrete (eager)."""
    check_args(policy, state, q, k, v, pos, rope)
    check_shapes(q, k, v, pos)
    if concrete(state, pos):
        check_state(policy, state, k)
        check_positions(policy, state, pos)
    d, rd = q.shape[3], getattr(getattr(rope, "rope", rope), "head_dim", q.shape[3])
    if rd != d:
        raise ValueError(f"attend: rope is for head_dim {rd}, q and k have head_dim {d} (Rope({d}, theta))")


def bad_positions(policy: Any, state: Any, pos: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """Traced: the queries whose position the state cannot take (negative, not increasing within
    the chunk, past a bounded state's slots)."""
    bad = pos < 0
    if pos.shape[1] > 1:
        bad = bad | jnp.pad(jnp.diff(pos, axis=1) <= 0, ((0, 0), (1, 0)))
    cap = limit(policy, state)
    if cap is not None:
        bad = bad | (pos >= cap)
    return bad


def poison(out: Float[Array, "B T N D"], policy: Any, state: Any, pos: Int[Array, "B T"]) -> Float[Array, "B T N D"]:
    """The outputs with NaN at every query whose position the state cannot take (others unchanged,
    bit for bit)."""
    bad = bad_positions(policy, state, pos)
    return jnp.where(bad[:, :, None, None], jnp.asarray(jnp.nan, out.dtype), out)


def exhausted(state: Any) -> bool:
    """Whether a concrete state records an exhausted pool (paged's `overflow` flag)."""
    flag = getattr(state, "overflow", None)
    return flag is not None and bool(np.asarray(flag).any())


def can_exhaust(cache: Any) -> bool:
    """Whether any state of a cache (one state, or a tuple of them) records pool exhaustion."""
    states = cache if isinstance(cache, (tuple, list)) else (cache,)
    return any(getattr(st, "overflow", None) is not None for st in states)


def check_cache(cache: Any, where: str = "") -> None:
    """ValueError if a state of the cache (one state, or a tuple of them) exhausted its pool."""
    states = cache if isinstance(cache, (tuple, list)) else (cache,)
    for i, st in enumerate(states):
        if exhausted(st):
            nb = st.refs.shape[-1] if hasattr(st, "refs") else "?"
            raise ValueError(f"{where}paged pool exhausted (run {i}: {nb} blocks per layer): the step's writes did "
                             "not fit and were dropped; give Paged a larger `blocks` (or blocks=None: enough for "
                             "every row), fewer rows or a shorter sequence")
