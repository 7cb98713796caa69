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
same batch give each press's own floats bit for bit (tests/evals/test_shared_answers.py). States
of several presses of one prompt may also join as the rows of one batch (`shared_rows`); a batch of
another shape may round otherwise (XLA groups a matmul's sums by the batch's shape), and on XLA:CPU
a larger batch was not faster (docs/results/speed.md), so `evals.peer` keeps a press's ratios as its
batch.

Head pools (`kvpolicies.adakv.AdaKV`'s shape class, `kvpolicies.adascored.AdaScored` and CriticalAdaKV's
`kvpolicies.critical.CriticalAda`, which keeps AdaScored's decode steps: K x S slots
shared by a layer's K kv heads, head segments contiguous) also only append after kvpress's
compression (every head gets each new token, within the pool's K x max_new free slots). Their state
converts (`pool_rows`, one gather) to per-head rows of S' = the engine's max_len slots (head h's
tokens in text order, then empty slots): the most a head can hold, so one canonical policy of S'
slots answers every ratio and every head-pool press of a grid. The same (head, position, key, value)
sets, but NOT the same floats: the pool's own attention sums over the masked K x S pool, the
canonical form over each head's S' slots (another summation order; the question's logits agree to
float32 rounding, the greedy ids in the tests and on issue 57's grid). The full cache (`Full`: slot i
holds token i, keys stored after RoPE) has the same form: its max_len slots are its rows already (its
own steps read the stored slots and the new ones as separate attention pieces: float32 rounding
apart), so its row joins the head pools' batch. A head-pool row and a prompt scorer's row join one
batch only where their S' agree. KVzip's pool (`kvpolicies.kvzip.KVzip`: a `HeadPool` whose decode also only
appends, within max_new per head) converts the same way. A policy that decodes otherwise (kvzap, duo ...) has no
canonical form (`canonical` gives None) and keeps its own engine.

Shapes: L layers of a run, B batch rows, K kv heads, Kp = 1 or K position rows, S slots, S' slots per
head of a head pool's canonical rows, P = K x S pool slots, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvpolicies.adakv import AdaKV, HeadPool, head_of
from kvpolicies.adascored import AdaScored, CountedPool
from kvpolicies.base import EMPTY, SlotState, keys_rotated
from kvpolicies.full import Full
from kvpolicies.knorm import Knorm
from kvpolicies.kvzip import KVzip
from kvpolicies.prompt_scored import PromptScored

# what a decode step of a prompt scorer does with its slots (the view attention reads, the writes, the
# sparse reads); a class that overrides any of them decodes otherwise than the canonical policy
_DECODE = ("extend", "compact", "select", "defer", "appends_quietly", "pad_spare", "cut_spare", "spared")
# the same for a head pool of adascored's (`init`: its pool's layout)
_POOL_DECODE = ("init", "extend", "compact", "select", "defer", "appends_quietly")


def head_pool(policy: Any) -> bool:
    """A head pool whose decode only appends after kvpress's compression (within its max_new): adakv's
    shape class (the engine refuses more, `appends_only`) or adascored and its subclasses, which keep its
    decode steps (K x max_new free pool slots; CriticalAdaKV: `kvpolicies.critical.CriticalAda`), or kvzip's
    pool (`KVzip`: every head gets each new token, within max_new; `shared_rows` refuses more)."""
    return (type(policy) is AdaKV and policy.appends_only) or type(policy) is KVzip or (
        isinstance(policy, AdaScored) and not any(getattr(type(policy), m) is not getattr(AdaScored, m)
                                                  for m in _POOL_DECODE))


def _form(slots: int, max_new: int, codec: Any) -> Knorm:
    """A knorm shape class of `slots`: no statistics, every layer compressed, keys stored after RoPE
    (`rotated`) unless the codec encodes before it."""
    pol = Knorm(budget=0, max_new=max_new, dense_layers=0, codec=codec).shape_class(slots)
    return dataclasses.replace(pol, rotated=keys_rotated(codec))


def canonical(policy: Any, max_len: int = 0) -> Knorm | None:
    """The append-only policy that decodes a compressed state of `policy` alike: for a shape-class
    prompt scorer that only appends with the base class's decode steps, a knorm shape class of the
    same slots, max_new and codec; for a head pool (`head_pool`) or the full cache (`Full`: every
    token, appended in place), the same of `max_len` slots per head (its engine's; required) that may
    append up to max_len tokens (what the head pool may append, its max_new, is checked by
    `shared_rows`), so that both share one form; else None."""
    if head_pool(policy) or type(policy) is Full:
        if not max_len:
            raise ValueError(f"canonical({type(policy).__name__}): its canonical rows hold max_len slots "
                             "per head: pass its engine's max_len")
        return _form(max_len, max_len, policy.codec)
    if not isinstance(policy, PromptScored) or not policy.appends_only or policy.spare:
        return None
    if any(getattr(type(policy), m, None) is not getattr(Knorm, m, None) for m in _DECODE):
        return None
    if not getattr(type(policy).observe, "chunked", False):  # its question would run token by token
        return None
    return _form(policy.slots, policy.max_new, policy.codec)


def canonical_of(engine: Any) -> Knorm | None:
    """The one canonical policy of every layer of `engine` (whose compressed cache is one run), or None."""
    pols = {canonical(p, engine.max_len) for p in engine.policies}
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
                         "canonical append-only form (a shape class's prompt scorer or a head pool; see canonical)")
    if "_answering" not in engine.__dict__:
        out = Engine(engine._model, (pol,) * engine.cfg.n_layers, max_len=engine.max_len,
                     cache_dtype=engine.cache_dtype, rope_tables=engine.params[1] is not None, share_steps=True)
        out.slot_limit = pol.max_new  # what the shape classes it stands for may append (`_check_room`)
        engine._answering = out
    return engine._answering


def append_state(run: SlotState, kv_heads: int, slots: int) -> SlotState:
    """A run's compressed state (leaves [L, B, K|Kp, S, ...]) as the canonical append-only state of
    `slots` slots: a head pool's per-head rows (`pool_rows`), else its keys, values and positions (broadcast
    to K position rows), every other field dropped."""
    if type(run) in (HeadPool, CountedPool):
        return pool_rows(run, slots)
    pos = run.pos  # [L, B, Kp, S]
    pos = jnp.broadcast_to(pos, pos.shape[:2] + (kv_heads,) + pos.shape[3:])  # [L, B, K, S]
    return SlotState(k=run.k, v=run.v, pos=pos)


@functools.partial(jax.jit, static_argnums=1)
def pool_rows(run: HeadPool | CountedPool, slots: int) -> SlotState:
    """A head pool's state (leaves [L, B, K, S, ...]: K rows of one flat pool of P = K x S slots, head
    segments contiguous in head order, each in text order) as per-head rows [L, B, K, slots, ...]: head
    h's c_h tokens in slots 0..c_h-1 of row h (the pool's order), then empty slots (pos -1, zeros).
    The heads' counts: `counts` (adascored) or `head_of`'s segments (adakv); one gather for every layer.
    `slots` must cover every head's count (a head holds distinct positions: max_len always does)."""
    l, b, kh, s = run.pos.shape
    flat = run.pos.reshape(l, b, kh * s)  # [L, B, P]
    if isinstance(run, CountedPool):
        counts = run.counts  # [L, B, K]
    else:
        head = head_of(flat, kh)  # [L, B, P], K for empty slots
        counts = (head[..., None, :] == jnp.arange(kh)[:, None]).sum(axis=-1, dtype=jnp.int32)  # [L, B, K]
    j = jnp.arange(slots)  # [S']
    live = j < counts[..., None]  # [L, B, K, S']
    idx = jnp.where(live, (jnp.cumsum(counts, axis=-1) - counts)[..., None] + j, 0)  # [L, B, K, S'] pool slots

    def take(x):  # [L, B, K, S, ...] -> [L, B, K, S', ...]
        x = x.reshape((l * b, 1, kh * s) + x.shape[4:])  # [L*B, 1, P, ...]
        got = jnp.take_along_axis(x, idx.reshape((l * b, kh, slots) + (1,) * (x.ndim - 3)), axis=2)
        got = got.reshape((l, b, kh, slots) + x.shape[3:])  # [L, B, K, S', ...]
        return jnp.where(live.reshape(live.shape + (1,) * (got.ndim - 4)), got, jnp.zeros((), got.dtype))

    pos = jnp.where(live, take(run.pos), EMPTY)  # [L, B, K, S']
    return SlotState(k=jax.tree.map(take, run.k), v=jax.tree.map(take, run.v), pos=pos)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _batch(runs: tuple[SlotState, ...], tables: dict | None, rotate: tuple[bool, ...], local: tuple,
           ropes: tuple) -> SlotState:
    """The rows' states (leaves [L, 1, K, S, ...]) as one batch [L, B, K, S, ...] in one program, the
    keys of the rows marked in `rotate` rotated at their positions, layer l by its RoPE (the local or
    global table, or `ropes` without tables): the rotation attention applies to un-rotated stored keys
    (the same cos/sin and formula, elementwise, so a row's keys are the same floats whatever batch
    it joins). The other rows' keys are copied as they are."""
    cat = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *runs)
    if not any(rotate):
        return cat
    pick = (lambda loc: tables["local" if loc else "global"]) if tables is not None else (lambda loc: ropes[loc])
    if len(set(local)) == 1:
        k = pick(local[0]).apply(cat.k, cat.pos)  # [L, B, K, S, D]
    else:
        k = jnp.stack([pick(loc).apply(cat.k[i], cat.pos[i]) for i, loc in enumerate(local)])
    keep = jnp.asarray(rotate)[None, :, None, None, None]  # [1, B, 1, 1, 1]
    return dataclasses.replace(cat, k=jnp.where(keep, k, cat.k))


