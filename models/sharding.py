"""Sharding an `Engine` on a `jax.sharding.Mesh`: batch over a `data` axis, KV heads over a
`model` axis (each device holds whole GQA groups), weights by their logical axes.

Shapes: L layers, B batch, K kv heads, N = K*G query heads (G per kv head), D head dim, d model
width, F MLP width, V vocab, S cache slots, Kp = 1 or K (slot positions shared or per head).

Sharding is a layout, never a semantics: under `jax.jit` a sharded step computes the same
function as on one device (XLA inserts the collectives), so every policy runs unchanged and
only reduction orders differ (results equal to ~1e-6; tests/models/test_sharding.py holds them to 1e-5).

Weights (the canonical layout of models/config.py) carry logical axes, mapped to mesh axes by
`axis_rules`:

    heads, kv_heads -> model   wq/bq [.., N*D], wk/wv/bk/bv [.., K*D] columns, wo [L, N*D, d] rows
    mlp             -> model   w_gate/w_up [L, d, F] columns, w_down [L, F, d] rows
    vocab           -> model   embed [V, d] rows, lm_head [d, V] columns
    everything else replicated (norms, q_norm/k_norm [L, D], the layer axis, d)

A logical axis is split only when its size divides by the `model` axis (else replicated); the two
head axes split together, when K divides: a contiguous split of N*D = (K G D) columns gives device
j the query heads of kv heads [j K/m, (j+1) K/m), exactly its columns of wk and wv (attention
groups queries as "B T (K G) D -> B K G T D"), so attention needs no communication; only wo's
contraction over N*D and w_down's over F end in a sum over `model`. When K does not divide (e.g.
SmolLM2's 3 kv heads on model=2), attention weights and caches are replicated and a warning says
so; the MLP and vocabulary still split.

Caches: a state leaf is [L_run, B, K|Kp, S, ...] (kvpolicies.base.SlotState and the policies'
own fields): axis 1 on `data` when it is the batch B and B divides by the data axis, axis 2 on
`model` when it is the K kv heads and they split; anything else is replicated along that axis
(Kp = 1 positions, duo's retrieval/streaming head subsets). A state that is not a SlotState
(paged's block pool: k, v [L, NB, K, blk, ..], whose blocks any row may own) splits only the K
axis of its k and v, and the batch axis of a field that has one (its block table [L, B, M]).
Token inputs [B, ...] are split on `data` when B divides, else replicated (a batch of 1 runs on
every data row: the data axis buys nothing).

Multi-host: `jax.distributed.initialize()` in every process, then the same code with a mesh over
all processes' devices (`make_mesh` uses `jax.devices()`, which lists them all). Host arrays
(weights, tokens) are the same in every process and are placed with `jax.make_array_from_callback`
(each process fills its own shards); what a step returns besides the cache (logits, NLL, ids) is
replicated before the host reads it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvpolicies.base import SlotState
from models.config import LlamaConfig
from models.llama import layer_keys

DATA, MODEL = "data", "model"

# weight name -> logical axis per dimension (None: never split); the canonical layout
LOGICAL: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", None),  # [V, d]
    "lm_head": (None, "vocab"),  # [d, V]
    "final_norm": (None,),  # [d]
    "attn_norm": ("layers", None), "mlp_norm": ("layers", None),  # [L, d]
    "post_attn_norm": ("layers", None), "post_mlp_norm": ("layers", None),  # [L, d]
    "wq": ("layers", None, "heads"),  # [L, d, N*D]
    "wk": ("layers", None, "kv_heads"), "wv": ("layers", None, "kv_heads"),  # [L, d, K*D]
    "wo": ("layers", "heads", None),  # [L, N*D, d]
    "bq": ("layers", "heads"), "bk": ("layers", "kv_heads"), "bv": ("layers", "kv_heads"),  # [L, N*D], [L, K*D]
    "q_norm": ("layers", None), "k_norm": ("layers", None),  # [L, D]
    "w_gate": ("layers", None, "mlp"), "w_up": ("layers", None, "mlp"),  # [L, d, F]
    "w_down": ("layers", "mlp", None),  # [L, F, d]
}


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: every device of every process), with Auto
    axes (XLA propagates shardings). ValueError, before any compute, when data x model is not
    the number of devices."""
    for name, v in ((DATA, data), (MODEL, model)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"mesh {name}={v!r}: must be an int >= 1")
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but there are {len(devices)}: "
                         f"{devices} (data x model must use them all; on a CPU, "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=n before jax is imported gives n)")
    return jax.make_mesh((int(data), int(model)), (DATA, MODEL), (AxisType.Auto, AxisType.Auto), devices=devices)


