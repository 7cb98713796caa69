"""A host tier for cold keys/values: a state's k/v kept in host memory, and each decode step
fetching to the device only the slots its query reads (Quest's selected pages).

Shapes: B batch, K kv heads, S slots, n gathered blocks of `size` slots, M = n x size gathered
slots, D head dim.

Where an array lives is data, not a policy field: `to_host(cache)` moves the keys and values of
every state in a cache (an `Engine` cache: one stacked state per run of layers) into the backend's
host memory (JAX memory kind `pinned_host`; the type of the array says `<host>`), and everything
else of the state (positions, Quest's page bounds) stays on the device. A policy that supports the
tier keeps it: Quest writes a step's new tokens into the host arrays (`to_space`), and
`kvpolicies.attend` reads a host view in one of two ways:
  * a gathered decode step (`attend.Gather`: Quest's decode query) moves to the device only the
    gathered slots' keys and values (`fetch`): top_k pages x page slots per kv head and layer;
  * a dense step (a prompt chunk, Quest's dense prefill) moves the whole view (`device`).
Only Quest writes into a host tier so far (the other policies' writes would mix memory spaces,
which JAX refuses with an error naming them).
The bytes moved are counted at trace time from the shapes moved, and reported per executed step
by a host callback inside `record_moves()` (compiled only into steps traced while a recorder is
open, like `attend.record_visible`). `gathered_bytes` is their closed form.

On the CPU this is a simulation: the CPU backend has a `pinned_host` memory distinct in type from
its `device` memory, so the same program (the same memory-space checks, the same transfers in the
compiled step) runs, but both are the same RAM and a "transfer" is a memcpy. On a GPU the host
arrays are in pinned host memory and each fetch crosses PCIe; `benchmarks/gpu.py` measures it
there when a GPU is lent. A backend without a host memory kind raises in `to_host` (nothing to
simulate with: a numpy array passed to a jitted step would be copied whole to the device at every
call, which is not a tier).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from kvpolicies.base import SlotState
from kvpolicies.memory import tree_nbytes

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def host_kind(device: jax.Device | None = None) -> str | None:
    """The memory kind the host tier uses on `device` (default: the first device): `pinned_host`
    where the backend has it, else `unpinned_host`, else None (no host memory kind)."""
    device = jax.devices()[0] if device is None else device
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def on_host(x) -> bool:
    """Whether array (or tracer) `x` lives in host memory (its type's memory space)."""
    return getattr(jax.typeof(x), "memory_space", None) == HOST


def _move_kv(cache, sharding_of):
    def move(st):
        if not isinstance(st, SlotState):
            return st
        put = lambda x: jax.device_put(x, sharding_of(x))  # noqa: E731
        # the rest committed to the device as well, as a jitted step returns it (else the next step recompiles)
        rest = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), st)
        return dataclasses.replace(rest, k=jax.tree.map(put, st.k), v=jax.tree.map(put, st.v))

    return jax.tree.map(move, cache, is_leaf=lambda x: isinstance(x, SlotState))


def to_host(cache):
    """`cache` (a state, or any pytree of states) with every state's keys and values in host
    memory (positions and policy bookkeeping stay on the device)."""
    kind = host_kind()
    if kind is None:
        raise ValueError(f"to_host: backend {jax.default_backend()!r} has no host memory kind "
                         f"(its memories: {[m.kind for m in jax.devices()[0].addressable_memories()]})")
    return _move_kv(cache, lambda x: x.sharding.with_memory_kind(kind))


def to_device(cache):
    """`cache` with every state's keys and values back in device memory."""
    return _move_kv(cache, lambda x: x.sharding.with_memory_kind("device"))


