"""The jitted steps of `Engine`: pure functions of (params, cache, tokens, pos) with the cache
donated, length buckets (`reach_of`), layer-by-layer decoding over per-layer weights and states,
and kvzip's reconstruction pass (the `Steps` mixin).

Shapes: B batch, T tokens in a step, V vocab, n generated tokens, L layers, K kv heads, S slots, D head dim."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvpolicies.attend import Deferred, write_deferred
from kvpolicies.prompt import after_prompt
from kvpolicies.slots import has_prefix_slots
from kvpolicies.attention.tuning import Tuning
from models.llama import Cache, Llama, policy_runs
from models.reconstruct import reconstruct
from models.engine.checks import check_int, check_pool

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


def fork_cache(cache: Cache) -> Cache:
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


def split_layers(cache: Cache) -> list:
    """A cache (one stacked state per run, every leaf [n, ...]) -> one state per layer, in
    layer order (copies). One call per layer of a program compiled once per run's leaf shapes:
    a single program of every layer's slices compiled one kernel per slice, much slower to
    compile (docs/results/speed.md, "Numbers behind comments in the code")."""
    out = []
    for run in cache:
        leaves, treedef = jax.tree.flatten(run)
        out += [treedef.unflatten(_take_layer(leaves, np.int32(i))) for i in range(leaves[0].shape[0])]
    return out


def write_layers(states: list, writes: list) -> list:
    """Each layer's state after its step: its `Deferred` writes applied (in place: `states` is
    donated), or the new state it returned."""
    return [write_deferred(st, wr) if isinstance(wr, Deferred) else wr for st, wr in zip(states, writes)]


_write_layer = jax.jit(write_deferred, donate_argnums=0)


def write_each(states: list, writes: list) -> list:
    """`write_layers` one layer at a time: one program per layer's shapes, shared by every engine
    (a fitted engine's layers change sizes from prompt to prompt; one program of all of them
    would compile again whenever any layer's size does)."""
    return [_write_layer(st, wr) if isinstance(wr, Deferred) else wr for st, wr in zip(states, writes)]


def stack_layers(states: list, policies: tuple, n_layers: int) -> Cache:
    """Per-layer states -> a cache (one stacked state per run of `policy_runs`): `split_layers`'s inverse."""
    return tuple(jax.tree.map(lambda *x: jnp.stack(x), *states[a:b]) for a, b, _ in policy_runs(policies, n_layers))


def pieces(t: int) -> list[int]:
    """t as a sum of powers of two, largest first (13 -> [8, 4, 1]): a feed in these pieces
    compiles at most log2(t) + 1 step shapes, whatever t."""
    return [1 << b for b in reversed(range(t.bit_length())) if t >> b & 1]


@functools.partial(jax.jit, static_argnums=3)
def rotate_keys(k: Float[Array, "L B K S D"], pos: Int[Array, "L B Kp S"], tables: dict,
                 local: tuple[bool, ...]) -> Float[Array, "L B K S D"]:
    """Stored keys of a run of layers rotated at their slots' positions, as `attend` rotates a
    new key (the same RoPE tables, in k's dtype): layer l by the local or the global RoPE."""
    if len(set(local)) == 1:
        return tables["local" if local[0] else "global"].apply(k, pos)
    return jnp.stack([tables["local" if x else "global"].apply(k[i], pos[i]) for i, x in enumerate(local)])


class Steps:
    """The jitted step functions (traced once per shape) and the host loops that call them."""

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
        """[B, T, d] embeddings of the tokens [B, T] (or [B]: T = 1; layer-by-layer steps' first call)."""
        return self._merge(params)[0].embed_tokens(token if token.ndim == 2 else token[:, None])

    def _layer_impl(self, w, state, x, pos, tables, policy, local, reach):
        """One layer of a step on its own weights and state (`Llama.layer`; pos [B, T] or [B]: T = 1)."""
        self.traces["decode_layer"] += 1
        return self._model.layer(policy, local, w, x, pos if pos.ndim == 2 else pos[:, None], state, tables, reach)

    def _head_impl(self, params, x):
        """Logits [B, V] of the last token of a layer-by-layer step's output x [B, T, d]."""
        m, _ = self._merge(params)
        return m.logits(m.final(x[:, -1:]))[:, 0]

    def _next_impl(self, params, x, pos):
        """(greedy next ids [B], positions + 1) from the last layer's output [B, 1, d]."""
        m, _ = self._merge(params)
        return jnp.argmax(m.logits(m.final(x))[:, 0], axis=-1).astype(jnp.int32), pos + 1

    def _layer_tables(self):
        """The RoPE tables of straight-line layer steps (the RoPE cond picks cos/sin: RopeTable), or None."""
        tables = self.params[1]
        return None if tables is None else {k: dataclasses.replace(t, cond_angles=True) for k, t in tables.items()}

    def _through_layers(self, states: list, x, pos, tables, reach: int | None):
        """x [B, T, d] at positions pos ([B, T] or [B]) through every layer's jitted step, then the
        layers' writes: (the last layer's output, the per-layer states after them)."""
        local = self.cfg.local_layers
        writes = []
        for i, (w, st, pol) in enumerate(zip(layer_weights(self._model), states, self.policies)):
            x, wr = self._layer_step(w, st, x, pos, tables, policy=pol, local=bool(local[i]), reach=reach)
            writes.append(wr)
        return x, (write_each if self.shares_layer_steps else self._write_layers)(states, writes)

    def _decode_layers(self, cache: Cache, token, pos, n: int, reach: int | None):
        """n greedy steps from `token` [B] at positions `pos` [B], one jitted call per layer and
        step over per-layer weights and states (`decode_loop="layers"`): ([B, n] ids, the
        per-layer states after them). `cache` stays usable (its layers are copied out once).

        Why: XLA's CPU backend materialises the slice of a stacked weight or cache that a layer
        scan hands to a matmul, so the scan copies every layer's weights and keys/values at every
        step; separate per-layer buffers are read in place. The writes are a call of their own:
        a computation that reads a donated buffer and writes into it makes XLA copy it first."""
        tables = self._layer_tables()
        states = split_layers(cache)
        out = []
        for _ in range(n):
            x, states = self._through_layers(states, self._embed_step(self.params, token), pos, tables, reach)
            token, pos = self._next_step(self.params, x, pos)
            out.append(token)
        return jnp.stack(out, axis=1), states

    def _feed_layers(self, cache: Cache, tokens: np.ndarray, start: int):
        """(logits [B, V] of the last token, the cache) after tokens [B, T] at positions
        start.. went through the decode policies layer by layer (`Llama.layer`, as
        `_decode_layers`), in power-of-two `pieces` (a chunk never changes a result). A fitted
        engine's feed (`share_layer_steps`): each layer's step compiles per layer shape and piece,
        not per prompt. `cache` stays usable (its layers are copied out)."""
        tables = self._layer_tables()
        states, s = split_layers(cache), start
        for t in pieces(tokens.shape[1]):
            toks = jnp.asarray(tokens[:, s - start:s - start + t], jnp.int32)
            pos = jnp.broadcast_to(jnp.arange(s, s + t, dtype=jnp.int32), toks.shape)
            x, states = self._through_layers(states, self._embed_step(self.params, toks), pos, tables,
                                             self._reach(s + t, t))
            s += t
        check_pool(states)
        return self._head_step(self.params, x), stack_layers(states, self.policies, self.cfg.n_layers)

    def share_layer_steps(self, other) -> None:
        """Use `other`'s jitted layer-by-layer steps (embedding, layer, head; the same model), one
        layer at a time for the writes, and feed tokens layer by layer (`_feed_layers`): a fitted
        engine, whose layers' sizes change from prompt to prompt, then compiles a layer's step once
        per (policy, shape) over all the prompts of `other`, not a whole model per prompt. Its
        traces are counted in `other.traces` ("decode_layer")."""
        if other._model is not self._model:
            raise ValueError("share_layer_steps: the engines run different models")
        self._layer_step, self._embed_step = other._layer_step, other._embed_step
        self._next_step, self._head_step = other._next_step, other._head_step
        self.shares_layer_steps = True

    def _generate_rest(self, cache: Cache, first, pos, n: int, end: int, fork: bool = False):
        """Greedy ids [B, n] after `first` [B] at positions `pos` [B] (every position < `end`):
        layer by layer (the default) or as one fused `lax.scan` (`decode_loop="scan"`, and any
        engine on a mesh). fork: `cache` must stay usable (the scan donates it)."""
        reach = self._reach(end)
        if self.decode_loop == "layers" and self.placement is None:
            out, states = self._decode_layers(cache, first, pos, n, reach)
        else:
            out, states = self._decode_n(self.params, fork_cache(cache) if fork else cache, first, pos, n, reach)
        check_pool(states)
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

    def _reconstruct(self, cache: Cache, tokens: np.ndarray) -> Cache:
        """kvzip's reconstruction pass (`models.reconstruct.reconstruct`) over a prompt-phase cache."""
        if not self.reconstructors:
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

    def _step(self, cache: Cache, tokens, start: int, prompt: bool = False):
        """The jitted step on checked tokens [B, T] at positions start..start+T-1."""
        tokens = jnp.asarray(tokens, jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(start, start + tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, cache = self._logits_step(self.params, cache, tokens, pos, prompt=prompt,
                                          reach=self._reach(start + tokens.shape[1], tokens.shape[1], prompt))
        return logits, check_pool(cache)

    def step(self, cache: Cache, tokens, start: int):
        """Feed tokens [B, T] at positions start..start+T-1; returns last logits [B, V] and cache.

        Host tokens (numpy, lists) are checked id by id; a jax array (e.g. the argmax of the
        previous step) is checked for shape and dtype, and its range on the device (one scalar
        read back: the step waits for the ids, not for their values on the host).
        """
        start = check_int("start", start, 0)
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