def batch_rows(eng: Any, runs: Sequence[SlotState], rotate: Sequence[bool]) -> SlotState:
    """`runs` (one row each, in `eng`'s canonical layout) as one batch; the keys of the rows marked in
    `rotate` stored after RoPE, as `eng`'s rotated canonical policy reads them (`PromptScored.rotated`):
    rotated once here, never again by a step."""
    m = eng._model
    return _batch(tuple(runs), eng.params[1], tuple(bool(x) for x in rotate),
                  tuple(bool(x) for x in eng.cfg.local_layers), (m.rope, m.rope_local))


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
    runs, rotate = [], []
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
        pol = e.policies[0]
        after = st.length - st.compressed_at if st.compressed_at >= 0 else 0
        if head_pool(pol) and after + written > pol.max_new:  # a head pool's free slots: max_new per head
            raise ValueError(f"shared_rows: {after} + {written} tokens after the compression, past max_new="
                             f"{pol.max_new} of {type(pol).__name__}'s pool (it would evict)")
        runs.append(append_state(st.cache[0], eng.cfg.n_kv_heads, eng.policies[0].slots))
        rotate.append(eng.policies[0].rotated_keys and not getattr(pol, "rotated_keys", False))  # full's are
    cache = (batch_rows(eng, runs, rotate),)  # leaves [L, B, ...]
    first = pairs[0][1]
    logits = jnp.concatenate([st.logits for _, st in pairs])  # [B, V]
    return eng, dataclasses.replace(first, cache=cache, logits=logits, tokens=None, maker=eng.maker())
