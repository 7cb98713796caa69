"""Expected Attention with precomputed query statistics (NVIDIA/kvpress `ExpectedAttentionStatsPress`, after
Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution"): `expected`'s score, the query mean and covariance read from calibration statistics instead
of the prompt's own queries. Reached through `kvpolicies.compat.kvpress("ExpectedAttentionStatsPress", r,
stats_folder=<file>)`; not registered (it is `expected` with given statistics).

Shapes: B batch, K kv heads, G query heads per kv head, N = K G, S slots, V view slots, D head dim, L layers,
F = n_future_positions.

kvpress downloads the statistics (`alessiodevoto/exp_att_stats_<model>_kmfoda_booksum_100_1000_4`:
the mean and covariance, N - 1 denominator, of the pre-RoPE queries of every layer and query head over
100 BookSum chapters cut to 1,000 characters, each without its first n_sink = 4 tokens), not reachable
offline; `python -m evals.expected_stats model=<name>` computes ours the same way on the Paul Graham essays
and saves `$KVP_DATA/expected_stats/<model>.npz` ("mu" [L, N, D], "cov" [L, N, D, D] float32).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.expected import turn
from kvpolicies.keydiff import rotated
from kvpolicies.presets import Preset
from kvpolicies.prompt_scored import PromptScored, rank_by


@functools.lru_cache(maxsize=8)
def load_stats(path: str) -> dict[str, np.ndarray]:
    """{"mu": [L, N, D], "cov": [L, N, D, D]} float32 from an .npz file of `evals.expected_stats`."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"expected-stats.stats={path!r}: no such file; compute the statistics with "
                         "`python -m evals.expected_stats model=<name>` ($KVP_DATA/expected_stats/<model>.npz)")
    with np.load(p) as z:
        missing = {"mu", "cov"} - set(z.files)
        if missing:
            raise ValueError(f"expected-stats.stats={path!r}: the file has no {sorted(missing)} ({z.files})")
        mu, cov = np.asarray(z["mu"], np.float32), np.asarray(z["cov"], np.float32)
    if mu.ndim != 3 or cov.shape != mu.shape + mu.shape[-1:]:
        raise ValueError(f"expected-stats.stats={path!r}: mu {mu.shape} and cov {cov.shape} are not [L, N, D] and "
                         "[L, N, D, D]")
    return {"mu": mu, "cov": cov}


