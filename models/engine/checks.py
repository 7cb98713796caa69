"""Argument checks of `Engine` (on the host, with numpy, before anything is traced): token
ids, counts, lengths, policies; the `ArgumentChecks` mixin holds the per-engine ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvpolicies import limits
from kvpolicies.base import Policy
from kvpolicies.prompt import reads_prompt_state
from models.llama import policy_runs
from models.engine.extent import EngineCache, Maker, bare_shapes, refused

MAX_LEN = 2**31 - 2**16  # positions are int32 (and kvzip feeds up to ~2K repeat tokens past a context)


def check_int(name: str, value: Any, lo: int) -> int:
    """`value` as an int >= lo (numpy ints accepted, bools not), or ValueError naming `name`."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value >= lo:
        return int(value)
    raise ValueError(f"{name}={value!r}: must be an int >= {lo}")


def check_policies(policies: Any) -> None:
    """TypeError unless `policies` is a Policy or a sequence of Policy (one per layer)."""
    seq = isinstance(policies, Sequence) and not isinstance(policies, str)
    if isinstance(policies, Policy) or (seq and len(policies) and all(isinstance(p, Policy) for p in policies)):
        return
    hint = f" (build it with kvpolicies.get({policies!r}))" if isinstance(policies, str) else ""
    bad = next((p for p in policies if not isinstance(p, Policy)), None) if seq and len(policies) else policies
    raise TypeError(f"Engine policies: expected a Policy or a sequence of Policy (one per layer), got "
                    f"{type(bad).__name__} {bad!r}{hint}")


def check_pool(cache: Any) -> Any:
    """`cache`, after a ValueError if a paged pool in it was exhausted (a host sync, only for a
    cache that can exhaust: a paged one)."""
    if limits.can_exhaust(cache):
        limits.check_cache(cache, "Engine: ")
    return cache


def _where(index: tuple[int, ...]) -> str:
    return f"position {index[0]}" if len(index) == 1 else f"row {index[0]}, position {index[1]}"


def _first_bad(arr: np.ndarray, bad: np.ndarray, name: str, what: str) -> ValueError:
    """One error for the first True of `bad`: its value, where it is, and how many others."""
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    more = int(bad.sum()) - 1
    value = arr[first].item()
    tail = f" (and {more} more)" if more else ""
    return ValueError(f"{name}: token id {value!r} at {_where(first)} {what}{tail}")


def check_token_ids(tokens: Any, vocab_size: int, name: str = "tokens") -> np.ndarray:
    """`tokens` as an int32 numpy array, checked on the host: every id a whole number in [0, vocab_size).

    Integer arrays (and lists) are checked for range; float arrays are accepted when every value is
    a whole number (e.g. `np.zeros(5)`), otherwise the first non-integral id is reported; bool,
    string and object arrays are rejected. A ragged list of lists (rows of different lengths) is
    rejected here (`Engine.generate` and `Engine.score` take them before this check). Errors name `name`, the bad id and
    its position ("row b, position t" for a batch).
    """
    try:
        arr = np.asarray(tokens)
    except ValueError as e:  # numpy >= 1.24: "inhomogeneous shape"
        lengths = row_lengths(tokens)
        if lengths is not None and len(set(lengths)) > 1:
            raise ValueError(
                f"{name}: ragged batch (rows of lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''}) is not "
                "supported here (Engine.generate and Engine.score take one): pad the rows to one length or run "
                "them separately"
            ) from None
        raise ValueError(f"{name}: cannot be read as an array of token ids ({e})") from None
    kind = arr.dtype.kind
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            raise _first_bad(arr, bad, name, "is not an integer")
    elif kind not in "iu":
        raise ValueError(f"{name}: token ids must be integers, got an array of dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise _first_bad(arr, bad, name, f"is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int32, copy=False)


def row_lengths(tokens: Any) -> list[int] | None:
    """Lengths of the rows of a list of sequences, or None if it is not one."""
    if not isinstance(tokens, Sequence) or isinstance(tokens, (str, bytes)):
        return None
    if not all(isinstance(r, (Sequence, np.ndarray)) and not isinstance(r, (str, bytes)) for r in tokens):
        return None
    return [len(r) for r in tokens]


def is_ragged(tokens: Any) -> bool:
    """A list of token rows of different lengths."""
    lengths = row_lengths(tokens)
    return lengths is not None and len(set(lengths)) > 1


