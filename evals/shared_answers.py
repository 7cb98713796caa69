"""Compressed states of different prompt compressors answered as the rows of one batch, through one
set of compiled steps (`evals.peer`'s `answer=shared`).

On kvpress's protocol the context is compressed once; after that a shape class's prompt scorer
(`kvpolicies.prompt_scored.PromptScored` with `appends_only`) only appends: the question and the
greedy tokens go to its free slots, nothing is evicted, and its statistics are never read again.
Its decode steps then read and write the stored keys, values and positions the same way whatever
ranked them (snapkv, knorm, tova, streamingllm, expected attention, pyramidkv's shape class ...):
the same `extend`, `compact`, `select` and `defer`. So each state converts to one canonical
append-only state (its `SlotState` of keys, values and positions, statistics dropped; the same
un-rotated keys and RoPE at text positions) that `canonical`'s policy decodes alike: the question
and decode steps compile once per (S, batch shape) for every press, not once per press, and at the
same batch give each press's own floats bit for bit (tests/models/test_shared_answers.py). States
of several presses of one prompt may also join as the rows of one batch (`shared_rows`); a batch of
another shape may round otherwise (XLA groups a matmul's sums by the batch's shape), and on XLA:CPU
a larger batch was not faster (docs/results/speed.md), so `evals.peer` keeps a press's ratios as its
batch. A policy that decodes otherwise (adakv's head pool, kvzip, duo, full ...) has no canonical
form (`canonical` gives None) and keeps its own engine.

Shapes: L layers of a run, B batch rows, K kv heads, Kp = 1 or K position rows, S slots, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvpolicies.base import SlotState, keys_rotated
from kvpolicies.knorm import Knorm
from kvpolicies.prompt_scored import PromptScored

# what a decode step of a prompt scorer does with its slots (the view attention reads, the writes, the
# sparse reads); a class that overrides any of them decodes otherwise than the canonical policy
_DECODE = ("extend", "compact", "select", "defer", "appends_quietly", "pad_spare", "cut_spare", "spared")

def canonical(policy: Any) -> Knorm | None:
    """The append-only policy that decodes a compressed state of `policy` alike (a knorm shape class
    of the same slots, max_new and codec: no statistics, every layer compressed), or None where
    `policy` is not a shape-class prompt scorer that only appends with the base class's decode steps."""
    if not isinstance(policy, PromptScored) or not policy.appends_only or policy.spare:
        return None
    if any(getattr(type(policy), m, None) is not getattr(Knorm, m, None) for m in _DECODE):
        return None
    if not getattr(type(policy).observe, "chunked", False):  # its question would run token by token
        return None
    return dataclasses.replace(Knorm(budget=0, max_new=policy.max_new, dense_layers=0, codec=policy.codec).shape_class(
        policy.slots), rotated=keys_rotated(policy.codec))


def canonical_of(engine: Any) -> Knorm | None:
    """The one canonical policy of every layer of `engine` (whose compressed cache is one run), or None."""
    pols = {canonical(p) for p in engine.policies}
    return next(iter(pols)) if len(pols) == 1 and None not in pols else None


def _key(engine: Any) -> tuple:
    """What the answering engine of `engine` depends on."""
    return (id(engine._model), canonical_of(engine), engine.max_len, str(engine.cache_dtype),
            engine.params[1] is not None)


def answering_engine(engine: Any) -> Any:
    """The engine of `canonical_of(engine)` for `engine`'s model, max_len and cache dtype, kept by
    `engine`; its jitted steps are shared (`share_steps`) by the answering engines of every press of
    the same key, so they compile once. It may append as many tokens after a compression as the
    policy's max_new (`slot_limit`)."""
    from models.engine import Engine

    pol = canonical_of(engine)
    if pol is None:
        raise ValueError(f"answering_engine: {sorted({type(p).__name__ for p in engine.policies})} have no common "
                         "canonical append-only form (a shape class's prompt scorer; see canonical)")
    if "_answering" not in engine.__dict__:
        out = Engine(engine._model, (pol,) * engine.cfg.n_layers, max_len=engine.max_len,
                     cache_dtype=engine.cache_dtype, rope_tables=engine.params[1] is not None, share_steps=True)
        out.slot_limit = pol.max_new  # what the shape classes it stands for may append (`_check_room`)
        engine._answering = out
    return engine._answering


