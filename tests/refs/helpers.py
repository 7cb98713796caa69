"""Shared test utilities: run attention through a policy chunk by chunk."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvpolicies import Rope, attend


@functools.partial(jax.jit, static_argnums=(0, 6))
def _step(policy, state, q, k, v, pos, rope):
    return attend(policy, state, q, k, v, pos, rope)


def run_policy(policy, q, k, v, chunks, rope: Rope, max_len=64, dtype=jnp.float32, state=None, start=0,
               step=None):
    """Feed q/k/v [B, T, ., D] (at positions start, start + 1, ...) through `policy` in chunks of
    the given sizes (cycled), from `state` (default: empty); returns the outputs [B, T, N, D]
    and the final state. `step`: the jitted attention step (default: one shared by every test of
    the process, so a `record_visible` test that must trace its own steps passes a fresh one)."""
    step = _step if step is None else step
    b, t, n, d = q.shape
    state = policy.init(b, k.shape[2], d, dtype, max(max_len, start + t)) if state is None else state
    outs, i, r = [], 0, 0  # r: row of q/k/v
    while r < t:
        c = min(chunks[i % len(chunks)], t - r)
        pos = jnp.broadcast_to(jnp.arange(start + r, start + r + c, dtype=jnp.int32), (b, c))
        o, state = step(policy, state, q[:, r:r + c], k[:, r:r + c], v[:, r:r + c], pos, rope)
        outs.append(np.asarray(o))
        r += c
        i += 1
    return np.concatenate(outs, axis=1), state
