"""`pyramidkv`: PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling"; Zefan-Cai/KVCache-Factory `pyramidkv_utils.py`, kvpress
`PyramidKVPress`) — SnapKV's selection with per-layer budgets that shrink with depth.

Shapes: as `kvpolicies.snapkv` (per layer).
"""

from __future__ import annotations

import dataclasses

from kvpolicies.budgets import pyramid_budgets
from kvpolicies.presets import Preset
from kvpolicies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class PyramidKV(Preset, SnapKV):
    """A model-level preset: layer i runs `SnapKV` with the i-th of `pyramid_budgets(budget x
    n_layers, n_layers, beta)` (an arithmetic sequence from 2 budget - budget / beta at the
    bottom to budget / beta at the top), every other field (obs_window, kernel, max_new,
    codec) the same in every layer, as the authors keep the observation window in every layer.
    `budget` is the uniform per-layer budget, so the stack's total equals uniform SnapKV's
    (and, below max_len, so do its stored bytes); `stack(n_layers)` gives the layer policies.
    Used alone (one layer) it is SnapKV with `budget`. With `ratio` set, the stack is kvpress's
    `PyramidKVPress` schedule of each prompt's length (`PyramidLayer`).

    Defaults: beta = 20 (the paper's, the authors' code's and kvpress's), our SnapKV's
    otherwise (obs_window 32, kernel 7; kvpress's PyramidKVPress: 64 / 5). Deviations: the authors' code clips the bottom layer to the prompt length and
    falls back to uniform SnapKV for short prompts; we keep the schedule whatever the prompt,
    with each layer's slots capped by max_len (then the total is below uniform's). Budgets
    are rounded to integers by largest remainders so the total is exact.
    """

    label = "pyramidkv"

    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.beta, (int, float)) or isinstance(self.beta, bool) or not self.beta >= 1:
            raise ValueError(f"pyramidkv.beta={self.beta!r}: must be a number >= 1")

    def stack(self, n_layers):
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SnapKV)}
        if self.ratio:  # kvpress's sizing: its `get_layer_budget` of each prompt's length
            return tuple(PyramidLayer(**fields, layer=i, n_layers=n_layers, beta=self.beta) for i in range(n_layers))
        return tuple(SnapKV(**{**fields, "budget": b})
                     for b in pyramid_budgets(self.budget * n_layers, n_layers, self.beta))


@dataclasses.dataclass(frozen=True)
class PyramidLayer(SnapKV):
    """Layer `layer` of kvpress's `PyramidKVPress` (of `n_layers`): SnapKV keeping
    `get_layer_budget(n)` tokens of an n-token prompt (window included)."""

    label = "pyramid-layer"

    layer: int = 0
    n_layers: int = 1
    beta: int = 20

    def shape_class(self, slots):
        """SnapKV's shape class: every layer of the pyramid shares one (its budget is a table)."""
        return SnapKV(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SnapKV)}).shape_class(slots)

    def kept_for(self, n):
        w, r = self.obs_window, self.ratio
        cap = w + n * (1 - r)
        lo = (cap - w) / self.beta
        hi = (cap - w) * 2 - lo
        if hi >= n - w:
            hi = n - w
            lo = (cap - w) * 2 - hi
        if not n >= hi >= lo >= w:
            return max(1, round(n * (1 - r)))
        steps = (hi - lo) / (self.n_layers - 1) if self.n_layers > 1 else 0.0
        return round(hi - self.layer * steps)
