"""Per-layer policies for a model: the run's policy on global layers, a window on local ones.

A hybrid model (Gemma 3: five sliding-window layers of 512 tokens per global layer) attends
locally by construction, so its local layers need no compression policy: `window(512)` stores
exactly 512 slots there (gemma's own JAX sampler allocates the full length on local layers).
The policy under test acts on the global layers only; `local_policy` overrides the local ones
for those who want to compress them too. For a model without local layers `model_stack` is
`stack_of(policy, n_layers)`.
"""

from __future__ import annotations

import kvpolicies
from kvpolicies.base import Policy
from kvpolicies.presets import stack_of
from models.config import LlamaConfig


def local_window(cfg: LlamaConfig) -> Policy:
    """The cache of a local layer: a ring of `cfg.sliding_window` slots."""
    if cfg.sliding_window is None:
        raise ValueError(f"{cfg.name} has no sliding_window: it has no local layers")
    return kvpolicies.get("window", window=cfg.sliding_window)


def model_stack(cfg: LlamaConfig, policy: Policy, local_policy: Policy | None = None) -> tuple[Policy, ...]:
    """One policy per layer: `stack_of(policy, n_layers)` (model-level presets such as quest's dense
    first layers or pyramidkv's per-depth budgets, indexed by the layer's depth) on the global
    layers, `local_policy` (default `window(sliding_window)`) on the local layers."""
    stack = stack_of(policy, cfg.n_layers)
    if not any(cfg.local_layers):
        if local_policy is not None:
            raise ValueError(f"local_policy={local_policy!r}: {cfg.name} has no local layers")
        return stack
    local = local_window(cfg) if local_policy is None else local_policy
    return tuple(local if is_local else p for p, is_local in zip(stack, cfg.local_layers))