class ArgumentChecks:
    """The engine's checks of its arguments (`Engine` inherits them)."""

    def _tokens(self, tokens: Any, name: str, ndims: tuple[int, ...]) -> np.ndarray:
        """Host-side check of a token array: ids, rank and a non-empty batch."""
        arr = check_token_ids(tokens, self.cfg.vocab_size, name)
        if arr.ndim not in ndims:
            want = " or ".join({1: "[T]", 2: "[B, T]"}[d] for d in ndims)
            raise ValueError(f"{name}: expected token ids of shape {want}, got shape {arr.shape}")
        if arr.ndim == 2 and arr.shape[0] == 0:
            raise ValueError(f"{name}: empty batch (shape {arr.shape})")
        return arr

    def _check_len(self, end: int, what: str):
        if end > self.max_len:
            raise ValueError(f"{what} exceeds the engine's max_len={self.max_len}")

    def _chunk(self, chunk: Any, default: int, t: int | None = None) -> int | tuple[int, ...]:
        """A chunk size (None: `default`), or with `t`, a list of each step's tokens summing to t
        (power-of-two pieces of ragged lengths compile one step per piece length, not per length)."""
        if t is not None and isinstance(chunk, (list, tuple)):
            sizes = tuple(check_int(f"chunk[{i}]", c, 1) for i, c in enumerate(chunk))
            if sum(sizes) != t:
                raise ValueError(f"chunk: the steps' sizes {list(sizes)} sum to {sum(sizes)}, not to the {t} tokens fed")
            return sizes
        return default if chunk is None else check_int("chunk", chunk, 1)

    def _check_repeat(self):
        if self.reconstructors and self.repeat is None:
            raise ValueError("kvzip scores a prompt by reconstructing it: give the engine the tokenizer or the repeat "
                             "prompts, Engine(..., repeat=tokenizer) or repeat=models.reconstruct.repeat_prompts(tokenizer)")

    def _rows(self, rows: Sequence, name: str) -> list[np.ndarray]:
        out = []
        for i, r in enumerate(rows):
            r = self._tokens(r, f"{name} row {i}", (1,))
            if r.shape[0] == 0:
                raise ValueError(f"{name} row {i}: empty")
            out.append(r)
        return out

    def _check_room(self, state: Prompted, written: int, what: str) -> None:
        """A shape-class engine (`slots`) decodes as its exact policies only while what follows the
        compression fits their `max_new` slots: more is refused before anything runs."""
        if self.slot_limit is None:
            return
        after = state.length - state.compressed_at if state.compressed_at >= 0 else 0
        if after + written > self.slot_limit:
            raise ValueError(f"{what}: {after} + {written} tokens after the compression, past max_new="
                             f"{self.slot_limit} of this Engine(slots={self.slots}): its shape classes keep the exact "
                             "policies' tokens only until they would recompress; use an Engine without slots=")

    # -- a state's extent and maker (models.engine.extent) -------------------------------------
    def maker(self, prompt: bool = False) -> Maker:
        """This engine's layout, as the caches it makes carry it (prompt: its prompt phase's)."""
        key = "_maker_prompt" if prompt else "_maker"
        if key not in self.__dict__:
            c = self.cfg
            dtype = np.dtype(self.cache_dtype if self.cache_dtype is not None else self._model.dtype).name
            self.__dict__[key] = Maker(tuple(self.prompt_policies if prompt else self.policies), self.max_len,
                                       (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_model, c.vocab_size),
                                       dtype)
        return self.__dict__[key]

    def _extent(self, cache: Any, what: str, bare: bool, batch: int) -> tuple[tuple, np.ndarray | None]:
        """(the runs, the next position of each row [B]) of a decode-phase cache this engine made
        for `batch` rows, or one clear ValueError. A bare tuple of run states (`bare`: allowed) is
        checked against this engine's shapes and has no known length (None)."""
        if isinstance(cache, EngineCache):
            if cache.maker != self.maker():
                raise refused(what, cache.maker, self.maker())
            length = np.asarray(cache.length)
            if length.shape != (batch,):
                raise ValueError(f"tokens: batch {batch} does not match the cache's batch {length.shape[0]}")
            return cache.runs, length
        if not bare:
            raise ValueError(f"{what}: expected the cache an Engine returned (init_cache, prefill, step), which "
                             f"carries where it ends; got a bare {type(cache).__name__} of run states")
        shapes = self.__dict__.setdefault("_bare_shapes", {})
        if batch not in shapes:
            shapes[batch] = jax.eval_shape(lambda: self._model.init_cache(self.policies, batch, self.max_len,
                                                                          self.cache_dtype))
        bare_shapes(cache, shapes[batch], what)
        return tuple(cache), None

    def _check_made(self, state: Any, what: str) -> None:
        """A `Prompted` this engine made (its decode phase once compressed), or an uncompressed one
        whose prompt phase this engine reads (`shares_prompt`): else one clear ValueError."""
        made = getattr(state, "maker", None)
        if made is None:
            return  # a Prompted built by hand: the layout checks of `_adopt` / the steps apply
        want = self.maker(prompt=not state.compressed)
        if made == want:
            return
        if not state.compressed and made.model == want.model and made.max_len == want.max_len \
                and made.dtype == want.dtype and self._reads(made.policies):
            return
        raise refused(what, made, want)

    def _reads(self, policies: tuple) -> bool:
        """Whether this engine's prompt phase takes, layer by layer, the prompt states of `policies`."""
        n = self.cfg.n_layers
        if [r[:2] for r in policy_runs(policies, n)] != [r[:2] for r in policy_runs(self.prompt_policies, n)]:
            return False
        return all(reads_prompt_state(a, b) for a, b in zip(self.prompt_policies, policies))

    def _check_row(self, row: Any, batch: int) -> int:
        """A batch row index in [0, batch), or ValueError naming it."""
        row = check_int("row", row, 0)
        if row >= batch:
            raise ValueError(f"row={row}: the state has {batch} row{'s' if batch > 1 else ''} (row 0..{batch - 1})")
        return row
