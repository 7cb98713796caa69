"""`kvpress(name, compression_ratio, /, **fields)`: the policy that reproduces a kvpress 0.5.5 press.

Shapes: B batch, K kv heads, S slots, V view slots, W observation rows.

kvpress (NVIDIA/kvpress, `presses/`) compresses a context ONCE, in the forward hook of its
prefill, to n_kept = max(1, int(n (1 - compression_ratio))) tokens per kv head (windows and
sinks included); the question and the answer are then appended, never compressed. Our prompt
compressors do the same through `Engine.prompt` -> `Engine.compress` -> `continue_generate`,
sized by their `ratio` field (`PromptScored.kept_for`), with kvpress's defaults:

    SnapKVPress             snapkv, window_size 64 (obs_window), kernel_size 5, average pooling
    PyramidKVPress          snapkv per layer, kvpress's `get_layer_budget` (beta 20, window 64, kernel 5)
    KnormPress              knorm over every layer
    StreamingLLMPress       `SinkOnce`: n_sink 4 + the newest, once (our `sink` keeps sliding)
    ExpectedAttentionPress  expected (n_future_positions 512, n_sink 4, covariance, vnorm)
    ObservedAttentionPress  observed
    TOVAPress               `LastQuery`: one top-k by the last query's attention averaged over
                            every head, the last token kept (our `tova` evicts per token)

    AdaKVPress              adakv (press="SnapKVPress", the default): SnapKVPress's scores, kvpress's
                            safeguard max(1, int(0.2 n_kept)) counted with the window

    KVzipPress              kvzip with kvpress's rule: `scope="model"` (the int(L K n r) lowest
                            reconstruction scores of all layers removed; layerwise=True: per layer),
                            n_sink 4 kept, the newest token not forced, its repeat prompts and chat
                            prefix (`prompts="kvpress"`), chunk 2048. The engine needs the tokenizer
                            (Engine(..., repeat=tok), or a model from models.loading / evals.zoo,
                            which remember theirs). Stored at full size: layers keep data-dependent
                            counts, as kvpress (which masks)
    KVComposePress          kvcompose (structured; kvpress's agg_* fields): a second pass over the context
                            itself, layer counts from one top-k over all layers' composite scores; stored
                            at what each layer kept with Engine(..., fit=1), as kvpress (which truncates);
                            structured=False: `kvcompose.KVComposeHeads`, each (layer, kv head) its own count,
                            a counted head pool (kvpress masks)
    KVgradPress             kvgrad: KVzipPress's pass and choice (chunk_size 512), a token's score its attention
                            x ||v W_o||_2 x the gradient norm of the repeat query's attention output
                            (models.gradient); layerwise=True: per layer, each head's share stored
    DuoAttentionPress       duo with compression_ratio as kvpress's head_compression_ratio: the
                            round(L K r) lowest of `head_scores` ([L][K], a file or nested lists;
                            kvpress downloads the authors' patterns or scores BookSum, neither
                            reachable offline) stream; sink_size 128 / recent_size 256 (kvpress's
                            on-the-fly values) trimmed once after the dense prompt, the question
                            and answer appended (`appended=max_new`)

    KeyDiffPress            keydiff (-cos of the key after RoPE with the head's mean unit key)
    QFilterPress            qfilter: -<f, k> of the keys after RoPE, f the layer's filters (q_filters=: kvpress
                            downloads the authors'; ours by their recipe, `python -m evals.qfilter`)
    ExpectedAttentionStatsPress  `expected_stats.ExpectedStats`: expected's score, the query mean and covariance
                            of calibration text (stats_folder=: ours, `python -m evals.expected_stats`)
    KVzapPress              `kvzap_scored.ZapScored`: kvzap's surrogate scores (model_type "mlp", kvzap_model_name=
                            our weights, evals.train_kvzap), per kv head top-k, no window (DMS: `kvzap`)
    FastKVzipPress          `fastkvzip.FastKVzip` (gates= a file): the gates' scores, the int(L K n r) lowest
                            (layer, kv head, token) of all layers dropped (layerwise=True: each layer's
                            int(K n r)), a head pool (Engine(fit=1): each layer at what it kept)
    RestoreKVPress          `restorekv.RestoreKV`: KVzipPress's rule at min(1, r + n / t) over the context, after n
                            learned restore tokens (restore_model_name=: our arrays, evals.train_restorekv) went
                            through a LoRA-adapted pass (the engine runs it after the reconstruction pass)
    LagKVPress              lagkv (n_sink 4, lag_size 128, cross_scoring False)
    RandomPress             random with kvpress's counts and our draw (torch's cannot be reproduced)
    FinchPress              finch: window_size = the question's tokens, which end the prompt (kvpress: a
                            delimiter token), the question's attention rows weighted by position, keys
                            re-rotated to their ranks
    CURPress                cur (num_sinks 4, kv_product leverage over local windows of 16)
    CompactorPress          compactor (leverage of sketched keys + non-causal chunked attention, sinks 8 + 4);
    NonCausalAttnPress,     its attention alone and its leverage alone (no sinks); the sketch is our draw
    LeverageScorePress      (kvpolicies.compactor.sketch), torch's cannot be reproduced

    SimLayerKVPress         simlayerkv (compression_ratio 0: kvpress's is read-only, reported after the
                            prefill): a lazy layer (its last n_last queries' attention on the first n_initial and
                            the n_recent tokens before them above lazy_threshold) keeps those, the others the prompt

    CapPress                cap (CAPKV's capacity score: relevance-weighted value leverage, 4 sinks)

    Wrappers (`press=` the inner press: a class name, its fields among `fields`, or a kvpress(...) result):
    PerLayerCompressionPress  one inner policy per layer at `compression_ratios[i]`
    MergingPress            `Merging`: evicted values folded into the most similar kept token (knorm,
                            keydiff, lagkv, random, cur; kvpolicies.merging)
    ChunkPress              `Chunked`: chunks of chunk_length (1024) scored apart (knorm, keydiff, lagkv, random)
    BlockPress              `Blocked`: KeyDiff's block-wise eviction, blocks of block_size (128) (knorm, keydiff, random)
    ComposedPress           `Composed`: `presses=` applied in turn (later ones: knorm, keydiff, random);
                            [press, ThinKPress]: `ThinK(press=...)`, the channels of the keys the press kept
    AdaKVPress              over any other scorer without per-slot statistics (knorm, keydiff, lagkv,
                            random, StreamingLLM, TOVA, expected): `kvpolicies.adascored.AdaScored`
                            (PyramidKVPress: its score is SnapKV's, so `adakv`)
    ChunkKVPress            `ChunkKV`: chunks of chunk_length (20) kept whole by their mean score (knorm,
                            keydiff, lagkv, random, snapkv, expected; `Delegating`)
    EntropyGatedChunkKVPress  `EntropyChunkKV`: ChunkKV's chunks (10), spiky ones cut to their 4 best
    KeyRerotationPress      `Rerotated`: the inner press, RoPE at the kept keys' ranks (as ChunkKV's)
    CAMPress                `cam.CAM`: DecodingPress's schedule (base_press KnormPress or KeyDiffPress,
                            compression_interval 512, target_size 2048), the evicted values merged into the
                            next merge_budget (32) kept ones by a Bernoulli draw (ours, not torch's)
    ThinKPress              think: key_channel_compression_ratio (default 2 r: kvpress's compression_ratio is
                            its half) of each kv head's key channels pruned by the window_size (32) newest
                            queries; every token kept, only the kept channels of the prompt's keys stored
    CriticalKVPress         `critical.Critical` (press="SnapKVPress" by default; expected, keydiff, pyramidkv's
                            score): stage 1 by the score, stage 2 by (score + epsilon) ||v W_o||_1
    CriticalAdaKVPress      `critical.CriticalAda`: Ada-KV's head budgets, then the two stages per head

    KnormPress with compression_interval=I, target_size=T: kvpress's PrefillDecodingPress
                            (KnormPress(compression_ratio) on the prefill, DecodingPress(KnormPress(),
                            I, T) while decoding): knorm with `interval=I, target=T`, every I decoded
                            tokens the cache back to T per kv head. The same as kvpress when the
                            prompt keeps T tokens and each step is one token (kvpress counts steps)
    DecodingPress,          `decoding.Decoding` (base_press= KnormPress or KeyDiffPress): kvpress's steps exactly,
    CompressionRatioDecodingPress,  every compression_interval forward steps (the question one) the whole cache back
    PrefillDecodingPress    to target_size (or int(n_seen (1 - target_compression_ratio))), after the prefilling press
    DMSPress                `kvzap` with rule="threshold" (press= KVzapPress; decoding=False): window + score >= threshold
    LUKVPress               `lukv.LUKV`: per-head budgets from budget_curves= (a given [99, L, K] curve) around press=

Differences that remain by construction: scores are computed in JAX (float32 sums in another
order than torch's), so a near tie can fall the other way; kvpress breaks exact ties by
torch.topk's order, we keep the newer token.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvpolicies.adakv import AdaKV
from kvpolicies.adascored import AdaScored
from kvpolicies.cam import CAM
from kvpolicies.cap import Cap
from kvpolicies.base import Policy, RopePositions
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.compactor import Compactor
from kvpolicies.critical import Critical, CriticalAda, SnapOnce
from kvpolicies.cur import CUR
from kvpolicies.decoding import PRESSES as DECODING_PRESSES, from_kvpress as decoding_press
from kvpolicies.lukv import from_kvpress as lukv_press
from kvpolicies.expected import Expected
from kvpolicies.finch import Finch
from kvpolicies.full import Full
from kvpolicies.duo import Duo, load_pattern
from kvpolicies.knorm import Knorm
from kvpolicies.keydiff import KeyDiff
from kvpolicies.kvgrad import KVgrad
from kvpolicies.kvzip import KVzip
from kvpolicies.kvcompose import KVCompose, KVComposeHeads
from kvpolicies.lagkv import LagKV
from kvpolicies.merging import Merging
from kvpolicies.observed import Observed
from kvpolicies.prompt import PromptPhase, PromptState
from kvpolicies.prompt_scored import PromptScored, rank_by
from kvpolicies.pyramidkv import PyramidKV, PyramidLayer  # noqa: F401  (PyramidLayer: re-exported, it lived here)
from kvpolicies.expected_stats import from_kvpress as expected_stats_press
from kvpolicies.fastkvzip import from_kvpress as fastkvzip_press
from kvpolicies.restorekv import from_kvpress as restorekv_press
from kvpolicies.kvzap_scored import from_kvpress as kvzap_press
from kvpolicies.qfilter import from_kvpress as qfilter_press
from kvpolicies.random_keep import RandomKeep
from kvpolicies.ties import TIES, torch_cpu_top_mask
from kvpolicies.scored import pack, top_mask
from kvpolicies.simlayerkv import SimLayerKV
from kvpolicies.snapkv import SnapKV
from kvpolicies.wrapped import Delegating, Wrapped
from kvpolicies.think import ThinK

SNAP_DEFAULTS = {"obs_window": 64, "kernel": 5, "pooling": "avg"}  # kvpress's SnapKVPress / PyramidKVPress


@dataclasses.dataclass(frozen=True)
class SinkOnce(PromptScored):
    """kvpress's `StreamingLLMPress`: after the prompt, keep the first `n_sink` tokens and the
    newest kept() - n_sink, once; decoded tokens are appended (no sliding). Streams: the same
    rule on overflow. Keys keep their text positions (kvpress caches them rotated)."""

    label = "sink-once"

    budget: int = 1024
    n_sink: int = 4
    max_new: int = 256
    codec: Codec = Identity()

    def rank(self, slots, keys, stats, seen):
        pos = slots.pos  # [B, K, V]
        return rank_by(jnp.where(pos < self.n_sink, jnp.inf, pos.astype(jnp.float32)), pos)


@dataclasses.dataclass(frozen=True)
class LastQuery(PromptScored):
    """kvpress's `TOVAPress`: after the prompt, one top-k by the attention of the last prompt
    query averaged over every query head (one ranking shared by the kv heads), the last token
    always kept; decoded tokens are appended. Streams (overflow): the newest tokens are kept."""

    label = "last-query"

    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    def rank(self, slots, keys, stats, seen):
        return rank_by(slots.pos.astype(jnp.float32), slots.pos)

    def prompt_rank(self, state, slots, keys, stats):
        pos = slots.pos  # [B, K, V]
        att = jnp.broadcast_to(state.rows.sum(axis=(1, 2))[:, None], pos.shape)  # [B, K, V]: every head's sum
        last = pos == pos.max(axis=-1, keepdims=True)
        return rank_by(jnp.where(last, jnp.inf, att), pos)

    def prompt_policy(self):
        return PromptPhase(codec=self.codec, of=self, obs_window=1)


@dataclasses.dataclass(frozen=True)
class Chunked(Wrapped):
    """kvpress's `ChunkPress(press, chunk_length)` (after FINCH, Corallo & Papotti 2024): the prompt cut
    into chunks of `chunk_length` tokens from position 0, each scored by `press` on its own tokens and
    keeping its own max(1, int(len (1 - ratio))) best; the question and answer appended."""

    label = "chunked"
    table_rows = -1  # kept_table: the kept counts, then each chunk's (as many rows as the prompt phase has chunks)
    chunk_length: int = 1024

    def kept_for(self, n):
        c = self.chunk_length
        return sum(max(1, int(min(c, n - i) * (1 - self.ratio))) for i in range(0, n, c))

    def kept_table(self, max_len):
        """[1 + C, M + 1] int32, per prompt length n: the kept count, then each of the C chunks' own,
        kvpress's max(1, int(size (1 - ratio))) (Python's float64 product, as kvpress; float32 before
        2026-12-07, which differs at ratios such as 0.55): what a shape class is given as data."""
        return None if self.interval or self.slots else np.concatenate([self._counts(max_len)[None],
                                                                        self._chunk_counts(max_len)])

    def _chunk_counts(self, max_len: int) -> np.ndarray:
        n, c = np.arange(max_len + 1), self.chunk_length
        size = np.clip(n[None] - np.arange(0, max_len, c)[:, None], 0, c).astype(np.float64)  # [C, M + 1]
        return np.maximum(1, np.floor(size * (1 - self.ratio))).astype(np.int32)

    def ties_decided_here(self):
        return False  # each chunk's (block's) top-k is its own

    def prompt_rank(self, state, slots, keys, stats):
        return self.rank_given(state, slots, keys, stats, jnp.asarray(self._chunk_counts(slots.pos.shape[-1])))

    def rank_given(self, state, slots, keys, stats, rows):
        pos, c = slots.pos, self.chunk_length
        n = (pos >= 0).sum(axis=-1, keepdims=True)  # [B, K, 1] prompt tokens
        kept = jnp.zeros(pos.shape, bool)
        for j, i in enumerate(range(0, pos.shape[-1], c)):  # static: the prompt phase's slots
            chunk = (pos >= i) & (pos < i + c)  # [B, K, V]
            want = rows[j][n]  # [B, K, 1] kvpress's max(1, int(size (1 - ratio)))
            kept = kept | (chunk & top_mask(self.subset_rank(state, slots, keys, stats, chunk), pos, want))
        return rank_by(jnp.where(kept, 1.0, 0.0), pos)


@dataclasses.dataclass(frozen=True)
class Blocked(Wrapped):
    """kvpress's `BlockPress(press, block_size)`, the block-wise eviction of KeyDiff (Park et al. 2025):
    the first n_kept prompt tokens are kept, then each block of `block_size` later tokens joins them
    and `press`, scoring the kept tokens and the block together, keeps the n_kept best; the question
    and answer appended. `press` must score a token set regardless of its order (knorm, keydiff,
    random: kvpress hands it the kept tokens in score order, lagkv would read them as a sequence)."""

    label = "blocked"
    takes = (Knorm, KeyDiff, RandomKeep)
    block_size: int = 128

    table_rows = 2  # kept_table: the kept counts, then n_kept again for the ranking

    def kept_table(self, max_len):
        """[2, M + 1] int32: kvpress's n_kept per prompt length, for the kept count and for the ranking."""
        return None if self.interval or self.slots else np.stack([self._counts(max_len)] * 2)

    def ties_decided_here(self):
        return False  # each chunk's (block's) top-k is its own

    def prompt_rank(self, state, slots, keys, stats):
        return self.rank_given(state, slots, keys, stats, jnp.asarray(self._counts(slots.pos.shape[-1]))[None])

    def rank_given(self, state, slots, keys, stats, rows):
        pos = slots.pos
        filled = pos >= 0
        n = filled.sum(axis=-1, keepdims=True)  # [B, K, 1]
        n_kept = rows[0][n]  # [B, K, 1] kvpress's n_kept
        bs = jnp.minimum(self.block_size, n)  # kvpress: block_size capped by the prompt

        def block(b, kept):
            lo = n_kept + b * bs  # [B, K, 1]
            cand = kept | (filled & (pos >= lo) & (pos < lo + bs))
            best = top_mask(self.subset_rank(state, slots, keys, stats, cand), pos, n_kept)
            return jnp.where(lo < n, best & cand, kept)

        kept = filled & (pos < n_kept)
        n_blocks = -(-pos.shape[-1] // max(1, min(self.block_size, pos.shape[-1])))  # static bound
        kept = jax.lax.fori_loop(0, n_blocks, block, kept)
        return rank_by(jnp.where(kept, 1.0, 0.0), pos)


@dataclasses.dataclass(frozen=True)
class ChunkKV(Delegating):
    """kvpress's `ChunkKVPress(press, chunk_length)` (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV
    Cache Compression for Efficient Long-Context LLM Inference", arXiv:2502.00299): `press` scores the
    whole prompt, each chunk of `chunk_length` tokens from position 0 (the last one shorter) is scored
    by the mean over its tokens of the scores summed over kv heads, and the max(1, int(n_chunks (1 -
    ratio))) best chunks are kept whole, in every head (a prompt shorter than one chunk: `press` alone).
    The kept count depends on the choice: a short last chunk that wins keeps fewer than n_chunks_kept x
    chunk_length tokens (the state is sized for the most). Tokens `press` always keeps score +inf here,
    kvpress's max + 1 of the layer's scores (batch row 0's chunks serve every row there, ours each its
    own). The authors rank chunks by SnapKV's observation attention, and also share the indices across
    layers (`layer-wise index reuse`), which kvpress does not."""

    label = "chunkkv"
    chunk_length: int = 20

    def __post_init__(self):
        super().__post_init__()
        check_int(self.label, "chunk_length", self.chunk_length, 1)

    def ties_decided_here(self):
        return True  # `chosen`'s top-k calls break exact ties by `ties`

    def kept_for(self, n):
        """The most tokens kept of an n-token prompt (every kept chunk full)."""
        c = self.chunk_length
        if n < c:
            return max(1, int(n * (1 - self.ratio)))
        return min(n, max(1, int(-(-n // c) * (1 - self.ratio))) * c)

    def kept_table(self, max_len):
        """[2, M + 1] int32, per prompt length n: the chunks kept, kvpress's max(1, int(n_chunks (1 - ratio))),
        and `press`'s own count for a prompt shorter than one chunk, max(1, int(n (1 - ratio))), both
        kvpress's float64 products (float32 before 2026-12-07): the counts a shape class (ratio 0,
        sized for the most kept, `kept_for`) is given as data. The tokens kept depend on which chunks win."""
        return None if self.interval or self.slots else self.given(max_len)

    def given(self, max_len: int) -> np.ndarray:
        """`kept_table`'s counts, also with `interval` (streams: `press`'s rule on overflow)."""
        n = np.arange(max_len + 1)
        keep = 1 - self.ratio  # kvpress's int(n (1 - compression_ratio)): Python's float64 product
        chunks = np.floor((-(-n // self.chunk_length)).astype(np.float64) * keep)
        alone = np.floor(n.astype(np.float64) * keep)
        return np.maximum(1, np.stack([chunks, alone])).astype(np.int32)

    def chosen(self, state: PromptState, slots, keys, stats, table: Array) -> Array:
        """[B, K, M]: the prompt tokens kvpress's ChunkKVPress keeps (slot j holds token j); `table`:
        `kept_table`'s."""
        pos, c = slots.pos, self.chunk_length
        filled = pos >= 0
        prio, tie = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        score = self.head_sums(state, prio, filled)  # [B, M]
        n = filled[:, 0].sum(axis=-1)  # [B] prompt tokens
        m = score.shape[-1]
        n_c = -(-m // c)  # static: chunks of the prompt phase's slots
        sums = jnp.pad(score, ((0, 0), (0, n_c * c - m))).reshape(-1, n_c, c).sum(axis=-1)  # [B, C]
        size = jnp.clip(n[:, None] - c * jnp.arange(n_c), 0, c)  # [B, C] tokens of each chunk
        mean = jnp.where(size > 0, sums / jnp.maximum(size, 1), -jnp.inf)
        want = table[0][n]  # [B] chunks kept
        n_kept = table[1][n][:, None, None]
        if self.ties == "torch_cpu":  # kvpress's chunk_scores.topk and `press`'s scores.topk, exact ties as torch's
            top_c = torch_cpu_top_mask(mean, (size > 0).sum(axis=-1), want)
            alone = torch_cpu_top_mask(prio, filled.sum(axis=-1), n_kept[..., 0]) & filled
        else:
            top_c = top_mask(mean, jnp.broadcast_to(jnp.arange(n_c), mean.shape), want[:, None]) & (size > 0)  # [B, C]
            alone = top_mask(prio, tie, n_kept) & filled  # [B, K, M]: `press` itself
        whole = jnp.repeat(top_c, c, axis=-1)[:, None, :m] & filled  # [B, 1, M]
        return jnp.where((n < c)[:, None, None], alone, whole)

    def head_sums(self, state: PromptState, prio: Array, filled: Array) -> Array:
        """[B, M]: kvpress's `press.score` summed over kv heads, tokens it always keeps (+inf here) at
        its max + 1 (the largest finite score of the layer, batch row 0's in kvpress, each row's here)."""
        prio = self.kvpress_scores(state, prio)
        finite = filled & jnp.isfinite(prio)
        top = jnp.max(jnp.where(finite, prio, -jnp.inf), axis=(1, 2), keepdims=True)  # [B, 1, 1]
        return jnp.where(filled, jnp.where(finite, prio, top + 1), 0.0).sum(axis=1)  # [B, M]

    def after_prompt(self, state: PromptState, table=None):
        if table is None:
            if self.slots:
                raise ValueError(f"{self.label}(slots={self.slots}): a shape class keeps the counts it is given: "
                                 "after_prompt(state, table)")
            table = self.given(state.slots)  # static
        s = self.capacity(state.slots)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, M, D]
        pos = jnp.broadcast_to(state.pos, keys.shape[:3])  # [B, K, M]
        slots, stats = self.from_prompt(state, pos)
        return self.join(pack(slots, self.chosen(state, slots, keys, stats, jnp.asarray(table)), s), stats)


@dataclasses.dataclass(frozen=True)
class EntropyChunkKV(ChunkKV):
    """kvpress's `EntropyGatedChunkKVPress(press, chunk_length=10, low_entropy_chunk_length=4)` (kvpress's
    extension of ChunkKV, arXiv:2502.00299): chunks scored as `ChunkKV` and taken greedily in decreasing
    score until kvpress's n_kept = max(1, int(n (1 - ratio))) tokens are spent; a chunk whose score is
    at least the (lower) median and whose normalised score entropy is below the median keeps only its
    `low_entropy_chunk_length` best tokens, the others are kept whole (or their best, when the budget
    ends inside them); the budget left is spent on the best remaining tokens. The same tokens in every
    kv head (kvpress: batch row 0's choice for every row; ours each row's)."""

    label = "entropy-chunkkv"
    chunk_length: int = 10
    low_entropy_chunk_length: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.low_entropy_chunk_length, int) and self.chunk_length > self.low_entropy_chunk_length >= 1):
            raise ValueError(f"entropy-chunkkv: low_entropy_chunk_length={self.low_entropy_chunk_length!r} must be an "
                             f"int in [1, chunk_length={self.chunk_length})")

    def kept_for(self, n):
        return max(1, int(n * (1 - self.ratio)))

    def kept_table(self, max_len):
        """[M + 1] int32: the token budget of an n-token prompt, kvpress's max(1, int(n (1 - ratio))) (a
        float64 product, as kvpress's; float32 before 2026-12-07), given as data to a shape class."""
        return None if self.interval or self.slots else self.given(max_len)

    def given(self, max_len: int) -> np.ndarray:
        n = np.arange(max_len + 1).astype(np.float64)  # kvpress's int(kv_len (1 - ratio)): a float64 product
        return np.maximum(1, np.floor(n * (1 - self.ratio))).astype(np.int32)

    def chosen(self, state, slots, keys, stats, table):
        pos, c, eps = slots.pos, self.chunk_length, 1e-8  # kvpress's EPSILON
        filled = pos >= 0
        prio, _ = self.press.prompt_rank(state, slots, keys, stats)  # [B, K, M]
        score = self.head_sums(state, prio, filled)  # [B, M]
        n = filled[:, 0].sum(axis=-1)  # [B] prompt tokens
        m = score.shape[-1]
        n_c = -(-m // c)  # static
        tok = jnp.pad(score, ((0, 0), (0, n_c * c - m))).reshape(-1, n_c, c)  # [B, C, c]
        at = (c * jnp.arange(n_c))[:, None] + jnp.arange(c)  # [C, c] token positions
        valid = at[None] < n[:, None, None]  # [B, C, c]
        size = valid.sum(axis=-1)  # [B, C]
        live = size > 0
        mean = jnp.where(live, jnp.where(valid, tok, 0.0).sum(axis=-1) / jnp.maximum(size, 1), -jnp.inf)  # [B, C]
        low = jnp.minimum(jnp.min(jnp.where(valid, tok, jnp.inf), axis=-1, keepdims=True), 0.0)  # [B, C, 1]
        shifted = jnp.where(valid, tok - low, 0.0)
        prob = shifted / (shifted.sum(axis=-1, keepdims=True) + eps)
        ent = -jnp.where(valid, prob * jnp.log(prob + eps), 0.0).sum(axis=-1)  # [B, C]
        ent = jnp.where(size > 1, jnp.clip(ent / jnp.log(jnp.maximum(size, 2)), 0.0, 1.0), 0.0)
        n_live = live.sum(axis=-1, keepdims=True)  # [B, 1]
        median = lambda x: jnp.take_along_axis(jnp.sort(jnp.where(live, x, jnp.inf), axis=-1),  # noqa: E731
                                               (n_live - 1) // 2, axis=-1)  # torch.median: the lower one
        spiky = (mean >= median(mean)) & (ent < median(ent))  # [B, C]
        order = jnp.argsort(jnp.where(live, -mean, jnp.inf), axis=-1)  # [B, C]: best first, stable

        def take(budget, i):  # the i-th best chunk: how many of its tokens
            ch = order[:, i]  # [B]
            sz = jnp.take_along_axis(size, ch[:, None], axis=-1)[:, 0]
            k = jnp.clip(jnp.minimum(sz, budget), 0)
            k = jnp.where(jnp.take_along_axis(spiky, ch[:, None], axis=-1)[:, 0],
                          jnp.minimum(k, self.low_entropy_chunk_length), k)
            return budget - k, (ch, k)

        budget = table[n]  # [B] tokens
        left, (chs, ks) = jax.lax.scan(take, budget, jnp.arange(n_c))  # ks [C, B]: per visit
        want = jnp.zeros((score.shape[0], n_c), jnp.int32).at[jnp.arange(score.shape[0])[:, None], chs.T].set(ks.T)
        if self.ties == "torch_cpu":  # each chunk's torch.topk (n <= chunk_length: its nth_element path)
            best = torch_cpu_top_mask(jnp.where(valid, tok, -jnp.inf), size, want) & (want > 0)[..., None]
        else:
            best = top_mask(jnp.where(valid, tok, -jnp.inf), jnp.broadcast_to(at, tok.shape), want[..., None])  # [B, C, c]
        keep = (best & valid).reshape(-1, n_c * c)[:, :m]  # [B, M]
        free = ~keep & (pos[:, 0] >= 0)  # [B, M]
        if self.ties == "torch_cpu":  # kvpress's torch.topk(scores[leftover], add): the leftover in text order
            order = jnp.argsort(~free, axis=-1, stable=True)  # [B, M]: the free tokens first
            n_free = free.sum(axis=-1)
            add = jnp.minimum(left, n_free)
            sel = torch_cpu_top_mask(jnp.take_along_axis(score, order, axis=-1), n_free, add) & (add > 0)[:, None]
            rest = jnp.zeros_like(free).at[jnp.arange(free.shape[0])[:, None], order].set(sel)
        else:
            rest = top_mask(jnp.where(free, score, -jnp.inf), pos[:, 0], left[:, None])
        keep = keep | (rest & free)  # the budget left: the best remaining tokens
        return keep[:, None, :] & filled


@dataclasses.dataclass(frozen=True)
class Rerotated(Delegating):
    """kvpress's `KeyRerotationPress(press)`: `press`'s choice after the prompt, then RoPE sees the kept keys
    at their ranks 0..m-1 in the head's cache and the question and answer from m on (kvpress re-rotates the
    cached keys, and its pipeline continues at the compressed length m; the same in every head, each keeps
    m). Our keys are stored un-rotated: the view's RoPE positions, not a second rotation (float rounding
    differs); masks still read text positions. Streams: `press`'s rule on overflow, ranks as above."""

    label = "rerotated"

    def ties_decided_here(self):
        return self.press.ties_decided_here()

    def prompt_rank(self, state, slots, keys, stats):
        return self.press.prompt_rank(state, slots, keys, stats)

    def extend(self, state, k, v, pos):
        view = super().extend(state, k, v, pos)
        # the stored slots are packed in text order (`pack`, `append_packed`): a slot's rank is its index
        s, t = state.pos.shape[-1], pos.shape[1]
        c = (state.pos >= 0).sum(axis=-1, dtype=jnp.int32)  # [B, K] tokens held (equal over the heads)
        ranks = jnp.concatenate([jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), state.pos.shape),
                                 c[..., None] + jnp.arange(t, dtype=jnp.int32)], axis=-1)  # [B, K, S + T]
        q = c[:, :1] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        return dataclasses.replace(view, rope=RopePositions(q=q[..., None], k=ranks))

    def spared(self):
        return None  # a key's rank is its slot's index, which the spare slot's is not (`SpareSlot`)


@dataclasses.dataclass(frozen=True)
class Composed(PromptScored):
    """kvpress's `ComposedPress(presses)`: the presses applied in turn to the prompt, press i keeping
    max(1, int(m (1 - r_i))) of the m tokens the previous ones kept; the question and answer
    appended. The first press may be any prompt scorer of `kvpress` here (it ranks the whole prompt);
    a later one ranks the kept tokens alone, in no particular order (kvpress hands it the cache the
    previous press gathered, in score order), so it must be a scorer of token sets (knorm, keydiff,
    random). Streams (and generation past `max_new`): the last press's rule on overflow."""

    label = "composed"
    takes_later: ClassVar[tuple[type, ...]] = (Knorm, KeyDiff, RandomKeep)

    presses: tuple = ()
    budget: int = 1024
    max_new: int = 256
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        if not self.presses or not all(isinstance(p, PromptScored) for p in self.presses):
            raise ValueError(f"composed.presses={self.presses!r}: must be prompt scorers (kvpress(...) results)")
        later = [p for p in self.presses[1:] if type(p) not in self.takes_later]
        if later:
            raise ValueError(f"composed.presses: {type(later[0]).__name__} after the first press: a later press "
                             f"must be one of {[c.__name__ for c in self.takes_later]} (it ranks the kept tokens alone)")

    @property
    def observes(self):
        return self.presses[-1].observes

    def kept_for(self, n):
        for p in self.presses:
            n = max(1, int(n * (1 - p.ratio)))
        return n

    def rank(self, slots, keys, stats, seen):
        return self.presses[-1].rank(slots, keys, stats, seen)

    def prompt_policy(self):
        phase = self.presses[0].prompt_policy()
        sinks = [p.collects["query_sink"] for p in self.presses[1:] if "query_sink" in p.collects]
        if sinks and phase.query_sink < 0:  # a later press's RoPE frequencies (keydiff)
            phase = dataclasses.replace(phase, query_sink=sinks[0])
        return dataclasses.replace(phase, of=self)

    def ties_decided_here(self):
        return False  # each press's top-k is its own

    def prompt_rank(self, state, slots, keys, stats):
        pos = slots.pos
        kept = pos >= 0  # [B, K, V]
        m = kept.sum(axis=-1, keepdims=True)  # [B, K, 1]
        for i, p in enumerate(self.presses):
            m = jnp.maximum(1, jnp.floor(m * (1 - p.ratio))).astype(jnp.int32)  # kvpress's n_kept of what is left
            sub = slots if i == 0 else dataclasses.replace(slots, pos=jnp.where(kept, pos, -1))
            prio, tie = p.prompt_rank(state, sub, keys, stats)
            kept = kept & top_mask(jnp.where(kept, prio, -jnp.inf), tie if i == 0 else pos, m)
        return rank_by(jnp.where(kept, 1.0, 0.0), pos)


PRESSES = ("SnapKVPress", "PyramidKVPress", "KnormPress", "StreamingLLMPress", "ExpectedAttentionPress",
           "ObservedAttentionPress", "TOVAPress", "AdaKVPress", "KVzipPress", "DuoAttentionPress", "QFilterPress",
           "ExpectedAttentionStatsPress", "KVzapPress", "FastKVzipPress",
           "KeyDiffPress", "LagKVPress", "RandomPress", "PerLayerCompressionPress", "ChunkPress", "BlockPress",
           "ComposedPress", "FinchPress", "CURPress", "MergingPress", "CompactorPress", "NonCausalAttnPress", "LeverageScorePress",
           "ChunkKVPress", "KeyRerotationPress", "EntropyGatedChunkKVPress", "SimLayerKVPress", "CapPress",
           "CriticalKVPress", "CriticalAdaKVPress", "ThinKPress", *DECODING_PRESSES, "LUKVPress", "CAMPress",
           "KVComposePress", "RestoreKVPress", "KVgradPress")
SUPPORTED = PRESSES
WRAPPERS = ("MergingPress", "AdaKVPress", "PerLayerCompressionPress", "ChunkPress", "BlockPress", "ChunkKVPress",
            "KeyRerotationPress", "EntropyGatedChunkKVPress", "CriticalKVPress", "CriticalAdaKVPress")  # `press`: an inner press
# the inner presses a wrapper takes today, with their own fields (kvpress names)
INNER = {"MergingPress": ("KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress", "CURPress"),
         "AdaKVPress": ("SnapKVPress", "KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress", "StreamingLLMPress",
                        "ExpectedAttentionPress", "TOVAPress", "PyramidKVPress"),
         "PerLayerCompressionPress": ("SnapKVPress", "KnormPress", "KeyDiffPress", "LagKVPress", "ExpectedAttentionPress",
                                      "ObservedAttentionPress", "TOVAPress", "StreamingLLMPress", "RandomPress"),
         "ChunkPress": ("KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress"),
         "BlockPress": ("KnormPress", "KeyDiffPress", "RandomPress"),
         "ChunkKVPress": ("KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress", "SnapKVPress", "ExpectedAttentionPress"),
         "KeyRerotationPress": ("KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress", "SnapKVPress", "ExpectedAttentionPress"),
         "EntropyGatedChunkKVPress": ("KnormPress", "KeyDiffPress", "LagKVPress", "RandomPress", "SnapKVPress", "ExpectedAttentionPress"),
         "CriticalKVPress": ("SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress", "KeyDiffPress"),
         "CriticalAdaKVPress": ("SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress", "KeyDiffPress")}


def press_of(policy: Policy) -> tuple[str, dict]:
    """(kvpress class name, kvpress fields) of a `kvpress(...)` result used as an inner press."""
    if type(policy) is SnapKV and policy.pooling == "avg":
        return "SnapKVPress", {"window_size": policy.obs_window, "kernel_size": policy.kernel}
    if type(policy) is Knorm and policy.dense_layers == 0:
        return "KnormPress", {}
    if isinstance(policy, KeyDiff):
        return "KeyDiffPress", {}
    if isinstance(policy, CUR):
        return "CURPress", {"num_sinks": policy.n_sink, "leverage_type": policy.leverage,
                            "use_local_approximation": bool(policy.local_window),
                            "local_window_size": policy.local_window or 16}
    if isinstance(policy, LagKV):
        return "LagKVPress", {"n_sink": policy.n_sink, "lag_size": policy.lag_size,
                              "cross_scoring": policy.cross_scoring}
    if isinstance(policy, Expected):
        return "ExpectedAttentionPress", {f: getattr(policy, f) for f in (
            "n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")}
    raise ValueError(f"press={policy!r}: not a kvpolicies.compat.kvpress(...) result of a scorer press (at "
                     "compression_ratio 0 kvpress(...) is `full`: give the inner press by class name)")


def _inner(wrapper: str, r: float, fields: dict) -> dict:
    """`fields` with `press` as the inner press's class name and its fields among them: `press` given
    by name (its fields already among `fields`) or as an inner `kvpress(...)` result (whose
    compression_ratio, if set, must be the wrapper's: kvpress's wrappers read their inner press's)."""
    inner = fields.get("press", "SnapKVPress" if wrapper in ("AdaKVPress", "CriticalKVPress", "CriticalAdaKVPress") else None)
    if inner is None:
        raise ValueError(f"kvpress({wrapper!r}): give press= (an inner press: a class name or a kvpress(...) result)")
    own = {}
    if not isinstance(inner, str):
        if r is not None and getattr(inner, "ratio", 0) not in (0, r):
            raise ValueError(f"kvpress({wrapper!r}, {r}): the inner press has compression_ratio {inner.ratio} "
                             "(a kvpress wrapper's ratio is its inner press's: give the same, or 0)")
        inner, own = press_of(inner)
        clash = sorted(set(own) & set(fields))
        if clash:
            raise ValueError(f"kvpress({wrapper!r}): {clash} given twice (the inner press has them)")
    if inner not in INNER[wrapper]:
        raise NotImplementedError(f"kvpolicies.compat.kvpress: {wrapper} over {inner!r} (only {', '.join(INNER[wrapper])})")
    return {**fields, **own, "press": inner}


NEEDS_PATTERN = ("DuoAttentionPress",)  # given a head pattern (head_scores=...)


def duo_heads(head_scores, head_compression_ratio: float) -> tuple[tuple[int, ...], ...]:
    """[L][K] 0/1 retrieval heads as kvpress's `DuoAttentionPress.post_init_from_model`: scores
    clipped to [0, 1], the round(L K r) lowest (numpy's argsort over the flattened scores) stream."""
    scores = np.clip(load_pattern(head_scores), 0, 1)
    n_pruned = round(scores.size * head_compression_ratio)
    retrieval = np.ones(scores.shape, np.int32)
    if n_pruned > 0:
        retrieval[np.unravel_index(np.argsort(scores, axis=None)[:n_pruned], scores.shape)] = 0
    return tuple(tuple(int(h) for h in row) for row in retrieval)


def kvpress(name: str, compression_ratio: float, /, *, max_new: int = 256, n_layers: int | None = None,
            ties: str = "newer", **fields) -> Policy | tuple[Policy, ...]:
    """The policy (for "PyramidKVPress" the `pyramidkv` preset with `ratio`, whose `stack(n_layers)`
    is one `PyramidLayer` per layer; given `n_layers`, that tuple) reproducing kvpress 0.5.5's
    press class `name` at `compression_ratio` with its defaults; `fields` are the press's own
    (kvpress names: window_size, kernel_size, n_sink, beta, ...; `press=` is a wrapper's inner
    press, by class name, its fields among `fields`, or as an inner `kvpress(...)` result).
    `max_new`: decode slots for the appended question and answer. compression_ratio 0 is
    kvpress's no-op: `full`. `ties="torch_cpu"` (ours, not kvpress's: a prompt scorer's
    `PromptScored.ties`): exact ties at the prompt's compression broken as torch.topk breaks them on
    the CPU (`kvpolicies.ties`) instead of keeping the newer token."""
    out = _kvpress(name, compression_ratio, max_new, n_layers, fields)
    if ties == "newer" or type(out) is Full:  # compression_ratio 0: nothing compressed, no tie to break
        return out
    pols = out if isinstance(out, tuple) else (out,)
    if ties not in TIES:
        raise ValueError(f"kvpress({name!r}, ties={ties!r}): ties= must be one of {list(TIES)}")
    if not all(isinstance(p, PromptScored) for p in pols):
        raise ValueError(f"kvpress({name!r}, ties={ties!r}): ties= is a prompt scorer's (PromptScored), not "
                         f"{sorted({type(p).__name__ for p in pols})}'s")
    tied = tuple(dataclasses.replace(p, ties=ties) for p in pols)
    return tied if isinstance(out, tuple) else tied[0]


def _kvpress(name: str, compression_ratio: float, max_new: int, n_layers: int | None, fields: dict
             ) -> Policy | tuple[Policy, ...]:
    press = name
    if press not in PRESSES:
        raise ValueError(f"kvpress({press!r}): the press must be one of {list(PRESSES)}")
    if n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1):
        raise ValueError(f"kvpress({press!r}): n_layers={n_layers!r} must be an int >= 1 (the model's layers)")
    if press in DECODING_PRESSES:  # kvpress's decoding presses and DMSPress (kvpolicies.decoding)
        return decoding_press(press, compression_ratio, max_new, fields, kvpress)
    if press == "LUKVPress":  # head budgets from a given curve (kvpress downloads one): kvpolicies.lukv
        return lukv_press(compression_ratio, max_new, n_layers, fields, kvpress)
    if press in WRAPPERS:
        fields = _inner(press, None if press == "PerLayerCompressionPress" else compression_ratio, fields)
    elif "press" in fields:
        raise ValueError(f"kvpress({press!r}): press= is a wrapper's inner press ({', '.join(WRAPPERS)})")
    r = compression_ratio
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
        raise ValueError(f"compression_ratio={r!r}: must be a number in [0, 1)")
    if press == "PerLayerCompressionPress":
        return _per_layer(r, max_new, n_layers, fields)
    if press == "ComposedPress":
        return _composed(r, max_new, fields)
    if press == "CAMPress":  # a DecodingPress: compression_interval and target_size are its own
        return _cam(r, max_new, fields)
    decoding = {k: fields.pop(k) for k in ("compression_interval", "target_size") if k in fields}
    if decoding:
        return _decoding(press, r, max_new, n_layers, decoding, fields)
    if press == "DuoAttentionPress":  # compression_ratio: kvpress's head_compression_ratio
        out = _duo(r, max_new, n_layers, fields)
    elif press == "ThinKPress":  # compression_ratio: kvpress's read-only key_channel_compression_ratio / 2
        out = _think(r, max_new, fields)
    elif press == "SimLayerKVPress":  # no compression_ratio field: kvpress reports one after the prefill
        out = _simlayerkv(r, max_new, fields)
    elif r == 0:
        return Full()
    elif press == "KVzipPress":
        if fields.pop("kvzip_plus_normalization", False):
            raise NotImplementedError("kvpolicies.compat.kvpress: KVzipPress(kvzip_plus_normalization=True)")
        layerwise = fields.pop("layerwise", False)
        out = KVzip(ratio=r, max_new=max_new, n_sink=fields.pop("n_sink", 4), repeat_chunk=fields.pop("chunk_size", 2048),
                    scope="layer" if layerwise else "model", keep_last=False, prompts="kvpress")
    elif press == "KVComposePress":  # structured (kvpress's default) or not: each head its own count, a head pool
        structured = fields.pop("structured", True)
        if not structured:
            fields.pop("agg_head", None)  # the composite's aggregation: unused unstructured (in kvpress too)
        out = (KVCompose if structured else KVComposeHeads)(ratio=r, max_new=max_new, **{
            k: fields.pop(k) for k in list(fields) if k in ("agg_task", "agg_group", "agg_head", "add_v_norm",
                                                             "add_mean_across_heads", "keep_token_lower_bound")})
    elif press == "RestoreKVPress":  # KVzipPress + n learned restore tokens (restore_model_name=: our arrays)
        out = restorekv_press(r, max_new, fields)
    elif press == "KVgradPress":  # KVzipPress's fields (kvzip_plus_normalization is fixed off), chunk 512
        layerwise = fields.pop("layerwise", False)
        out = KVgrad(ratio=r, max_new=max_new, n_sink=fields.pop("n_sink", 4), repeat_chunk=fields.pop("chunk_size", 512),
                     scope="layer" if layerwise else "model", keep_last=False, prompts="kvpress")
    else:
        out = _scored(press, r, max_new, n_layers, fields)
    if fields:
        raise ValueError(f"kvpress({press!r}): unknown field(s) {sorted(fields)}")
    return out


def _decoding(press: str, r: float, max_new: int, n_layers: int | None, decoding: dict,
              fields: dict) -> Policy | tuple[Policy, ...]:
    """kvpress's `PrefillDecodingPress(prefilling_press=press(r), decoding_press=DecodingPress(press(),
    compression_interval, target_size))`: the prompt compressed once, then every `compression_interval`
    decoded tokens the whole cache back to `target_size` per kv head (`PromptScored.interval`, `target`)."""
    if press != "KnormPress":
        raise NotImplementedError(
            f"kvpolicies.compat.kvpress: {press!r} with compression_interval/target_size: only KnormPress (its "
            "score reads the keys alone). kvpress's DecodingPress re-scores with the base press on up to 256 "
            "buffered decode hidden states; our prompt scorers rank by their stream rule instead (give a "
            "policy interval= and target= for that schedule)")
    if r == 0:
        raise NotImplementedError(
            "kvpolicies.compat.kvpress: compression_interval/target_size without a prefill compression (kvpress's "
            "DecodingPress alone): kvpress counts steps from the end of the prefill, ours compresses when target + "
            "interval tokens are held, the same only after a prompt that keeps target_size tokens")
    if set(decoding) != {"compression_interval", "target_size"}:
        raise ValueError(f"kvpress({press!r}): give compression_interval and target_size together, got {sorted(decoding)}")
    out = _scored(press, r, max_new, None, fields)
    out = dataclasses.replace(out, interval=decoding["compression_interval"], target=decoding["target_size"])
    if fields:
        raise ValueError(f"kvpress({press!r}): unknown field(s) {sorted(fields)}")
    return out


def _per_layer(r: float, max_new: int, n_layers: int | None, fields: dict) -> tuple[Policy, ...]:
    """kvpress's `PerLayerCompressionPress(press, compression_ratios)`: layer i is the inner press at
    `compression_ratios[i]` (one policy per layer, each stored at its own size). kvpress's
    compression_ratio is their mean (read-only there): the one given must be that mean."""
    ratios = fields.pop("compression_ratios", None)
    if not isinstance(ratios, (list, tuple)) or not ratios:
        raise ValueError("kvpress('PerLayerCompressionPress'): give compression_ratios= (one ratio per layer)")
    if n_layers is not None and len(ratios) != n_layers:
        raise ValueError(f"kvpress('PerLayerCompressionPress'): {len(ratios)} compression_ratios for {n_layers} layers")
    if abs(sum(ratios) / len(ratios) - r) > 1e-9:
        raise ValueError(f"kvpress('PerLayerCompressionPress', {r}): compression_ratio is the mean of "
                         f"compression_ratios ({sum(ratios) / len(ratios)!r}, kvpress's read-only property)")
    inner = fields.pop("press")
    return tuple(kvpress(inner, ri, max_new=max_new, **fields) for ri in ratios)


def _composed(r: float, max_new: int, fields: dict) -> Composed:
    """kvpress's `ComposedPress(presses)`: `presses` as kvpress(...) results or [name, ratio(, fields)]
    lists; kvpress sets its compression_ratio to 1 - prod(1 - r_i) (after a prefill): the one given
    must be that."""
    presses = fields.pop("presses", None)
    if not isinstance(presses, (list, tuple)) or not presses:
        raise ValueError("kvpress('ComposedPress'): give presses= (kvpress(...) results or [name, ratio, fields] lists)")
    built = tuple(p if isinstance(p, Policy) else kvpress(p[0], p[1], max_new=max_new, **(p[2] if len(p) > 2 else {}))
                  for p in presses)
    if isinstance(built[-1], ThinK):  # a token press, then ThinK's channels
        return _think_over(r, built)
    if any(not isinstance(p, PromptScored) for p in built):
        raise NotImplementedError(f"kvpolicies.compat.kvpress: ComposedPress of {built!r} (prompt scorers only; "
                                  "kvpress refuses AdaKVPress and KVzipPress there too)")
    kept = float(np.prod([1 - p.ratio for p in built]))
    if abs(1 - kept - r) > 1e-9:
        raise ValueError(f"kvpress('ComposedPress', {r}): compression_ratio is 1 - prod(1 - r_i) of its presses "
                         f"({1 - kept!r}, what kvpress sets)")
    return Composed(ratio=r, max_new=max_new, presses=built)


def _think_over(r: float, built: tuple) -> ThinK:
    """kvpress's `ComposedPress([press, ThinKPress(c)])`: the token press compresses the context, then
    ThinK prunes the channels of the keys it kept (`think.ThinK(press=...)`); kvpress's compression_ratio
    is then 1 - (1 - r_press)(1 - c / 2)."""
    if len(built) != 2 or not isinstance(built[0], PromptScored) or type(built[0].prompt_policy()) is not PromptPhase:
        raise NotImplementedError(f"kvpolicies.compat.kvpress: ComposedPress of {built!r} (ThinKPress after one prompt "
                                  "scorer whose prompt phase is a plain PromptPhase: SnapKV, Knorm, KeyDiff, ...)")
    press, think = built
    want = 1 - (1 - press.ratio) * (1 - think.ratio / 2)
    if abs(want - r) > 1e-9:
        raise ValueError(f"kvpress('ComposedPress', {r}): compression_ratio is 1 - (1 - r_press)(1 - c / 2) with "
                         f"ThinKPress's key_channel_compression_ratio c ({want!r}, what kvpress sets)")
    return dataclasses.replace(think, press=dataclasses.replace(press, max_new=0))


def _duo(r: float, max_new: int, n_layers: int | None, fields: dict) -> Policy | tuple[Policy, ...]:
    if fields.pop("on_the_fly_scoring", False):
        raise NotImplementedError("kvpolicies.compat.kvpress: DuoAttentionPress(on_the_fly_scoring=True) scores "
                                  "heads on BookSum, which is not reachable offline: give head_scores=")
    scores = fields.pop("head_scores", None)
    if scores is None:
        raise ValueError("kvpress('DuoAttentionPress'): give head_scores= ([layers][kv heads] gate values, a "
                         "file or nested lists); kvpress downloads the authors' patterns for six checkpoints")
    if isinstance(scores, (np.ndarray, list)):
        scores = tuple(tuple(float(x) for x in row) for row in np.asarray(scores, np.float64))
    out = Duo(sink=fields.pop("sink_size", 128), recent=fields.pop("recent_size", 256), pattern=duo_heads(scores, r),
              appended=max_new)
    return out.stack(n_layers) if n_layers is not None else out


def _cam(r: float, max_new: int, fields: dict) -> CAM:
    """kvpress's `CAMPress(base_press, compression_interval=512, target_size=2048, hidden_states_buffer_size=256,
    merge_budget=32)` (`kvpolicies.cam`): a `DecodingPress` (`kvpolicies.decoding`, whose fields it takes: the
    base press KnormPress or KeyDiffPress) that merges what it evicts, by our draw, not torch's."""
    merge_budget = fields.pop("merge_budget", 32)
    dec = decoding_press("DecodingPress", r, max_new, fields, kvpress)  # refuses a ratio, checks the base press
    return CAM(**{f.name: getattr(dec, f.name) for f in dataclasses.fields(dec)}, merge_budget=merge_budget)


def _think(r: float, max_new: int, fields: dict) -> Policy:
    """kvpress's `ThinKPress(key_channel_compression_ratio, window_size=32)` (`kvpolicies.think`): its
    compression_ratio is a read-only property, key_channel_compression_ratio / 2, so the one given must be
    that or 0; key_channel_compression_ratio defaults to 2 compression_ratio. 0 channels pruned: `full`."""
    c = fields.pop("key_channel_compression_ratio", 2 * r)
    if r not in (0, c / 2):
        raise ValueError(f"kvpress('ThinKPress', {r}): compression_ratio is key_channel_compression_ratio / 2 "
                         f"({c / 2!r}, kvpress's read-only property): give that, or 0")
    if c == 0:
        return Full()
    return ThinK(ratio=c, window=fields.pop("window_size", 32), max_new=max_new)


def _simlayerkv(r: float, max_new: int, fields: dict) -> SimLayerKV:
    """kvpress's `SimLayerKVPress(lazy_threshold=1.0, n_last=1, n_recent=1024, n_initial=4)`: its
    compression_ratio is a read-only property (the mean over layers of what each trimmed, after a
    prefill), so the one given must be 0."""
    if r != 0:
        raise ValueError(f"kvpress('SimLayerKVPress', {r}): SimLayerKVPress has no compression_ratio to set (kvpress "
                         "reports it after the prefill, from the lazy layers): give 0 and lazy_threshold=")
    return SimLayerKV(max_new=max_new, **{k: fields.pop(k) for k in list(fields) if k in (
        "lazy_threshold", "n_last", "n_recent", "n_initial")})


def _finch(r: float, max_new: int, fields: dict) -> Finch:
    """kvpress's `FinchPress`: `window_size` is the question's length (kvpress reads it from a delimiter
    token between context and question, `update_model_and_tokenizer`): the prompt ends with the question."""
    window = fields.pop("window_size", None)
    if window is None:
        raise ValueError("kvpress('FinchPress'): give window_size= (the question's tokens, which end the prompt; "
                         "kvpress finds them from a delimiter token in the prompt)")
    if fields.pop("chunk_length", None) is not None:
        raise NotImplementedError("kvpolicies.compat.kvpress: FinchPress(chunk_length=...) (the top-k chunk by chunk)")
    return Finch(ratio=r, max_new=max_new, obs_window=window, normalize=fields.pop("normalize_scores", True),
                 rerotate=fields.pop("rerotate_keys", True))


def _compactor(press: str, r: float, max_new: int, fields: dict) -> Compactor:
    """kvpress's Compactor family: `CompactorPress` (leverage blended with non-causal chunked attention,
    sinks 8 + 4), its parts `NonCausalAttnPress` (attention alone) and `LeverageScorePress` (leverage
    alone), neither with sinks. The sketch is our draw (`kvpolicies.compactor.sketch`), not torch's."""
    if press == "NonCausalAttnPress":
        return Compactor(ratio=r, max_new=max_new, sink_start=0, sink_end=0, blending=0.0,
                         chunk_size=fields.pop("chunk_size", 256))
    if press == "LeverageScorePress":
        return Compactor(ratio=r, max_new=max_new, sink_start=0, sink_end=0, attention=False,
                         sketch_dim=fields.pop("sketch_dimension", 48))
    return Compactor(ratio=r, max_new=max_new, sink_start=fields.pop("sink_size_start", 8),
                     sink_end=fields.pop("sink_size_end", 4), chunk_size=fields.pop("chunk_size", 256),
                     sketch_dim=fields.pop("sketch_dimension", 48), blending=fields.pop("blending", None))


def _critical(press: str, r: float, max_new: int, fields: dict) -> Policy:
    """kvpress's `CriticalKVPress(press, epsilon, first_stage_ratio)` and `CriticalAdaKVPress(press,
    alpha_safeguard, epsilon, first_stage_ratio)` (`kvpolicies.critical`). PyramidKVPress: only its score is read, SnapKV's."""
    own = {k: fields.pop(k) for k in ("epsilon", "first_stage_ratio") if k in fields}
    inner = fields.pop("press")
    if inner == "PyramidKVPress":
        inner = "SnapKVPress"
        fields.pop("beta", None)
    if press == "CriticalAdaKVPress":
        own["alpha_safeguard"] = fields.pop("alpha_safeguard", 0.2)
    pol = kvpress(inner, r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
    if press == "CriticalKVPress":
        return Critical(ratio=r, max_new=max_new, press=pol, **own)
    if type(pol) is SnapKV:  # a head pool keeps no accumulated mass (its stream rule: `SnapOnce`)
        pol = SnapOnce(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)})
    return CriticalAda(press=pol, ratio=r, max_new=max_new, **own)


def _scored(press: str, r: float, max_new: int, n_layers: int | None, fields: dict) -> Policy | tuple[Policy, ...]:
    """The presses that score tokens once after the context (SnapKV's family, Knorm, ...)."""
    if press == "FinchPress":
        return _finch(r, max_new, fields)
    if press == "MergingPress":  # its own fields, the rest the inner press's
        if fields.pop("merge_fraction", 1.0) != 1.0:
            raise NotImplementedError("kvpolicies.compat.kvpress: MergingPress(merge_fraction < 1) (its quantile gate)")
        threshold = fields.pop("similarity_threshold", 0.0)
        inner = kvpress(fields.pop("press"), r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        return Merging(ratio=r, max_new=max_new, press=inner, similarity_threshold=threshold)
    if press in ("CompactorPress", "NonCausalAttnPress", "LeverageScorePress"):
        return _compactor(press, r, max_new, fields)
    if press == "CURPress":
        if fields.pop("use_random_leverage", False):
            raise NotImplementedError("kvpolicies.compat.kvpress: CURPress(use_random_leverage=True) (torch's "
                                      "Gaussian projection cannot be reproduced)")
        local = fields.pop("local_window_size", 16) if fields.pop("use_local_approximation", True) else 0
        return CUR(ratio=r, max_new=max_new, n_sink=fields.pop("num_sinks", 4),
                   leverage=fields.pop("leverage_type", "kv_product"), local_window=local)
    if press in ("CriticalKVPress", "CriticalAdaKVPress"):
        return _critical(press, r, max_new, fields)
    if press == "AdaKVPress" and fields["press"] == "PyramidKVPress":  # AdaKVPress reads only its score: SnapKV's
        fields["press"] = "SnapKVPress"
        fields.pop("beta", None)
    if press == "AdaKVPress" and fields["press"] != "SnapKVPress":  # kvpolicies.adascored: any other scorer
        inner, alpha = fields.pop("press"), fields.pop("alpha_safeguard", 0.2)
        inner = kvpress(inner, r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        return AdaScored(press=inner, ratio=r, alpha_safeguard=alpha, max_new=max_new)
    if press == "KeyRerotationPress":
        inner = kvpress(fields.pop("press"), r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        return Rerotated(ratio=r, max_new=max_new, press=inner)
    if press == "EntropyGatedChunkKVPress":
        sizes = {"chunk_length": fields.pop("chunk_length", 10),
                 "low_entropy_chunk_length": fields.pop("low_entropy_chunk_length", 4)}
        inner = kvpress(fields.pop("press"), r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        return EntropyChunkKV(ratio=r, max_new=max_new, press=inner, **sizes)
    if press in ("ChunkPress", "BlockPress", "ChunkKVPress"):  # the wrapper's size field, the rest the inner press's
        cls, size, default = {"ChunkPress": (Chunked, "chunk_length", 1024), "BlockPress": (Blocked, "block_size", 128),
                              "ChunkKVPress": (ChunkKV, "chunk_length", 20)}[press]
        own = fields.pop(size, default)
        inner = kvpress(fields.pop("press"), r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        return cls(ratio=r, max_new=max_new, press=inner, **{size: own})
    # SnapKV's own fields (taken here, after the wrappers, which hand them to their inner press)
    snap = {"obs_window": fields.pop("window_size", 64), "kernel": fields.pop("kernel_size", 5), "pooling": "avg"} \
        if press in ("AdaKVPress", "SnapKVPress", "PyramidKVPress") else {}
    if press == "AdaKVPress":
        fields.pop("press")  # SnapKVPress (`_inner`)
        return AdaKV(ratio=r, max_new=max_new, safeguard_window=True,
                     alpha_safeguard=fields.pop("alpha_safeguard", 0.2), **snap)
    if press == "SnapKVPress":
        return SnapKV(ratio=r, max_new=max_new, **snap)
    if press == "PyramidKVPress":
        out = PyramidKV(ratio=r, max_new=max_new, beta=fields.pop("beta", 20), **snap)  # stack(n): PyramidLayers
        return out.stack(n_layers) if n_layers is not None else out
    if press == "KnormPress":
        return Knorm(ratio=r, max_new=max_new, dense_layers=0)  # kvpress compresses every layer
    if press == "StreamingLLMPress":
        return SinkOnce(ratio=r, max_new=max_new, n_sink=fields.pop("n_sink", 4))
    if press == "ExpectedAttentionPress":
        return Expected(ratio=r, max_new=max_new, **{k: fields.pop(k) for k in list(fields) if k in (
            "n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")})
    if press == "ObservedAttentionPress":
        return Observed(ratio=r, max_new=max_new)
    if press == "QFilterPress":  # kvpress downloads the authors' filters: given here (q_filters=, evals.qfilter)
        return qfilter_press(r, max_new, n_layers, fields)
    if press == "ExpectedAttentionStatsPress":  # kvpress downloads the statistics: stats_folder= ours
        return expected_stats_press(r, max_new, n_layers, fields)
    if press == "KVzapPress":  # kvzap's surrogate (kvzap_model_name=: our weights), kvpress's per-head top-k
        return kvzap_press(r, max_new, fields)
    if press == "FastKVzipPress":  # gates= a file (kvpress downloads the authors'); layerwise False by default
        return fastkvzip_press(r, max_new, fields)
    if press == "KeyDiffPress":
        return KeyDiff(ratio=r, max_new=max_new)
    if press == "CapPress":
        return Cap(ratio=r, max_new=max_new, **{k: fields.pop(k) for k in list(fields) if k in (
            "tau", "n_future_positions", "n_sink", "epsilon")})
    if press == "LagKVPress":
        return LagKV(ratio=r, max_new=max_new, **{k: fields.pop(k) for k in list(fields) if k in (
            "n_sink", "lag_size", "cross_scoring")})
    if press == "RandomPress":  # our draw (a hash of seed, kv head, position), not torch's: kvpolicies.random_keep
        seed = fields.pop("seed", None)
        return RandomKeep(ratio=r, max_new=max_new, seed=0 if seed is None else seed)
    return LastQuery(ratio=r, max_new=max_new)  # TOVAPress
