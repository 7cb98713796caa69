"""kvpress's `KVzapPress` alone (a `ScorerPress`): per kv head the n_kept tokens with the highest scores of
KVzap's surrogate (`kvpolicies.kvzap`: a per-layer linear map or 2-layer MLP of the layer's normalised
input hidden states), one top-k over the prompt, no window. The paper's method (Jegou et al., "KVzap: Fast,
Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891) pairs the surrogate with DMS's threshold and
sliding window, the registered `kvzap` (rule="threshold"); kvpress's `KVzapPress` is the scorer on its own,
reached through `kvpolicies.compat.kvpress("KVzapPress", r, model_type=..., kvzap_model_name=...)`. Not
registered (`kvzap`'s surrogate under kvpress's per-head top-k).

Shapes: B batch, K kv heads, M prompt slots, V view slots.

kvpress downloads `nvidia/KVzap-<model_type>-<checkpoint>`; ours are `kvzap`'s weights
(`python -m evals.train_kvzap`, kvpolicies/kvzap_weights/), trained on our kvzip's scores.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.checks import check_choice
from kvpolicies.codecs import Codec, Identity
from kvpolicies.kvzap import KINDS, ZapPhase
from kvpolicies.prompt_scored import PromptScored, rank_by


@dataclasses.dataclass(frozen=True)
class ZapScored(PromptScored):
    """After the prompt, keep per kv head the `budget` (or kvpress's n_kept) tokens with the highest
    surrogate log-scores (`kind`, `surrogate` as `kvzap`'s), read by the prompt phase from each layer's
    input hidden states (`kvzap.ZapPhase`). Decoding appends; a stream (or generation past `max_new`)
    has no surrogate scores for its new tokens (kvzap's decoding adds none) and keeps the newest on
    overflow (our extension)."""

    label = "kvzap-scored"

    budget: int = 1024
    max_new: int = 256
    kind: str = "mlp"  # kvpress's model_type default
    surrogate: str = "auto"  # kvzap's: a file stem under kvpolicies/kvzap_weights, a .npz path, "auto", "random"
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_choice(self.label, "kind", self.kind, KINDS)

    def prompt_policy(self):
        return ZapPhase(codec=self.codec, of=self, obs_window=0, kind=self.kind, surrogate=self.surrogate)

    def prompt_rank(self, state, slots, keys, stats):
        return rank_by(state.extra["zap"], slots.pos)  # [B, K, M]: slot j holds prompt token j

    def rank(self, slots, keys, stats, seen):
        return rank_by(slots.pos.astype(jnp.float32), slots.pos)


def from_kvpress(r: float, max_new: int, fields: dict) -> ZapScored:
    """`kvpolicies.compat.kvpress("KVzapPress", r, model_type="mlp", kvzap_model_name=...)`: kvpress's
    model_type ("linear" or "mlp"); kvzap_model_name, which kvpress sets to the hub's repository it
    downloads, is here `kvzap`'s surrogate (a file stem of kvpolicies/kvzap_weights, an .npz path, or
    "auto": the file of that kind matching the model)."""
    return ZapScored(ratio=r, max_new=max_new, kind=fields.pop("model_type", "mlp"),
                     surrogate=str(fields.pop("kvzap_model_name", "auto")))
