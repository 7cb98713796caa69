"""`finch`: FINCH (Corallo & Papotti 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large
Language Models", TACL 12; NVIDIA/kvpress `FinchPress`) — the question rides in the prompt; after it,
keep per kv head the context tokens the question's queries attend to most (each query's row weighted
by its position), plus the question itself, and re-rotate the kept keys to contiguous positions.

Shapes: B batch, K kv heads, S = budget + window + max_new slots, T new tokens, V = S + T view slots,
W window rows (the question's tokens), D head dim.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvpolicies.base import RopePositions
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class Finch(SnapKV):
    """After a prompt that ends with the question (`obs_window` = its tokens), keep per kv head the
    `budget` context tokens with the largest attention from the question's queries, the row of the
    query at position p weighted by p, plus the question; decoding appends, keys rotated by their
    rank in the cache (`rerotate`).

    The score is kvpress's `FinchPress` (the authors' implementation: their repository
    giulio98/context-compression points to it): SnapKV's window attention without pooling, multiplied by the
    query's position (`normalize_scores`: the number of weights the causal softmax spreads, less
    one) and averaged over the window and the query heads of a kv head (we sum: the same ranking).
    kvpress finds the window from a delimiter token the prompt holds between context and question,
    removed in the embedding hook (`update_model_and_tokenizer`); here the question's length is the
    static field `obs_window`, and the engine's staged prompt holds the question
    (`Engine.prompt(context)` then `extend_prompt(question)`, or one prompt of both). A new length
    compiles a new compression, the price of a data-free field.

    `rerotate` (kvpress's `rerotate_keys`, its default): after the compression, RoPE sees the kept
    keys at their ranks 0..m-1 in the head's cache and the next token at m (kvpress re-rotates the
    cached keys and its pipeline continues at position m), the same for every head (each keeps
    m). Our keys are stored un-rotated, so this is the view's RoPE positions, not a second rotation
    (float rounding differs); masks still read text positions. kvpress's optional `chunk_length`
    (the top-k taken chunk by chunk) is not reproduced (compat refuses it).

    Streams (`Engine.score`) and generation past `max_new`: SnapKV's rule on overflow (the last
    `obs_window` queries' attention mass before it, unweighted, no pooling), ranks for RoPE as above.
    """

    label = "finch"

    budget: int = 1024
    obs_window: int = 32
    kernel: int = 1
    max_new: int = 256
    pooling: str = "max"
    normalize: bool = True
    rerotate: bool = True
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int("finch", "kernel", self.kernel, 1, 1)  # FINCH does not pool (SnapKV's field, fixed here)
        for name in ("normalize", "rerotate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"finch.{name}={getattr(self, name)!r}: must be a bool")

    def prompt_rank(self, state, slots, keys, stats):
        rows = state.rows  # [B, K, W, S]: the question's queries' attention, summed over G
        if self.normalize:  # kvpress: row i times k_len - window + i, its query's position
            return self._rank(jnp.einsum("BKWS,BW->BKS", rows, jnp.maximum(state.row_pos, 0).astype(rows.dtype)),
                              slots.pos)
        return self._rank(rows.sum(axis=2), slots.pos)

    def extend(self, state, k, v, pos):
        view = super().extend(state, k, v, pos)
        if not self.rerotate:
            return view
        # the stored slots are packed in text order (`pack`, `append_packed`): a slot's rank is its index
        s, t = state.pos.shape[-1], pos.shape[1]
        c = (state.pos >= 0).sum(axis=-1, dtype=jnp.int32)  # [B, K] tokens held (equal over the heads)
        ranks = jnp.concatenate([jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), state.pos.shape),
                                 c[..., None] + jnp.arange(t, dtype=jnp.int32)], axis=-1)  # [B, K, S + T]
        q = c[:, :1] + jnp.arange(t, dtype=jnp.int32)  # [B, T]: after head 0's m kept
        return dataclasses.replace(view, rope=RopePositions(q=q[..., None], k=ranks))

    def spared(self):
        # re-rotated keys: a key's rank is its slot's index, which the spare slot's is not (`SpareSlot`)
        return None if self.rerotate else super().spared()
