"""The registry matrix: every registered policy, small instances whose limits 24-32 tokens cross, each
with an independent reference (tests/kvpolicies/test_policies.py checks them; tests/refs/sharding_check.py
and tests/kvpolicies/attention/test_blocked.py run the same instances)."""

from __future__ import annotations

import numpy as np

import kvpolicies
from kvpolicies import Rope
from tests.refs.oracle import VISIBLE, default_inv_freq, dense_attention
from tests.refs.prompt_scored import pyramid_ref, stream_ref
from tests.refs.headwise import adakv_reference, duo_reference
from tests.refs.hub import qfilter_stream
from tests.refs.kvzap import stream_reference as kvzap_reference
from tests.refs.kvcompose import stream_reference as kvcompose_reference
from tests.refs.kvzip import stream_reference as kvzip_reference
from tests.refs.multires_quest import hier_oracle, quest_oracle
from tests.refs.quant import np_kivi_attention
from tests.refs.scored import simulate
from tests.refs.scorers2 import cap_stream, simlayerkv_stream


B, N, K, D, THETA = 2, 4, 2, 16, 10000.0
ROPE = Rope(D, THETA)


def qkv(t, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, t, h, D)).astype(np.float32) for h in (N, K, K))


def reference(name, pol, q, k, v):
    t = q.shape[1]
    vis = [VISIBLE[name](p, pol) for p in range(t)]
    cache_ranks = isinstance(pol, kvpolicies.Sink) and pol.positions == "cache"
    return dense_attention(q, k, v, vis, cache_ranks, default_inv_freq(D, THETA))


# ---------------------------------------------------------------------------------------------
# The registry matrix: every registered policy is run against an independent reference. A policy
# added to the registry without an entry here fails `test_registered_policy_matches_reference`.
# References: the dense oracle (tests/refs/oracle.py) for position-based policies; step-by-step
# simulations of the papers' rules written independently of the library for the others.
# ---------------------------------------------------------------------------------------------


def _scored_ref(pol, q, k, v, chunks):
    return simulate(pol, q, k, v, [1])[0]  # evicts after every token, whatever the chunk


def _inner_ref(pol, q, k, v, chunks):  # a wrapper that streams by its inner press's rule (critical)
    return _scored_ref(pol.press, q, k, v, chunks)


def _compactor_ref(pol, q, k, v, chunks):  # our sketch (the draw), the rule in numpy
    from kvpolicies.compactor import sketch
    from tests.refs.prompt_scored import compactor_stream

    return compactor_stream(pol, q, k, v, np.asarray(sketch(pol.seed, K, D, pol.sketch_dim), np.float64))


def _hier_ref(pol, q, k, v, chunks):
    return hier_oracle(q, k, v, pol)[0]


def _quest_ref(pol, q, k, v, chunks):
    return quest_oracle(q, k, v, pol)[0]


def _kivi_ref(pol, q, k, v, chunks):
    return np_kivi_attention(q, k, v, [1], pol.bits, pol.group, pol.residual, pol.after_rope)  # token by token, any chunk


def _paged_ref(pol, q, k, v, chunks):  # paged storage: the dense oracle of full / window / sink
    vis = [VISIBLE["paged"](p, pol) for p in range(q.shape[1])]
    ranks = pol.n_sink > 0 and pol.positions == "cache"
    return dense_attention(q, k, v, vis, ranks, default_inv_freq(D, THETA))


def _dense_ref(name):
    return lambda pol, q, k, v, chunks: reference(name, pol, q, k, v)


