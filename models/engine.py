"""Jitted prefill/decode steps, greedy generation and streaming log-likelihood through a policy.

Shapes: B batch, T tokens in a step, C chunk length, V vocab, n generated tokens.

The model is split once into (graphdef, params); every step is a pure jitted function of
(params, cache, tokens, pos) with the cache donated, so the compiled step is reused for every
step of the same shape. `traces` counts how often each step kind was traced (compiled).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kvpolicies.base import Policy
from models.llama import Cache, Llama, policy_runs


class Engine:
    """Runs a `Llama` with a fixed per-layer policy tuple and maximum length."""

    def __init__(self, model: Llama, policies: Policy | Sequence[Policy], max_len: int, cache_dtype=None):
        self.cfg = model.cfg
        self.policies = tuple(p for a, b, p in policy_runs(policies, model.cfg.n_layers) for _ in range(b - a))
        self.max_len = max_len
        self.cache_dtype = cache_dtype
        self.graphdef, self.params = nnx.split(model)
        self.traces: collections.Counter = collections.Counter()
        self._model = model
        donate = dict(donate_argnums=(1,))
        self._logits_step = jax.jit(self._logits_impl, **donate)
        self._nll_step = jax.jit(self._nll_impl, **donate)
        self._decode_n = jax.jit(self._decode_n_impl, static_argnums=(4,), **donate)

    # -- pure step functions (traced once per shape) ---------------------------------------
    def _merge(self, params) -> Llama:
        return nnx.merge(self.graphdef, params)

    def _logits_impl(self, params, cache, tokens, pos):
        """Logits of the last token [B, V] and the new cache."""
        self.traces["logits" if tokens.shape[1] > 1 else "decode"] += 1
        m = self._merge(params)
        h, cache = m.hidden(tokens, pos, cache, self.policies)
        return m.logits(h[:, -1:])[:, 0], cache

    def _nll_impl(self, params, cache, tokens, pos, targets):
        """Negative log-likelihood [B, T] of `targets` (the next tokens) and the new cache."""
        self.traces["nll"] += 1
        m = self._merge(params)
        h, cache = m.hidden(tokens, pos, cache, self.policies)
        lp = jax.nn.log_softmax(m.logits(h), axis=-1)  # [B, T, V] float32
        return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0], cache

    def _decode_n_impl(self, params, cache, token, pos, n):
        """n greedy steps from `token` [B] at positions `pos` [B], as one lax.scan."""
        self.traces["decode_n"] += 1
        m = self._merge(params)

        def step(carry, _):
            cache, tok, p = carry
            h, cache = m.hidden(tok[:, None], p[:, None], cache, self.policies)
            nxt = jnp.argmax(m.logits(h)[:, 0], axis=-1).astype(jnp.int32)  # [B]
            return (cache, nxt, p + 1), nxt

        (cache, _, _), toks = jax.lax.scan(step, (cache, token, pos), None, length=n)
        return toks.T, cache  # [B, n]

    # -- public API ---------------------------------------------------------------------------
    def init_cache(self, batch: int = 1) -> Cache:
        return self._model.init_cache(self.policies, batch, self.max_len, self.cache_dtype)

    def _check_len(self, end: int):
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the engine's max_len={self.max_len}")

    def step(self, cache: Cache, tokens, start: int):
        """Feed tokens [B, T] at positions start..start+T-1; returns last logits [B, V] and cache."""
        tokens = jnp.asarray(tokens, jnp.int32)
        self._check_len(start + tokens.shape[1])
        pos = jnp.broadcast_to(jnp.arange(start, start + tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return self._logits_step(self.params, cache, tokens, pos)

    def prefill(self, tokens, chunk: int | None = None, cache: Cache | None = None):
        """Process a prompt [B, T] in chunks; returns (last logits [B, V], cache)."""
        tokens = np.asarray(tokens, np.int32)
        cache = self.init_cache(tokens.shape[0]) if cache is None else cache
        chunk = chunk or tokens.shape[1]
        logits = None
        for s in range(0, tokens.shape[1], chunk):
            logits, cache = self.step(cache, tokens[:, s:s + chunk], s)
        return logits, cache

    def generate(self, prompt, n: int, chunk: int | None = None) -> np.ndarray:
        """Greedy decoding: prompt ids [B, T] (or [T]) -> n new ids [B, n] (or [n])."""
        prompt = np.asarray(prompt, np.int32)
        squeeze = prompt.ndim == 1
        prompt = prompt[None] if squeeze else prompt
        t = prompt.shape[1]
        self._check_len(t + n)
        logits, cache = self.prefill(prompt, chunk)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            out = np.asarray(first)[:, None]
        else:
            pos = jnp.full(first.shape, t, jnp.int32)
            rest, _ = self._decode_n(self.params, cache, first, pos, n - 1)
            out = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
        return out[0] if squeeze else out

    def score(self, tokens, chunk: int = 512, progress: bool = False) -> np.ndarray:
        """Per-token NLL of a stream [T] (or [B, T]) processed through the policy in chunks.

        Returns [T-1] (or [B, T-1]): entry i is -log p(token i+1 | tokens <= i). Chunked
        processing equals token-by-token decoding (masks are exact per position).
        """
        tokens = np.asarray(tokens, np.int32)
        squeeze = tokens.ndim == 1
        tokens = tokens[None] if squeeze else tokens
        n = tokens.shape[1] - 1
        self._check_len(n)
        cache = self.init_cache(tokens.shape[0])
        out = []
        bar = tqdm(total=n, desc="score", unit="tok", disable=not progress, leave=False)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            pos = jnp.broadcast_to(jnp.arange(s, e, dtype=jnp.int32), (tokens.shape[0], e - s))
            nll, cache = self._nll_step(self.params, cache, jnp.asarray(tokens[:, s:e]), pos,
                                        jnp.asarray(tokens[:, s + 1:e + 1]))
            out.append(np.asarray(nll))
            bar.update(e - s)
        bar.close()
        res = np.concatenate(out, axis=1)
        return res[0] if squeeze else res


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll))))
