"""Capacity is checked, never overrun (issue 38): every registered policy through `attend` (eager:
a ValueError; inside jit: NaN outputs at the bad queries) and through the Engine; a paged pool's
exhaustion at every entry point; `attend`'s shape checks; the Engine's argument checks.

Each non-error case is checked against an independent run: a policy that takes a position past
its state's slots without an error (a ring, an evictor) must give the same outputs as the same
policy over a state four times larger (nothing was overwritten)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies import Rope, attend, limits, paged

B, N, K, D = 2, 4, 2, 16
ROPE = Rope(D, 10000.0)
L = 12  # the small state's max_len: 12 tokens fill it, position 12 is past a bounded state's slots

# one instance per registered policy, small enough that L tokens reach its limits
SMALL = {
    "full": kvpolicies.get("full"),
    "window": kvpolicies.get("window", window=6),
    "sink": kvpolicies.get("sink", n_sink=2, window=5),
    "h2o": kvpolicies.get("h2o", heavy=4, recent=3),
    "tova": kvpolicies.get("tova", budget=6),
    "snapkv": kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4),
    "finch": kvpolicies.get("finch", budget=5, obs_window=3, max_new=4),
    "cur": kvpolicies.get("cur", budget=6, max_new=3, n_sink=1, local_window=4),
    "compactor": kvpolicies.get("compactor", budget=6, max_new=3, sink_start=1, sink_end=1, sketch_dim=4),
    "pyramidkv": kvpolicies.get("pyramidkv", budget=5, obs_window=3, kernel=3, max_new=4),
    "knorm": kvpolicies.get("knorm", budget=6, max_new=3),
    "random": kvpolicies.get("random", budget=6, max_new=3, seed=1),
    "keydiff": kvpolicies.get("keydiff", budget=6, max_new=3),
    "simlayerkv": kvpolicies.get("simlayerkv", budget=6, max_new=3, n_initial=2),
    "cap": kvpolicies.get("cap", budget=6, max_new=3, n_sink=2, n_future_positions=8),
    "think": kvpolicies.get("think", max_new=12),  # a stream: 12 whole slots
    "qfilter": kvpolicies.get("qfilter", budget=6, max_new=3, filters="random"),
    "lagkv": kvpolicies.get("lagkv", budget=6, max_new=3, n_sink=1, lag_size=3),
    "observed": kvpolicies.get("observed", budget=6, max_new=3),
    "expected": kvpolicies.get("expected", budget=6, max_new=3, n_sink=2, n_future_positions=8),
    "adakv": kvpolicies.get("adakv", budget=5, obs_window=3, kernel=3, max_new=4),
    "critical": kvpolicies.get("critical", budget=8, max_new=4, press=kvpolicies.get("snapkv", obs_window=3, kernel=3)),
    "kvzip": kvpolicies.get("kvzip", budget=5, max_new=3, n_sink=2),
    "kvgrad": kvpolicies.get("kvgrad", budget=5, max_new=3, n_sink=2),
    "kvzap": kvpolicies.get("kvzap", budget=5, max_new=3, window=2, surrogate="random"),
    "kvcompose": kvpolicies.get("kvcompose", budget=5, max_new=3),
    "duo": kvpolicies.get("duo", sink=2, recent=5, heads=(1, 0)),
    "multires": kvpolicies.get("multires", window=3, branch=2, slots_per_level=2, levels=3),
    "quest": kvpolicies.get("quest", page=4, top_k=2, window=5),
    "kivi": kvpolicies.get("kivi", bits=2, group=4, residual=8),
    "paged": kvpolicies.get("paged", block=4),
}
BOUNDED = {"full", "duo", "quest", "kivi", "paged", "think"}  # slot i holds token i: positions < slots only
RINGS = {"window", "sink"}


def qkv(t, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, t, h, D)), jnp.float32) for h in (N, K, K))


def positions(lo, hi):
    return jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (B, hi - lo))


@functools.partial(jax.jit, static_argnums=0)
def _jitted(pol, st, q, k, v, pos):
    return attend(pol, st, q, k, v, pos, ROPE)


def fill(pol, max_len, q, k, v):
    """The state after positions 0..L-1 (one chunk, compiled: the eager checks are the tests'), and the outputs."""
    st = pol.init(B, K, D, jnp.float32, max_len)
    return _jitted(pol, st, q[:, :L], k[:, :L], v[:, :L], positions(0, L))


def test_every_registered_policy_is_classified():
    assert set(SMALL) == set(kvpolicies.POLICIES)
    for name, pol in SMALL.items():
        assert isinstance(pol, limits.Bounded) == (name in BOUNDED), name
        assert limits.is_ring(pol) == (name in RINGS), name
    assert limits.is_ring(kvpolicies.get("paged", block=4, window=5, n_sink=2))


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_a_position_past_capacity_is_refused_or_taken_unharmed(name):
    """Eager: a bounded state refuses position L (ValueError); a ring or an evictor takes it with
    the outputs of a state four times larger (nothing overwritten). Inside jit: NaN outputs at a
    bounded state's position L and at a negative position, finite ones elsewhere. Eager again: a
    negative, a repeated and an out-of-order position are refused by every policy."""
    pol = SMALL[name]
    q, k, v = qkv(L + 1, seed=1)
    _, st = fill(pol, L, q, k, v)
    step = (q[:, L:], k[:, L:], v[:, L:], positions(L, L + 1))
    if name in BOUNDED:
        with pytest.raises(ValueError, match=rf"position {L} is past the capacity of this \w+ state"):
            attend(pol, st, *step, ROPE)
    else:
        out, _ = attend(pol, st, *step, ROPE)
        _, big = fill(pol, 4 * L, q, k, v)
        ref, _ = _jitted(pol, big, *step)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)

    pos = jnp.asarray([[L], [-3]], jnp.int32)  # row 0 past the slots (bad only when bounded), row 1 negative
    out = np.asarray(_jitted(pol, st, *step[:3], pos)[0])
    assert np.isnan(out[1]).all()
    assert np.isnan(out[0]).all() if name in BOUNDED else np.isfinite(out[0]).all()

    with pytest.raises(ValueError, match="negative position -1"):
        attend(pol, st, *step[:3], positions(-1, 0), ROPE)
    with pytest.raises(ValueError, match="must increase within a step"):
        attend(pol, st, q[:, :2], k[:, :2], v[:, :2], jnp.full((B, 2), L, jnp.int32), ROPE)
    if name != "paged":  # a pool's positions are not per row (its block table is; see test_paged)
        with pytest.raises(ValueError, match=f"out of order: row 0 feeds position {L - 1} but the state already "
                                             f"holds position {L - 1}"):
            attend(pol, st, *step[:3], positions(L - 1, L), ROPE)


