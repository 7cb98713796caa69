"""The jitted steps of `Engine`: pure functions of (params, cache, tokens, pos) with the cache
donated, length buckets (`reach_of`), and kvzip's reconstruction pass (the `Steps` mixin; the
layer-by-layer steps are `models.engine.layers`).

Shapes: B batch, T tokens in a step, V vocab, n generated tokens, L layers, K kv heads, S slots, D head dim."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvpolicies.prompt import after_prompt, appended_tokens
from kvpolicies.slots import has_prefix_slots
from kvpolicies.attention.tuning import Tuning
from models.llama import Cache, Llama, policy_runs
from models.lora import append_pass
from models.reconstruct import model_scope, reconstruct, scored_runs
from models.engine.checks import check_int, check_pool
from models.engine.extent import EngineCache

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

    def _generate_rest(self, cache: Cache, first, pos, n: int, end: int, fork: bool = False, until=None):
        """Greedy ids [B, n] after `first` [B] at positions `pos` [B] (every position < `end`): layer by layer (the
        default; `until`: `_decode_layers`'s, may end early) or as one fused `lax.scan` (`decode_loop="scan"`, and
        any engine on a mesh: all n). fork: `cache` must stay usable (the scan donates it)."""
        reach = self._reach(end)
        if self.decode_loop == "layers" and self.placement is None:
            out, states = self._decode_layers(cache, first, pos, n, reach, cut=False, until=until)
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

    def _reconstruct(self, cache: Cache, tokens: np.ndarray, append: bool = True) -> Cache:
        """kvzip's pass (`models.reconstruct.reconstruct`) over a prompt-phase cache, then (`append`) `_append`."""
        if not self.reconstructors:
            return cache
        self._check_repeat()
        cache = reconstruct(self, cache, tokens, policy_runs(self.recon_policies, self.cfg.n_layers))
        return self._append(cache, tokens.shape[1]) if append else cache

    @property
    def appends(self) -> int:
        """Tokens the reconstruction pass appends after a prompt (`kvpolicies.prompt.Appends`: RestoreKV's n
        restore tokens; 0 for none): a fresh prompt of t tokens continues at t + appends."""
        return appended_tokens(self.reconstructors)

    def _append(self, cache: Cache, t: int) -> Cache:
        """A scored prompt-phase cache of t tokens after the tokens the reconstructors append (`models.lora.
        append_pass`) and their `after_pass` (a choice over all layers, the appended slots in it)."""
        if not self.appends:
            return cache
        scored = scored_runs(self.reconstructors, policy_runs(self.recon_policies, self.cfg.n_layers))
        return model_scope(self.reconstructors, append_pass(self, cache, t, scored), scored)

    def _score_key(self) -> tuple:
        """What kvzip's scores depend on: the model, max_len, the pass's policies with what kvzip keeps
        reset (`KVzip.scoring`: kvzip at another ratio or budget scores alike), the repeat prompts."""
        policies = tuple(p.scoring() if hasattr(p, "scoring") else p for p in self.recon_policies)
        return id(self._model), self.max_len, policies, self.repeat

    def _scored(self, state: Any, cache: Cache, append: bool = True) -> tuple[Cache, int]:
        """(the adopted prompt cache of `state` with kvzip's scores: a reconstruction pass now, or the scores
        `reconstruct` put in the state when it ran a pass that scores alike (then only this engine's choice over
        all layers, scope="model", is made again); with `append`, the tokens the pass appends (`_append`) unless
        the state holds them already; the state's length then)."""
        if not self.reconstructors:
            return cache, state.length
        held = state.tokens is not None and state.length > state.tokens.shape[1]  # appended already (lora.restore)
        if getattr(state, "scored", None) != self._score_key():
            if state.tokens is None:
                raise ValueError("kvzip needs the prompt's token ids (a state from Engine.prompt)")
            if held:
                raise ValueError(f"the state holds {state.length - state.tokens.shape[1]} tokens appended after "
                                 "another engine's reconstruction pass (RestoreKV's restore tokens): compress it "
                                 "with that engine, or an engine of the same pass")
            cache = self._reconstruct(cache, state.tokens, append=False)
        else:
            scored = scored_runs(self.reconstructors, policy_runs(self.recon_policies, self.cfg.n_layers))
            cache = model_scope(self.reconstructors, cache, scored)
        if not append or held or not self.appends:
            return cache, state.length
        self._check_len(state.length + self.appends, f"prompt of {state.length} tokens + {self.appends} appended "
                        "after the reconstruction pass (RestoreKV's restore tokens)")
        return self._append(cache, state.length), state.length + self.appends

    def reconstruct(self, state: Any) -> Any:
        """kvzip's reconstruction pass over an uncompressed `Prompted` on its own (`compress` runs
        it otherwise): the state returned holds the scores, and `compress` of it by this engine or
        by any engine that `shares_prompt` with this one and scores alike (kvzip at other ratios
        or budgets) keeps from them without another pass: score once, compress at every ratio.
        A state whose kvzip layers hold scores alike is returned as it is; more prompt tokens
        (`extend_prompt`) drop the scores. The tokens a pass appends (RestoreKV's) are not in it:
        `compress` appends them."""
        if getattr(state, "compressed", True):
            raise ValueError("reconstruct: needs an uncompressed Prompted (Engine.prompt, before compress)")
        if not self.reconstructors:
            raise ValueError(f"reconstruct: no layer of this engine reconstructs (kvzip); got "
                             f"{sorted({type(p).__name__ for p in self.policies})}")
        if getattr(state, "scored", None) == self._score_key():
            return state
        cache, _ = self._scored(state, self._adopt(state.cache, "reconstruct"), append=False)  # the pass
        return dataclasses.replace(state, cache=cache, scored=self._score_key())

    def _after_prompt_impl(self, cache, tables=None):
        """Each run's prompt state -> its decode state (stacked over the run's layers); `tables`:
        per run, the kept counts of its layers' shape class ([n, ...]) or None (`Engine(slots=)`)."""
        runs = self.decode_runs(cache)
        tables = tables or (None,) * len(runs)
        return tuple(jax.vmap(functools.partial(after_prompt, pol))(st) if tab is None else
                     jax.vmap(lambda s, t, pol=pol: after_prompt(pol, s, t))(st, tab)
                     for (_, _, pol, st), tab in zip(runs, tables, strict=True))

    def compress_cache(self, cache: Cache) -> Cache:
        """`after_prompt` of every run of a prompt-phase cache (kvzip's scores already in it)."""
        return self._after_prompt(cache, self.keep_tables)

    def decode_runs(self, cache: Cache) -> list[tuple[int, int, Any, Any]]:
        """A prompt-phase cache (a stacked state per run of `prompt_policies`) cut into the runs of
        `policies`: (start, end, policy, stacked state). Equal policies have equal prompt phases,
        so each run of `policies` lies inside one run of the prompt phase (pyramidkv: one phase
        run, a run per layer)."""
        n = self.cfg.n_layers
        have = policy_runs(self.prompt_policies, n)
        out = []
        for a, b, pol in policy_runs(self.policies, n):
            i = next(i for i, (c, d, _) in enumerate(have) if c <= a and b <= d)
            c, d, _ = have[i]
            out.append((a, b, pol, cache[i] if (c, d) == (a, b) else jax.tree.map(lambda x: x[a - c:b - c], cache[i])))
        return out

    def _held_after_prompt(self, cache):
        """[L, B] tokens each layer would hold after `after_prompt` (jitted once per engine: only
        the positions of the compressed state are computed, its keys and values are dead code)."""
        if "_held_step" not in self.__dict__:
            def held(cache):
                out = [jax.vmap(functools.partial(after_prompt, pol))(st).pos for _, _, pol, st in self.decode_runs(cache)]
                return jnp.concatenate([(p >= 0).sum(axis=(2, 3)) for p in out])  # [L, B]
            self._held_step = jax.jit(held)
        return self._held_step(cache)

    # -- public API ---------------------------------------------------------------------------
    def init_cache(self, batch: int = 1, prompt: bool = False) -> EngineCache:
        """An empty cache (prompt: the prompt phase's, for `prefill` of a fresh prompt) of length 0,
        carrying this engine's `maker` (models.engine.extent); on a mesh, created in its shardings."""
        return EngineCache(self._init_runs(batch, prompt), jnp.zeros(batch, jnp.int32), self.maker(prompt))

    def _init_runs(self, batch: int, prompt: bool = False) -> Cache:
        make = lambda: self._model.init_cache(self.prompt_policies if prompt else self.policies, batch,  # noqa: E731
                                              self.max_len, self.cache_dtype)
        return make() if self.placement is None else self.placement.create(make, batch, prompt)

    def _step(self, cache: Cache, tokens, start: int | np.ndarray, prompt: bool = False, end: int | None = None):
        """The jitted step on checked tokens [B, T] at positions start..start+T-1 (start: an int, or
        each row's [B]); `end`: the feed's end, whose length bucket every piece of it reads (one program
        per piece size; a bucket's unfilled slots change no float: blocks no query sees are skipped)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        t = tokens.shape[1]
        # positions built on the host and copied in (no eager device operation between steps)
        first = np.asarray(start, np.int32).reshape(-1, 1)  # [B or 1, 1]: each row from its own position
        pos = jnp.asarray(np.broadcast_to(first + np.arange(t, dtype=np.int32), tokens.shape))  # [B, T]
        logits, cache = self._logits_step(self.params, cache, tokens, pos, prompt=prompt,
                                          reach=self._reach(end or int(np.max(start)) + t, t, prompt))
        return logits, check_pool(cache)

    def step(self, cache: EngineCache | Cache, tokens, start: int | None = None):
        """Feed tokens [B, T] at positions start..start+T-1 (None: from where the cache ends);
        returns last logits [B, V] and the cache (an `EngineCache`).

        `cache`: one this engine made (init_cache, prefill, step; another engine's is refused), or
        a bare tuple of run states of this engine's shapes (then `start` is needed). An explicit
        `start` is the caller's: a gap after the cache's end, or a rewind (`full` then masks its
        slots past `start` as future until they are written again). Host tokens (numpy, lists)
        are checked id by id; a jax array (e.g. the argmax of the previous step) is checked for
        shape and dtype, and its range on the device (one scalar read back: the step waits for the
        ids, not for their values on the host).
        """
        start = None if start is None else check_int("start", start, 0)
        self._refuse_streams("step")
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
        runs, length = self._extent(cache, "step", bare=True, batch=tokens.shape[0])
        if start is None:
            if length is None:
                raise ValueError("step: start=None needs a cache that carries where it ends (init_cache, prefill, "
                                 "step); give start for a bare tuple of run states")
            start = int(length[0]) if (length == length[0]).all() else length
        end = int(np.max(start)) + t
        self._check_len(end, f"positions {int(np.max(start))}..{end - 1} ({end} tokens)")
        logits, runs = self._step(runs, tokens, start)
        return logits, EngineCache(runs, jnp.asarray(np.broadcast_to(np.asarray(start, np.int32) + t,
                                                                     (tokens.shape[0],))), self.maker())