def as_mesh(mesh: Mesh | AbstractMesh | tuple[int, int] | list[int]) -> Mesh | AbstractMesh:
    """A mesh from a `Mesh` (its axes must be named data and model; made Auto) or [data, model]; an
    AbstractMesh (axis sizes, no devices) passes, for the rules alone."""
    if isinstance(mesh, (Mesh, AbstractMesh)) and set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(f"mesh axes {mesh.axis_names}: must be named ({DATA!r}, {MODEL!r})")
    if isinstance(mesh, AbstractMesh):
        return mesh
    if isinstance(mesh, Mesh):
        if any(t != AxisType.Auto for t in mesh.axis_types):
            mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        return mesh
    if isinstance(mesh, (list, tuple)) and len(mesh) == 2:
        return make_mesh(*mesh)
    raise ValueError(f"mesh={mesh!r}: must be a jax.sharding.Mesh with axes ({DATA!r}, {MODEL!r}) or [data, model]")


def _splits(size: int, mesh: Mesh, axis: str) -> bool:
    n = mesh.shape[axis]
    return n > 1 and size % n == 0


def axis_rules(cfg: LlamaConfig, mesh: Mesh) -> dict[str, str | None]:
    """Logical axis -> mesh axis (None: replicated) for this model on this mesh."""
    heads = MODEL if _splits(cfg.n_kv_heads, mesh, MODEL) else None  # query heads follow their kv heads
    return {"layers": None, "heads": heads, "kv_heads": heads,
            "mlp": MODEL if _splits(cfg.d_ff, mesh, MODEL) else None,
            "vocab": MODEL if _splits(cfg.vocab_size, mesh, MODEL) else None}


def param_specs(cfg: LlamaConfig, mesh: Mesh) -> dict[str, P]:
    """The PartitionSpec of every weight of this config (the canonical names)."""
    rules = axis_rules(cfg, mesh)
    names = ("embed", "final_norm") + (() if cfg.tie_embeddings else ("lm_head",)) + layer_keys(cfg)
    return {n: P(*(None if a is None else rules[a] for a in LOGICAL[n])) for n in names}


def cache_spec(shape: tuple[int, ...], cfg: LlamaConfig, mesh: Mesh, batch: int, heads: bool = True) -> P:
    """The PartitionSpec of a cache leaf [L, B, K|Kp|.., ...] of a batch of `batch` rows (`heads`:
    whether its axis 2 may be kv heads: any SlotState field; only k and v in another state)."""
    b = DATA if len(shape) > 1 and shape[1] == batch and _splits(batch, mesh, DATA) else None
    h = MODEL if (heads and len(shape) > 2 and shape[2] == cfg.n_kv_heads
                  and _splits(cfg.n_kv_heads, mesh, MODEL)) else None
    axes = [None, b, h]
    while axes and axes[-1] is None:  # P(None, "data"), not P(None, "data", None)
        axes.pop()
    return P(*axes)


