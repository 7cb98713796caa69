"""Prompt compression: the capability (`PromptCompressor`, `Reconstructor`) and the prompt phase
of a prompt-compression method (snapkv, pyramidkv, knorm, random, observed, expected, ...).

Shapes: B batch, K kv heads, G query heads per kv head, T new tokens, S slots (= max_len;
slot j holds token j), W observation window (rows), D head dim.

A prompt compressor (`PromptCompressor`) holds a fresh prompt in another policy, its prompt
phase (`prompt_policy()`), and turns that state into its decode state once, after the whole
prompt (`after_prompt(state)`). The engine asks every policy through `prompt_policy_of(policy)`
and `after_prompt(policy, state)`, which give the streaming default (the policy itself, the
state unchanged) to a policy without the capability. A `Reconstructor` (kvzip) also scores its
prompt with a second model pass between the two (`reconstruction()`; `reconstructs(policy)`;
the pass's hooks: `pass_policies`, `Reconstructor`); one that `Appends` (RestoreKV) has learned
tokens appended after the pass.

Most such methods run dense attention over the whole prompt, then compress the cache once
(`after_prompt`) before decoding. During the prompt every token is kept, as `full`
does, and the attention rows of the newest W queries (summed over each kv head's G query
heads) are kept too, so the compression after the prompt sees exactly the last W queries'
attention — the question's, in a retrieval prompt — whatever the prefill chunk size.

What else it collects over the whole prompt is set by its own fields (so two prompt phases
with equal fields store the same thing, whatever `of`; `obs_window=0`: no rows):
`columns`, the attention every slot received from all prompt queries (observed attention), and
`query_sink >= 0`, the sums of the pre-RoPE queries at positions >= query_sink and of their
outer products, per query head (expected attention's statistics), with RoPE's frequencies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, SlotState, empty_slots
from kvpolicies.checks import check_int
from kvpolicies.limits import Bounded
from kvpolicies.slots import PrefixSlots, encode_new, head_slots, put_head, view_of, write_at


class PromptCompressor:
    """Capability: a fresh prompt is held by another policy, the prompt phase (`prompt_policy`), whose
    state `after_prompt` turns into this policy's decode state, once, as decoding starts (the
    engine's `compress`). A policy that compresses only in some settings (h2o's `prompt="stream"`)
    answers with itself and the state unchanged there, as a policy without the capability does."""

    def prompt_policy(self) -> Policy:
        """The policy that holds a fresh prompt before `after_prompt`."""
        raise NotImplementedError

    def after_prompt(self, state: SlotState) -> SlotState:
        """The decode state from the prompt phase's state after the whole prompt (by default the
        same state: a prompt phase that builds the decode state itself, quest's)."""
        return state


class Reconstructor(PromptCompressor):
    """Capability: a prompt compressor that scores its prompt with a second model pass (kvzip's
    context reconstruction): the engine runs each layer's `reconstruction()` policy over its repeat
    inputs between the prompt phase and `after_prompt` (`models.reconstruct`).

    The pass is the engine's, its rules the reconstructor's: the engine asks a reconstructor of the
    model (one pass serves them all) what every other layer runs in it (`pass_policy`), which
    layers score (`scores_in_pass`), how a scoring layer's state marks the context chunk of each
    repeat input (`before_chunk`) and what follows the last input (`after_pass`). The fields
    `repeat_chunk` (context tokens per repeat input), `repeat_tail` (tokens of the previous chunk
    quoted in the next prompt) and `prompts` (the repeat prompts' style,
    `models.reconstruct.repeat_prompts`) say how the engine cuts the inputs."""

    repeat_chunk: int
    repeat_tail: int
    prompts: str

    def reconstruction(self) -> Policy:
        """The layer's policy while the engine feeds the repeat inputs."""
        raise NotImplementedError

    def pass_policy(self, phase: Policy) -> Policy:
        """The policy of a layer of another policy during the pass (`phase`: its prompt-phase
        policy); by default the phase itself (its writes are discarded)."""
        return phase

    def scores_in_pass(self, policy: Policy) -> bool:
        """Whether a layer running `policy` in the pass scores (the engine keeps its state)."""
        raise NotImplementedError

    def before_chunk(self, state: SlotState, lo: int, hi: int, end: int) -> SlotState:
        """A scoring layer's prompt state (any leading axes: a run of layers) before the repeat
        input of context tokens [lo, hi), whose real tokens end at position `end`."""
        return state

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """The prompt cache (one stacked state per run, `scored`: whether the run scores) after
        the last repeat input, given every reconstructor of the model: e.g. a choice made over all
        layers at once. By default unchanged."""
        return states