def host_bytes(cache) -> int:
    """Bytes of `cache`'s arrays that live in host memory (concrete arrays)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(cache) if x.sharding.memory_kind != "device"))


def to_space(x, like):
    """Pytree `x` in the memory space of array `like` (host or device): where a policy writes a
    step's new tokens into its stored slots."""
    space = HOST if on_host(like) else DEVICE
    return jax.tree.map(lambda a: a if on_host(a) == (space == HOST) else jax.device_put(a, space), x)


# -- moves into the device, counted ---------------------------------------------------------------
_RECORDERS: list[dict[str, int]] = []


def _report(nbytes) -> None:
    for rec in _RECORDERS:
        rec["bytes"] += int(nbytes)
        rec["moves"] += 1


def _count(nbytes: int) -> None:
    if _RECORDERS and nbytes:
        jax.debug.callback(_report, np.int64(nbytes))


@contextlib.contextmanager
def record_moves():
    """Record the bytes moved from host to device memory by the attention steps run inside the
    context, as {"bytes": total, "moves": number of (layer, step) moves}; measured from the arrays
    the compiled steps move (only steps traced while a recorder is open report)."""
    rec = {"bytes": 0, "moves": 0}
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


def device(x):
    """Pytree `x` in device memory: the leaves in host memory are moved whole (a dense step)."""
    moved = [a for a in jax.tree.leaves(x) if on_host(a)]
    _count(tree_nbytes(moved))
    return jax.tree.map(lambda a: jax.device_put(a, DEVICE) if on_host(a) else a, x)


def take_blocks(a, start: Int[Array, "B K n"], size: int):
    """a [B, H, S, ...] -> [B, K, n x size, ...]: per (row, head) the blocks of `size` consecutive
    slots at `start` (in [0, S - size]; H may be 1 or K), as one XLA gather of whole blocks (each a
    contiguous size x ... copy). In host memory it runs there, its operands all on the host (JAX
    checks that an operation's inputs share a memory space), and only the result moves."""
    b, n = a.shape[0], start.shape[2]
    h = max(a.shape[1], start.shape[1])
    a = jnp.broadcast_to(a, (b, h) + a.shape[2:]) if a.shape[1] != h else a
    start = jnp.broadcast_to(start, (b, h, n))
    grid = jnp.stack([jnp.broadcast_to(jnp.arange(b)[:, None, None], start.shape),
                      jnp.broadcast_to(jnp.arange(h)[None, :, None], start.shape), start], axis=-1)  # [B, K, n, 3]
    host = on_host(a)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(3, a.ndim + 1)), collapsed_slice_dims=(0, 1),
                                        start_index_map=(0, 1, 2))
    out = jax.lax.gather(a, jax.device_put(grid, HOST) if host else grid, dn, slice_sizes=(1, 1, size) + a.shape[3:],
                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)  # [B, K, n, size, ...]
    out = out.reshape((b, h, n * size) + a.shape[3:])  # [B, K, M, ...]
    return jax.device_put(out, DEVICE) if host else out


def fetch(x, start: Int[Array, "B K n"], size: int):
    """`take_blocks` of every leaf of a pytree of [B, K, S, ...] arrays, on the device: a leaf in
    host memory is gathered there and only its n x size gathered slots cross (bytes counted)."""
    out = jax.tree.map(lambda a: take_blocks(a, start, size), x)
    _count(sum(tree_nbytes(o) for a, o in zip(jax.tree.leaves(x), jax.tree.leaves(out)) if on_host(a)))
    return out


def gathered_bytes(policy, *, kv_heads: int, head_dim: int, max_len: int, batch: int = 1, n_layers: int = 1,
                   dtype=jnp.bfloat16) -> int:
    """Closed form of the keys/values one decode step moves to the device from a host tier: the
    policy's gathered slots (Quest: `gather_slots`, top_k x page for window <= 1) x K x D x 2
    (keys and values) x bytes per element, per layer and batch row."""
    slots = policy.gather_slots(max_len)
    return n_layers * batch * kv_heads * slots * head_dim * 2 * jnp.dtype(dtype).itemsize