@dataclasses.dataclass(frozen=True)
class ExpectedStats(Preset, PromptScored):
    """After the prompt, keep per kv head the `budget` tokens with the largest expected attention of
    queries distributed as the layer's calibration statistics (`stats`, a file; `layer` this layer's
    index, set by `stack(n_layers)`), per query head, rotated by RoPE averaged over the next
    `n_future_positions` positions; the first n_sink tokens kept. kvpress's defaults: 512, 4,
    covariance, value norms, epsilon 0. The stream extension (`PromptScored`: recompress on overflow)
    scores the view with the same statistics. Prompt phase: RoPE's frequencies only (`query_sink`, as
    expected's, whose query sums it does not read)."""

    label = "expected-stats"
    observes = ("k_rot", "rope")

    budget: int = 1024
    max_new: int = 256
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    stats: str = ""  # the statistics file (evals.expected_stats)
    layer: int = -1  # this layer's index in `stats` (set by `stack`)
    codec: Codec = Identity()

    def __post_init__(self):
        super().__post_init__()
        check_int(self.label, "n_future_positions", self.n_future_positions, 1)
        check_int(self.label, "n_sink", self.n_sink, 0)
        check_int(self.label, "layer", self.layer, -1)
        if not isinstance(self.stats, str):
            raise ValueError(f"{self.label}.stats={self.stats!r}: must be a file path (evals.expected_stats)")
        if not isinstance(self.epsilon, (int, float)) or self.epsilon < 0:
            raise ValueError(f"{self.label}.epsilon={self.epsilon!r}: must be a number >= 0")

    @property
    def collects(self):
        return {"query_sink": self.n_sink}

    def stack(self, n_layers):
        n = load_stats(self.stats)["mu"].shape[0] if self.stats else 0
        if n != n_layers:
            raise ValueError(f"{self.label}: the statistics {self.stats!r} hold {n} layers, the model has {n_layers}")
        return tuple(dataclasses.replace(self, layer=i) for i in range(n_layers))

    def moments(self, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """This layer's query mean [K, G, D] and covariance [K, G, D, D] (query head n = k G + g)."""
        if self.layer < 0 or not self.stats:
            raise ValueError(f"{self.label} needs its statistics and layer: stats=<file of `python -m "
                             "evals.expected_stats`>, stacked per layer by a model's engine (stack(n_layers))")
        s = load_stats(self.stats)
        mu, cov = s["mu"][self.layer], s["cov"][self.layer]  # [N, D], [N, D, D]
        if mu.shape[-1] != head_dim or mu.shape[0] % kv_heads:
            raise ValueError(f"{self.label}: statistics of {mu.shape[0]} query heads of dim {mu.shape[-1]}, the layer "
                             f"has {kv_heads} kv heads of dim {head_dim}")
        g = mu.shape[0] // kv_heads
        return mu.reshape(kv_heads, g, head_dim), cov.reshape(kv_heads, g, head_dim, head_dim)

    def rank(self, slots, keys, stats, seen):
        start = slots.pos.max(axis=(1, 2)) + 1  # [B] the first future position
        return self.score(seen.k_rot, slots.v, slots.pos, jnp.asarray(seen.rope.inv_freq()), start)

    def prompt_rank(self, state, slots, keys, stats):
        inv = state.extra["inv_freq"]
        return self.score(rotated(keys, slots.pos, inv), slots.v, slots.pos, inv, slots.pos.max(axis=(1, 2)) + 1)

    def score(self, k_rot: Float[Array, "B K V D"], v, pos: Int[Array, "B K V"], inv_freq: Float[Array, "H"],
              start: Int[Array, "B"]) -> tuple[Array, Array]:
        """(priority, tie): kvpress's ExpectedAttentionPress.score with the layer's statistics: the softmax
        over the non-sink keys of mu'.k / sqrt(D) + k^T C' k / (2 D) (mu' = R mu, C' = R C R^T, R RoPE
        averaged over start .. start + F - 1), averaged over G, times ||v||; the n_sink first tokens first."""
        kh, d = k_rot.shape[1], k_rot.shape[-1]
        mu, cov = (jnp.asarray(x) for x in self.moments(kh, d))  # [K, G, D], [K, G, D, D]
        future = start[:, None] + jnp.arange(self.n_future_positions)  # [B, F]
        ang = future.astype(jnp.float32)[..., None] * inv_freq  # [B, F, D/2]
        c, s = (f(ang).mean(axis=1)[:, None, None] for f in (jnp.cos, jnp.sin))  # [B, 1, 1, D/2]: mean R
        mu = turn(mu[None], c, s)  # [B, K, G, D]: R mu
        k = k_rot.astype(jnp.float32)
        logit = jnp.einsum("BKVD,BKGD->BKGV", k, mu) / jnp.sqrt(d)  # [B, K, G, V]
        if self.use_covariance:
            c2, s2 = c[..., None, :], s[..., None, :]  # [B, 1, 1, 1, D/2]
            cov = turn(jnp.swapaxes(turn(cov[None], c2, s2), -1, -2), c2, s2)  # [B, K, G, D, D]: R C R^T
            logit = logit + jnp.einsum("BKVI,BKGIJ,BKVJ->BKGV", k, cov, k) / (2 * d)
        sink = pos < self.n_sink  # [B, K, V]
        scored = ((pos >= 0) & ~sink)[:, :, None]  # [B, K, 1, V]
        logit = jnp.where(scored, logit, -jnp.inf)
        top = jnp.max(logit, axis=-1, keepdims=True)
        e = jnp.where(scored, jnp.exp(logit - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        p = (e / jnp.maximum(e.sum(axis=-1, keepdims=True), 1e-30)).mean(axis=2)  # [B, K, V]
        if self.use_vnorm:
            vals = self.codec.decode(v, jnp.float32)  # [B, K, V, D]
            p = (p + self.epsilon) * jnp.sqrt(jnp.sum(jnp.square(vals), axis=-1))
        return rank_by(jnp.where(sink, jnp.inf, p), pos)


# kvpress's fields that name the statistics it downloads (dataset, samples, length): ours are the file's
NAMING = ("dataset_name", "num_samples", "sample_seq_len")


def from_kvpress(r: float, max_new: int, n_layers: int | None,
                 fields: dict) -> ExpectedStats | tuple[ExpectedStats, ...]:
    """`kvpolicies.compat.kvpress("ExpectedAttentionStatsPress", r, stats_folder=<file>)`: kvpress's
    `stats_folder` (a saved `ExpectedAttentionStats`) or its download is here a file of
    `evals.expected_stats`; the expected-attention fields are kvpress's. Given `n_layers`, the tuple."""
    path = fields.pop("stats_folder", None)
    if not path:
        raise ValueError("kvpress('ExpectedAttentionStatsPress'): give stats_folder= (a file of `python -m "
                         "evals.expected_stats model=<name>`, $KVP_DATA/expected_stats/<model>.npz); kvpress "
                         "downloads its statistics from the Hugging Face hub, which is not reachable offline")
    for k in NAMING:
        fields.pop(k, None)
    own = {k: fields.pop(k) for k in list(fields) if k in (
        "n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")}
    out = ExpectedStats(ratio=r, max_new=max_new, stats=str(path), **own)
    return out.stack(n_layers) if n_layers is not None else out
