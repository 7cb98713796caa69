"""Jitted prefill/decode steps, greedy generation and streaming log-likelihood through a policy.

Shapes: B batch, T tokens in a step, C chunk length, V vocab, n generated tokens.

A prompt can also be run in stages, for protocols that compress a context before the question
is known (`Prompted`, a functional state: a fork is the same value used twice):
    s = engine.prompt(context)            # one prefill, through the policies' prompt phase
    s = engine.compress(s)                # after_prompt (a prompt compressor compresses here)
    ids = engine.continue_generate(s, question, n)   # question through the decode policies
`engine.extend_prompt(s, question)` instead keeps the question in the prompt phase (query-aware
compression after a shared context prefill). Every method that takes a `Prompted` leaves it
usable (the donated buffers are copies), so N questions can fork one state. Another engine
whose prompt phase stores the same state (`shares_prompt`: e.g. snapkv at any budget, and
`full`) can `compress` it: one dense prefill serves several prompt compressors. Counters:
`prefills` (fresh prompts prefilled), `prefill_tokens`, `prompts_compressed`, `prefills_shared`
(states prefilled by another engine and compressed here; `evals.prefills` keeps the count).

The model is split once into (graphdef, params); every step is a pure jitted function of
(params, cache, tokens, pos) with the cache donated, so the compiled step is reused for every
step of the same shape. `traces` counts how often each step kind was traced (compiled).

Generation (`generate`, `continue_generate`) decodes layer by layer by default
(`decode_loop="layers"`, `_decode_layers`): per step one jitted call per layer over that layer's
own weight and state arrays (`layer_weights`: one copy of the layer weights per model), then one
call writing every layer's new slots. On XLA:CPU that reads weights and keys/values in place,
where the layer scan materialises each layer's slices; `decode_loop="scan"` (and any engine on a
mesh) runs the fused `lax.scan` instead. `step`, `prefill` and `score` always use the scan.

Length buckets: where a policy stores token i in slot i (`kvpolicies.slots.PrefixSlots`: full), a step
whose positions all lie below n needs only the cache's first n slots. Each step is given the
smallest bucket of 1024 x 2^k x {1, 1.25, 1.5, 1.75} slots (decode) or 1024 x 2^k x {1, 1.5}
(chunks) that holds its positions (`reach_of`; static, so one trace per bucket reached), and
reads and writes only those slots: a 1K context in a 16K-slot cache costs a 1,280-slot step, and
a long prompt's chunks attend over the filled part, not max_len. An engine of at most 1,024
slots, or without such a policy, has one bucket.

Every public method checks its arguments on the host, with numpy, before anything is traced:
token ids must be whole numbers in [0, vocab) (an integer array, or a float array whose values are
all whole numbers), batches rectangular, counts and chunk sizes ints in range, and the sequence
within `max_len`; each violation is one ValueError naming the argument, the bad value and where.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int
from tqdm.auto import tqdm

from kvpolicies import limits
from kvpolicies.attend import Deferred, recording, write_deferred
from kvpolicies.base import Policy
from kvpolicies.kvzip import recon_policy
from kvpolicies.presets import stack_of
from kvpolicies.prompt import adopt, after_prompt, prompt_policy_of, reads_prompt_state, reconstructs
from kvpolicies.slots import has_prefix_slots
from kvpolicies.attention.tuning import Tuning
from models.llama import Cache, Llama, policy_runs
from models.reconstruct import RepeatPrompts, engine_prompts, reconstruct
from models.tokenizer import tokenizer_of


MAX_LEN = 2**31 - 2**16  # positions are int32 (and kvzip feeds up to ~2K repeat tokens past a context)
REACH_MIN = 1024  # the smallest length bucket (slots)


def reach_of(end: int, max_len: int, fine: bool = True) -> int | None:
    """The length bucket of a step whose positions are all below `end`: the smallest bucket
    >= end, or None (the whole cache) when that is not below max_len. Buckets are REACH_MIN x
    2^k x {1, 1.25, 1.5, 1.75} (`fine`: a decode step reads at most 25 % more than it needs), or
    x {1, 1.5} (a chunk of a prompt or stream: half the traces, at most 50 % more attention)."""
    steps = (4, 5, 6, 7) if fine else (4, 6)
    octave = REACH_MIN
    while True:
        for m in steps:
            r = octave * m // 4
            if r >= end:
                return r if r < max_len else None
        octave *= 2


@dataclasses.dataclass(frozen=True)
class Prompted:
    """A prompt run so far: the cache, the number of tokens in it (the next position), the last
    token's logits [B, V], and whether `after_prompt` has run (the cache is the decode state)."""

    cache: Cache
    length: int
    logits: jax.Array
    compressed: bool
    tokens: np.ndarray | None = None  # [B, length] the ids fed (kvzip reconstructs them)


def _fork(cache: Cache) -> Cache:
    """A copy of a cache, for a step that donates (and so invalidates) its input buffers."""
    return jax.tree.map(jnp.copy, cache)


