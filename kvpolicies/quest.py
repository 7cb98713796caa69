"""`quest`: Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", github.com/mit-han-lab/Quest) — every token is kept, but each decode query reads only
the pages whose keys could score highest. Storage is that of `full`; what shrinks is the bytes
*read* per decode step.

Shapes: B batch, T new tokens, K kv heads, G query heads per kv head, S slots (= max_len),
C pages of `page` tokens (C = ceil(max_len / page)), D head dim.

Slot j holds token j (as in `full`); page c holds slots [c page, (c+1) page). Per page and kv
head, the state's `kmin`, `kmax` [B, K, C, D] are the elementwise min/max of its keys *rotated
at their own positions* (Quest bounds rotated keys; with keys stored before RoPE these are still
fixed once written), folded in as tokens arrive: `select` folds the step's rotated keys into a
copy to rank pages, `compact` stores the same fold (from `Seen.k_rot`). As in `full`, the view
reads the stored slots in place and the step's new tokens after them (`View.append`), and
`defer` returns the step's writes (the new slots, and the bounds of the pages they touch) for a
model to apply after its layer loop, so a decode step never copies the cache. For a query q (rotated
at its position) the bound on q . k over page c is
    U_c = sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min.

The protocol (the authors' kernels, `quest/utils/controller.py`, `quest/models/llama.py`):
  * prefill: a fresh prompt is attended densely, as Quest's code does whenever the query length
    is > 1 (its prompt is one step); the page bounds are still built for every token. This is
    the policy's prompt phase, `prompt_policy()` -> `QuestPrompt` (same fields, same state, no
    selection), which `Engine.prefill`/`generate` run over a fresh prompt whatever its chunking;
    decoding then continues from that state (`after_prompt` changes nothing).
  * decode: query p reads its own page (the last page, possibly partial, always read as in
    Quest's kernels) and the `top_k - 1` pages before it ranked by U, so `top_k` is Quest's page
    budget *including* the last page and `top_k * page` is its token budget
    (`--token_budget 1024 --chunk_size 16` is top_k=64, page=16, our default). While the
    query has at most `top_k` pages, it reads all of them.
  * streams (perplexity): outside the prompt phase every query selects pages as a decode query
    does, also inside a chunk, so a chunk gives exactly the token-by-token result and a stream
    scored with `Engine.score` is sparse at every token: the protocol of Quest's PG19 script
    (`evaluation/pg19/ppl_eval.py` feeds one token per step, so every token is a decode).
  * GQA: one set of pages per kv head, ranked by the max of U over the group's G query heads
    (Quest's kernels support MHA only, and its accuracy scripts repeat the kv heads and select
    per query head; for MHA this is the paper's per-head choice). The bytes read per step are
    then exactly those of the kv head's pages.
  * layers: Quest keeps layers 0 and 1 dense; `quest_stack(n_layers, ...)` builds that
    per-layer tuple (`full` for layers 0-1), the preset for a model-level run.

Our deviations and extensions:
  * `window` > 0 (ours, off by default): the always-read region grows from the query's page to
    the pages holding its newest `window` tokens (window <= 1 is Quest); `top_k - 1` pages
    are still chosen before that region, so those extra pages are on top of the budget.
  * Quest's accuracy-evaluation code (`evaluation/quest_attention.py`) differs from its
    kernels: it ranks the partial last page with the others instead of always reading it, and
    reads at least 3 pages (the paper's accuracy tables come from that script, its speed
    numbers from the kernels). We follow the kernels: the last page is always read.
  * Ties in U go to the lower page (torch's top-k leaves them unspecified). Bounds are of the
    keys as decoded by the codec (Quest: float16 keys), kept in the cache dtype.
Candidate pages are complete and lie before the always-read region, so a chunk selects for each
query exactly what decoding one by one would; the prompt phase stores the same state as the
decode phase would, so the final state never depends on the chunking either.

Sparse reads are real at decode (`gathers`): `kvpolicies.attend` asks a decode query's selection
before rotating any key, and `select` answers with an `attend.Gather` of M = `gather_slots(max_len)`
slots per kv head (the top_k - 1 chosen pages, then the pages of the always-read region: top_k x
page for window <= 1), so the step rotates, scores and reads M slots instead of max_len; ranking
reads the page bounds (C x D per kv head). The pages and the softmax are the masked path's (the
query's own page is never a candidate, so ranking before folding the new key in changes nothing).
A chunk (T > 1) keeps the masked path. The gathered step also moves only those M slots to the
device when the keys and values live in host memory (`kvpolicies.offload.to_host`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kvpolicies import offload
from kvpolicies.attend import Gather
from kvpolicies.base import Deferred, Policy, SlotState
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.full import Full
from kvpolicies.limits import Bounded
from kvpolicies.memory import tree_nbytes
from kvpolicies.presets import Preset
from kvpolicies.prompt import PromptCompressor
from kvpolicies.slots import append_view, encode_new, write_deferred


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuestState(SlotState):
    """Slots plus per-page bounds of the rotated keys.

    kmin, kmax: [B, K, C, D] elementwise min / max over each page's keys (+inf / -inf: empty).
    """

    kmin: Float[Array, "B K C D"]
    kmax: Float[Array, "B K C D"]


@dataclasses.dataclass(frozen=True)
class Quest(Preset, PromptCompressor, Bounded, Policy):
    """All tokens kept; a decode query reads its own page plus the `top_k - 1` highest-bound pages
    before it (`top_k` pages in all); a fresh prompt is dense (`prompt_policy()`)."""

    observes = ("k_rot",)
    gathers = True  # a decode query's read is a Gather (attend's sparse path)

    page: int = 16
    top_k: int = 64
    window: int = 0
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("quest", "page", self.page, 1)
        check_int("quest", "top_k", self.top_k, 1)  # the query's own page counts
        check_int("quest", "window", self.window, 0)

    def capacity(self, max_len):
        return max_len

    def pages(self, max_len: int) -> int:
        return -(-max_len // self.page)

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        shape = (batch, kv_heads, self.pages(max_len), head_dim)  # [B, K, C, D]
        return QuestState(st.k, st.v, st.pos, kmin=jnp.full(shape, jnp.inf, dtype), kmax=jnp.full(shape, -jnp.inf, dtype))

    def extend(self, state, k, v, pos):
        # Chunks are contiguous, so the chunk starts at slot pos[:, 0]; as in `full`, attention
        # reads the stored slots in place and the new tokens after them, and the step's writes
        # (the new slots, the bounds of their pages) can be deferred (`defer`).
        new = encode_new(self.codec, k, v, pos)
        view = append_view(self.codec, SlotState(state.k, state.v, state.pos), new, pos, k.dtype, carry=(state, pos),
                           start=pos[:, 0])
        like = jax.tree.leaves(state.k)[0]  # a host tier (offload.to_host): the new slots are written there
        slots = SlotState(offload.to_space(new.k, like), offload.to_space(new.v, like), new.pos)
        return dataclasses.replace(view, append=view.append._replace(slots=slots))

    def _bounds(self, state: QuestState, new: Float[Array, "B K T D"], q_pos) -> tuple[Array, Array]:
        """The pages' bounds [B, K, C, D] with the step's new rotated keys folded in."""
        pg = q_pos // self.page  # [B, T]
        kmin = jax.vmap(lambda m, c, x: m.at[:, c].min(x.astype(m.dtype)))(state.kmin, pg, new)  # [B, K, C, D]
        kmax = jax.vmap(lambda m, c, x: m.at[:, c].max(x.astype(m.dtype)))(state.kmax, pg, new)
        return kmin, kmax

    def defer(self, view, seen) -> Deferred:
        """The new slots, and the bounds of the n pages from `first` that hold the step's tokens
        (n = the most pages T contiguous tokens can touch; `first` clamped so that they fit)."""
        state, q_pos = view.carry
        t, n_pages = q_pos.shape[1], state.kmin.shape[2]
        n = min(n_pages, (t + self.page - 2) // self.page + 1)
        first = jnp.minimum(q_pos[:, 0] // self.page, n_pages - n)  # [B]
        cut = lambda m: jax.vmap(lambda x, f: jax.lax.dynamic_slice_in_dim(x, f, n, axis=1))(m, first)  # noqa: E731
        pages = QuestState(None, None, None, kmin=cut(state.kmin), kmax=cut(state.kmax))  # [B, K, n, D]
        kmin, kmax = self._bounds(pages, seen.k_rot[:, :, -t:], q_pos - first[:, None] * self.page)  # the view's last T: new
        app = view.append
        return Deferred(app.slots, app.start, fields={"kmin": (kmin, first), "kmax": (kmax, first)})

    def compact(self, view, seen):
        return write_deferred(view.carry[0], self.defer(view, seen))

    def local_pages(self) -> int:
        """Pages an always-read region can span (1 for window <= 1)."""
        return (max(self.window, 1) + self.page - 2) // self.page + 1

    def gather_chosen(self, n_pages: int) -> int:
        """Pages a gathered decode step chooses besides its always-read region: top_k - 1, or
        fewer in a cache of fewer pages (the query's own page is never a candidate)."""
        return min(self.top_k - 1, n_pages - 1)

    def gather_slots(self, max_len: int) -> int:
        """M: the slots a gathered decode step reads per kv head (top_k x page for window <= 1,
        fewer in a cache of fewer pages): the chosen pages, then the always-read region's."""
        return (self.gather_chosen(self.pages(max_len)) + min(self.local_pages(), self.pages(max_len))) * self.page

    def local_start(self, q_pos):
        """First token of query p's always-read region: the start of its own page, or with
        window > 1 of the page holding p - window + 1. Pages before it are candidates."""
        return self.page * (jnp.maximum(0, q_pos - max(self.window, 1) + 1) // self.page)

    def prompt_policy(self) -> "QuestPrompt":
        """Quest's prefill: the prompt attended densely, the page bounds built (same state)."""
        return QuestPrompt(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def _rank(self, q_rot, kmin, kmax, start, kk: int) -> tuple[Array, Array]:
        """(top, ok) [B, K, T, kk]: the kk highest-bound pages before each query's always-read
        region (per kv head: max over the group's query heads), ok False where fewer candidates
        exist. 0 < kk <= C."""
        n_pages = kmin.shape[2]
        # Upper bound of q . k per page, per kv head (max over the group's query heads). Empty
        # pages (+-inf bounds: -inf or nan here) are never candidates, so they are not cleaned
        # first: that pass over all C x D bounds cost as much as the bound itself.
        lo, hi = kmin.astype(jnp.float32), kmax.astype(jnp.float32)
        q = q_rot.astype(jnp.float32)  # [B, K, G, T, D]
        # the bounds as the matmuls' left operand, pages first in the output: XLA:CPU then reads
        # them as stored instead of first copying them transposed (docs/results/speed.md,
        # "Numbers behind comments in the code")
        bound = (jnp.einsum("BKCD,BKGTD->BKCGT", hi, jnp.maximum(q, 0), preferred_element_type=jnp.float32)
                 + jnp.einsum("BKCD,BKGTD->BKCGT", lo, jnp.minimum(q, 0), preferred_element_type=jnp.float32))
        score = jnp.moveaxis(bound.max(axis=-2), 2, -1)  # [B, K, T, C]

        # Top (top_k - 1) among the complete pages before each query's always-read region.
        cand = jnp.arange(n_pages) < (start // self.page)[:, None, :, None]  # [B, 1, T, C]
        score = jnp.where(cand, score, -jnp.inf)
        _, top = jax.lax.top_k(score, kk)  # [B, K, T, kk]; ties -> lower page
        ok = jnp.take_along_axis(jnp.broadcast_to(cand, score.shape), top, axis=-1)  # [B, K, T, kk]
        return top, ok

    def select(self, view, q_rot, k_rot) -> Bool[Array, "B K|1 1 T S"] | Gather:
        """The slots each query reads: a mask [B, K|1, 1, T, S]; or, asked with k_rot=None (the
        decode step of `attend`, T == 1), the same slots as a `Gather` of `gather_slots` slots."""
        state, q_pos = view.carry  # q_pos [B, T]
        if k_rot is None:
            return self._gather(view, q_rot, q_pos)
        t = q_pos.shape[1]
        start = self.local_start(q_pos)  # [B, T]
        token = view.pos[:, :1]  # [B, 1, S'] each view slot's token: stored slot j holds token j, the new ones follow
        mask = token[:, :, None, :] >= start[:, None, :, None]  # [B, 1, T, S'] the always-read region
        if min(self.top_k - 1, state.kmin.shape[2]) == 0:
            return mask[:, :, None]
        kmin, kmax = self._bounds(state, k_rot[:, :, -t:], q_pos)  # the new tokens (the view's last T) folded in
        top, ok = self._rank(q_rot, kmin, kmax, start, min(self.top_k - 1, kmin.shape[2]))  # [B, K, T, kk]
        b, k, _, kk = top.shape
        ix = jnp.ix_(jnp.arange(b), jnp.arange(k), jnp.arange(t), jnp.arange(kk))[:3]  # index grids
        sel = jnp.zeros((b, k, t, kmin.shape[2]), bool).at[ix + (top,)].set(ok)  # [B, K, T, C] chosen pages
        page = jnp.maximum(token, 0) // self.page  # [B, 1, S'] (an empty slot: any page, causality masks it)
        mask = mask | jnp.take_along_axis(sel, jnp.broadcast_to(page[:, :, None], (b, k, t, page.shape[-1])), axis=-1)
        return mask[:, :, None]  # [B, K, 1, T, S']

    def _gather(self, view, q_rot, q_pos) -> Gather:
        """A decode query's slots as a Gather [B, K, M]: its chosen pages (ranked on the stored
        bounds: the new key's page is never a candidate), then the always-read region's pages."""
        if q_pos.shape[1] != 1:
            raise ValueError(f"quest: a Gather answers one decode query (T == 1), got T={q_pos.shape[1]}")
        state = view.carry[0]  # ranked on the stored bounds
        n_pages = state.kmin.shape[2]
        start = self.local_start(q_pos)  # [B, 1]
        b, k = q_rot.shape[:2]
        local = (start // self.page) + jnp.arange(min(self.local_pages(), n_pages))  # [B, L] always-read pages
        pages = jnp.broadcast_to(local[:, None], (b, k, local.shape[-1]))  # [B, K, L]
        ok = jnp.broadcast_to((local < n_pages)[:, None], pages.shape)
        if self.gather_chosen(n_pages) > 0:
            top, chosen = self._rank(q_rot, state.kmin, state.kmax, start, self.gather_chosen(n_pages))  # [B, K, 1, kk]
            pages = jnp.concatenate([top[:, :, 0], pages], axis=-1)  # [B, K, kk + L]
            ok = jnp.concatenate([chosen[:, :, 0], ok], axis=-1)
        return Gather(start=pages * self.page, ok=ok, size=self.page)  # [B, K, kk + L] pages of `page` slots

    def reads(self, context: int) -> tuple[int, int]:
        """(tokens read, pages whose bounds are read) per kv head by the decode query at position
        `context`. Bounds are read only when pages are ranked: when there are more candidates
        than the top_k - 1 chosen (Quest's `need_estimate`; with fewer, every page is read)."""
        start = self.page * (max(0, context - max(self.window, 1) + 1) // self.page)
        n_cand = start // self.page
        chosen = min(self.top_k - 1, n_cand)
        return context - start + 1 + self.page * chosen, (n_cand if 0 < chosen < n_cand else 0)

    def stack(self, n_layers):
        """Quest's published model-level preset: layers 0-1 dense (`quest_stack`)."""
        return quest_stack(n_layers, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def decode_reads(self, state, context):
        """The tokens `reads` gives (keys and values) and the bounds of its candidate pages."""
        tokens, pages = self.reads(context)
        bounds = (state.kmin, state.kmax)
        return tree_nbytes((state.k, state.v)) * tokens // state.slots, tree_nbytes(bounds) * pages // state.kmin.shape[2]


@dataclasses.dataclass(frozen=True)
class QuestPrompt(Quest):
    """Quest's prompt phase: every query attends to all earlier tokens, as Quest's code does
    whenever the query length is > 1; the state (tokens and page bounds) is Quest's."""

    gathers = False  # dense: every query reads every earlier token

    def prompt_policy(self):
        return self

    def select(self, view, q_rot, k_rot):
        return None


def quest_stack(n_layers: int, dense_layers: int = 2, **fields) -> tuple[Policy, ...]:
    """Quest's model-level preset: `full` for the first `dense_layers` layers (Quest keeps layers
    0 and 1 dense), `Quest(**fields)` for the rest; the full layers use the same codec."""
    check_int("quest_stack", "n_layers", n_layers, 1)
    check_int("quest_stack", "dense_layers", dense_layers, 0)
    quest = Quest(**fields)
    dense = min(dense_layers, n_layers)
    return (Full(codec=quest.codec),) * dense + (quest,) * (n_layers - dense)