# registry name -> (instances small enough that 24 tokens cross their limits, reference)
REFERENCES = {
    "full": ([kvpolicies.get("full")], _dense_ref("full")),
    "window": ([kvpolicies.get("window", window=6)], _dense_ref("window")),
    "sink": ([kvpolicies.get("sink", n_sink=2, window=5)], _dense_ref("sink")),
    "h2o": ([kvpolicies.get("h2o", heavy=4, recent=3)], _scored_ref),
    "tova": ([kvpolicies.get("tova", budget=6), kvpolicies.get("tova", budget=6, scope="head")], _scored_ref),
    "snapkv": ([kvpolicies.get("snapkv", budget=5, obs_window=3, kernel=3, max_new=4)], _scored_ref),
    "finch": ([kvpolicies.get("finch", budget=5, obs_window=3, max_new=4)], _scored_ref),  # keys at their ranks
    "pyramidkv": ([kvpolicies.get("pyramidkv", budget=5, obs_window=3, kernel=3, max_new=4)], pyramid_ref),
    "knorm": ([kvpolicies.get("knorm", budget=6, max_new=3)], stream_ref),  # tests/refs/prompt_scored.py
    "random": ([kvpolicies.get("random", budget=6, max_new=3, seed=1)], stream_ref),
    "keydiff": ([kvpolicies.get("keydiff", budget=6, max_new=3)], stream_ref),
    # a stream never compressed (no prompt phase) stores every token whole: full's oracle (its channel pruning
    # after a prompt: tests/kvpolicies/test_prompt_matrix.py, test_kvpress_parity_channels.py)
    "think": ([kvpolicies.get("think")], _dense_ref("full")),
    "qfilter": ([kvpolicies.get("qfilter", budget=6, max_new=3, filters="random")], qfilter_stream),  # tests/refs/hub.py
    "compactor": ([kvpolicies.get("compactor", budget=6, max_new=3, sink_start=1, sink_end=1, sketch_dim=4)],
                  _compactor_ref),
    # local_window 4: views of 10 tokens hold 3 blocks (the last one short)
    "cur": ([kvpolicies.get("cur", budget=6, max_new=3, n_sink=1, local_window=4)], stream_ref),
    # lag_size 3: views of 10 tokens hold 2 scored partitions after the sink (cross_scoring: test_prompt_scored)
    "lagkv": ([kvpolicies.get("lagkv", budget=6, max_new=3, n_sink=1, lag_size=3)], stream_ref),
    "observed": ([kvpolicies.get("observed", budget=6, max_new=3)], stream_ref),
    "simlayerkv": ([kvpolicies.get("simlayerkv", budget=6, max_new=3, n_initial=2)], simlayerkv_stream),
    "cap": ([kvpolicies.get("cap", budget=6, max_new=3, n_sink=2, n_future_positions=8)], cap_stream),
    "expected": ([kvpolicies.get("expected", budget=6, max_new=3, n_sink=2, n_future_positions=8)], stream_ref),
    "adakv": ([kvpolicies.get("adakv", budget=5, obs_window=3, kernel=3, max_new=4)],
              adakv_reference),  # tests/refs/headwise.py
    # streams by its inner press's rule (the value norms are read by the prompt phase only: the kvpress parity
    # of tests/kvpolicies/test_kvpress_parity_critical.py): snapkv's, at the same slots
    "critical": ([kvpolicies.get("critical", budget=8, max_new=4, press=kvpolicies.get(
        "snapkv", budget=5, obs_window=3, kernel=3, max_new=4))], _inner_ref),
    "kvzip": ([kvpolicies.get("kvzip", budget=5, max_new=3, n_sink=2)],
              kvzip_reference),  # tests/refs/kvzip.py
    # streams by kvzip's rule (no gradient mid-stream); its prompt rule is checked beside kvpress
    # (tests/kvpolicies/test_kvpress_parity_kvgrad.py); kvzip's chunking and prompts, so that one
    # reconstruction pass serves both in a model of both (the 8-device check runs kvgrad in a model of its own:
    # tests/refs/sharding_check.APART)
    "kvgrad": ([kvpolicies.get("kvgrad", budget=5, max_new=3, n_sink=2, repeat_chunk=2000, prompts="authors")],
               kvzip_reference),
    "kvzap": ([kvpolicies.get("kvzap", budget=5, max_new=3, window=2, surrogate="random")],
              kvzap_reference),  # tests/refs/kvzap.py
    "kvcompose": ([kvpolicies.get("kvcompose", budget=6, max_new=3)],
                  kvcompose_reference),  # tests/refs/kvcompose.py (9 slots: 6 kept on overflow; observed's shapes)
    "duo": ([kvpolicies.get("duo", sink=2, recent=5, heads=(1, 0))],
            duo_reference),
    "multires": ([kvpolicies.get("multires", window=3, branch=2, slots_per_level=2, levels=3)], _hier_ref),
    "quest": ([kvpolicies.get("quest", page=4, top_k=2, window=5)], _quest_ref),
    "kivi": ([kvpolicies.get("kivi", bits=2, group=4, residual=8)], _kivi_ref),
    "paged": ([kvpolicies.get("paged", block=4), kvpolicies.get("paged", block=3, window=5, n_sink=2)], _paged_ref),
}
