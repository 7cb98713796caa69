"""Memory accounting: exact state bytes equal the closed form; ring caches do not grow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies.memory import closed_form_bytes, state_bytes, tree_bytes
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama


@pytest.mark.parametrize("dtype,nbytes", [(jnp.bfloat16, 2), (jnp.float32, 4)])
@pytest.mark.parametrize(
    "name,kw,slots",
    [("full", {}, 8192), ("window", dict(window=1024), 1024), ("sink", dict(n_sink=4, window=1024), 1028)],
)
def test_state_bytes_equal_closed_form(name, kw, slots, dtype, nbytes):
    pol = kvpolicies.get(name, **kw)
    sb = state_bytes(pol, kv_heads=3, head_dim=64, max_len=8192, n_layers=30, batch=2, dtype=dtype)
    assert sb.kv == closed_form_bytes(n_layers=30, kv_heads=3, head_dim=64, slots=slots, bytes_per_elem=nbytes, batch=2)
    assert sb.meta == 30 * 2 * slots * 4  # one int32 position per slot, per layer and sequence


def test_llama3_8b_numbers():
    # 32 layers, 8 kv heads, head_dim 128, bf16: 1K tokens = 134 MB, 128K tokens = 17.2 GB.
    kw = dict(kv_heads=8, head_dim=128, n_layers=32, dtype=jnp.bfloat16)
    assert state_bytes(kvpolicies.get("full"), max_len=1024, **kw).kv == 134_217_728
    assert round(state_bytes(kvpolicies.get("full"), max_len=131072, **kw).kv / 1e9, 1) == 17.2


def test_ring_state_size_does_not_depend_on_tokens_processed():
    cfg = LlamaConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
    m = Llama(cfg)
    toks = np.random.default_rng(0).integers(0, 40, 300)
    for pol in (kvpolicies.get("window", window=16), kvpolicies.get("sink", n_sink=4, window=16)):
        eng = Engine(m, pol, max_len=1000)
        sizes = []
        for n in (10, 100, 300):
            _, cache = eng.prefill(toks[None, :n], chunk=32)
            sizes.append(sum(tree_bytes(s).total for s in cache))
            live = np.asarray(cache[0].pos)
            assert (live >= 0).sum() == 2 * min(n, pol.capacity(1000))  # 2 layers
        assert sizes[0] == sizes[1] == sizes[2]
        assert sizes[0] == sum(
            state_bytes(pol, kv_heads=1, head_dim=8, max_len=1000, n_layers=2, dtype=jnp.float32).total for _ in [0]
        )


def test_eval_shape_allocates_nothing_for_huge_contexts():
    sb = state_bytes(kvpolicies.get("full"), kv_heads=8, head_dim=128, max_len=1 << 20, n_layers=80)
    assert sb.kv == 2 * 80 * 8 * 128 * (1 << 20) * 2
    assert jax.devices()  # still alive
