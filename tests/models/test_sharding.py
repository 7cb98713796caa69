"""models/sharding.py: the partition rules (every weight, cache leaves, inputs), the clear errors, and
the 8-device checks: on a data=2 x model=4 mesh, every registered policy equals one device to 1e-5
(streaming NLL and cache, prompt logits, the compressed cache, greedy ids) with arrays really split.

The 8 CPU devices need XLA_FLAGS before jax is imported, so that half runs tests/refs/sharding_check.py
in a subprocess, once for the unit tests (`all`: one model with one layer per registered policy, one
compile serving them all, kvgrad in a 2-layer model of its own, then the fallback where neither the kv
heads nor a batch of 1 split; about 190 s of CPU on the loaded machine, beside the other pytest-xdist
worker's files); the two-process `jax.distributed` run is slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import kvpolicies
from models import sharding as S
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5

SMOLLM2 = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
                      tie_embeddings=True)
QWEN_05B = LlamaConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864,
                       tie_embeddings=True, qkv_bias=True)


def mesh(data: int, model: int) -> AbstractMesh:
    """A mesh shape without devices (the rules only read its axis sizes)."""
    return AbstractMesh((data, model), (S.DATA, S.MODEL))


# -- the rules ------------------------------------------------------------------------------------


def test_qwen_weights_split_by_logical_axes_heads_with_their_groups():
    specs = S.param_specs(QWEN_05B, mesh(4, 2))  # 2 kv heads on model=2: one kv head and its 7 query heads each
    heads = {"wq": P(None, None, "model"), "wk": P(None, None, "model"), "wv": P(None, None, "model"),
             "wo": P(None, "model", None), "bq": P(None, "model"), "bk": P(None, "model"), "bv": P(None, "model")}
    mlp = {"w_gate": P(None, None, "model"), "w_up": P(None, None, "model"), "w_down": P(None, "model", None)}
    replicated = {n: P(*[None] * len(S.LOGICAL[n])) for n in ("attn_norm", "mlp_norm", "final_norm")}
    assert specs == {"embed": P("model", None), **heads, **mlp, **replicated}  # tied: no lm_head
    assert "data" not in str(specs)  # weights are replicated over the data axis
    # a contiguous half of wq's N*D = (K G D) columns is exactly kv head k's G query heads
    n_d = QWEN_05B.n_heads * QWEN_05B.head_dim
    g = QWEN_05B.groups
    for k in range(2):
        cols = np.arange(k * n_d // 2, (k + 1) * n_d // 2)
        assert set(cols // QWEN_05B.head_dim // g) == {k}


def test_kv_heads_that_do_not_divide_replicate_attention_only():
    specs = S.param_specs(SMOLLM2, mesh(1, 2))  # 3 kv heads on model=2
    assert all(specs[n] == P(None, None, None) for n in ("wq", "wk", "wv", "wo"))
    assert specs["w_gate"] == P(None, None, "model") and specs["w_down"] == P(None, "model", None)
    assert specs["embed"] == P("model", None)
    assert S.axis_rules(SMOLLM2, mesh(1, 3))["kv_heads"] == "model"  # 3 divides by 3
    odd = LlamaConfig(vocab_size=97, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=10)
    assert S.axis_rules(odd, mesh(1, 4)) == {"layers": None, "heads": None, "kv_heads": None, "mlp": None,
                                              "vocab": None}
    assert S.axis_rules(QWEN_05B, mesh(8, 1)) == {"layers": None, "heads": None, "kv_heads": None, "mlp": None,
                                                  "vocab": None}  # a model axis of 1 splits nothing
    gemma = LlamaConfig(vocab_size=64, d_model=8, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=8,
                        qk_norm=True, post_norms=True)
    g = S.param_specs(gemma, mesh(1, 2))
    assert g["lm_head"] == P(None, "model") and g["q_norm"] == P(None, None) and g["post_mlp_norm"] == P(None, None)


@pytest.mark.parametrize("shape, want", [
    ((30, 4, 2, 4096, 64), P(None, "data", "model")),  # k/v [L, B, K, S, D]
    ((30, 64, 2, 16, 64), P(None, None, "model")),  # paged's block pool [L, NB, K, blk, D]: any row's blocks
    ((30, 64), P()),  # its refcounts [L, NB]
    ((30, 4, 1, 4096), P(None, "data")),  # positions shared by the heads (Kp = 1)
    ((30, 4, 2, 4096), P(None, "data", "model")),  # per-head positions, scores
    ((30, 4, 2, 1, 64, 64), P(None, "data", "model")),  # expected's query statistics
    ((30, 4), P(None, "data")),  # per-row counters
    ((30, 3, 2, 16, 64), P(None, None, "model")),  # a batch of 3 on data=2: replicated (batch=3 below)
    ((30, 4, 1, 16, 64), P(None, "data")),  # duo's one retrieval head of 2
    ((30,), P()),
])
def test_cache_leaves_batch_on_data_kv_heads_on_model(shape, want):
    batch = 3 if shape[1:2] == (3,) else 4
    assert S.cache_spec(shape, QWEN_05B, mesh(2, 2), batch) == want


def test_a_state_of_another_layout_splits_only_its_k_and_v_heads():
    """paged's pool: k/v [L, NB, K, blk, D] (heads on model), pos [L, NB, blk] with blk == K (not
    heads), table [L, B, M] (batch on data), refs [L, NB], overflow [L]."""
    from kvpolicies.paged import PagedState

    pl = S.Placement(QWEN_05B, mesh(2, 2))  # the rules without devices
    st = PagedState(k=jax.ShapeDtypeStruct((3, 8, 2, 2, 64), np.float32), v=jax.ShapeDtypeStruct((3, 8, 2, 2, 64),
                    np.float32), pos=jax.ShapeDtypeStruct((3, 8, 2), np.int32),
                    table=jax.ShapeDtypeStruct((3, 4, 5), np.int32), refs=jax.ShapeDtypeStruct((3, 8), np.int32),
                    overflow=jax.ShapeDtypeStruct((3,), np.int32))
    (got,) = jax.tree.map(lambda sh: sh.spec, pl.cache_shardings((st,), batch=4))
    assert (got.k, got.v, got.pos, got.table, got.refs, got.overflow) == (
        P(None, None, "model"), P(None, None, "model"), P(), P(None, "data"), P(), P())
    slot = kvpolicies.SlotState(k=jax.ShapeDtypeStruct((3, 4, 2, 16, 64), np.float32),
                                v=jax.ShapeDtypeStruct((3, 4, 2, 16, 64), np.float32),
                                pos=jax.ShapeDtypeStruct((3, 4, 2, 16), np.int32))
    (got,) = pl.cache_shardings((slot,), batch=4)
    assert got.pos.spec == P(None, "data", "model")  # per-head positions of a SlotState: heads


def test_inputs_split_on_data_when_the_batch_divides():
    assert S.batch_spec((4, 16), mesh(2, 2)) == P("data")
    assert S.batch_spec((1, 16), mesh(2, 2)) == P()
    assert S.batch_spec((), mesh(2, 2)) == P()


# -- clear errors, before any compute ---------------------------------------------------------------


def test_mesh_errors_name_the_devices():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"mesh data=2 x model=4 = 8 devices, but there are {n}: \[.*Device"):
        S.make_mesh(2, 4, devices=jax.devices()[:1])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            S.make_mesh(bad, 1)
    with pytest.raises(ValueError, match=r"must be a jax.sharding.Mesh with axes \('data', 'model'\) or \[data, model\]"):
        S.as_mesh("2x4")
    other = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"mesh axes \('x',\): must be named"):
        S.as_mesh(other)


def test_engine_on_a_mesh_too_large_fails_before_compiling():
    model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=16))
    want = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=rf"mesh data=1 x model={want} = {want} devices, but there are"):
        Engine(model, kvpolicies.get("full"), 16, mesh=[1, want])
    eng = Engine(model, kvpolicies.get("full"), 16, mesh=[1, 1])
    with pytest.raises(ValueError, match="already on a mesh"):
        eng.shard([1, 1])
    assert not eng.traces  # nothing compiled


# -- 8 devices: sharded equals one device ---------------------------------------------------------------


def eight_devices(mode: str) -> dict:
    """tests/refs/sharding_check.py `mode` in a process with 8 CPU devices; its JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # -O0: XLA's CPU backend compiles faster, same results (scripts/test.sh)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                        " --xla_backend_optimization_level=0").strip()
    proc = subprocess.run([sys.executable, "-m", "tests.refs.sharding_check", mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    return out


def check_equal(r: dict, order: list[str]) -> None:
    """Streaming NLL, prompt logits and every layer's caches within TOL; the greedy ids identical.
    The one-device engine generates layer by layer and the mesh's through the fused scan, so the ids
    and every layer's state after them (`decoded`) also check the two decode loops against each other."""
    assert r["nll"] <= TOL and r["logits"] <= TOL, (r["nll"], r["logits"])
    assert r["ids_equal"]
    for name, stream, compressed in zip(order, r["stream_cache"], r["cache"], strict=True):
        assert stream <= TOL and compressed <= TOL, (name, stream, compressed)  # ints (positions) exactly
    assert len(r["decoded"]) >= len(order) and max(r["decoded"]) <= TOL, r["decoded"]  # per layer
    assert 4.0 < r["nll_mean"] < 6.0 and r["nll_spread"] > 0.01  # a random model over 128 ids: ~log 128, not constant


def check_split(r: dict, order: list[str]) -> None:
    """Weights split by their logical axes, GQA groups together, every cache's batch on data and its
    K kv heads on model (4 kv heads, batch 2 on data=2 x model=4)."""
    n = len(order)  # layers: one per policy
    params = {e["path"].split("'")[-2]: e for e in r["param_layout"]}
    assert params["wq"]["spec"] == [None, None, "model"] and params["wq"]["shard"] == [n, 32, 16]  # N*D = 64 / 4
    assert params["wk"]["shard"] == [n, 32, 8] and params["wo"]["shard"] == [n, 16, 32]
    assert params["w_down"]["shard"] == [n, 16, 32] and params["lm_head"]["shard"] == [32, 32]
    assert params["attn_norm"]["shard"] == [n, 32]  # replicated
    # GQA groups together: on every device, wq's query heads are those of its wk kv heads (G = 2, D = 8)
    for dev, (_, _, (q0, q1)) in params["wq"]["index"].items():
        (_, _, (k0, k1)) = params["wk"]["index"][dev]
        assert (q0 // 16, q1 // 16) == (k0 // 8, k1 // 8), dev
    for name, layers in zip(order, r["cache_layout"], strict=True):
        for leaf in layers:
            spec = leaf["spec"] + [None] * (len(leaf["shape"]) - len(leaf["spec"]))  # trailing Nones may be left out
            if len(leaf["shape"]) < 2:  # a flag per layer (paged's overflow): whole on every device
                assert leaf["shard"] == leaf["shape"], (name, leaf)
            elif leaf["shape"][1] == 2:  # the batch of 2 on data=2
                assert spec[1] == "data" and leaf["shard"][1] == 1, (name, leaf)
            else:  # paged's block pool [L, NB, ..] (blocks of any row) and its refcounts
                assert name == "paged" and spec[1] is None and leaf["shard"][1] == leaf["shape"][1], (name, leaf)
            heads = leaf["shape"][2] if len(leaf["shape"]) > 2 else None
            if name == "paged" and not leaf["path"].startswith((".k", ".v")):  # pos [L, NB, blk]: not heads
                heads = None if heads is None else -1
            if heads == 4:  # the K kv heads: one per device on model=4
                assert spec[2] == "model" and leaf["shard"][2] == 1, (name, leaf)
            elif heads is not None:  # Kp = 1 positions, duo's head subsets, paged's block slots
                assert spec[2] is None and leaf["shard"][2] == leaf["shape"][2], (name, leaf)
        if name != "duo":  # duo stores its retrieval and streaming heads apart (2 + 2): not the K axis; think: .k.kept
            assert any(leaf["path"].endswith(("k", "codes", ".k.kept")) and leaf["shard"][2] == 1 for leaf in layers), name
    assert "'data'" in r["logits_sharding"]  # the steps ran on the mesh


@pytest.fixture(scope="module")
def eight():
    return eight_devices("all")


def test_every_policy_on_a_data_x_model_mesh_equals_one_device(eight):
    """Every registered policy, one per layer of one model, but the prompt scorers `COVERED` by a
    representative's run (their states are the representative's, leaf by leaf) and those `APART`
    (kvgrad: its gradient pass differentiates the whole model), each checked in a 2-layer model of
    its own (it, then full)."""
    from tests.refs.sharding_check import APART, COVERED, instances

    assert sorted(eight["order"]) == sorted(set(kvpolicies.POLICIES) - set(COVERED) - set(APART))
    assert sorted(eight["apart"]) == sorted(APART) and set(APART) <= set(kvpolicies.POLICIES)
    for name, r in eight["apart"].items():
        check_equal(r, [name, "full"])
        check_split(r, [name, "full"])
        assert r["warnings"] == [] and r["traces"].get("gradient", 0) >= 1, name  # the mesh ran kvgrad's gradient pass
    pols = instances(4, covered=True)
    for name, rep in COVERED.items():
        a, b = (jax.eval_shape(lambda p=pols[n]: p.init(2, 4, 8, jnp.float32, 40)) for n in (name, rep))
        assert type(a) is type(b) and jax.tree.structure(a) == jax.tree.structure(b), name
        assert [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(b)], name
    check_equal(eight["mesh"], eight["order"])
    check_split(eight["mesh"], eight["order"])
    assert eight["mesh"]["warnings"] == []


def test_heads_that_do_not_split_and_a_batch_of_one_fall_back_to_replication(eight):
    r = eight["fallback"]
    check_equal(r, ["sink"])
    assert len(r["warnings"]) == 1 and "2 kv heads do not divide" in r["warnings"][0]
    params = {e["path"].split("'")[-2]: e for e in r["param_layout"]}
    assert params["wq"]["spec"] == [None, None, None] and params["w_gate"]["spec"] == [None, None, "model"]
    for leaf in r["cache_layout"][0]:
        assert leaf["shard"] == leaf["shape"], leaf  # batch 1, 2 kv heads: whole on every device


@pytest.mark.slow
def test_two_processes_joined_by_jax_distributed_run_the_same_code_path():
    """Multi-host on one machine: 2 processes x 4 CPU devices, `jax.distributed.initialize`, one
    data=2 x model=4 mesh over both; every process reads back the one-device numbers."""
    import socket

    from tests.refs.sharding_check import MAX_LEN, host_inputs, run

    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                        " --xla_backend_optimization_level=0").strip()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.refs.sharding_check", "host", str(i), "2", str(port)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    model, pols, stream, prompt = host_inputs()
    one = run(Engine(model, pols, MAX_LEN), stream, prompt, 8)
    for i, out in enumerate(outs):
        assert (out["process"], out["processes"], out["devices"], out["local_devices"]) == (i, 2, 8, 4)
        np.testing.assert_allclose(out["nll"], one["nll"], atol=TOL, rtol=0)
        np.testing.assert_allclose(out["logits"], one["logits"], atol=TOL, rtol=0)
        np.testing.assert_array_equal(out["ids"], one["ids"])
