"""The gradient pass of kvgrad's context reconstruction (`kvpolicies.kvgrad`): before each repeat input, the
norm of the gradient of Phi = sum_p ||h_p^L||^2 (the last layer's output before the final norm, summed over
the input's real tokens) with respect to every layer's attention output at every repeat token.

Shapes: B batch, T repeat-input tokens, d model width, L layers.

The repeat input runs after the prompt-phase cache as in the reconstruction pass (each layer's
`ReadsGradients.gradient_policy()` or its pass policy: the cache read, never written), with a perturbation
delta_l [B, T, d] = 0 added to each layer's attention output (`models.llama.block` reads it from the layer's
weights as "attn_delta"); dPhi / d delta_l is dPhi / d(attention output), what kvpress's KVgradPress reads
off `attention_output.grad`. A layer body is rematerialised in the backward pass (`jax.checkpoint`): the
memory is one layer's attention, not all of them. Nothing here names a policy: `models.reconstruct` calls
`attention_gradients` when a layer of the pass `reads_gradients`.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvpolicies.attention.tuning import Tuning
from kvpolicies.prompt import reads_gradients
from models.llama import block, policy_runs

DENSE = 1 << 30  # Tuning.block of the gradient pass: every step attends densely
_STEPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # engine -> its jitted pass


def gradient_runs(policies: tuple, n_layers: int) -> tuple[tuple[int, int, Any], ...]:
    """(start, end, policy in the gradient pass) per run of the reconstruction pass's `policies` (the runs of
    the pass's cache, kept even where two runs' gradient policies are equal)."""
    return tuple((a, b, p.gradient_policy() if reads_gradients(p) else p)
                 for a, b, p in policy_runs(policies, n_layers))


def grad_norms(graphdef: Any, runs: tuple, params: tuple, cache: tuple, tokens: Int[Array, "B T"],
               pos: Int[Array, "B T"], end: Int[Array, ""]) -> Float[Array, "L B T"]:
    """||dPhi / d(attention output of layer l at token t)||_2 of the repeat input `tokens` at `pos` after the
    prompt cache (one state per run of `runs`: `gradient_runs`); tokens at positions >= `end` are pads (not in
    Phi). float32."""
    state, tables = params
    m = nnx.merge(graphdef, state)
    # dense attention (the blocked path's loop has a dynamic trip count, which reverse mode cannot take); the
    # pass's other layers run past their capacity, their writes discarded (as in the reconstruction pass)
    tuning = dataclasses.replace(m.cfg.attention or Tuning(), checked=False, block=DENSE)
    cfg = dataclasses.replace(m.cfg, attention=tuning)
    rope, rope_local = (m.rope, m.rope_local) if tables is None else (tables["global"], tables["local"])
    weights = {k: v[...] for k, v in m.layers.items()}  # each [L, ...]
    local = np.asarray(cfg.local_layers)  # [L] bool
    x0 = m.embed_tokens(tokens)  # [B, T, d]
    real = (pos < end)[..., None]  # [B, T, 1]

    def phi(delta: Float[Array, "L B T d"]) -> Float[Array, ""]:
        x = x0
        for (a, b, pol), st in zip(runs, cache):
            kinds = set(local[a:b].tolist())

            @jax.checkpoint
            def body(x, inp, pol=pol, kinds=kinds):
                w, st, dl, is_local = inp
                w = {**w, "attn_delta": dl}
                if len(kinds) == 1:
                    return block(cfg, pol, rope_local if kinds == {True} else rope, w, x, pos, st)[0], None
                return jax.lax.cond(is_local, lambda: block(cfg, pol, rope_local, w, x, pos, st)[0],
                                    lambda: block(cfg, pol, rope, w, x, pos, st)[0]), None

            wr = {k: v[a:b] for k, v in weights.items()}  # [n, ...]
            x, _ = jax.lax.scan(body, x, (wr, st, delta[a:b], jnp.asarray(local[a:b])))  # x: [B, T, d]
        xf = x.astype(jnp.float32)
        return jnp.sum(jnp.where(real, xf * xf, 0.0))

    g = jax.grad(phi)(jnp.zeros((cfg.n_layers,) + x0.shape, x0.dtype))  # [L, B, T, d]
    g = g.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(g * g, axis=-1))  # [L, B, T]


def attention_gradients(engine: Any, cache: tuple, tokens: Int[Array, "B T"], pos: Int[Array, "B T"],
                        end: int) -> tuple:
    """The reconstruction pass's `cache` (one state per run of `engine.recon_policies`) with each layer that
    `reads_gradients` holding its gradient norms of the repeat input `tokens` (`read_gradients`). One compiled
    pass per engine and input shape (`engine.traces["gradient"]` counts its traces)."""
    runs = policy_runs(engine.recon_policies, engine.cfg.n_layers)
    step = _STEPS.get(engine)
    if step is None:
        grad_runs = gradient_runs(engine.recon_policies, engine.cfg.n_layers)

        def traced(params, cache, tokens, pos, end):
            engine.traces["gradient"] += 1
            return grad_norms(engine.graphdef, grad_runs, params, cache, tokens, pos, end)

        step = _STEPS[engine] = jax.jit(traced)
    # a scoring layer's pass state without what the scoring added (unread here: one trace for every input)
    bare = tuple(dataclasses.replace(st, extra={}) if reads_gradients(pol) else st
                 for (_, _, pol), st in zip(runs, cache))
    norms = step(engine.params, bare, tokens, pos, jnp.int32(end))  # [L, B, T]
    out = []
    for (a, b, pol), st in zip(runs, cache):
        out.append(jax.vmap(pol.read_gradients)(st, norms[a:b]) if reads_gradients(pol) else st)
    return tuple(out)


