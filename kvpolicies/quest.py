"""`quest`: Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference") — every token is kept, but each query reads only the pages whose keys could score
highest, plus the newest tokens. Storage is that of `full`; what shrinks is the bytes *read*.

Shapes: B batch, T new tokens, K kv heads, G query heads per kv head, S slots (= max_len),
C pages of `page` tokens (C = ceil(max_len / page)), D head dim.

Slot j holds token j (as in `full`); page c holds slots [c page, (c+1) page). Per page and kv
head, the state's `kmin`, `kmax` [B, K, C, D] are the elementwise min/max of its keys *rotated
at their own positions* — Quest bounds rotated keys, and with keys stored before RoPE these are
still fixed once written, so they are folded in as tokens arrive: `select` folds the step's
rotated keys into a copy to rank pages, `compact` stores the same fold (from `Seen.k_rot`).
For a query q (rotated at its position) the bound on q . k over page c is
    U_c = sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min.
Query p reads:
  * its local region: tokens from the start of the page holding p - window + 1, up to p (the
    newest `window` tokens rounded out to whole pages; always includes the query's own page,
    whose min/max is incomplete, as Quest always loads the last page);
  * the `top_k` pages before that region ranked by U (per kv head: the max of U over its G query
    heads, so a GQA group reads one set of pages; for MHA this is the paper's per-head choice).
Candidate pages are complete and lie before the local region, so chunked prefill selects for
each query exactly what decoding one by one would. Quest leaves the first layers dense; pass a
per-layer tuple (e.g. `full` for layers 0-1) to the model to do the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvpolicies.base import Policy, SlotState, check_int, encode_new, tree_nbytes, view_of, write_at
from kvpolicies.codecs import Codec, Identity


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuestState(SlotState):
    """Slots plus per-page bounds of the rotated keys.

    kmin, kmax: [B, K, C, D] elementwise min / max over each page's keys (+inf / -inf: empty).
    """

    kmin: Float[Array, "B K C D"]
    kmax: Float[Array, "B K C D"]


@dataclasses.dataclass(frozen=True)
class Quest(Policy):
    """All tokens kept; each query attends its local pages plus the `top_k` highest-bound pages."""

    observes = ("k_rot",)

    page: int = 16
    top_k: int = 64
    window: int = 16
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("quest", "page", self.page, 1)
        check_int("quest", "top_k", self.top_k, 1)
        check_int("quest", "window", self.window, 1)  # the query always sees itself

    def capacity(self, max_len):
        return max_len

    def pages(self, max_len: int) -> int:
        return -(-max_len // self.page)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        shape = (batch, kv_heads, self.pages(max_len), head_dim)  # [B, K, C, D]
        return QuestState(st.k, st.v, st.pos, kmin=jnp.full(shape, jnp.inf, dtype), kmax=jnp.full(shape, -jnp.inf, dtype))

    def extend(self, state, k, v, pos):
        slots = SlotState(state.k, state.v, state.pos)
        written = write_at(slots, encode_new(self.codec, k, v, pos), pos[:, 0])  # contiguous chunk at slot pos[:, 0]
        return view_of(self.codec, written, pos, k.dtype, carry=(state, written, pos))

    def _bounds(self, carry, k_rot: Float[Array, "B K S D"]) -> tuple[Array, Array]:
        """The pages' bounds with the step's new rotated keys (slots pos[:, 0] ...) folded in."""
        state, _, q_pos = carry
        t = q_pos.shape[1]
        new = jax.vmap(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, t, axis=1))(k_rot, q_pos[:, 0])  # [B, K, T, D]
        pg = q_pos // self.page  # [B, T]
        kmin = jax.vmap(lambda m, c, x: m.at[:, c].min(x.astype(m.dtype)))(state.kmin, pg, new)  # [B, K, C, D]
        kmax = jax.vmap(lambda m, c, x: m.at[:, c].max(x.astype(m.dtype)))(state.kmax, pg, new)
        return kmin, kmax

    def compact(self, view, seen):
        _, written, _ = view.carry
        kmin, kmax = self._bounds(view.carry, seen.k_rot)
        return QuestState(written.k, written.v, written.pos, kmin=kmin, kmax=kmax)

    def local_start(self, q_pos):
        """First token of query p's local region (a page boundary); pages before it are candidates."""
        return self.page * (jnp.maximum(0, q_pos - self.window + 1) // self.page)

    def select(self, view, q_rot, k_rot) -> Bool[Array, "B K 1 T S"]:
        q_pos = view.carry[2]  # [B, T]
        t, s = q_pos.shape[1], view.pos.shape[-1]
        # 1. The pages' bounds, the new tokens included (complete pages of this chunk are candidates).
        kmin, kmax = self._bounds(view.carry, k_rot)
        # 2. Upper bound of q . k per page, per kv head (max over the group's query heads).
        lo = jnp.where(jnp.isfinite(kmin), kmin, 0).astype(jnp.float32)  # empty pages -> 0 (never candidates)
        hi = jnp.where(jnp.isfinite(kmax), kmax, 0).astype(jnp.float32)
        q = q_rot.astype(jnp.float32)  # [B, K, G, T, D]
        bound = (jnp.einsum("BKGTD,BKCD->BKGTC", jnp.maximum(q, 0), hi, preferred_element_type=jnp.float32)
                 + jnp.einsum("BKGTD,BKCD->BKGTC", jnp.minimum(q, 0), lo, preferred_element_type=jnp.float32))
        score = bound.max(axis=2)  # [B, K, T, C]

        # 3. Top-k among the complete pages before each query's local region.
        start = self.local_start(q_pos)  # [B, T]
        n_pages = kmin.shape[2]
        cand = jnp.arange(n_pages) < (start // self.page)[:, None, :, None]  # [B, 1, T, C]
        score = jnp.where(cand, score, -jnp.inf)
        kk = min(self.top_k, n_pages)
        _, top = jax.lax.top_k(score, kk)  # [B, K, T, kk]; ties -> lower page
        ok = jnp.take_along_axis(jnp.broadcast_to(cand, score.shape), top, axis=-1)  # [B, K, T, kk]
        b, k = score.shape[:2]
        ix = jnp.ix_(jnp.arange(b), jnp.arange(k), jnp.arange(t), jnp.arange(kk))[:3]  # index grids
        sel = jnp.zeros(score.shape, bool).at[ix + (top,)].set(ok)  # [B, K, T, C] chosen pages

        slot = jnp.arange(s)  # [S]
        mask = jnp.take(sel, slot // self.page, axis=-1) | (slot >= start[:, None, :, None])  # [B, K, T, S]
        return mask[:, :, None]  # [B, K, 1, T, S]

    def reads(self, context: int) -> tuple[int, int]:
        """(tokens read, pages whose bounds are read) per kv head for the query at position `context`."""
        start = self.page * (max(0, context - self.window + 1) // self.page)
        n_cand = start // self.page
        return context - start + 1 + self.page * min(self.top_k, n_cand), n_cand

    def decode_reads(self, state, context):
        """The tokens `reads` gives (keys and values) and the bounds of its candidate pages."""
        tokens, pages = self.reads(context)
        bounds = (state.kmin, state.kmax)
        return tree_nbytes((state.k, state.v)) * tokens // state.slots, tree_nbytes(bounds) * pages // state.kmin.shape[2]