_LAYER_WEIGHTS: "weakref.WeakKeyDictionary[Llama, tuple[dict, ...]]" = weakref.WeakKeyDictionary()


def layer_weights(model: Llama) -> tuple[dict, ...]:
    """Each layer's weights as separate arrays (a copy of the stacked layer weights, made once
    per model through host memory, no compilation; shared by the model's engines), with the
    q/k/v projections and the MLP's gate/up each concatenated into one matrix (`wqkv`, `w_gu`:
    one matvec instead of three and two; `models.llama.block` splits the products).
    Layer-by-layer decoding reads them in place."""
    if model not in _LAYER_WEIGHTS:
        stacked = {k: np.asarray(v[...]) for k, v in model.layers.items()}  # each [L, ...]
        fused = {"wqkv": ("wq", "wk", "wv"), "w_gu": ("w_gate", "w_up")}
        for name, parts in fused.items():
            stacked[name] = np.concatenate([stacked.pop(k) for k in parts], axis=-1)
        _LAYER_WEIGHTS[model] = tuple({k: jnp.array(a[i]) for k, a in stacked.items()}
                                      for i in range(model.cfg.n_layers))
    return _LAYER_WEIGHTS[model]


@jax.jit
def _take_layer(leaves: list, i) -> list:
    """Layer i of each stacked leaf (a copy; i traced: one compile per run's leaf shapes)."""
    return [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in leaves]


def _split_layers(cache: Cache) -> list:
    """A cache (one stacked state per run, every leaf [n, ...]) -> one state per layer, in
    layer order (copies). One call per layer of a program compiled once per run's leaf shapes:
    a single program of every layer's slices compiled one kernel per slice, much slower to
    compile (docs/results/speed.md, "Numbers behind comments in the code")."""
    out = []
    for run in cache:
        leaves, treedef = jax.tree.flatten(run)
        out += [treedef.unflatten(_take_layer(leaves, np.int32(i))) for i in range(leaves[0].shape[0])]
    return out


def _write_layers(states: list, writes: list) -> list:
    """Each layer's state after its step: its `Deferred` writes applied (in place: `states` is
    donated), or the new state it returned."""
    return [write_deferred(st, wr) if isinstance(wr, Deferred) else wr for st, wr in zip(states, writes)]


@functools.partial(jax.jit, static_argnums=3)
def _rotate_keys(k: Float[Array, "L B K S D"], pos: Int[Array, "L B Kp S"], tables: dict,
                 local: tuple[bool, ...]) -> Float[Array, "L B K S D"]:
    """Stored keys of a run of layers rotated at their slots' positions, as `attend` rotates a
    new key (the same RoPE tables, in k's dtype): layer l by the local or the global RoPE."""
    if len(set(local)) == 1:
        return tables["local" if local[0] else "global"].apply(k, pos)
    return jnp.stack([tables["local" if x else "global"].apply(k[i], pos[i]) for i, x in enumerate(local)])


def _check_int(name: str, value: Any, lo: int) -> int:
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


def _check_pool(cache: Any) -> Any:
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
        lengths = _row_lengths(tokens)
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


def _row_lengths(tokens: Any) -> list[int] | None:
    """Lengths of the rows of a list of sequences, or None if it is not one."""
    if not isinstance(tokens, Sequence) or isinstance(tokens, (str, bytes)):
        return None
    if not all(isinstance(r, (Sequence, np.ndarray)) and not isinstance(r, (str, bytes)) for r in tokens):
        return None
    return [len(r) for r in tokens]


def _is_ragged(tokens: Any) -> bool:
    """A list of token rows of different lengths."""
    lengths = _row_lengths(tokens)
    return lengths is not None and len(set(lengths)) > 1


