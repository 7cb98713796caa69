"""benchmarks.decode_speed's roofline arithmetic (the timings themselves are benchmarks, not tests):
the bytes a decode step must read are every weight plus the filled slots' keys, values and
positions, in closed form."""

from __future__ import annotations

import numpy as np

import kvpolicies
from benchmarks.decode_speed import read_bandwidth, step_read_bytes
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama

CFG = LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=96)


def test_step_reads_the_weights_and_the_filled_slots():
    model = Llama(CFG)
    head = 0 if CFG.tie_embeddings else 48 * 97  # an untied output head is read too
    n_params = sum(int(np.prod(v.shape)) for v in model.layers.values()) + 97 * 48 + 48 + head  # + embed, norm
    eng = Engine(model, kvpolicies.get("full"), max_len=64)
    got = step_read_bytes(model, eng.init_cache(1), ctx=31)  # 32 of 64 slots filled after the step
    per_slot = CFG.n_layers * (CFG.n_kv_heads * 2 * CFG.head_dim * 4 + 4)  # k, v float32; one int32 position
    assert got == {"weight_bytes": 4 * n_params, "kv_read_bytes": 32 * per_slot}
    sink = Engine(model, kvpolicies.get("sink", n_sink=2, window=14), max_len=64)
    assert step_read_bytes(model, sink.init_cache(1), ctx=31)["kv_read_bytes"] == 16 * per_slot  # all its slots


def test_read_bandwidth_is_a_rate():
    assert 1e8 < read_bandwidth(16 << 20, repeats=2) < 1e13