class Appends:
    """Capability: a reconstructor whose prompt of t tokens is followed, after its pass and before `after_pass`,
    by n learned tokens that go once through an adapted copy of the model at positions t..t+n-1, attending to the
    whole prompt (RestoreKV's restore tokens): the engine runs them through every layer's prompt phase
    (`models.lora.append_pass`), hands each scoring layer's state to `after_append`, and the prompt then ends at
    t + n (`Engine.compress`, `generate`; `appended_tokens`)."""

    def appended(self) -> dict:
        """{"embeddings": [n, d] the tokens' input embeddings, "lora_A": {weight: [L, r, I]}, "lora_B": {weight:
        [L, O, r]}, "alpha": float}: what the pass feeds, and the LoRA on `models.llama`'s layer weights."""
        raise NotImplementedError

    def after_append(self, state: Any, t: int) -> Any:
        """A scoring layer's prompt state (any leading axes) once the tokens are in after a t-token prompt."""
        return state


def appended_tokens(reconstructors: tuple) -> int:
    """How many tokens the reconstruction pass of `reconstructors` appends after the prompt (`Appends`; one pass
    serves all, so they must append the same arrays), 0 for none."""
    arrays = {id(p.appended()): p.appended() for p in reconstructors if isinstance(p, Appends)}
    if len(arrays) > 1:
        raise ValueError("reconstructors that append different tokens (Appends.appended): one pass serves all")
    return int(next(iter(arrays.values()))["embeddings"].shape[0]) if arrays else 0


def pass_policies(reconstructors: tuple, phases: tuple) -> tuple:
    """Each layer's policy in the reconstruction pass of `reconstructors` (the layers' prompt-phase
    policies `phases`): a reconstructor's own layers run its `reconstruction()`, every other layer
    what the first reconstructor says (`pass_policy`); the phases themselves without one."""
    if not reconstructors:
        return tuple(phases)
    return tuple(p.of.reconstruction() if isinstance(p, PromptPhase) and reconstructs(p.of)
                 else reconstructors[0].pass_policy(p) for p in phases)


def prompt_policy_of(policy: Policy) -> Policy:
    """The policy that holds a fresh prompt for `policy`: its prompt phase, or itself (streaming)."""
    return policy.prompt_policy() if isinstance(policy, PromptCompressor) else policy


def after_prompt(policy: Policy, state: SlotState, table: Int[Array, "N"] | None = None) -> SlotState:
    """`policy`'s decode state from its prompt phase's state (`prompt_policy_of`) after the whole
    prompt: a prompt compressor compresses it here, once; unchanged for a streaming policy.
    `table`: the kept counts of a `KeptTable` shape class (`shape_class`), as data."""
    if not isinstance(policy, PromptCompressor):
        return state
    return policy.after_prompt(state) if table is None else policy.after_prompt(state, table)


class KeptTable:
    """Capability: a prompt compressor whose count kept after the prompt is a table over the
    prompt's length (kvpress's ratio, a budget, pyramidkv's per-layer schedule), which an engine
    can hand over as data instead of compiling it in (`models.engine.Engine(..., slots=S)`).

    `shape_class(slots)` is the same method at `slots` decode slots per kv head with what it keeps
    left out of its fields; its `after_prompt(state, table)` keeps `table[n]` tokens per kv head
    of an n-token prompt, so every ratio, budget and pyramid layer whose state fits `slots` shares
    one policy, hence one compiled step. With the table of `kept_table(max_len)` it keeps what
    this policy keeps, and decodes alike as long as nothing overflows (at most `max_new` tokens
    appended after the compression: the engine checks that). On an overflow a shape class
    recompresses to `slots - max_new` tokens (this policy: its own stream rule)."""

    def kept_table(self, max_len: int) -> np.ndarray | None:
        """[max_len + 1] int32: tokens per kv head kept after an n-token prompt (on average, for a
        head pool); None where this setting has no such table (then it is not bucketed)."""
        raise NotImplementedError

    def shape_class(self, slots: int) -> Policy:
        """This method at `slots` decode slots per kv head, its kept count given as data."""
        raise NotImplementedError


def shape_class_of(policy: Policy, max_len: int, slots: int) -> tuple[Policy, np.ndarray | None]:
    """(the policy a `slots`-slot engine runs for `policy`, the kept table it is given or None):
    a `KeptTable` whose table exists and whose own state fits `slots` becomes its shape class;
    any other policy is itself."""
    if isinstance(policy, KeptTable) and policy.capacity(max_len) <= slots:
        table = policy.kept_table(max_len)
        if table is not None:
            return policy.shape_class(min(slots, max_len)), np.asarray(table, np.int32)
    return policy, None