class Engine:
    """Runs a `Llama` with a fixed per-layer policy tuple and maximum length (`decode_loop`: how
    generation runs its decode steps, "layers" or "scan"; the module docstring).

    `policies`: one per layer (or runs of them, `policy_runs`), or one `Policy` for the whole
    model, which the engine expands with `stack_of(policy, n_layers)`: itself in every layer, or a
    model-level preset's layers (pyramidkv's per-depth budgets, quest's and knorm's dense first
    layers, duo's per-layer head pattern). To run a preset's compressor in every layer instead,
    pass the tuple `(policy,) * n_layers`."""

    def __init__(self, model: Llama, policies: Policy | Sequence[Policy], max_len: int, cache_dtype=None,
                 repeat: RepeatPrompts | Any = None, rope_tables: bool = True, mesh=None,
                 decode_loop: str = "layers"):
        self.cfg = model.cfg
        check_policies(policies)
        if isinstance(policies, Policy):  # one policy for the model: its per-layer stack (a model-level
            policies = stack_of(policies, model.cfg.n_layers)  # preset: pyramidkv's budgets, quest's and knorm's dense layers)
        self.policies = tuple(p for a, b, p in policy_runs(policies, model.cfg.n_layers) for _ in range(b - a))
        # A fresh prompt is held by each policy's prompt phase, then `after_prompt` (once); the
        # same policies for streaming policies, a dense phase for prompt compressors (snapkv).
        self.prompt_policies = tuple(prompt_policy_of(p) for p in self.policies)
        self._compresses = self.prompt_policies != self.policies
        # kvzip: a reconstruction pass between the prompt phase and after_prompt (models.reconstruct)
        self._zippers = tuple(dict.fromkeys(p for p in self.policies if reconstructs(p)))
        self.repeat = engine_prompts(self._zippers, repeat if repeat is not None else tokenizer_of(model))
        self.recon_policies = tuple(recon_policy(p) for p in self.prompt_policies)
        self.reconstruct_tokens = 0  # repeat-input tokens fed by reconstruction passes
        self.reconstruct_pad_tokens = 0  # and the pads that bucket their lengths (models.reconstruct.RECON_BUCKET)
        self.prompts_compressed = 0  # how many times after_prompt ran (once per fresh prompt)
        self.prefills = 0  # fresh prompts prefilled (prefill, generate, prompt)
        self.prefills_shared = 0  # prompt states another engine prefilled for this one (evals.prefills)
        self.prefill_tokens = 0  # tokens those prefills and extend_prompt / continue_generate fed
        self.max_len = _check_int("Engine max_len", max_len, 1)
        if self.max_len > MAX_LEN:
            raise ValueError(f"Engine max_len={self.max_len}: positions are int32, so a sequence holds at most "
                             f"MAX_LEN={MAX_LEN} tokens (2^31 - 2^16: room for kvzip's repeat inputs after it)")
        self.cache_dtype = cache_dtype
        self.graphdef, state = nnx.split(model)
        # each step's arguments: the weights and the RoPE cos/sin tables of positions [0, max_len)
        # (every position this engine feeds, but kvzip's repeat inputs, which fall back to cos/sin)
        # (rope_tables=False: cos/sin computed in every step, the slower path; benchmarks.decode_profile)
        self.params = (state, model.rope_tables(self.max_len) if rope_tables else None)
        self.traces: collections.Counter = collections.Counter()
        self._model = model
        donate = dict(donate_argnums=(1,))
        self._logits_step = jax.jit(self._logits_impl, static_argnames=("prompt", "reach"), **donate)
        self._after_prompt = jax.jit(self._after_prompt_impl)  # new shapes: nothing to donate into
        self._nll_step = jax.jit(self._nll_impl, static_argnames=("reach",), **donate)
        self._decode_n = jax.jit(self._decode_n_impl, static_argnums=(4, 5), **donate)
        self._recon_step = jax.jit(self._recon_impl)  # the prompt state stays usable: no donation
        if decode_loop not in ("layers", "scan"):
            raise ValueError(f"Engine decode_loop={decode_loop!r}: expected 'layers' or 'scan'")
        self.decode_loop = decode_loop
        # layer-by-layer generation (`_decode_layers`): each step is one call per layer, then one
        # call writing every layer's new slots (policy, RoPE kind and bucket static)
        self._layer_step = jax.jit(self._layer_impl, static_argnames=("policy", "local", "reach"))
        self._embed_step = jax.jit(self._embed_impl)
        self._next_step = jax.jit(self._next_impl)
        self._write_layers = jax.jit(_write_layers, donate_argnums=0)
        self.placement = None  # a models.sharding.Placement once on a mesh (`shard`)
        if mesh is not None:
            self.shard(mesh)

    def shard(self, mesh) -> "Engine":
        """Put this engine on a `jax.sharding.Mesh` with axes (data, model), or [data, model] devices
        (models.sharding: weights split by their logical axes, batch on data, kv heads on model);
        every step then places its cache and inputs first. Returns the engine."""
        from models.sharding import Placement

        if self.placement is not None:
            raise ValueError(f"Engine.shard: the engine is already on a mesh ({self.placement})")
        pl = Placement(self.cfg, mesh)
        self.params = pl.params(self.params)
        self._logits_step, self._nll_step, self._decode_n = map(pl.step, (self._logits_step, self._nll_step,
                                                                          self._decode_n))
        self._recon_step = pl.step(self._recon_step, returns_cache_only=True)
        self.placement = pl  # (_after_prompt's cache comes from placed steps: jit keeps its shardings)
        return self

    # -- pure step functions (traced once per shape) ---------------------------------------
    def _merge(self, params) -> tuple[Llama, dict]:
        """(the model, its RoPE tables) from a step's `params` argument."""
        state, tables = params
        return nnx.merge(self.graphdef, state), tables

    def _reach(self, end: int, t: int = 1, prompt: bool = False) -> int | None:
        """The static length bucket of a step of `t` tokens whose positions are below `end`
        (None: the whole cache; also when no policy of the step has `PrefixSlots`, so that it
        never splits traces)."""
        pols = self.prompt_policies if prompt else self.policies
        return reach_of(end, self.max_len, fine=t == 1) if any(has_prefix_slots(p) for p in pols) else None

    def _logits_impl(self, params, cache, tokens, pos, prompt=False, reach=None):
        """Logits of the last token [B, V] and the new cache (prompt: through the prompt phase)."""
        self.traces["logits" if tokens.shape[1] > 1 else "decode"] += 1
        m, tables = self._merge(params)
        h, cache = m.hidden(tokens, pos, cache, self.prompt_policies if prompt else self.policies, tables, reach)
        return m.logits(h[:, -1:])[:, 0], cache

    def _nll_impl(self, params, cache, tokens, pos, targets, reach=None):
        """Negative log-likelihood [B, T] of `targets` (the next tokens) and the new cache."""
        self.traces["nll"] += 1
        m, tables = self._merge(params)
        h, cache = m.hidden(tokens, pos, cache, self.policies, tables, reach)
        lg = m.logits(h)  # [B, T, V] float32
        # log_softmax's value at the target, without writing the [B, T, V] log-probabilities (the
        # same operations, so the same numbers: 30 % less time for the head of a 512-token chunk)
        top = lg.max(axis=-1, keepdims=True)  # [B, T, 1]
        lse = jnp.log(jnp.exp(lg - top).sum(axis=-1))  # [B, T]
        return lse - (jnp.take_along_axis(lg, targets[..., None], axis=-1)[..., 0] - top[..., 0]), cache

    def _decode_n_impl(self, params, cache, token, pos, n, reach=None):
        """n greedy steps from `token` [B] at positions `pos` [B], as one lax.scan."""
        self.traces["decode_n"] += 1
        m, tables = self._merge(params)

        def step(carry, _):
            cache, tok, p = carry
            h, cache = m.hidden(tok[:, None], p[:, None], cache, self.policies, tables, reach)
            nxt = jnp.argmax(m.logits(h)[:, 0], axis=-1).astype(jnp.int32)  # [B]
            return (cache, nxt, p + 1), nxt

        (cache, _, _), toks = jax.lax.scan(step, (cache, token, pos), None, length=n)
        return toks.T, cache  # [B, n]

    def _embed_impl(self, params, token):
        """[B, 1, d] embeddings of the tokens [B] (layer-by-layer decoding's first call)."""
        return self._merge(params)[0].embed_tokens(token[:, None])

    def _layer_impl(self, w, state, x, pos, tables, policy, local, reach):
        """One layer of a decode step on its own weights and state (`Llama.layer`)."""
        self.traces["decode_layer"] += 1
        return self._model.layer(policy, local, w, x, pos[:, None], state, tables, reach)

    def _next_impl(self, params, x, pos):
        """(greedy next ids [B], positions + 1) from the last layer's output [B, 1, d]."""
        m, _ = self._merge(params)
        return jnp.argmax(m.logits(m.final(x))[:, 0], axis=-1).astype(jnp.int32), pos + 1

    def _decode_layers(self, cache: Cache, token, pos, n: int, reach: int | None):
        """n greedy steps from `token` [B] at positions `pos` [B], one jitted call per layer and
        step over per-layer weights and states (`decode_loop="layers"`): ([B, n] ids, the
        per-layer states after them). `cache` stays usable (its layers are copied out once).

        Why: XLA's CPU backend materialises the slice of a stacked weight or cache that a layer
        scan hands to a matmul, so the scan copies every layer's weights and keys/values at every
        step; separate per-layer buffers are read in place. The writes are a call of their own:
        a computation that reads a donated buffer and writes into it makes XLA copy it first."""
        tables = self.params[1]
        if tables is not None:  # straight-line layer steps: the RoPE cond picks cos/sin (RopeTable)
            tables = {k: dataclasses.replace(t, cond_angles=True) for k, t in tables.items()}
        weights = layer_weights(self._model)
        states = _split_layers(cache)
        local = self.cfg.local_layers
        out = []
        for _ in range(n):
            x = self._embed_step(self.params, token)
            writes = []
            for i, (w, st, pol) in enumerate(zip(weights, states, self.policies)):
                x, wr = self._layer_step(w, st, x, pos, tables, policy=pol, local=bool(local[i]), reach=reach)
                writes.append(wr)
            token, pos = self._next_step(self.params, x, pos)
            states = self._write_layers(states, writes)
            out.append(token)
        return jnp.stack(out, axis=1), states

    def _generate_rest(self, cache: Cache, first, pos, n: int, end: int, fork: bool = False):
        """Greedy ids [B, n] after `first` [B] at positions `pos` [B] (every position < `end`):
        layer by layer (the default) or as one fused `lax.scan` (`decode_loop="scan"`, and any
        engine on a mesh). fork: `cache` must stay usable (the scan donates it)."""
        reach = self._reach(end)
        if self.decode_loop == "layers" and self.placement is None:
            out, states = self._decode_layers(cache, first, pos, n, reach)
        else:
            out, states = self._decode_n(self.params, _fork(cache) if fork else cache, first, pos, n, reach)
        _check_pool(states)
        return out

    def _recon_impl(self, params, cache, tokens, pos):
        """The cache after one repeat input through the reconstruction policies (kvzip layers'
        scores updated; every other layer's writes are discarded by `_reconstruct`)."""
        self.traces["reconstruct"] += 1
        m, tables = self._merge(params)
        # the repeat input runs past the capacity of other policies' layers (their writes are
        # discarded): their queries are computed as the view gives them, not poisoned
        m.cfg = dataclasses.replace(m.cfg, attention=dataclasses.replace(m.cfg.attention or Tuning(), checked=False))
        _, cache = m.hidden(tokens, pos, cache, self.recon_policies, tables)
        return cache

    def _check_repeat(self):
        if self._zippers and self.repeat is None:
            raise ValueError("kvzip scores a prompt by reconstructing it: give the engine the tokenizer or the repeat "
                             "prompts, Engine(..., repeat=tokenizer) or repeat=models.reconstruct.repeat_prompts(tokenizer)")

    def _reconstruct(self, cache: Cache, tokens: np.ndarray) -> Cache:
        """kvzip's reconstruction pass (`models.reconstruct.reconstruct`) over a prompt-phase cache."""
        if not self._zippers:
            return cache
        self._check_repeat()
        return reconstruct(self, cache, tokens, policy_runs(self.recon_policies, self.cfg.n_layers))

    def _after_prompt_impl(self, cache):
        """Each run's prompt state -> its decode state (stacked over the run's layers)."""
        runs = policy_runs(self.policies, self.cfg.n_layers)
        return tuple(jax.vmap(functools.partial(after_prompt, pol))(st) for (_, _, pol), st in zip(runs, cache))

    # -- public API ---------------------------------------------------------------------------
    def init_cache(self, batch: int = 1, prompt: bool = False) -> Cache:
        """An empty cache (prompt: the prompt phase's, for `prefill` of a fresh prompt); on a mesh,
        created in its shardings."""
        make = lambda: self._model.init_cache(self.prompt_policies if prompt else self.policies, batch,  # noqa: E731
                                              self.max_len, self.cache_dtype)
        return make() if self.placement is None else self.placement.create(make, batch, prompt)

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

    def _chunk(self, chunk: Any, default: int) -> int:
        return default if chunk is None else _check_int("chunk", chunk, 1)

    def _step(self, cache: Cache, tokens, start: int, prompt: bool = False):
        """The jitted step on checked tokens [B, T] at positions start..start+T-1."""
        tokens = jnp.asarray(tokens, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(start, start + tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, cache = self._logits_step(self.params, cache, tokens, pos, prompt=prompt,
                                          reach=self._reach(start + tokens.shape[1], tokens.shape[1], prompt))
        return logits, _check_pool(cache)

    def step(self, cache: Cache, tokens, start: int):
        """Feed tokens [B, T] at positions start..start+T-1; returns last logits [B, V] and cache.

        Host tokens (numpy, lists) are checked id by id; a jax array (e.g. the argmax of the
        previous step) is checked for shape and dtype, and its range on the device (one scalar
        read back: the step waits for the ids, not for their values on the host).
        """
        start = _check_int("start", start, 0)
        if isinstance(tokens, jax.Array):
            if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
                raise ValueError(f"tokens: expected integer ids of shape [B, T], got {tokens.dtype} {tokens.shape}")
            if tokens.size and bool(((tokens < 0) | (tokens >= self.cfg.vocab_size)).any()):
                lo, hi = int(tokens.min()), int(tokens.max())
                raise ValueError(f"tokens: ids must be in the vocabulary [0, {self.cfg.vocab_size}), got ids from "
                                 f"{lo} to {hi}")
        else:
            tokens = self._tokens(tokens, "tokens", (2,))
        t = tokens.shape[1]
        if t == 0:
            raise ValueError("tokens: step needs at least 1 token, got shape " + str(tuple(tokens.shape)))
        self._check_len(start + t, f"positions {start}..{start + t - 1} ({start + t} tokens)")
        return self._step(cache, tokens, start)

    def prefill(self, tokens, chunk: int | None = None, cache: Cache | None = None):
        """Process a prompt [B, T] in chunks (None: one chunk); returns (last logits [B, V], cache).

        A fresh prompt (cache=None) goes through each policy's prompt phase, then `after_prompt`
        once (a prompt compressor compresses it there); with a cache, the tokens extend it.
        """
        tokens = self._tokens(tokens, "tokens", (2,))
        t = tokens.shape[1]
        if t == 0:
            raise ValueError(f"tokens: prefill needs a prompt of at least 1 token, got shape {tokens.shape}")
        chunk = self._chunk(chunk, t)
        self._check_len(t, f"prompt of {t} tokens")
        fresh = cache is None and self._compresses
        if fresh:
            self._check_repeat()
        cache_was_none = cache is None
        cache = self.init_cache(tokens.shape[0], prompt=fresh) if cache is None else cache
        logits = None
        for s in range(0, t, chunk):
            logits, cache = self._step(cache, tokens[:, s:s + chunk], s, prompt=fresh)
        if cache_was_none:
            self.prefills += 1
        self.prefill_tokens += t * tokens.shape[0]
        if fresh:
            self.prompts_compressed += 1
            cache = self._after_prompt(self._reconstruct(cache, tokens))
        return logits, cache

    # -- staged prompts: compress before the question, fork one state ---------------------------
    def prompt(self, tokens, chunk: int | None = None) -> Prompted:
        """A fresh prompt [B, T] through each policy's prompt phase, not compressed yet (one
        prefill; `compress` or `extend_prompt` next)."""
        tokens = self._tokens(tokens, "tokens", (2,))
        t = tokens.shape[1]
        if t == 0:
            raise ValueError(f"tokens: prompt needs at least 1 token, got shape {tokens.shape}")
        self._check_len(t, f"prompt of {t} tokens")
        self._check_repeat()
        cache = self.init_cache(tokens.shape[0], prompt=True)
        self.prefills += 1
        empty = np.zeros((tokens.shape[0], 0), np.int32)
        return self._feed(Prompted(cache, 0, None, False, empty), tokens, self._chunk(chunk, t), prompt=True,
                          fork=False)

    def _feed(self, state: Prompted, tokens: np.ndarray, chunk: int, prompt: bool, fork: bool = True) -> Prompted:
        cache, logits, start = _fork(state.cache) if fork else state.cache, state.logits, state.length
        t = tokens.shape[1]
        for s in range(0, t, chunk):
            logits, cache = self._step(cache, tokens[:, s:s + chunk], start + s, prompt=prompt)
        self.prefill_tokens += t * tokens.shape[0]
        fed = None if state.tokens is None else np.concatenate([state.tokens, tokens], axis=1)
        return Prompted(cache, start + t, logits, state.compressed, fed)

    def _check_state(self, state: Prompted, tokens, what: str) -> np.ndarray:
        if not isinstance(state, Prompted):
            raise ValueError(f"{what}: state must be a Prompted (from Engine.prompt), got {type(state).__name__}")
        tokens = self._tokens(tokens, "tokens", (2,))
        if tokens.shape[0] != state.logits.shape[0]:
            raise ValueError(f"tokens: batch {tokens.shape[0]} does not match the state's batch "
                             f"{state.logits.shape[0]}")
        return tokens

    def extend_prompt(self, state: Prompted, tokens, chunk: int | None = None) -> Prompted:
        """More prompt tokens [B, T] through the prompt phase of an uncompressed state (which stays
        usable: a fork)."""
        tokens = self._check_state(state, tokens, "extend_prompt")
        if state.compressed:
            raise ValueError("extend_prompt: the state is already compressed; use continue_generate")
        t = tokens.shape[1]
        self._check_len(state.length + t, f"prompt of {state.length} + {t} tokens")
        return self._feed(state, tokens, self._chunk(chunk, max(t, 1)), prompt=True) if t else state

    def shares_prompt(self, other: "Engine") -> bool:
        """Whether this engine can `compress` the uncompressed states of `other`: same model,
        max_len and cache dtype, and layer by layer the same prompt-phase state (a PromptPhase
        whatever compressor it serves), or `full` here over a dense PromptPhase there."""
        if other._model is not self._model or other.max_len != self.max_len or other.cache_dtype != self.cache_dtype:
            return False

        bounds = lambda e: [(a, b) for a, b, _ in policy_runs(e.prompt_policies, e.cfg.n_layers)]  # noqa: E731
        if bounds(self) != bounds(other):
            return False  # the prompt cache is stacked by runs of equal layers: another grouping is another layout
        return all(reads_prompt_state(a, b) for a, b in zip(self.prompt_policies, other.prompt_policies))

    def _adopt(self, cache: Cache) -> Cache:
        """A prompt-phase cache in this engine's prompt-phase runs (full's runs take the dense
        slots of a PromptPhase state)."""
        runs = policy_runs(self.prompt_policies, self.cfg.n_layers)
        if len(runs) != len(cache):
            raise ValueError(f"compress: the state has {len(cache)} runs of layers, this engine's prompt phase "
                             f"{len(runs)}: it comes from an engine that does not share the prompt (shares_prompt)")
        out = []
        for (a, b, pol), st in zip(runs, cache):
            st, rotate = adopt(pol, st)
            if rotate:  # a prompt phase stores keys un-rotated; e.g. full stores them rotated
                tables = self.params[1] or self._model.rope_tables(self.max_len)
                local = tuple(bool(x) for x in np.asarray(self.cfg.local_layers)[a:b])
                st = dataclasses.replace(st, k=_rotate_keys(st.k, st.pos, tables, local))
            out.append(st)
        return tuple(out)

    def compress(self, state: Prompted) -> Prompted:
        """`after_prompt` on a prompt-phase state (this engine's, or that of an engine it
        `shares_prompt` with); the input stays usable. A streaming policy's state is unchanged."""
        if not isinstance(state, Prompted):
            raise ValueError(f"compress: state must be a Prompted (from Engine.prompt), got {type(state).__name__}")
        if state.compressed:
            raise ValueError("compress: the state is already compressed")
        cache = self._adopt(state.cache)
        # the state type of each run (a phase may add statistics after its first step, so not the full structure)
        want = [type(st) for st in jax.eval_shape(lambda: self.init_cache(state.logits.shape[0], prompt=True))]
        if [type(st) for st in cache] != want:
            raise ValueError("compress: the state's cache does not have this engine's prompt-phase layout "
                             "(another model, max_len or prompt phase; see shares_prompt)")
        if self._compresses:
            self.prompts_compressed += 1
            if self._zippers:
                if state.tokens is None:
                    raise ValueError("compress: kvzip needs the prompt's token ids (a state from Engine.prompt)")
                cache = self._reconstruct(cache, state.tokens)
            cache = self._after_prompt(cache)
        return Prompted(cache, state.length, state.logits, True, state.tokens)

    def kept_positions(self, state: Prompted, row: int = 0) -> list[list[np.ndarray]]:
        """The token positions the cache of `state` holds for batch row `row`: [layer][kv head] ->
        sorted int array. Per-head token sets (snapkv, h2o...), one set shared by the layer's heads
        (window, sink, full...), head pools (adakv, kvzip: each head's share of the layer's pool),
        duo's two head groups and paged block tables. A prompt phase (not yet compressed) holds
        every prompt token."""
        if not isinstance(state, Prompted):
            raise ValueError(f"kept_positions: state must be a Prompted, got {type(state).__name__}")
        k = self.cfg.n_kv_heads
        out: list[list[np.ndarray]] = []
        for (a, b, pol), run in zip(policy_runs(self.policies if state.compressed else self.prompt_policies,
                                                self.cfg.n_layers), state.cache):
            for i in range(b - a):
                out.append(jax.tree.map(lambda x: np.asarray(x[i]), run).held(row, k, pol))
        return out

    def continue_generate(self, state: Prompted, tokens, n: int, chunk: int | None = None) -> np.ndarray:
        """Greedy ids [B, n] after feeding `tokens` [B, T] (T >= 0; e.g. a question) through the
        decode policies of a compressed state (the state stays usable: forks do not interfere)."""
        if isinstance(tokens, (list, tuple)) and len(tokens) == 0:
            tokens = np.zeros((state.logits.shape[0], 0), np.int32)
        tokens = self._check_state(state, tokens, "continue_generate")
        n = _check_int("n", n, 0)
        if not state.compressed and self._compresses:
            raise ValueError("continue_generate: the state is not compressed yet (compress it first)")
        t = tokens.shape[1]
        self._check_len(state.length + t + n, f"state of {state.length} + {t} tokens + n={n} new tokens")
        if t:
            state = self._feed(state, tokens, self._chunk(chunk, t), prompt=False)
        if n == 0:
            return np.zeros((tokens.shape[0], 0), np.int32)
        first = jnp.argmax(state.logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            return np.asarray(first)[:, None]
        pos = jnp.full(first.shape, state.length, jnp.int32)
        rest = self._generate_rest(state.cache, first, pos, n - 1, state.length + n - 1, fork=not t)
        return np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)

    def generate(self, prompt, n: int, chunk: int | None = None) -> np.ndarray:
        """Greedy decoding: prompt ids [B, T] (or [T]) -> n new ids [B, n] (or [n]); n = 0 gives an
        empty int32 array of that shape. A list of rows of different lengths is a ragged batch
        (`_generate_ragged`: each row prefilled alone, decoded together; [B, n])."""
        if _is_ragged(prompt):
            return self._generate_ragged(prompt, n, chunk)
        prompt = self._tokens(prompt, "prompt", (1, 2))
        n = _check_int("n", n, 0)
        squeeze = prompt.ndim == 1
        prompt = prompt[None] if squeeze else prompt
        t = prompt.shape[1]
        if t == 0:
            raise ValueError(f"prompt: generate needs a prompt of at least 1 token, got shape {prompt.shape}")
        chunk = self._chunk(chunk, t)
        self._check_len(t + n, f"prompt of {t} tokens + n={n} new tokens = {t + n}")
        if n == 0:
            out = np.zeros((prompt.shape[0], 0), np.int32)
            return out[0] if squeeze else out
        logits, cache = self.prefill(prompt, chunk)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            out = np.asarray(first)[:, None]
        else:
            pos = jnp.full(first.shape, t, jnp.int32)
            rest = self._generate_rest(cache, first, pos, n - 1, t + n - 1)
            out = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
        return out[0] if squeeze else out

    def _rows(self, rows: Sequence, name: str) -> list[np.ndarray]:
        out = []
        for i, r in enumerate(rows):
            r = self._tokens(r, f"{name} row {i}", (1,))
            if r.shape[0] == 0:
                raise ValueError(f"{name} row {i}: empty")
            out.append(r)
        return out

    def _generate_ragged(self, prompts: Sequence, n: int, chunk: int | None) -> np.ndarray:
        """Greedy ids [B, n] for prompts of different lengths: each row is prefilled on its own
        (its policy's prompt phase and compression included), the rows' states are stacked into
        one batch and decoded together, each row at its own positions. Equal to one row at a time."""
        rows = self._rows(prompts, "prompt")
        n = _check_int("n", n, 0)
        for i, r in enumerate(rows):
            self._check_len(len(r) + n, f"prompt row {i} of {len(r)} tokens + n={n} new tokens = {len(r) + n}")
        if n == 0:
            return np.zeros((len(rows), 0), np.int32)
        done = [self.prefill(r[None], chunk) for r in rows]  # (logits [1, V], cache) per row
        logits = jnp.concatenate([lg for lg, _ in done], axis=0)  # [B, V]
        cache = tuple(type(run[0]).join_rows(list(run)) for run in zip(*[c for _, c in done]))  # one batch
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            return np.asarray(first)[:, None]
        pos = jnp.asarray([len(r) for r in rows], jnp.int32)
        rest = self._generate_rest(cache, first, pos, n - 1, max(map(len, rows)) + n - 1)
        return np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)

    def _score_ragged(self, streams: Sequence, chunk: int, progress: bool) -> list[np.ndarray]:
        """Per-token NLL of streams of different lengths, in one batch: each row is padded at its
        end (with its last id) to the longest, and its NLL cut to its own T_i - 1 entries. A pad
        comes after every real token of its row, and attention is causal, so no real token's NLL
        sees it (equal to one row at a time)."""
        rows = self._rows(streams, "tokens")
        short = [i for i, r in enumerate(rows) if len(r) < 2]
        if short:
            raise ValueError(f"tokens row {short[0]}: score needs a stream of at least 2 tokens, got {len(rows[short[0]])}")
        longest = max(len(r) for r in rows)
        batch = np.stack([np.concatenate([r, np.full(longest - len(r), r[-1], np.int32)]) for r in rows])
        nll = self.score(batch, chunk=chunk, progress=progress)
        return [nll[i, :len(r) - 1] for i, r in enumerate(rows)]

    def score(self, tokens, chunk: int = 512, progress: bool = False, return_cache: bool = False):
        """Per-token NLL of a stream [T] (or [B, T]), T >= 2, processed through the policy in chunks.

        Returns [T-1] (or [B, T-1]): entry i is -log p(token i+1 | tokens <= i); with
        `return_cache`, (nll, the cache after the T-1 fed tokens). A list of streams of different
        lengths is scored in one batch (`_score_ragged`) and gives a list of [T_i - 1] arrays. The chunk size
        never changes the result (tested for every policy): masks are exact per query, and
        policies that evict after every token (`per_token`) scan the chunk token by token. A
        stream has no prompt: prompt compressors run their streaming rule from the first token
        (snapkv: compress whenever the cache overflows).
        """
        if _is_ragged(tokens):
            if return_cache:
                raise ValueError("score: return_cache with streams of different lengths (the padded rows' caches "
                                 "hold their pads); score them one at a time")
            return self._score_ragged(tokens, _check_int("chunk", chunk, 1), progress)
        tokens = self._tokens(tokens, "tokens", (1, 2))
        chunk = _check_int("chunk", chunk, 1)
        squeeze = tokens.ndim == 1
        tokens = tokens[None] if squeeze else tokens
        if tokens.shape[1] < 2:
            raise ValueError(
                f"tokens: score needs a stream of at least 2 tokens (each token after the first is scored), "
                f"got {tokens.shape[1]}"
            )
        n = tokens.shape[1] - 1
        self._check_len(n, f"stream of {n + 1} tokens ({n} fed to the model, the last only as a target)")
        cache = self.init_cache(tokens.shape[0])
        out = []
        # A ragged last chunk is padded at its end to a whole chunk (its pads come after every real
        # token, so causal attention keeps them out of every real NLL), so that a stream compiles
        # one step, not two. Not when the cache is returned (it would hold the pads), when the
        # pads' positions pass max_len, or inside `record_visible` (pad queries would be counted).
        last = n - (n - 1) // chunk * chunk
        padded = n > chunk and not return_cache and not recording() and n - last + chunk <= self.max_len
        pad = chunk - last if padded else 0
        toks = np.concatenate([tokens, np.repeat(tokens[:, -1:], pad, axis=1)], axis=1)
        bar = tqdm(total=n, desc="score", unit="tok", disable=not progress, leave=False)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            f = e + pad if e == n else e  # fed up to f: the last chunk with its pads
            pos = jnp.broadcast_to(jnp.arange(s, f, dtype=jnp.int32), (tokens.shape[0], f - s))
            nll, cache = self._nll_step(self.params, cache, jnp.asarray(toks[:, s:f]), pos,
                                        jnp.asarray(toks[:, s + 1:f + 1]), reach=self._reach(f, f - s))
            out.append(np.asarray(nll)[:, :e - s])
            bar.update(e - s)
        bar.close()
        _check_pool(cache)
        res = np.concatenate(out, axis=1)
        res = res[0] if squeeze else res
        return (res, cache) if return_cache else res


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll))))
