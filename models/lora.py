"""A LoRA-adapted copy of a model for one pass, and RestoreKV's restore pass over an engine's prompt
(`kvpolicies.restorekv`, kvpress's `RestoreKVPress.append_restore_tokens`).

Shapes: B batch, t context tokens, n restore tokens, d model width, L layers, r LoRA rank, I / O a
projection's input / output width (ours: h @ W with W [I, O]; PEFT's nn.Linear weight is [O, I]).

LoRA (PEFT's convention): a projection's output is h W + (alpha / r) (h A^T) B^T with A [r, I] (lora_A) and
B [O, r] (lora_B). `merge` folds it into a copy of the weights, W + (alpha / r) A^T B^T, computed in float32;
PEFT adds the product to the base output instead (the same numbers up to float rounding), and the base
model's weights are never changed: only the one restore pass runs on the copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from kvpolicies.prompt import Appends, appended_tokens
from models.llama import Llama


def merge(layers: dict[str, np.ndarray], lora_a: dict[str, np.ndarray], lora_b: dict[str, np.ndarray],
          alpha: float) -> dict[str, np.ndarray]:
    """Stacked layer weights {name: [L, I, O]} with each adapted one's W + (alpha / r) A^T B^T (A [L, r, I],
    B [L, O, r]), in each weight's dtype."""
    out = dict(layers)
    for name, a in lora_a.items():
        w = np.asarray(layers[name])
        b = lora_b[name]
        if a.shape[0] != w.shape[0] or a.shape[2] != w.shape[1] or b.shape != (w.shape[0], w.shape[2], a.shape[1]):
            raise ValueError(f"lora: {name} is {w.shape}, lora_A {a.shape} and lora_B {b.shape} do not fit "
                             "([L, r, I] and [L, O, r])")
        delta = np.einsum("lri,lor->lio", a.astype(np.float32), b.astype(np.float32)) * (alpha / a.shape[1])
        out[name] = (w.astype(np.float32) + delta).astype(w.dtype)
    return out


def merge_jax(layers: dict[str, Array], lora_a: dict[str, Array], lora_b: dict[str, Array], alpha: float) -> dict:
    """`merge` traced (training: gradients flow to A and B)."""
    return {k: w + (alpha / lora_a[k].shape[1]) * jnp.einsum("lri,lor->lio", lora_a[k], lora_b[k]).astype(w.dtype)
            if k in lora_a else w for k, w in layers.items()}


def adapted(model: Llama, arrays: dict) -> Llama:
    """A copy of `model` with the LoRA of `arrays` merged (`kvpolicies.restorekv.load_restore`'s dict) and the
    n restore embeddings as its embedding table, so token ids 0..n-1 feed them (divided by the model's
    embedding scale, which `embed_tokens` multiplies back: kvpress feeds them as inputs_embeds)."""
    cfg = model.cfg
    emb = np.asarray(arrays["embeddings"], np.float32)
    if emb.shape[1] != cfg.d_model:
        raise ValueError(f"restore embeddings are {emb.shape}, the model's width is {cfg.d_model}")
    layers = {k: np.asarray(v[...]) for k, v in model.layers.items()}
    params = {"embed": emb / cfg.embed_scale, "final_norm": np.asarray(model.final_norm[...]),
              "layers": merge(layers, arrays["lora_A"], arrays["lora_B"], arrays["alpha"])}
    return Llama(cfg, params, model.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pass(graphdef, policies: tuple, state, cache, ids, pos, tables):
    """The cache after the restore tokens `ids` [B, n] at positions `pos` went through the prompt phase."""
    return nnx.merge(graphdef, state).hidden(ids, pos, cache, policies, tables)[1]


def append_pass(engine, cache: tuple, t: int, scored: list[bool]) -> tuple:
    """An engine's prompt-phase cache of t tokens after the tokens its reconstructors append
    (`kvpolicies.prompt.Appends`: RestoreKV's n restore embeddings) at positions t..t+n-1 through the LoRA-adapted
    copy of the model and the engine's prompt phase (every layer's cache gains their keys and values; they attend
    to the whole prompt), each scoring run's state (`scored`) then handed to `Appends.after_append`. The adapted
    weights are merged once per engine."""
    owner = next(p for p in engine.reconstructors if isinstance(p, Appends))
    arrays = owner.appended()
    n, b = arrays["embeddings"].shape[0], cache[0].pos.shape[-3]
    if t + n > engine.max_len:
        raise ValueError(f"restore: the {t} prompt tokens and {n} restore tokens exceed the engine's max_len "
                         f"{engine.max_len} (give it room for them, the question and the answer)")
    memo = engine.__dict__.get("_appended_model")
    if memo is None or memo[0] is not arrays:  # the arrays held with their merge (so compared by identity)
        memo = engine.__dict__["_appended_model"] = (arrays, *nnx.split(adapted(nnx.merge(engine.graphdef,
                                                                                       engine.params[0]), arrays)))
    _, graphdef, weights = memo
    ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    cache = _pass(graphdef, engine.prompt_policies, weights, cache, ids, ids + t, engine.params[1])
    return tuple(owner.after_append(st, t) if z else st for st, z in zip(cache, scored))


def restore(engine, state):
    """RestoreKV's restore pass on an uncompressed `Engine.prompt` state of t context tokens, by hand (an engine
    runs it in `compress` and `generate`: `kvpolicies.prompt.Appends`): the reconstruction pass first
    (`Engine.reconstruct`: kvzip's scores of the context alone), then `append_pass`. Returns the state at length
    t + n, which `engine.compress` keeps from without another pass (the question follows at t + n); a state
    restored already is returned as it is."""
    if getattr(state, "compressed", True):  # (a models.engine.Prompted: models.engine imports this module)
        raise ValueError("restore: needs an uncompressed Prompted (Engine.prompt, before compress)")
    if not appended_tokens(engine.reconstructors):
        raise ValueError("restore: no layer of this engine restores (kvpolicies.compat.kvpress('RestoreKVPress', ...))")
    if state.tokens is None:
        raise ValueError("restore: the state has no token ids (a state from Engine.prompt)")
    n = appended_tokens(engine.reconstructors)
    if state.length + n * (state.tokens.shape[1] == state.length) > engine.max_len:
        raise ValueError(f"restore: the {state.length} prompt tokens and {n} restore tokens exceed the engine's "
                         f"max_len {engine.max_len} (give it room for them, the question and the answer)")
    state = engine.reconstruct(state)
    cache, length = engine._scored(state, engine._adopt(state.cache, "restore"))  # the pass's tokens appended
    return dataclasses.replace(state, cache=cache, length=length)