def test_the_issue_example_full_at_128_fed_140_tokens():
    pol = kvpolicies.get("full")
    q, k, v = qkv(140, seed=4)
    st = pol.init(B, K, D, jnp.float32, 128)
    with pytest.raises(ValueError, match="position 139 is past the capacity of this full state \\(128 slots"):
        attend(pol, st, q, k, v, positions(0, 140), ROPE)
    with pytest.raises(ValueError, match="consecutive positions"):
        attend(pol, st, q[:, :3], k[:, :3], v[:, :3], jnp.asarray([[0, 1, 5]] * B, jnp.int32), ROPE)


def test_attend_checks_batch_heads_head_dim_and_t_with_one_error_each():
    pol = kvpolicies.get("full")
    q, k, v = qkv(3, seed=5)
    st = pol.init(B, K, D, jnp.float32, 16)
    pos = positions(0, 2)
    cases = [
        ((q[:1, :2], k[:1, :2], v[:1, :2], pos[:1]), "the state holds batch 2, the step batch 1"),
        ((q[:, :2], k[:, :2, :1], v[:, :2, :1], pos), "kv heads differ: the step's k/v have 1"),
        ((q[:, :2, :, :8], k[:, :2, :, :8], v[:, :2, :, :8], pos), "another head_dim than the step's 8"),
        ((q[:, :3], k[:, :2], v[:, :2], pos), "T \\(new tokens\\) differs: q 3, k/v 2, pos 2"),
        ((q[:, :2, :3], k[:, :2], v[:, :2], pos), "q's 3 heads are not a multiple of k/v's 2 kv heads"),
        ((q[:, :2], k[:, :2], v[:, :2, :, :8], pos), "k \\(2, 2, 2, 16\\) and v \\(2, 2, 2, 8\\) must have the same"),
        ((q[:, :2], k[:, :2], v[:, :2], pos[0]), "pos must have shape \\[B, T\\]"),
        ((q[:, :2], k[:, :2], v[:, :2], pos.astype(jnp.float32)), "pos must hold integer positions"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            attend(pol, st, *args, ROPE)
    with pytest.raises(ValueError, match="T \\(new tokens\\) differs"):  # shapes are checked inside jit too
        _jitted(pol, st, q[:, :3], k[:, :2], v[:, :2], pos)


def test_eager_attend_raises_when_a_paged_pool_is_exhausted():
    pol = kvpolicies.get("paged", block=4, blocks=2)
    q, k, v = qkv(9, seed=6)
    st = pol.init(1, K, D, jnp.float32, 32)
    _, st = attend(pol, st, q[:1, :8], k[:1, :8], v[:1, :8], positions(0, 8)[:1], ROPE)  # 2 blocks: full
    with pytest.raises(ValueError, match="paged pool exhausted \\(run 0: 2 blocks per layer\\)"):
        attend(pol, st, q[:1, 8:], k[:1, 8:], v[:1, 8:], positions(8, 9)[:1], ROPE)


def test_paged_fork_validates_its_rows():
    st = kvpolicies.get("paged", block=4).init(1, K, D, jnp.float32, 16)
    for rows, msg in (([5], r"rows \[5\] must be in \[0, 1\)"), ([-1], r"must be in \[0, 1\)"),
                      ([], "non-empty sequence"), ([0.5], "non-empty sequence"), ([[0]], "non-empty sequence")):
        with pytest.raises(ValueError, match=msg):
            paged.fork(st, rows)
    assert paged.fork(st, [0, 0]).table.shape[0] == 2


# -- through the Engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from models.config import LlamaConfig
    from models.llama import Llama

    return Llama(LlamaConfig(vocab_size=97, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64))


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_engine_refuses_positions_past_max_len_for_every_policy(name, tiny):
    from models.engine import Engine

    eng = Engine(tiny, SMALL[name], max_len=16)
    ids = np.arange(1, 19, dtype=np.int32)
    with pytest.raises(ValueError, match="exceeds the engine's max_len=16"):
        eng.score(ids, chunk=8)
    with pytest.raises(ValueError, match="exceeds the engine's max_len=16"):
        eng.step(eng.init_cache(1), ids[None, :2], 15)
    with pytest.raises(ValueError, match="exceeds the engine's max_len=16"):
        eng.generate(ids[:10], 8)


def test_engine_raises_when_the_paged_pool_runs_out_at_every_entry_point(tiny):
    from models.engine import Engine

    eng = Engine(tiny, kvpolicies.get("paged", block=4, blocks=2), max_len=32)
    msg = "Engine: paged pool exhausted"
    with pytest.raises(ValueError, match=msg):  # the issue's example: returned zeros after 4 ids
        eng.generate(list(range(1, 7)), 10)
    with pytest.raises(ValueError, match=msg):  # returned NaN for 7 of 19
        eng.score(np.arange(1, 21, dtype=np.int32))
    with pytest.raises(ValueError, match=msg):
        eng.prefill(np.arange(1, 11, dtype=np.int32)[None], chunk=4)
    with pytest.raises(ValueError, match=msg):
        eng.step(eng.init_cache(1), np.arange(1, 11, dtype=np.int32)[None], 0)
    ok = eng.generate(list(range(1, 5)), 4)  # 8 positions: 2 blocks of 4, fits
    assert ok.shape == (4,)


def test_engine_type_checks_its_policy_argument(tiny):
    from models.engine import Engine

    for bad, msg in (("full", r"got str 'full' \(build it with kvpolicies.get\('full'\)\)"), (None, "got NoneType None"),
                     ([kvpolicies.get("full"), "x"], "got str 'x'"), ([], "got list \\[\\]"), (3, "got int 3")):
        with pytest.raises(TypeError, match="Engine policies: expected a Policy or a sequence of Policy .*" + msg):
            Engine(tiny, bad, max_len=16)


def test_engine_step_refuses_out_of_range_jax_ids(tiny):
    from models.engine import Engine

    eng = Engine(tiny, kvpolicies.get("full"), max_len=16)
    for ids, lo, hi in ((jnp.asarray([[-7]]), -7, -7), (jnp.asarray([[3, 300]]), 3, 300)):
        with pytest.raises(ValueError, match=rf"ids must be in the vocabulary \[0, 97\), got ids from {lo} to {hi}"):
            eng.step(eng.init_cache(1), ids, 0)
    logits, _ = eng.step(eng.init_cache(1), jnp.asarray([[96]]), 0)
    assert np.isfinite(np.asarray(logits)).all()