def reconstructs(policy: Policy) -> bool:
    """Whether `policy` scores its prompt with a reconstruction pass (`Reconstructor`)."""
    return isinstance(policy, Reconstructor)


class ReadsGradients:
    """Capability: a reconstruction-pass policy whose scores read, for each repeat input, the norm of the
    gradient of Phi = sum ||h^L||^2 (the last layer's output over the input's real tokens) with respect to
    its layer's attention output at each repeat token (kvgrad). Before each input the engine's pass runs a
    gradient pass (`models.gradient`) in which this layer runs `gradient_policy()`, then hands the norms."""

    def gradient_policy(self) -> Policy:
        """The layer's policy in the gradient pass (the same attention, nothing scored)."""
        raise NotImplementedError

    def read_gradients(self, state: Any, norms: Float[Array, "B T"]) -> Any:
        """The layer's pass state with the next repeat input's gradient norms [B, T] (pads included)."""
        raise NotImplementedError


def reads_gradients(policy: Any) -> bool:
    """Whether the reconstruction pass hands `policy` gradient norms (`ReadsGradients`)."""
    return isinstance(policy, ReadsGradients)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptState(SlotState):
    """Every prompt token, plus the attention rows of the newest W queries.

    rows:    [B, K, W, S] float32: row r holds the attention of the query at position
             `row_pos[b, r]` (r = position mod W) over the slots, summed over G.
    row_pos: [B, W] int32 position of each row's query, -1 for an empty row.
    extra:   dict of what else the phase collects: "mass" [B, K, S] float32 (columns);
             "q_sum" [B, K, G, D], "q_sq" [B, K, G, D, D], "q_n" [B] float32 and "inv_freq"
             [D/2] (query_sink; zeros from the model's `init_cache`, which knows G: `with_query_sums`).
    """

    rows: Float[Array, "B K W S"]
    row_pos: Int[Array, "B W"]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PromptPhase(PrefixSlots, Bounded, Policy):
    """Dense prompt storage for the prompt compressor `of` (its codec, its observation window,
    what else it collects: column sums, query statistics). Slot j holds token j; rows and column
    sums of slots past every query are 0: a step at positions < n needs the first n slots
    (`PrefixSlots`: prefill attention follows the filled length)."""

    of: Policy = None
    obs_window: int = 32
    columns: bool = False
    query_sink: int = -1

    def __post_init__(self):
        check_int("prompt phase", "obs_window", self.obs_window, 0)
        check_int("prompt phase", "query_sink", self.query_sink, -1)

    @property
    def score_rows(self):  # the rows of the newest W queries
        return self.obs_window or None

    @property
    def observes(self):
        return (("scores",) if self.obs_window else ()) + (("columns",) if self.columns else ()) + (
            ("q", "rope") if self.query_sink >= 0 else ())

    def capacity(self, max_len):
        return max_len

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = empty_slots(self.codec, batch, kv_heads, head_dim, dtype, max_len)
        w = self.obs_window
        extra = {"mass": jnp.zeros((batch, kv_heads, max_len), jnp.float32)} if self.columns else {}
        return PromptState(st.k, st.v, st.pos, rows=jnp.zeros((batch, kv_heads, w, max_len), jnp.float32),
                           row_pos=jnp.full((batch, w), -1, jnp.int32), extra=extra)

    def head(self, state, n, lead=0):
        cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, n, axis=lead + axis)  # noqa: E731
        slots = head_slots(SlotState(state.k, state.v, state.pos), n, lead)
        extra = dict(state.extra, **({"mass": cut(state.extra["mass"], 2)} if "mass" in state.extra else {}))
        return PromptState(slots.k, slots.v, slots.pos, rows=cut(state.rows, 3), row_pos=state.row_pos, extra=extra)

    def with_head(self, state, head, lead=0):
        put = lambda buf, x, axis: jax.lax.dynamic_update_slice_in_dim(buf, x, 0, axis=lead + axis)  # noqa: E731
        slots = put_head(SlotState(state.k, state.v, state.pos), SlotState(head.k, head.v, head.pos), lead)
        extra = dict(head.extra)  # the query statistics are not per slot (and appear at the first step)
        if "mass" in extra:
            extra["mass"] = put(state.extra["mass"], head.extra["mass"], 2)
        return PromptState(slots.k, slots.v, slots.pos, rows=put(state.rows, head.rows, 3), row_pos=head.row_pos,
                           extra=extra)

    def extend(self, state, k, v, pos):
        slots = SlotState(state.k, state.v, state.pos)
        written = write_at(slots, encode_new(self.codec, k, v, pos), pos[:, 0])  # contiguous chunk at pos[:, 0]
        return view_of(self.codec, written, pos, k.dtype, carry=(state, written, pos))

    def compact(self, view, seen):
        state, written, pos = view.carry
        w = self.obs_window
        rows, row_pos = state.rows, state.row_pos
        if w:
            # A chunk's positions are contiguous, so only its last min(T, W) queries can be among the
            # newest W: scatter those rows, not all T (the scatter of T rows dominated the step)
            m = min(pos.shape[1], w)
            last = pos[:, -m:]  # [B, m]
            row = jnp.where(last > pos[:, -1:] - w, last % w, w)  # w = dropped (not among the newest W)
            rows = jax.vmap(lambda r, i, x: r.at[:, i].set(x, mode="drop"))(rows, row, seen.scores[:, :, -m:])
            row_pos = jax.vmap(lambda r, i, x: r.at[i].set(x, mode="drop"))(row_pos, row, last)  # [B, W]
        extra = dict(state.extra)
        if self.columns:
            extra["mass"] = extra["mass"] + seen.columns  # [B, K, S]
        if self.query_sink >= 0:
            extra.update(query_sums(seen.q, pos, self.query_sink, extra))
            extra["inv_freq"] = jnp.asarray(seen.rope.inv_freq())  # [D/2]
        return PromptState(written.k, written.v, written.pos, rows=rows, row_pos=row_pos, extra=extra)


