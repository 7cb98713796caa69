"""Whole-sequence jobs of `Engine`: `prefill`, greedy `generate` (ragged batches too) and
streaming log-likelihood (`score`, `perplexity`); the `Generation` mixin.

Shapes: B batch, T tokens, V vocab, n generated tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from kvpolicies.attend import recording
from models.llama import Cache
from models.engine.checks import check_int, check_pool, is_ragged
from models.engine.extent import EngineCache

def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll))))


class Generation:
    """Prefill, greedy generation and streaming scoring."""

    def _refuse_streams(self, what: str) -> None:
        """A shape-class engine (`slots`) runs the staged protocol only: a stream would recompress
        by the shape class's rule, not by the exact policies' (nothing that the engine could check)."""
        if self.slots:
            raise ValueError(f"{what}: not on an Engine(slots={self.slots}) (shape classes keep the exact policies' "
                             "tokens after a prompt, not on a stream's recompressions); use an Engine without slots=")

    def _check_new(self, n) -> None:
        """n generated tokens write n - 1 after the compression: within a shape-class engine's max_new."""
        if self.slot_limit is not None and check_int("n", n, 0) - 1 > self.slot_limit:
            raise ValueError(f"generate: n={n} new tokens write {n - 1} after the compression, past max_new="
                             f"{self.slot_limit} of this Engine(slots={self.slots}); use an Engine without slots=")

    def prefill(self, tokens, chunk: int | None = None, cache: EngineCache | None = None):
        """Process a prompt [B, T] in chunks (None: one chunk); returns (last logits [B, V], cache:
        an `EngineCache`, which carries where it ends and the engine layout that made it).

        A fresh prompt (cache=None) goes through each policy's prompt phase, then `after_prompt`
        once (a prompt compressor compresses it there); with a cache this engine made (init_cache,
        prefill, step; another engine's is refused), the tokens extend it from where it ends,
        through the decode policies.
        """
        tokens = self._tokens(tokens, "tokens", (2,))
        t = tokens.shape[1]
        if t == 0:
            raise ValueError(f"tokens: prefill needs a prompt of at least 1 token, got shape {tokens.shape}")
        start = 0
        if cache is not None:
            self._refuse_streams("prefill(cache=...)")
            cache, length = self._extent(cache, "prefill(cache=...)", bare=False, batch=tokens.shape[0])
            start = int(length[0]) if (length == length[0]).all() else length
        chunk = self._chunk(chunk, t)
        fresh = cache is None and self.compresses
        more = self.appends if fresh else 0  # tokens the reconstruction pass appends (RestoreKV's)
        what = f"prompt of {t} tokens" + f" + {more} appended by the reconstruction pass" * bool(more)
        self._check_len(int(np.max(start)) + t + more, f"prompt of {int(np.max(start))} + {t} tokens" if cache is not
                        None else what)
        if fresh:
            self._check_repeat()
        cache_was_none = cache is None
        cache = self._init_runs(tokens.shape[0], prompt=fresh) if cache is None else cache
        logits = None
        for s in range(0, t, chunk):
            logits, cache = self._step(cache, tokens[:, s:s + chunk], start + s, prompt=fresh)
        if cache_was_none:
            self.prefills += 1
        self.prefill_tokens += t * tokens.shape[0]
        if fresh:
            self.prompts_compressed += 1
            cache = self.compress_cache(self._reconstruct(cache, tokens))  # kvzip: its pass (and appended tokens)
        end = jnp.asarray(np.broadcast_to(np.asarray(start, np.int32) + t + more, (tokens.shape[0],)))  # [B]
        return logits, EngineCache(tuple(cache), end, self.maker())

    def generate(self, prompt, n: int, chunk: int | None = None) -> np.ndarray:
        """Greedy decoding: prompt ids [B, T] (or [T]) -> n new ids [B, n] (or [n]); n = 0 gives an
        empty int32 array of that shape. A list of rows of different lengths is a ragged batch
        (`_generate_ragged`: each row prefilled alone, decoded together; [B, n]). With the engine's
        `fit`, a fresh prompt is stored at what each layer kept (`fitted`) before decoding."""
        if is_ragged(prompt):
            return self._generate_ragged(prompt, n, chunk)
        self._check_new(n)
        prompt = self._tokens(prompt, "prompt", (1, 2))
        n = check_int("n", n, 0)
        squeeze = prompt.ndim == 1
        prompt = prompt[None] if squeeze else prompt
        t = prompt.shape[1]
        if t == 0:
            raise ValueError(f"prompt: generate needs a prompt of at least 1 token, got shape {prompt.shape}")
        chunk = self._chunk(chunk, t)
        more = self.appends  # tokens the reconstruction pass appends after the prompt (RestoreKV's)
        self._check_len(t + more + n, f"prompt of {t} tokens + n={n} new tokens = {t + n}" + (
            f" + {more} appended by the reconstruction pass" * bool(more)))
        if n == 0:
            out = np.zeros((prompt.shape[0], 0), np.int32)
            return out[0] if squeeze else out
        if self.fit:  # each layer stored at what it kept, then decoded by the fitted engine
            engine, state = self.fitted(self.prompt(prompt, chunk), self.fit)
            out = engine.continue_generate(state, np.zeros((prompt.shape[0], 0), np.int32), n)
            return out[0] if squeeze else out
        logits, cache = self.prefill(prompt, chunk)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            out = np.asarray(first)[:, None]
        else:
            pos = jnp.full(first.shape, t + more, jnp.int32)
            rest = self._generate_rest(cache.runs, first, pos, n - 1, t + more + n - 1)
            out = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
        return out[0] if squeeze else out

    def _generate_ragged(self, prompts: Sequence, n: int, chunk: int | None) -> np.ndarray:
        """Greedy ids [B, n] for prompts of different lengths: each row is prefilled on its own
        (its policy's prompt phase and compression included), the rows' states are stacked into
        one batch and decoded together, each row at its own positions. Equal to one row at a time."""
        if self.fit:
            raise ValueError("generate: fit with prompts of different lengths (each is fitted alone); generate "
                             "them one at a time")
        rows = self._rows(prompts, "prompt")
        n = check_int("n", n, 0)
        self._check_new(n)
        more = self.appends  # tokens the reconstruction pass appends after each prompt (RestoreKV's)
        for i, r in enumerate(rows):
            self._check_len(len(r) + more + n, f"prompt row {i} of {len(r)} tokens + n={n} new tokens = {len(r) + n}"
                            + f" + {more} appended by the reconstruction pass" * bool(more))
        if n == 0:
            return np.zeros((len(rows), 0), np.int32)
        done = [self.prefill(r[None], chunk) for r in rows]  # (logits [1, V], cache) per row
        logits = jnp.concatenate([lg for lg, _ in done], axis=0)  # [B, V]
        cache = tuple(type(run[0]).join_rows(list(run)) for run in zip(*[c for _, c in done]))  # one batch
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
        if n == 1:
            return np.asarray(first)[:, None]
        pos = jnp.asarray([len(r) + more for r in rows], jnp.int32)
        rest = self._generate_rest(cache, first, pos, n - 1, max(map(len, rows)) + more + n - 1)
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
        self._refuse_streams("score")
        if is_ragged(tokens):
            if return_cache:
                raise ValueError("score: return_cache with streams of different lengths (the padded rows' caches "
                                 "hold their pads); score them one at a time")
            return self._score_ragged(tokens, check_int("chunk", chunk, 1), progress)
        tokens = self._tokens(tokens, "tokens", (1, 2))
        chunk = check_int("chunk", chunk, 1)
        squeeze = tokens.ndim == 1
        tokens = tokens[None] if squeeze else tokens
        if tokens.shape[1] < 2:
            raise ValueError(
                f"tokens: score needs a stream of at least 2 tokens (each token after the first is scored), "
                f"got {tokens.shape[1]}"
            )
        n = tokens.shape[1] - 1
        self._check_len(n, f"stream of {n + 1} tokens ({n} fed to the model, the last only as a target)")
        cache = self._init_runs(tokens.shape[0])
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
        check_pool(cache)
        res = np.concatenate(out, axis=1)
        res = res[0] if squeeze else res
        return (res, EngineCache(cache, jnp.full(tokens.shape[0], n, jnp.int32), self.maker())) if return_cache else res
