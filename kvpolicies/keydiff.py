"""`keydiff`: KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364; NVIDIA/kvpress
`KeyDiffPress`) — keep per kv head the tokens whose keys point furthest from the head's mean key
direction.

Shapes: B batch, K kv heads, S = budget + max_new slots, V view slots, D head dim, H = D / 2.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.codecs import Codec, Identity
from kvpolicies.expected import turn
from kvpolicies.prompt_scored import PromptScored, rank_by


def rotated(keys: Float[Array, "B K V D"], pos: Int[Array, "B K V"], inv_freq: Float[Array, "H"]
            ) -> Float[Array, "B K V D"]:
    """The stored (un-rotated) keys after RoPE at their text positions: what kvpress caches."""
    ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, K, V, H]
    return turn(keys, jnp.cos(ang), jnp.sin(ang))


@dataclasses.dataclass(frozen=True)
class KeyDiff(PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the lowest cosine similarity
    between their key and the anchor, the mean of the head's L2-normalised keys.

    The score is kvpress's `KeyDiffPress` (-cos(k, mean of k / ||k||), keys after RoPE as kvpress
    caches them), one top-k over the whole prompt. The paper evicts block by block while the
    prompt is prefilled in blocks; kvpress reaches that form through its `BlockPress` wrapper,
    which `kvpolicies.compat.kvpress("BlockPress", r, press="KeyDiffPress")` reproduces (`compat.Blocked`).
    `budget` counts every kept token (no sink
    or window is protected). Protocol and stream extension: `PromptScored` (the prompt held
    densely, ranked once; a stream recompresses on overflow, the anchor taken over the view's
    keys). Ties keep the newer token (kvpress: torch.topk's order).

    Cost: the prompt phase gets RoPE's frequencies from the query statistics it collects
    (`query_sink=4`, D^2 + D floats per query head summed at each prompt step; the scores read
    only the frequencies): the statistics are discarded after the prompt. query_sink 4 is expected's
    n_sink: one shared prompt phase then covers both (`kvpolicies.prompt.superset`, evals.peer).
    """

    label = "keydiff"
    observes = ("k_rot",)
    collects = {"query_sink": 4}  # for RoPE's frequencies (see Cost)

    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    def rank(self, slots, keys, stats, seen):
        return self.score(seen.k_rot, slots.pos)

    def prompt_rank(self, state, slots, keys, stats):
        return self.score(rotated(keys, slots.pos, state.extra["inv_freq"]), slots.pos)

    def score(self, k_rot: Float[Array, "B K V D"], pos: Int[Array, "B K V"]) -> tuple[Array, Array]:
        """(priority, tie): minus the cosine similarity of each filled slot's key with the anchor."""
        k = k_rot.astype(jnp.float32)
        filled = (pos >= 0)[..., None]  # [B, K, V, 1]
        norm = jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True))  # [B, K, V, 1]
        unit = jnp.where(filled, k / jnp.maximum(norm, 1e-12), 0.0)  # [B, K, V, D]
        anchor = unit.sum(axis=2, keepdims=True) / jnp.maximum(filled.sum(axis=2, keepdims=True), 1)  # [B, K, 1, D]
        a_norm = jnp.sqrt(jnp.sum(anchor * anchor, axis=-1))  # [B, K, 1]
        cos = jnp.sum(k * anchor, axis=-1) / jnp.maximum(norm[..., 0] * a_norm, 1e-8)  # [B, K, V]
        return rank_by(-cos, pos)