def with_query_sums(policy: Policy, state: Any, groups: int, head_dim: int) -> Any:
    """A fresh state of `policy` with a prompt phase's query statistics (query_sink >= 0) as zeros for
    G = `groups` query heads per kv head, which the model knows and `init` does not: the first step
    adds its sums to them as every later step does (x + 0 is x), so a prompt's pieces share one step
    program instead of the first compiling its own. Any other state is returned as it is."""
    if not (isinstance(policy, PromptPhase) and policy.query_sink >= 0) or "q_sum" in state.extra:
        return state
    b, kh = state.rows.shape[:2]
    zeros = {"q_sum": jnp.zeros((b, kh, groups, head_dim), jnp.float32),
             "q_sq": jnp.zeros((b, kh, groups, head_dim, head_dim), jnp.float32),
             "q_n": jnp.zeros((b,), jnp.float32), "inv_freq": jnp.zeros((head_dim // 2,), jnp.float32)}
    return dataclasses.replace(state, extra={**state.extra, **zeros})


def query_sums(q: Float[Array, "B K G T D"], pos: Int[Array, "B T"], n_sink: int, sums: dict[str, Any]
               ) -> dict[str, Any]:
    """`sums` ("q_sum", "q_sq", "q_n"; empty = zeros) plus the step's pre-RoPE queries at
    positions >= n_sink: their sum, the sum of their outer products and their number."""
    use = pos >= n_sink  # [B, T]
    q = jnp.where(use[:, None, None, :, None], q.astype(jnp.float32), 0.0)  # [B, K, G, T, D]
    step = {"q_sum": q.sum(axis=3),  # [B, K, G, D]
            "q_sq": jnp.einsum("BKGTI,BKGTJ->BKGIJ", q, q),  # [B, K, G, D, D]
            "q_n": use.sum(axis=1).astype(jnp.float32)}  # [B]
    return {n: x + sums[n] if n in sums else x for n, x in step.items()}


# -- what the engine asks about prompt phases (staged prompts shared between engines) -------------
def prompt_key(p: Policy) -> Policy:
    """What determines a prompt phase's state: a `PromptPhase` stores the same thing whatever
    prompt compressor it serves (`of`)."""
    return dataclasses.replace(p, of=None) if isinstance(p, PromptPhase) else p


def step_phase(p: Policy) -> Policy:
    """A layer's policy in the engine's prompt steps: `prompt_key` (layers whose compressors differ
    only in what they keep, like pyramidkv's per-depth budgets, run as one stacked run, compiled
    once), except a phase whose compressor reconstructs (kvzip: the pass reads `of`)."""
    return p if isinstance(p, PromptPhase) and reconstructs(p.of) else prompt_key(p)


def reads_prompt_state(mine: Policy, theirs: Policy) -> bool:
    """Whether a layer whose prompt phase is `mine` can take the prompt state of `theirs`: the
    same state (`prompt_key`), or `full` over a dense PromptPhase (its slots are full's)."""
    from kvpolicies.full import Full

    if prompt_key(mine) == prompt_key(theirs):
        return True
    return type(mine) is Full and isinstance(theirs, PromptPhase) and mine.codec == theirs.codec or covers(theirs, mine)


def covers(theirs: Policy, mine: Policy) -> bool:
    """Whether the prompt phase `theirs` holds all that `mine` collects, through the same attention:
    both plain `PromptPhase`s (not a subclass's, e.g. kvzap's) of one codec for no particular compressor (`of` None), neither summing
    columns (whose second pass changes the attention path), at least `mine`'s observation rows,
    and `mine`'s query statistics if any. Its slots are then `mine`'s bit for bit (the rows' scores
    are computed apart from the outputs, `kvpolicies.attention.dense.last_rows_scores`; tested on
    tiny and real models for steps of 2 tokens or more) and `adopt` cuts the rest away: one
    prefill serves snapkv, adakv, pyramidkv, knorm, tova's and streamingllm's kvpress forms and
    expected attention."""
    return (type(mine) is PromptPhase and type(theirs) is PromptPhase and mine.of is None
            and theirs.of is None and mine.codec == theirs.codec and not mine.columns and not theirs.columns
            and theirs.obs_window >= mine.obs_window and mine.query_sink in (-1, theirs.query_sink))


def superset(phases) -> "PromptPhase | None":
    """The one prompt phase that `covers` every phase of `phases` that a shared phase can cover, or
    None when fewer than two can (or their query statistics differ)."""
    ok = [p for p in phases if type(p) is PromptPhase and p.of is None and not p.columns]
    sinks = {p.query_sink for p in ok} - {-1}
    if len(set(ok)) < 2 or len(sinks) > 1 or len({p.codec for p in ok}) > 1:
        return None
    return PromptPhase(codec=ok[0].codec, obs_window=max(p.obs_window for p in ok),
                       query_sink=sinks.pop() if sinks else -1)


def restrict(phase: "PromptPhase", state: PromptState) -> PromptState:
    """A covering phase's state (`covers`) as `phase` would have built it: its newest
    `phase.obs_window` rows (row r: the query at the position p = r mod w among the newest w),
    and only the statistics `phase` collects. Any leading axes (a run of layers) carry over."""
    w, big = phase.obs_window, state.rows.shape[-2]
    rows, row_pos = state.rows, state.row_pos  # [..., B, K, W, S], [..., B, W]
    if w != big:
        newest = row_pos.max(axis=-1, keepdims=True)  # [..., B, 1]
        p = newest - (newest - jnp.arange(w)) % w if w else newest[..., :0]  # [..., B, w]: p = r mod w
        src = jnp.where(p >= 0, p % big, 0)
        rows = jnp.take_along_axis(rows, src[..., None, :, None], axis=-2)  # [..., B, K, w, S]
        rows = jnp.where((p >= 0)[..., None, :, None], rows, 0.0)
        row_pos = jnp.where(p >= 0, p, -1).astype(state.row_pos.dtype)
    return PromptState(state.k, state.v, state.pos, rows=rows, row_pos=row_pos,
                       extra={n: x for n, x in state.extra.items() if n in collected(phase)})


def collected(phase: "PromptPhase") -> set[str]:
    """The names of what `phase` collects beside its slots and rows (`PromptState.extra`)."""
    return ({"mass"} if phase.columns else set()) | ({"q_sum", "q_sq", "q_n", "inv_freq"} if phase.query_sink >= 0
                                                     else set())


def adopt(policy: Policy, state: Any) -> tuple[Any, bool]:
    """Another engine's prompt state for a layer of `policy`: (the state, whether its keys must
    be rotated) — `full` takes a PromptPhase's dense slots, whose keys are stored un-rotated; a
    PromptPhase takes a covering phase's state (`covers`), cut to what it collects (`restrict`)."""
    from kvpolicies.full import Full

    if isinstance(policy, Full) and isinstance(state, PromptState):
        return SlotState(state.k, state.v, state.pos), policy.rotated_keys
    if type(policy) is PromptPhase and policy.of is None and isinstance(state, PromptState) and (
            state.rows.shape[-2] != policy.obs_window or set(state.extra) - collected(policy)):
        return restrict(policy, state), False  # a covering phase's state (`covers`)
    return state, False
