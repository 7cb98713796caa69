"""The prompt phase of a prompt-compression method (snapkv, and later pyramidkv, adakv, ...).

Shapes: B batch, K kv heads, T new tokens, S slots (= max_len; slot j holds token j),
W observation window (rows), D head dim.

Such a method runs dense attention over the whole prompt, then compresses the cache once
(`Policy.after_prompt`) before decoding. During the prompt every token is kept, as `full`
does, and the attention rows of the newest W queries (summed over each kv head's G query
heads) are kept too, so the compression after the prompt sees exactly the last W queries'
attention — the question's, in a retrieval prompt — whatever the prefill chunk size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, SlotState, check_int, empty_slots, encode_new, view_of, write_at


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptState(SlotState):
    """Every prompt token, plus the attention rows of the newest W queries.

    rows:    [B, K, W, S] float32: row r holds the attention of the query at position
             `row_pos[b, r]` (r = position mod W) over the slots, summed over G.
    row_pos: [B, W] int32 position of each row's query, -1 for an empty row.
    """

    rows: Float[Array, "B K W S"]
    row_pos: Int[Array, "B W"]


@dataclasses.dataclass(frozen=True)
class PromptPhase(Policy):
    """Dense prompt storage for the prompt compressor `of` (its codec, its observation window)."""

    observes = ("scores",)

    of: Policy = None
    obs_window: int = 32

    def __post_init__(self):
        check_int("prompt phase", "obs_window", self.obs_window, 1)

    def capacity(self, max_len):
        return max_len

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, max_len)
        w = self.obs_window
        return PromptState(st.k, st.v, st.pos, rows=jnp.zeros((batch, kv_heads, w, max_len), jnp.float32),
                           row_pos=jnp.full((batch, w), -1, jnp.int32))

    def extend(self, state, k, v, pos):
        slots = SlotState(state.k, state.v, state.pos)
        written = write_at(slots, encode_new(self.codec, k, v, pos), pos[:, 0])  # contiguous chunk at pos[:, 0]
        return view_of(self.codec, written, pos, k.dtype, carry=(state, written, pos))

    def compact(self, view, seen):
        state, written, pos = view.carry
        w = self.obs_window
        row = jnp.where(pos > pos[:, -1:] - w, pos % w, w)  # [B, T]; w = dropped (not among the newest W)
        rows = jax.vmap(lambda r, i, x: r.at[:, i].set(x, mode="drop"))(state.rows, row, seen.scores)  # [B, K, W, S]
        row_pos = jax.vmap(lambda r, i, x: r.at[i].set(x, mode="drop"))(state.row_pos, row, pos)  # [B, W]
        return PromptState(written.k, written.v, written.pos, rows=rows, row_pos=row_pos)