def append_state(run: SlotState, kv_heads: int) -> SlotState:
    """A run's compressed state (leaves [L, B, K|Kp, S, ...]) as the canonical append-only state:
    keys, values and positions (broadcast to K position rows), every other field dropped."""
    pos = run.pos  # [L, B, Kp, S]
    pos = jnp.broadcast_to(pos, pos.shape[:2] + (kv_heads,) + pos.shape[3:])  # [L, B, K, S]
    return SlotState(k=run.k, v=run.v, pos=pos)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rotated(state: SlotState, tables: dict | None, local: tuple, ropes: tuple) -> SlotState:
    """The state's keys [L, B, K, S, D] rotated at their positions, layer l by its RoPE (the local or
    global table, or `ropes` without tables): the rotation attention applies to un-rotated stored
    keys (the same cos/sin and formula, elementwise)."""
    pick = (lambda loc: tables["local" if loc else "global"]) if tables is not None else (lambda loc: ropes[loc])
    k = [pick(loc).apply(state.k[i], state.pos[i]) for i, loc in enumerate(local)]
    return dataclasses.replace(state, k=jnp.stack(k))


def rotate_keys(eng: Any, state: SlotState) -> SlotState:
    """`state` (one run of every layer) with its keys stored after RoPE, as `eng`'s rotated
    canonical policy reads them (`PromptScored.rotated`): rotated once here, never again by a step."""
    m = eng._model
    return _rotated(state, eng.params[1], tuple(bool(x) for x in eng.cfg.local_layers), (m.rope, m.rope_local))


def shared_rows(pairs: Sequence[tuple[Any, Any]], written: int) -> tuple[Any, Any]:
    """(the answering engine, one `Prompted` batch) of the compressed one-row states `pairs` ((engine,
    state) each, of one prompt: the same length) whose engines share a canonical policy; `written`:
    the tokens that will follow the compression (each engine's room is checked, as its own feed
    would). The rows keep their order."""
    if not pairs:
        raise ValueError("shared_rows: no states")
    eng = answering_engine(pairs[0][0])
    lengths = {st.length for _, st in pairs}
    if len(lengths) != 1:
        raise ValueError(f"shared_rows: the states hold prompts of different lengths {sorted(lengths)} (one prompt's)")
    runs = []
    for e, st in pairs:
        if not st.compressed or st.fitted is not None:
            raise ValueError("shared_rows: every state must be compressed by its engine (Engine.compress, not fitted)")
        e._check_made(st, "shared_rows")
        if canonical_of(e) is None or _key(e) != _key(pairs[0][0]):
            raise ValueError(f"shared_rows: {type(e.policies[0]).__name__} (slots {getattr(e.policies[0], 'slots', 0)})"
                             " does not decode through the same canonical policy as the first state's")
        if len(st.cache) != 1 or st.logits.shape[0] != 1:
            raise ValueError(f"shared_rows: a one-row state of one run of layers, got {len(st.cache)} runs, "
                             f"{st.logits.shape[0]} rows")
        e._check_room(st, written, "shared_rows")
        runs.append(append_state(st.cache[0], eng.cfg.n_kv_heads))
    cache = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *runs)  # leaves [L, B, ...]
    cache = (rotate_keys(eng, cache) if eng.policies[0].rotated_keys else cache,)
    first = pairs[0][1]
    logits = jnp.concatenate([st.logits for _, st in pairs])  # [B, V]
    return eng, dataclasses.replace(first, cache=cache, logits=logits, tokens=None, maker=eng.maker())
