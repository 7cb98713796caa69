"""`kvpolicies.ties.torch_cpu_top_mask` against torch.topk itself (CPU) on rows full of exact ties, and against
our own top-k where there are none."""

import numpy as np
import jax.numpy as jnp
import pytest

from kvpolicies.scored import top_mask
from kvpolicies.ties import torch_cpu_top_mask

torch = pytest.importorskip("torch")


def lagkv_like(rng, parts: int, lag: int, tail: int) -> np.ndarray:
    """LagKV's scores without cross_scoring: each partition's ranks / lag (every partition the same values),
    the sinks and the tail at 1."""
    ranks = [rng.permutation(lag) / lag for _ in range(parts)]
    return np.concatenate([np.ones(4), *ranks, np.ones(tail)]).astype(np.float32)


def torch_kept(x: np.ndarray, k: int) -> set[int]:
    return set(torch.topk(torch.from_numpy(x), k).indices.tolist())


def test_the_kept_sets_are_torch_topks_on_rows_of_ties():
    rng = np.random.default_rng(0)
    v = 1100
    rows, ns, ks, want = [], [], [], []
    for _ in range(48):
        x = lagkv_like(rng, int(rng.integers(2, 8)), 128, int(rng.integers(1, 130)))
        x = x[: v]
        n = len(x)
        k = int(rng.integers(n // 64 + 1, n))  # torch's nth_element path (k * 64 > n)
        rows.append(np.pad(x, (0, v - n), constant_values=-np.inf))
        ns.append(n), ks.append(k), want.append(torch_kept(x, k))
    # a few tiny rows and rows of one value
    for x, k in ((np.float32([0.5, 0.5, 0.5]), 2), (np.float32([1.0, 0.25]), 1), (np.full(300, 0.75, np.float32), 77)):
        rows.append(np.pad(x, (0, v - len(x)), constant_values=-np.inf))
        ns.append(len(x)), ks.append(k), want.append(torch_kept(x, k))
    got = np.asarray(torch_cpu_top_mask(jnp.asarray(np.stack(rows)), jnp.asarray(ns), jnp.asarray(ks)))
    for i in range(len(rows)):
        assert set(np.flatnonzero(got[i]).tolist()) == want[i], i
    # the rule matters here: keeping the newer of the tied tokens differs from torch on most rows
    prio = jnp.asarray(np.stack(rows))
    newer = np.asarray(top_mask(prio, jnp.broadcast_to(jnp.arange(v), prio.shape), jnp.asarray(ks)[:, None]))
    assert sum(set(np.flatnonzero(newer[i]).tolist()) != want[i] for i in range(48)) > 24


def test_without_ties_it_is_the_top_k():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 400)).astype(np.float32)  # [B, K, V]: leading axes kept
    n = np.array([[400, 399, 250], [17, 4, 300]])
    k = np.array([[100, 7, 249], [9, 2, 5]])
    got = np.asarray(torch_cpu_top_mask(jnp.asarray(x), jnp.asarray(n), jnp.asarray(k)))
    for b in range(2):
        for h in range(3):
            row = x[b, h, : n[b, h]]
            assert set(np.flatnonzero(got[b, h]).tolist()) == set(np.argsort(-row)[: k[b, h]].tolist())


def test_a_prompt_scorer_takes_the_rule_as_a_field():
    import kvpolicies

    assert kvpolicies.get("lagkv", budget=64).ties == "newer"  # the default: the newer of tied tokens
    assert kvpolicies.get("snapkv", budget=64, ties="torch_cpu").ties == "torch_cpu"
    with pytest.raises(ValueError, match="ties='oldest'"):
        kvpolicies.get("lagkv", budget=64, ties="oldest")
