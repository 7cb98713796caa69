"""`qfilter`: Q-Filters (Godey et al. 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv:2503.02812; NathanGodey/qfilters; NVIDIA/kvpress `QFilterPress`) — keep per kv
head the tokens whose keys project furthest against the head's filter, a fixed direction of its
queries found by an SVD on calibration text.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim, L layers.

The filters are data, one [K, D] direction per layer: the authors publish them on the Hugging Face
hub for a few checkpoints (kvpress's `QFilterPress` downloads `nthngdy/<model>_qfilt`), which is not
reachable offline; `python -m evals.qfilter model=<name>` produces ours for any of our models by the
authors' recipe (`make_filters.py`, see `evals.qfilter`) and saves them as
`$KVP_DATA/qfilters/<model>.npz` ([L, K, D] float32 under "q_filters"). kvpress's score of a key k
after RoPE is -<f, k>; a press keeps the `budget` (or kvpress's n_kept) best per kv head.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.codecs import Codec, Identity
from kvpolicies.keydiff import rotated
from kvpolicies.presets import Preset
from kvpolicies.prompt_scored import PromptScored, rank_by


def load_filters(filters: str | tuple) -> np.ndarray:
    """[L, K, D] float32 filters from an .npz file (key "q_filters", `evals.qfilter`'s), an .npy file or
    nested tuples / lists."""
    if isinstance(filters, (tuple, list, np.ndarray)):
        arr = np.asarray(filters, np.float32)
    else:
        path = pathlib.Path(filters)
        if not path.is_file():
            raise ValueError(f"qfilter.filters={filters!r}: no such file; produce the filters with "
                             "`python -m evals.qfilter model=<name>` (they go to $KVP_DATA/qfilters/<model>.npz)")
        if path.suffix == ".npz":
            with np.load(path) as z:
                if "q_filters" not in z.files:
                    raise ValueError(f"qfilter.filters={filters!r}: the .npz file has no 'q_filters' array ({z.files})")
                arr = np.asarray(z["q_filters"], np.float32)
        else:
            arr = np.load(path).astype(np.float32)
    if arr.ndim != 3 or arr.size == 0 or not np.isfinite(arr).all():
        raise ValueError(f"qfilter.filters: expected finite [layers, kv_heads, head_dim] filters, got shape "
                         f"{arr.shape}")
    return arr


def random_filter(kv_heads: int, head_dim: int, seed: int = 0) -> np.ndarray:
    """Seeded random filters [K, D] float32 (numpy's default_rng(seed) standard normal draw): filters="random",
    a scorer that knows nothing (tests, any model's dims)."""
    return np.random.default_rng(seed).standard_normal((kv_heads, head_dim)).astype(np.float32)


def filter_scores(k_rot: Float[Array, "B K V D"], filt: Float[Array, "K D"]) -> Float[Array, "B K V"]:
    """kvpress's `QFilterPress.score`: minus each key's (after RoPE) projection on its head's filter."""
    return -jnp.einsum("BKVD,KD->BKV", k_rot.astype(jnp.float32), filt)


@dataclasses.dataclass(frozen=True)
class QFilter(Preset, PromptScored):
    """After the prompt, keep per kv head the `budget` tokens whose keys after RoPE have the lowest
    projection on the layer's filter (kvpress's score -<f, k>, one top-k over the prompt).

    A model-level preset: `filters` (a file or [L][K][D] nested tuples) gives every layer its
    direction, `stack(n_layers)` the per-layer policies, each with its own `filter` ([K][D]; given
    alone, the same filter serves every layer). Protocol and stream extension: `PromptScored` (the
    prompt held densely, ranked once; a stream recompresses on overflow with the same score of the
    view's keys after RoPE). `budget` counts every kept token (no sink or window is protected, as in
    kvpress; the authors' generation cache also keeps a window of the newest tokens). Ties keep the
    newer token (kvpress: torch.topk's order).

    Cost: the prompt phase gets RoPE's frequencies from the query statistics it collects
    (`query_sink=4`, as keydiff; discarded after the prompt). The filter is a constant of the layer's
    compiled step (a policy per layer: each layer compiles its own steps).
    """

    label = "qfilter"
    observes = ("k_rot",)
    collects = {"query_sink": 4}  # for RoPE's frequencies (as keydiff)

    budget: int = 1024
    max_new: int = 256
    filters: str | tuple = ""  # every layer's filters: an .npz/.npy file, [L][K][D] nested tuples, or "random"
    filter: tuple | None = None  # this layer's [K][D] (set by `stack`)
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.filters, (list, np.ndarray)):
            object.__setattr__(self, "filters", _nested(self.filters, 3))
        if not isinstance(self.filters, (str, tuple)):
            raise ValueError(f"qfilter.filters={self.filters!r}: must be a file path or [L][K][D] nested tuples")
        if self.filter is not None:
            arr = np.asarray(self.filter, np.float32)
            if arr.ndim != 2 or arr.size == 0 or not np.isfinite(arr).all():
                raise ValueError(f"qfilter.filter: expected finite [kv_heads, head_dim] values, got shape {arr.shape}")
            object.__setattr__(self, "filter", _nested(arr, 2))

    def stack(self, n_layers):
        if self.filters in ("", "random", ()):
            return (self,) * n_layers
        arr = load_filters(self.filters)
        if arr.shape[0] != n_layers:
            raise ValueError(f"qfilter.filters has {arr.shape[0]} layers, the model has {n_layers}")
        return tuple(dataclasses.replace(self, filters="", filter=_nested(f, 2)) for f in arr)

    def layer_filter(self, kv_heads: int, head_dim: int) -> Float[Array, "K D"]:
        """This layer's [K, D] filter (filters="random": `random_filter`, the same in every layer)."""
        if self.filter is None and self.filters == "random":
            return jnp.asarray(random_filter(kv_heads, head_dim))
        if self.filter is None:
            raise ValueError("qfilter needs its filters: filters=<file from `python -m evals.qfilter model=<name>`> "
                             "(a model's engine stacks them per layer) or filter=[K][D] for one layer")
        f = jnp.asarray(np.asarray(self.filter, np.float32))
        if f.shape != (kv_heads, head_dim):
            raise ValueError(f"qfilter.filter has shape {f.shape}, the layer has {kv_heads} kv heads of dim {head_dim}")
        return f

    def rank(self, slots, keys, stats, seen):
        return self.score(seen.k_rot, slots.pos)

    def prompt_rank(self, state, slots, keys, stats):
        return self.score(rotated(keys, slots.pos, state.extra["inv_freq"]), slots.pos)

    def score(self, k_rot: Float[Array, "B K V D"], pos: Int[Array, "B K V"]) -> tuple[Array, Array]:
        """(priority, tie): kvpress's -<f, k> of each filled slot's key after RoPE."""
        kh, d = k_rot.shape[1], k_rot.shape[3]
        return rank_by(filter_scores(k_rot, self.layer_filter(kh, d)), pos)


def _nested(arr, ndim: int) -> tuple:
    """An array as nested tuples of Python floats (hashable, exact for float32 values)."""
    arr = np.asarray(arr, np.float32)
    if arr.ndim != ndim:
        raise ValueError(f"qfilter: expected {ndim} dimensions, got shape {arr.shape}")
    return tuple(_nested(a, ndim - 1) for a in arr) if ndim > 1 else tuple(float(x) for x in arr)


def from_kvpress(r: float, max_new: int, n_layers: int | None, fields: dict) -> QFilter | tuple[QFilter, ...]:
    """`kvpolicies.compat.kvpress("QFilterPress", r, q_filters=...)`: kvpress's press downloads the authors'
    filters for its checkpoint (`q_filters`, a field it fills itself); here they are given: a file of
    `evals.qfilter` (or an .npy) or an [L, K, D] array. Given `n_layers`, the per-layer tuple."""
    filters = fields.pop("q_filters", None)
    if filters is None or (isinstance(filters, str) and not filters):
        raise ValueError("kvpress('QFilterPress'): give q_filters= (a file of `python -m evals.qfilter model=<name>`, "
                         "$KVP_DATA/qfilters/<model>.npz, or an [L, K, D] array); kvpress downloads the authors' "
                         "filters from the Hugging Face hub, which is not reachable offline")
    out = QFilter(ratio=r, max_new=max_new, filters=filters if isinstance(filters, str) else _nested(filters, 3))
    return out.stack(n_layers) if n_layers is not None else out
