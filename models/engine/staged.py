"""Staged prompts (`Prompted`): prompt -> compress -> continue_generate, forks of one state,
and prompt states shared between engines (the `Staged` mixin of `Engine`).

Shapes: B batch, T tokens, V vocab, n generated tokens."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvpolicies.budgets import Fits
from kvpolicies.memory import tree_nbytes
from kvpolicies.prompt import adopt, after_prompt, reads_prompt_state
from models.llama import Cache, policy_runs
from models.engine.checks import check_int
from models.engine.layers import split_layers, stack_layers
from models.engine.steps import fork_cache, rotate_keys


@functools.partial(jax.jit, static_argnums=0)
def _after_prompt_layer(policy, run, i):
    """Layer i of a run of prompt states after `policy`'s `after_prompt` (one compile per policy
    and run shape; only the layer's slice is copied)."""
    return after_prompt(policy, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), run))


@dataclasses.dataclass(frozen=True)
class Prompted:
    """A prompt run so far: the cache, the number of tokens in it (the next position), the last
    token's logits [B, V], and whether `after_prompt` has run (the cache is the decode state)."""

    cache: Cache
    length: int
    logits: jax.Array
    compressed: bool
    tokens: np.ndarray | None = None  # [B, length] the ids fed (kvzip reconstructs them)
    # the engine that stores this state when `compress` fitted it (Engine(fit=n)): its layers' policies
    # re-sized to what they kept; continue_generate, feed and kept_positions hand the state to it
    fitted: "Staged | None" = None  # (the Engine; typed by its mixin: no import of models.engine.core)
    scored: tuple | None = None  # the reconstruction pass whose kvzip scores the cache holds (Engine.reconstruct)
    compressed_at: int = -1  # the length at `compress` (-1: not compressed by an engine): what followed it
    maker: object = None  # the engine layout that made the cache (models.engine.extent.Maker; checked on entry)


