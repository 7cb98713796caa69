"""One dense prefill per context, shared by every job of a process that can use it.

Prompt compressors (snapkv, adakv, pyramidkv at any budget; knorm, random, kvzip; ...) differ only
in what they keep after the prompt: their prompt phase stores the same dense state
(`Engine.shares_prompt`), and `Prompted` states are functional values, so one prefill of a
context can be compressed by each of them in turn (`Engine.compress` leaves its input usable).
`sharing()` turns on a process-wide store of uncompressed prompt states, keyed by the exact
token ids, batch shape and chunk; `prompted(engine, tokens, chunk)` returns a stored state that
`engine` can compress (the same engine, or one that `shares_prompt` with the one that prefilled
it), and prefills otherwise (storing the state when `engine` is a prompt compressor: a streaming
policy's prompt state, already its decode state, serves no other policy). A kvzip engine gets
the state after its reconstruction pass (`Engine.reconstruct`), stored too: kvzip at another ratio
or budget compresses it without a second pass. `evals.compare` (and so `evals.suite`) runs its jobs
inside `sharing()`: every budget of a prompt compressor, and `full` beside them, reuse the first
job's prefills. The store is bounded (least recently used states are dropped past `limit_bytes`)
and holds nothing once the `with` block ends. Without `sharing()`, `prompted` is `engine.prompt`.

Counters: `Store.hits` (prefills avoided), `Store.prefills` (prefills run through the store).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

DEFAULT_LIMIT_BYTES = 4 << 30


def state_bytes(state: Any) -> int:
    """Bytes of the arrays of a state (a `Prompted`: its cache and last logits)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves((state.cache, state.logits)))


class Store:
    """Uncompressed prompt states by (token ids, shape, chunk): each a list of (engine, state)."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.entries: collections.OrderedDict[tuple, list[tuple[Any, Any, int]]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.prefills = 0

    @staticmethod
    def key(tokens: np.ndarray, chunk: int | None) -> tuple:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        return tokens.shape, hashlib.sha256(tokens.tobytes()).hexdigest(), chunk

    def prompt(self, engine, tokens: np.ndarray, chunk: int | None):
        key = self.key(tokens, chunk)
        state = None
        # a state that holds kvzip's scores (Engine.reconstruct) serves kvzip engines only, and first
        for src, st, _ in sorted(self.entries.get(key, []), key=lambda e: getattr(e[1], "scored", None) is None):
            if getattr(st, "scored", None) is not None and not engine.reconstructors:
                continue
            if src is engine or engine.shares_prompt(src):
                self.entries.move_to_end(key)
                self.hits += 1
                engine.prefills_shared += 1
                state = st
                break
        if state is None:
            state = engine.prompt(tokens, chunk=chunk)
            self.prefills += 1
            if engine.compresses:  # a streaming policy's prompt state serves no other
                self._put(key, engine, state)
        if engine.reconstructors:  # kvzip: its pass once per context, for every ratio or budget that scores alike
            scored = engine.reconstruct(state)
            if scored is not state:
                self._put(key, engine, scored)
            state = scored
        return state

    def _put(self, key: tuple, engine, state) -> None:
        n = state_bytes(state)
        if n > self.limit_bytes:
            return
        self.entries.setdefault(key, []).append((engine, state, n))
        self.entries.move_to_end(key)
        self.bytes += n
        while self.bytes > self.limit_bytes:  # drop the least recently used contexts
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= sum(b for _, _, b in dropped)


_STORE: Store | None = None


@contextlib.contextmanager
def sharing(limit_bytes: int = DEFAULT_LIMIT_BYTES) -> Iterator[Store]:
    """Share prompt prefills among the engines used inside the block (limit 0: share nothing)."""
    global _STORE
    outer, _STORE = _STORE, Store(limit_bytes)
    try:
        yield _STORE
    finally:
        _STORE = outer


def prompted(engine, tokens: np.ndarray, chunk: int | None):
    """`engine.prompt(tokens, chunk)`, or the state of an earlier identical prefill that `engine`
    can compress, when inside `sharing()`."""
    return engine.prompt(tokens, chunk=chunk) if _STORE is None else _STORE.prompt(engine, tokens, chunk)