def batch_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of a step input [B, ...] (token ids, positions, targets)."""
    return P(DATA) if len(shape) >= 1 and _splits(shape[0], mesh, DATA) else P()


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` with `sharding`: unchanged if it already has it; a device copy on one host; from the
    host copy (identical in every process) when the mesh spans processes."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class Placement:
    """Where an engine's arrays live on a mesh: `params`, `cache` and `batch` place them by the
    rules above, `step` wraps a jitted step so that its inputs are placed (a no-op when they
    already are) and what it returns besides the cache is readable on every host."""

    def __init__(self, cfg: LlamaConfig, mesh: Mesh | tuple[int, int] | list[int]):
        self.cfg, self.mesh = cfg, as_mesh(mesh)
        self.specs = param_specs(cfg, self.mesh)
        self.split_heads = axis_rules(cfg, self.mesh)["kv_heads"] is not None
        m = self.mesh.shape[MODEL]
        if m > 1 and not self.split_heads:
            warnings.warn(f"mesh model={m}: {cfg.n_kv_heads} kv heads do not divide by it, so attention weights and "
                          "KV caches are replicated on the model axis (only the MLP and vocabulary are split)",
                          stacklevel=3)
        self._creators: dict[Any, Callable] = {}

    def __repr__(self) -> str:
        return f"Placement(data={self.mesh.shape[DATA]}, model={self.mesh.shape[MODEL]}, split_heads={self.split_heads})"

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def params(self, params: Any) -> Any:
        """Weights (an nnx.State, or any pytree whose paths name canonical weights) placed by
        `param_specs`; other leaves (the RoPE tables) replicated."""

        def one(path, x):
            names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
            name = next((n for n in reversed(names) if n in self.specs), None)
            return put(x, self._named(self.specs[name] if name is not None else P()))

        return jax.tree_util.tree_map_with_path(one, params)

    def cache_shardings(self, cache: Any, batch: int) -> Any:
        """NamedShardings of a (concrete or abstract) cache of `batch` rows: a tuple of states, each
        a SlotState (every field [L, B, K|Kp, S, ..]) or another layout whose k and v only are
        [L, .., K, ..] (paged's pool)."""

        def state(st):
            def one(path, x):
                field = getattr(path[0], "name", None) if path else None
                heads = isinstance(st, SlotState) or field in ("k", "v")
                return self._named(cache_spec(x.shape, self.cfg, self.mesh, batch, heads))

            return jax.tree_util.tree_map_with_path(one, st)

        return tuple(map(state, cache)) if isinstance(cache, tuple) else state(cache)

    def cache(self, cache: Any, batch: int) -> Any:
        return jax.tree.map(put, cache, self.cache_shardings(cache, batch))

    def batch(self, x: Any) -> Any:
        if not isinstance(x, (jax.Array, np.ndarray)):
            return x  # a static argument (e.g. a step count)
        return put(x, self._named(batch_spec(x.shape, self.mesh)))

    def create(self, make: Callable[[], Any], batch: int, key: Any = None) -> Any:
        """`make()`, an empty cache of `batch` rows, created in its shardings (jitted once per key)."""
        key = (batch, key)
        if key not in self._creators:
            self._creators[key] = jax.jit(make, out_shardings=self.cache_shardings(jax.eval_shape(make), batch))
        return self._creators[key]()

    def readable(self, x: Any) -> Any:
        """`x` replicated when some of it lives on another process (so np.asarray works everywhere)."""
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, self._named(P()))
        return x

    def step(self, fn: Callable, returns_cache_only: bool = False) -> Callable:
        """`fn(params, cache, *inputs)` with its inputs (token ids, positions [B, ..]; static ints
        pass) placed and the cache placed for their batch B (no copy when it already is: a cache
        from a placed step); outputs `(x, cache)` (or the cache alone) with x readable on every host."""

        @functools.wraps(fn)
        def placed(params, cache, *inputs, **kwargs):
            batch = next(a.shape[0] for a in inputs if isinstance(a, (jax.Array, np.ndarray)))
            args = [params, self.cache(cache, batch), *map(self.batch, inputs)]
            out = fn(*args, **kwargs)
            if returns_cache_only:
                return out
            x, cache = out
            return self.readable(x), cache

        return placed

