"""Layer-by-layer steps of `Engine` (the `LayerSteps` mixin): each layer's weights and state as
arrays of their own (`layer_weights`, `split_layers`), one jitted call per layer (`Llama.layer`)
for greedy decoding (`decode_loop="layers"`) and for a fitted engine's feeds, the layers' writes,
and the sharing of these steps between an engine and its fitted engines (`share_layer_steps`).

Shapes: B batch, T tokens in a step, V vocab, n generated tokens, L layers."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from kvpolicies.attend import Deferred, write_deferred
from kvpolicies.slots import spare_slots, spared
from models.llama import Cache, Llama, policy_runs
from models.engine.checks import check_pool

UNTIL_EVERY = 8  # `until`'s steps between two reads of the ids (each read waits for the device)


_LAYER_WEIGHTS: "weakref.WeakKeyDictionary[Llama, tuple[dict, ...]]" = weakref.WeakKeyDictionary()


def layer_weights(model: Llama) -> tuple[dict, ...]:
    """Each layer's weights as arrays of their own (`model.layer_weights()`, the form its `layer`
    takes), made once per model and shared by the model's engines. Layer-by-layer decoding reads
    them in place."""
    if model not in _LAYER_WEIGHTS:
        _LAYER_WEIGHTS[model] = model.layer_weights()
    return _LAYER_WEIGHTS[model]


@jax.jit
def _take_layer(leaves: list, i) -> list:
    """Layer i of each stacked leaf (a copy; i traced: one compile per run's leaf shapes)."""
    return [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in leaves]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _take_spare(policy, treedef, leaves: list, i):
    """Layer i of a run's stacked state with `policy`'s spare slot added (`SpareSlot.pad_spare`; one copy)."""
    return policy.pad_spare(treedef.unflatten([jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in leaves]))


def split_layers(cache: Cache, spare: tuple | None = None) -> list:
    """A cache (one stacked state per run, every leaf [n, ...]) -> one state per layer, in
    layer order (copies). One call per layer of a program compiled once per run's leaf shapes:
    a single program of every layer's slices compiled one kernel per slice, much slower to
    compile (docs/results/speed.md, "Numbers behind comments in the code"). `spare`: per run, a
    `SpareSlot` policy whose spare slot each of the run's states gets (`pad_spare`), or None."""
    out = []
    for r, run in enumerate(cache):
        leaves, treedef = jax.tree.flatten(run)
        pol = None if spare is None else spare[r]
        out += [treedef.unflatten(_take_layer(leaves, np.int32(i))) if pol is None else
                _take_spare(pol, treedef, leaves, np.int32(i)) for i in range(leaves[0].shape[0])]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _cut_spare(policy, state):
    return policy.cut_spare(state)


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


class LayerSteps:
    """Per-layer jitted steps: decoding layer by layer, and a fitted engine's feeds."""

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

    def _through_layers(self, states: list, x, pos, tables, reach: int | None, policies: tuple | None = None):
        """x [B, T, d] at positions pos ([B, T] or [B]) through every layer's jitted step, then the
        layers' writes: (the last layer's output, the per-layer states after them). `policies`
        (default: the engine's): a layer whose policy writes into a spare slot (`SpareSlot`) runs
        the step that donates its state (written in place) and returns its new state."""
        local = self.cfg.local_layers
        policies = self.policies if policies is None else policies
        writes = []
        for i, (w, st, pol) in enumerate(zip(layer_weights(self._model), states, policies)):
            step = self._layer_step_in_place if spare_slots(pol) else self._layer_step
            x, wr = step(w, st, x, pos, tables, policy=pol, local=bool(local[i]), reach=reach)
            writes.append(wr)
        write = write_each if self.shares_layer_steps else self._write_layers
        rest = [i for i, pol in enumerate(policies) if not spare_slots(pol)]  # the others' states were donated
        if len(rest) == len(states):
            return x, write(states, writes)
        done = write([states[i] for i in rest], [writes[i] for i in rest]) if rest else []
        for i, st in zip(rest, done):
            writes[i] = st
        return x, writes

    def _decode_layers(self, cache: Cache, token, pos, n: int, reach: int | None, cut: bool = True, until=None):
        """n greedy steps from `token` [B] at positions `pos` [B], one jitted call per layer and
        step over per-layer weights and states (`decode_loop="layers"`): ([B, n] ids, the
        per-layer states after them). `cache` stays usable (its layers are copied out once).
        `until(ids [B, m]) -> bool`, asked every UNTIL_EVERY steps: True ends the loop early (m < n ids).

        Why: XLA's CPU backend materialises the slice of a stacked weight or cache that a layer
        scan hands to a matmul, so the scan copies every layer's weights and keys/values at every
        step; separate per-layer buffers are read in place. The writes are a call of their own:
        a computation that reads a donated buffer and writes into it makes XLA copy it first.
        A policy that can (`SpareSlot.spared`: a shape class's prompt scorers) decodes on states
        with a spare slot, each step written in place (`cut`: the states returned without it)."""
        tables = self._layer_tables()
        runs = policy_runs(self.policies, self.cfg.n_layers)
        spare = tuple(spared(p) for _, _, p in runs)
        states = split_layers(cache, spare)
        pols = tuple(sp or p for (a, b, p), sp in zip(runs, spare) for _ in range(b - a))
        out = []
        for i in range(n):
            x, states = self._through_layers(states, self._embed_step(self.params, token), pos, tables, reach, pols)
            token, pos = self._next_step(self.params, x, pos)
            out.append(token)
            if until is not None and (i + 1) % UNTIL_EVERY == 0 and i + 1 < n and until(np.asarray(jnp.stack(out, 1))):
                break  # the host reads the ids so far (a sync every UNTIL_EVERY steps, none without `until`)
        if cut:
            states = [_cut_spare(p, st) if spare_slots(p) else st for p, st in zip(pols, states)]
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
        self._layer_step_in_place = other._layer_step_in_place
        self._next_step, self._head_step = other._next_step, other._head_step
        self.shares_layer_steps = True