class Staged:
    """A prompt run in stages: compress a context before the question is known, fork one state."""

    # -- staged prompts: compress before the question, fork one state ---------------------------
    def prompt(self, tokens, chunk: int | Sequence[int] | None = None) -> Prompted:
        """A fresh prompt [B, T] through each policy's prompt phase, not compressed yet (one
        prefill; `compress` or `extend_prompt` next). `chunk` (here and in `extend_prompt`, `feed`,
        `continue_generate`): tokens per step (None: one step), or the list of each step's tokens
        (summing to T; e.g. `models.engine.layers.pieces`: powers of two, whose step shapes recur
        across prompts of different lengths). A chunk never changes a result."""
        tokens = self._tokens(tokens, "tokens", (2,))
        t = tokens.shape[1]
        if t == 0:
            raise ValueError(f"tokens: prompt needs at least 1 token, got shape {tokens.shape}")
        self._check_len(t, f"prompt of {t} tokens")
        self._check_repeat()
        cache = self._init_runs(tokens.shape[0], prompt=True)
        self.prefills += 1
        empty = np.zeros((tokens.shape[0], 0), np.int32)
        return self._feed(Prompted(cache, 0, None, False, empty, maker=self.maker(True)), tokens, self._chunk(chunk, t, t), prompt=True,
                          fork=False)

    def _feed(self, state: Prompted, tokens: np.ndarray, chunk: int | tuple[int, ...], prompt: bool,
              fork: bool = True) -> Prompted:
        layered = self.shares_layer_steps and not prompt  # a fitted engine: layer by layer (share_layer_steps)
        # (the layered feed copies each layer out of the cache: no fork needed)
        cache, logits, start = fork_cache(state.cache) if fork and not layered else state.cache, state.logits, state.length
        t = tokens.shape[1]
        sizes = chunk if isinstance(chunk, tuple) else [min(chunk, t - s) for s in range(0, t, chunk)]
        s = 0
        for m in sizes:
            if layered:
                logits, cache = self._feed_layers(cache, tokens[:, s:s + m], start + s)
            else:
                logits, cache = self._step(cache, tokens[:, s:s + m], start + s, prompt, start + t if prompt else None)
            s += m
        self.prefill_tokens += t * tokens.shape[0]
        fed = None if state.tokens is None else np.concatenate([state.tokens, tokens], axis=1)
        return dataclasses.replace(state, cache=cache, length=start + t, logits=logits, tokens=fed, scored=None)

    def _check_state(self, state: Prompted, tokens, what: str) -> np.ndarray:
        if not isinstance(state, Prompted):
            raise ValueError(f"{what}: state must be a Prompted (from Engine.prompt), got {type(state).__name__}")
        self._check_made(state, what)
        tokens = self._tokens(tokens, "tokens", (2,))
        if tokens.shape[0] != state.logits.shape[0]:
            raise ValueError(f"tokens: batch {tokens.shape[0]} does not match the state's batch "
                             f"{state.logits.shape[0]}")
        return tokens

    def extend_prompt(self, state: Prompted, tokens, chunk: int | Sequence[int] | None = None) -> Prompted:
        """More prompt tokens [B, T] through the prompt phase of an uncompressed state (which stays
        usable: a fork)."""
        tokens = self._check_state(state, tokens, "extend_prompt")
        if state.compressed or state.tokens is not None and state.length > state.tokens.shape[1]:
            raise ValueError("extend_prompt: the state is already compressed (or holds the tokens a reconstruction "
                             "pass appends, RestoreKV's: extend the prompt before them); use continue_generate")
        state = self._own(state, "extend_prompt")
        t = tokens.shape[1]
        self._check_len(state.length + t, f"prompt of {state.length} + {t} tokens")
        return self._feed(state, tokens, self._chunk(chunk, max(t, 1), t), prompt=True) if t else state

    def shares_prompt(self, other: "Staged") -> bool:
        """Whether this engine can `compress` the uncompressed states of `other`: same model,
        max_len and cache dtype, and layer by layer the same prompt-phase state (a PromptPhase
        whatever compressor it serves), or `full` here over a dense PromptPhase there."""
        if other._model is not self._model or other.max_len != self.max_len or other.cache_dtype != self.cache_dtype:
            return False

        bounds = lambda e: [(a, b) for a, b, _ in policy_runs(e.prompt_policies, e.cfg.n_layers)]  # noqa: E731
        if bounds(self) != bounds(other):
            return False  # the prompt cache is stacked by runs of equal layers: another grouping is another layout
        return all(reads_prompt_state(a, b) for a, b in zip(self.prompt_policies, other.prompt_policies))

    def _own(self, state: Prompted, what: str) -> Prompted:
        """An uncompressed state in this engine's prompt-phase layout: another engine's that this
        one `shares_prompt` with (evals.prefills) is adopted (`full` over a PromptPhase's dense
        slots: its keys rotated), whatever comes next (compress, more prompt, decoding)."""
        return state if state.compressed else dataclasses.replace(state, cache=self._adopt(state.cache, what), maker=self.maker(True))

    def _adopt(self, cache: Cache, what: str = "compress") -> Cache:
        """A prompt-phase cache in this engine's prompt-phase runs (full's runs take the dense
        slots of a PromptPhase state)."""
        runs = policy_runs(self.prompt_policies, self.cfg.n_layers)
        if len(runs) != len(cache):
            raise ValueError(f"{what}: the state has {len(cache)} runs of layers, this engine's prompt phase "
                             f"{len(runs)}: it comes from an engine that does not share the prompt (shares_prompt)")
        out = []
        for (a, b, pol), st in zip(runs, cache):
            st, rotate = adopt(pol, st)
            if rotate:  # a prompt phase stores keys un-rotated; e.g. full stores them rotated
                tables = self.params[1] or self._model.rope_tables(self.max_len)
                local = tuple(bool(x) for x in np.asarray(self.cfg.local_layers)[a:b])
                st = dataclasses.replace(st, k=rotate_keys(st.k, st.pos, tables, local))
            out.append(st)
        return tuple(out)

    def compress(self, state: Prompted) -> Prompted:
        """`after_prompt` on a prompt-phase state (this engine's, or that of an engine it
        `shares_prompt` with); the input stays usable. A streaming policy's state is unchanged.
        With the engine's `fit`, each layer is stored at what it kept (`fitted`): the state then
        belongs to the fitted engine (`Prompted.fitted`), to which this engine's
        `continue_generate`, `feed` and `kept_positions` hand it."""
        if not isinstance(state, Prompted):
            raise ValueError(f"compress: state must be a Prompted (from Engine.prompt), got {type(state).__name__}")
        if state.compressed:
            raise ValueError("compress: the state is already compressed")
        self._check_made(state, "compress")
        cache = self._adopt(state.cache)
        want = [type(st) for st in jax.eval_shape(lambda: self._init_runs(state.logits.shape[0], prompt=True))]
        if [type(st) for st in cache] != want:
            raise ValueError("compress: the state's cache does not have this engine's prompt-phase layout "
                             "(another model, max_len or prompt phase; see shares_prompt)")
        if self.fit:
            engine, fitted = self.fitted(state, self.fit)
            return dataclasses.replace(fitted, fitted=engine)
        length = state.length
        if self.compresses:
            self.prompts_compressed += 1
            cache, length = self._scored(state, cache)  # kvzip: its scores (a pass, or `reconstruct`'s), RestoreKV's
            cache = self.compress_cache(cache)
        return Prompted(cache, length, state.logits, True, state.tokens, compressed_at=length, maker=self.maker())

    def fitted(self, state: Prompted, round_to: int = 1) -> tuple["Staged", Prompted]:
        """A state stored at what each layer keeps: (an engine whose layers' policies are re-sized
        to their kept tokens, the compressed state in it). For every layer whose policy `Fits`
        (kvzap, whose threshold keeps per-layer numbers that depend on the content), the tokens
        the layer keeps are read to the host (max over the batch), the policy is `fit` to that
        many per kv head on average, rounded up to a multiple of `round_to` (fewer distinct
        shapes, so fewer compilations across prompts), and the layer is stored at that capacity
        (every kept token, and max_new free slots per head). Other layers are unchanged.

        An uncompressed state (`Engine.prompt`) is counted first (the compression's positions
        only), then each fitting layer is compressed straight to its size, one layer at a time:
        the static pool is never built. A compressed state (`Engine.compress`) has its pools cut
        (`Fits.fit_state`). The fitted engine keeps the same tokens and decodes the
        state as this one would, each layer at its own size; engines are remembered per fitted
        policy tuple, and with `decode_loop="layers"` every fitted engine runs this engine's
        jitted layer steps (`share_layer_steps`: its feeds and decoding layer by layer), so a
        layer's step compiles once per (policy, shape) over all prompts, not a whole model per
        prompt. Each call appends a
        record to `fit_records`: the prompt's tokens, its batch rows, each layer's kept tokens (all
        heads, the max over the batch), the stored bytes (all rows) in all and per layer."""
        if not isinstance(state, Prompted):
            raise ValueError(f"fitted: state must be a Prompted (Engine.prompt), got {type(state).__name__}")
        round_to = check_int("round_to", round_to, 1)
        if self.placement is not None:
            raise ValueError("fitted: not on a mesh (a per-layer size is not sharded yet)")
        if not any(isinstance(p, Fits) for p in self.policies):
            raise ValueError(f"fitted: no layer's policy can be fit to what it kept (kvzap); got "
                             f"{sorted({type(p).__name__ for p in self.policies})}")
        self._check_made(state, "fitted")
        kh, length = self.cfg.n_kv_heads, state.length
        if state.compressed:
            layers = split_layers(state.cache)
            held = [int(np.asarray((st.pos >= 0).sum(axis=(1, 2))).max()) for st in layers]
        else:
            cache, length = self._scored(state, self._adopt(state.cache))
            held = [int(n) for n in np.asarray(self._held_after_prompt(cache)).max(axis=1)]  # [L]
        policies = []
        for i, (pol, n) in enumerate(zip(self.policies, held)):
            if isinstance(pol, Fits):
                per_head = -(-n // kh)
                pol = pol.fit(-(-per_head // round_to) * round_to)
                if kh * pol.capacity(self.max_len) < n:  # a policy whose fit has no room for what it keeps
                    raise ValueError(f"fitted: layer {i} keeps {n} tokens, {type(pol).__name__}.fit gives "
                                     f"{kh} x {pol.capacity(self.max_len)} slots")
            policies.append(pol)
        policies = tuple(policies)
        if state.compressed:
            layers = [p.fit_state(st, self.max_len) if isinstance(p, Fits) else st
                      for p, st in zip(policies, layers)]
        else:
            self.prompts_compressed += 1
            layers = [_after_prompt_layer(policies[a + i], run, np.int32(i))
                      for a, b, _, run in self.decode_runs(cache) for i in range(b - a)]
        memo = self.__dict__.setdefault("_fitted_engines", {})
        if policies not in memo:
            memo[policies] = type(self)(self._model, policies, self.max_len, self.cache_dtype, repeat=self.repeat,
                                        rope_tables=self.params[1] is not None, decode_loop=self.decode_loop)
            if self.decode_loop == "layers":  # layer steps compiled per layer shape over all prompts, not per prompt
                memo[policies].share_layer_steps(self)
        cache = stack_layers(layers, policies, self.cfg.n_layers)
        self.fit_records.append({"tokens": state.length, "rows": int(state.logits.shape[0]), "kept": held,
                                 "stored_bytes": tree_nbytes(cache),
                                 "layer_bytes": [tree_nbytes(st) for st in layers]})
        return memo[policies], Prompted(cache, length, state.logits, True, state.tokens, maker=memo[policies].maker())

    def kept_positions(self, state: Prompted, row: int = 0) -> list[list[np.ndarray]]:
        """The token positions the cache of `state` holds for batch row `row`: [layer][kv head] ->
        sorted int array. Per-head token sets (snapkv, h2o...), one set shared by the layer's heads
        (window, sink, full...), head pools (adakv, kvzip: each head's share of the layer's pool),
        duo's two head groups and paged block tables. A prompt phase (not yet compressed) holds
        every prompt token."""
        if not isinstance(state, Prompted):
            raise ValueError(f"kept_positions: state must be a Prompted, got {type(state).__name__}")
        if state.fitted is not None and state.fitted is not self:
            return state.fitted.kept_positions(state, row)
        self._check_made(state, "kept_positions")
        row = self._check_row(row, state.logits.shape[0])
        state = self._own(state, "kept_positions")
        k = self.cfg.n_kv_heads
        out: list[list[np.ndarray]] = []
        for (a, b, pol), run in zip(policy_runs(self.policies if state.compressed else self.prompt_policies,
                                                self.cfg.n_layers), state.cache):
            host = jax.tree.map(lambda x: None if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x), run)
            for i in range(b - a):  # positions and tables read back, never the keys or values (`held`)
                out.append(jax.tree.map(lambda x: x[i], host).held(row, k, pol))
        return out

    def feed(self, state: Prompted, tokens, chunk: int | Sequence[int] | None = None, fork: bool = True) -> Prompted:
        """The state after `tokens` [B, T] went through the decode policies of a compressed state
        (what `continue_generate` does before it generates; `state` stays usable: a fork, unless
        `fork=False`: the steps then take its cache's buffers, no copy, and `state` is not to be used
        again). With the ids a generation wrote, its cache after them: `kept_positions` reads what it holds."""
        if isinstance(state, Prompted) and state.fitted is not None and state.fitted is not self:
            return state.fitted.feed(state, tokens, chunk, fork)
        tokens = self._check_state(state, tokens, "feed")
        if not state.compressed and self.compresses:
            raise ValueError("feed: the state is not compressed yet (compress it first)")
        state = self._own(state, "feed")
        t = tokens.shape[1]
        self._check_len(state.length + t, f"state of {state.length} + {t} tokens")
        self._check_room(state, t, "feed")
        return self._feed(state, tokens, self._chunk(chunk, max(t, 1), t), prompt=False, fork=fork) if t else state

    def continue_generate(self, state: Prompted, tokens, n: int, chunk: int | Sequence[int] | None = None, until=None) -> np.ndarray:
        """Greedy ids [B, n] after feeding `tokens` [B, T] (T >= 0; e.g. a question) through the decode policies of a compressed
        state (it stays usable: forks do not interfere); `until(ids [B, m]) -> bool`, asked every few steps: True ends them early."""
        if isinstance(state, Prompted) and state.fitted is not None and state.fitted is not self:
            return state.fitted.continue_generate(state, tokens, n, chunk, until)
        if isinstance(tokens, (list, tuple)) and len(tokens) == 0:
            tokens = np.zeros((state.logits.shape[0], 0), np.int32)
        tokens = self._check_state(state, tokens, "continue_generate")
        n = check_int("n", n, 0)
        if not state.compressed and self.compresses:
            raise ValueError("continue_generate: the state is not compressed yet (compress it first)")
        state = self._own(state, "continue_generate")
        t = tokens.shape[1]
        self._check_len(state.length + t + n, f"state of {state.length} + {t} tokens + n={n} new tokens")
        self._check_room(state, t + max(n - 1, 0), "continue_generate")
        if t:
            state = self._feed(state, tokens, self._chunk(chunk, t, t), prompt=False)
        first = jnp.argmax(state.logits, axis=-1).astype(jnp.int32)  # [B]
        head, pos = np.asarray(first)[:, None], jnp.full(first.shape, state.length, jnp.int32)
        if n <= 1:
            return head[:, :n]
        rest = self._generate_rest(state.cache, first, pos, n - 1, state.length + n - 1, fork=not t,
                                   until=until and (lambda ids: until(np.hstack([head, ids]))))
        return np.concatenate([head, np.asarray(rest)], axis=1)
