"""Hostile inputs to the policy half (issue 61): what `Policy.init`, `attend`, `Rope` and
`kvpolicies.compat.kvpress` are given is checked first; each mistake is one ValueError naming the
argument, before any compute (no array of a wrong dtype, no NaN output, no empty answer)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies import Rope, attend
from kvpolicies.compat import kvpress


def every_policy():
    """One instance of each registered policy (duo with a per-layer head pattern of 2 kv heads)."""
    return [kvpolicies.get(n, heads=(1, 0)) if n == "duo" else kvpolicies.get(n) for n in sorted(kvpolicies.POLICIES)]


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, "int8", str])
def test_init_refuses_dtypes_that_are_not_floating(dtype):
    for pol in every_policy():
        with pytest.raises(ValueError, match=r"\.init: dtype=.* must be a floating dtype"):
            pol.init(1, 2, 16, dtype, 64)


@pytest.mark.parametrize(("args", "match"), [
    ((-1, 2, 16, 64), r"batch=-1 must be an int >= 1"),
    ((1, 2.5, 16, 64), r"kv_heads=2.5 must be an int >= 1"),
    ((1, 2, 0, 64), r"head_dim=0 must be an int >= 1"),
    ((1, 2, 16, -8), r"max_len=-8 must be an int >= 1"),
    ((1, True, 16, 64), r"kv_heads=True must be an int >= 1"),
])
def test_init_refuses_negative_or_fractional_sizes(args, match):
    b, k, d, n = args
    for pol in every_policy():
        with pytest.raises(ValueError, match=match):
            pol.init(b, k, d, jnp.float32, n)


def test_init_takes_every_floating_dtype():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, np.dtype("float32"), "bfloat16"):
        assert kvpolicies.get("full").init(1, 2, 16, dtype, 8).pos.shape == (1, 1, 8)


POL = kvpolicies.get("full")
STATE = POL.init(1, 2, 16, jnp.float32, 32)
X = jnp.zeros((1, 4, 2, 16))
POS = jnp.arange(4)[None]


@pytest.mark.parametrize(("call", "match"), [
    (lambda: attend(POL, STATE, X, X, X, [[0, 1, 2, 3]], Rope(16)), r"pos must be an array, got list"),
    (lambda: attend(POL, STATE, X, X, X, POS, None), r"rope must be a kvpolicies.Rope .*got NoneType"),
    (lambda: attend(POL, None, X, X, X, POS, Rope(16)), r"state must be the policy's state .*got NoneType"),
    (lambda: attend("full", STATE, X, X, X, POS, Rope(16)),
     r"policy must be a kvpolicies.Policy, got str 'full' \(build it: kvpolicies.get\('full'\)\)"),
    (lambda: attend(POL, STATE, X, X, X, POS, Rope(8)), r"rope is for head_dim 8, q and k have head_dim 16"),
    (lambda: attend(POL, STATE, X[:, :0], X[:, :0], X[:, :0], POS[:, :0], Rope(16)), r"q has shape .*: new tokens T must be >= 1"),
    (lambda: attend(POL, STATE, X[:0], X[:0], X[:0], POS[:0], Rope(16)), r"q has shape .*: batch B must be >= 1"),
    (lambda: attend(POL, STATE, X[..., :0], X[..., :0], X[..., :0], POS, Rope(16)), r"q has shape .*: head_dim D must be >= 1"),
], ids=["pos-list", "rope-none", "state-none", "policy-name", "rope-head-dim", "T0", "B0", "D0"])
def test_attend_arguments_are_one_clear_error(call, match):
    with pytest.raises(ValueError, match="^attend: " + match):
        call()


@pytest.mark.parametrize(("theta", "head_dim"), [(float("nan"), 16), (float("inf"), 16), (0.0, 16), (-5.0, 16),
                                                 (10000.0, 15), (10000.0, 0), (10000.0, 2.0)])
def test_rope_refuses_a_theta_or_head_dim_that_gives_no_rotation(theta, head_dim):
    with pytest.raises(ValueError, match=r"^Rope (theta|head_dim)="):
        Rope(head_dim, theta)


@pytest.mark.parametrize("n_layers", [0, -2, 1.5, True])
def test_kvpress_refuses_a_model_without_layers(n_layers):
    with pytest.raises(ValueError, match=rf"kvpress\('PyramidKVPress'\): n_layers={n_layers!r} must be an int >= 1"):
        kvpress("PyramidKVPress", 0.5, n_layers=n_layers)
