"""Model-level presets: a policy that runs differently in different layers of a model.

A preset (`Preset`) is given as one policy and expands to one policy per layer with
`stack(n_layers)`: pyramidkv's per-depth budgets, quest's and knorm's dense first layers, duo's
per-layer head pattern. `stack_of(policy, n_layers)` is what a model asks (`models.engine.Engine`
given one policy, `models.stacks.model_stack`): the preset's layers, or the policy in every layer.
"""

from __future__ import annotations

from kvpolicies.base import Policy


class Preset:
    """Capability: the per-layer policies of a model of n_layers layers that runs this policy."""

    def stack(self, n_layers: int) -> tuple[Policy, ...]:
        """One policy per layer (a preset's own layers, e.g. `full` in quest's first two)."""
        raise NotImplementedError


def stack_of(policy: Policy, n_layers: int) -> tuple[Policy, ...]:
    """The per-layer policies of a model of n_layers layers that runs `policy`: a preset's
    `stack(n_layers)`, else the policy itself in every layer."""
    return policy.stack(n_layers) if isinstance(policy, Preset) else (policy,) * n_layers
