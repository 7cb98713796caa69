"""The 8-device half of tests/models/test_sharding.py, run in its own process (XLA_FLAGS must give the
CPU 8 devices before jax is imported): a tiny random Llama with 4 kv heads on one device and on a
data=2 x model=4 mesh, the same inputs, the largest differences and the mesh run's layouts printed
as one JSON object for the test to check.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.refs.sharding_check all
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.refs.sharding_check host I 2 PORT

all: every registered policy but those COVERED by another's run and those APART, one per layer, then each policy
APART in a 2-layer model of its own (it, then full), then the fallback: 2 kv heads on model=4 and a batch of 1
on data=2, neither of which splits.
host: process I of 2, each with 4 CPU devices, joined by `jax.distributed.initialize` into one
data=2 x model=4 mesh (multi-host on one machine); prints what every process reads back.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from kvpolicies.prompt import PromptPhase, prompt_policy_of
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama
from models.reconstruct import RepeatPrompts
from models.sharding import make_mesh

REPEAT = RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11))  # kvzip's repeat prompts, any ids
MAX_LEN = 40



# Prompt scorers whose mesh run is their representative's: the same state (class, leaves and shapes:
# test_sharding checks it), the same select and compaction code; they differ only in a score computed
# for each batch row and kv head apart from the others (snapkv's pooled attention over its window, or a
# function of each head's own keys and values), so the mesh splits them as it splits the
# representative's. A policy whose scores mix heads or rows (adakv's pool, kvzip's model-wide choice,
# simlayerkv's layer test), draw random numbers (random, compactor's sketch) or read the model's weights
# (critical's W_o) stays in the mesh, as does every policy not named here.
COVERED = {"finch": "snapkv", "pyramidkv": "snapkv", "keydiff": "knorm", "lagkv": "knorm", "cur": "knorm",
           "qfilter": "knorm"}
# kvcompose chooses over every layer at once (its layers cannot share a model with other policies, nor its
# pass another reconstructor's): its decode state is observed's layout (Accumulated), covered by observed's run
COVERED |= {"kvcompose": "observed"}
# Policies checked in a 2-layer model of their own (the policy, then full), not in the model of every policy:
# kvgrad's gradient pass differentiates the whole model (each repeat input's backward through every layer),
# which in the model of every policy is a backward through all of its layers, compiled on one device and on
# the mesh; in its own model it runs the same code (the gradient through a layer after it) on the mesh.
APART = ("kvgrad",)


def instances(kv_heads: int, covered: bool = False) -> dict[str, kvpolicies.Policy]:
    """Every registered policy as the registry matrix (tests/refs/registry.py) builds it (limits that 24-32
    tokens cross), duo's head pattern widened to `kv_heads` heads (half retrieval, half streaming); without
    `covered`, those of COVERED left out."""
    from tests.refs.registry import REFERENCES

    out = {}
    for name in sorted(kvpolicies.POLICIES):
        if name in COVERED and not covered:
            continue
        if name not in REFERENCES:
            raise SystemExit(f"tests/refs/sharding_check.py: registered policy {name!r} has no instance in "
                             "tests/refs/registry.py REFERENCES")
        pol = REFERENCES[name][0][0]
        if name == "duo":
            pol = dataclasses.replace(pol, heads=tuple(int(h % 3 == 0) for h in range(kv_heads)))
        out[name] = pol
    return out


def layer_order(pols: dict[str, kvpolicies.Policy]) -> list[str]:
    """Every policy once, the layers that kvzip's reconstruction pass reads densely (full and the
    dense prompt phases) alternating with the others as far as they go, then side by side (the pass
    keeps layers of different prompt phases in different runs: `Reconstruct.phase`)."""
    dense = [n for n, p in pols.items() if isinstance(prompt_policy_of(p), (PromptPhase, kvpolicies.Full))]
    other = [n for n in pols if n not in dense]
    return [x for pair in zip(dense, other) for x in pair] + dense[len(other):] + other[len(dense):]


def max_diff(a, b) -> float:
    """Largest |a - b| over two pytrees of arrays, equal infinities counting as equal (inf if the
    structures or shapes differ)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b) or [x.shape for x in la] != [y.shape for y in lb]:
        return float("inf")
    out = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        d = np.where(same, 0.0, np.abs(np.where(same, 0.0, x) - np.where(same, 0.0, y)))
        out = max(out, float(np.max(np.nan_to_num(d, nan=np.inf), initial=0.0)))
    return out


def layout(tree) -> list[dict]:
    """Each array leaf: path, shape, spec, the shape one device holds, and every device's index."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = getattr(x.sharding, "spec", None)
        idx = {sh.device.id: [[sl.start or 0, x.shape[i] if sl.stop is None else sl.stop] for i, sl in enumerate(sh.index)]
               for sh in x.addressable_shards}
        out.append({"path": jax.tree_util.keystr(path), "shape": list(x.shape),
                    "shard": list(x.addressable_shards[0].data.shape),
                    "spec": None if spec is None else [None if a is None else str(a) for a in spec], "index": idx})
    return out


def per_layer(cache) -> list:
    """A cache's runs split into one state per layer, in layer order."""
    return [jax.tree.map(lambda a, i=i: a[i], run) for run in cache for i in range(jax.tree.leaves(run)[0].shape[0])]


def decode(eng: Engine, state, n: int) -> tuple[np.ndarray, list]:
    """n greedy ids after a compressed state's first one, and every layer's state after them: layer by
    layer (`Engine._decode_layers`, a one-device engine's default) or the fused scan (`decode_loop="scan"`,
    and any engine on a mesh). The state stays usable."""
    first = jnp.argmax(state.logits, axis=-1).astype(jnp.int32)
    pos = jnp.full(first.shape, state.length, jnp.int32)
    reach = eng._reach(state.length + n)
    if eng.decode_loop == "layers" and eng.placement is None:
        ids, states = eng._decode_layers(state.cache, first, pos, n, reach)
        return np.asarray(ids), states
    ids, cache = eng._decode_n(eng.params, jax.tree.map(jnp.copy, state.cache), first, pos, n, reach)
    return np.asarray(ids), per_layer(cache)


def run(eng: Engine, stream: np.ndarray, prompt: np.ndarray, n: int, states: bool = True) -> dict:
    """Streaming NLL and cache; prompt logits, the compressed cache and n greedy ids after it
    (`continue_generate`); with `states`, every layer's state after those n ids (`decode`: layer
    by layer on one device, the scan on a mesh)."""
    nll, stream_cache = eng.score(stream, chunk=16, return_cache=True)
    state = eng.compress(eng.prompt(prompt))
    ids = eng.continue_generate(state, np.zeros((prompt.shape[0], 0), np.int32), n)
    out = {"nll": nll, "stream_cache": stream_cache, "logits": state.logits, "cache": state.cache, "ids": ids}
    if states:
        again, out["decoded"] = decode(eng, state, n - 1)
        assert np.array_equal(again, ids[:, 1:])
    return out


def compare(model: Llama, policies, mesh, batch: int, seed: int) -> dict:
    """One device against `mesh` on the same inputs: the largest differences, and the mesh run's layouts."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, model.cfg.vocab_size, (batch, 33))  # 32 fed: 2 chunks of 16
    prompt = rng.integers(0, model.cfg.vocab_size, (batch, 24))
    one = run(Engine(model, policies, MAX_LEN, repeat=REPEAT), stream, prompt, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Engine(model, policies, MAX_LEN, repeat=REPEAT, mesh=mesh)
        many = run(eng, stream, prompt, 8)
    return {
        "nll": max_diff(one["nll"], many["nll"]), "logits": max_diff(one["logits"], many["logits"]),
        "stream_cache": [max_diff(a, b) for a, b in zip(one["stream_cache"], many["stream_cache"])],  # per layer
        "cache": [max_diff(a, b) for a, b in zip(one["cache"], many["cache"])],
        # every layer after the n greedy steps: one device layer by layer, the mesh through the scan
        "decoded": [max_diff(a, b) for a, b in zip(one["decoded"], many["decoded"], strict=True)],
        "ids_equal": bool(np.array_equal(one["ids"], many["ids"])), "ids": one["ids"].tolist(),
        "nll_mean": float(np.mean(one["nll"])), "nll_spread": float(np.std(one["nll"])),
        "cache_layout": [layout(c) for c in many["cache"]], "stream_layout": [layout(c) for c in many["stream_cache"]],
        "param_layout": layout(eng.params[0]), "logits_sharding": str(jax.tree.leaves(many["logits"])[0].sharding),
        "warnings": [str(w.message) for w in caught], "traces": dict(eng.traces),  # the mesh engine's
    }


def main() -> None:
    t0 = time.perf_counter()
    pols = instances(4)
    apart = {name: pols.pop(name) for name in APART}
    order = layer_order(pols)
    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=len(order), n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64,
                      qkv_bias=True)
    mesh = make_mesh(2, 4)
    out = {"devices": len(jax.devices()), "order": order}
    out["mesh"] = compare(Llama(cfg), tuple(pols[n] for n in order), mesh, 2, 0)
    two = dataclasses.replace(cfg, n_layers=2)
    out["apart"] = {name: compare(Llama(two), (pol, kvpolicies.get("full")), mesh, 2, 2) for name, pol in apart.items()}
    # 2 kv heads on model=4 and a batch of 1 on data=2: neither splits (a warning)
    small = dataclasses.replace(cfg, n_layers=2, n_heads=4, n_kv_heads=2)
    out["fallback"] = compare(Llama(small), pols["sink"], mesh, 1, 1)
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out))


def host_inputs() -> tuple[Llama, tuple[kvpolicies.Policy, ...], np.ndarray, np.ndarray]:
    """The multi-host check's model (2 layers, 4 kv heads), policies (snapkv, h2o), stream and prompt."""
    cfg = LlamaConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64)
    pols = instances(4)
    rng = np.random.default_rng(2)
    return Llama(cfg), (pols["snapkv"], pols["h2o"]), rng.integers(0, 128, (2, 33)), rng.integers(0, 128, (2, 24))


def host(pid: int, nproc: int, port: int) -> None:
    """Process `pid` of `nproc` on this machine, each with its own CPU devices, joined by
    jax.distributed into one data=2 x model=4 mesh: the same Engine code as on one host."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)
    model, pols, stream, prompt = host_inputs()
    out = run(Engine(model, pols, MAX_LEN, mesh=make_mesh(2, 4)), stream, prompt, 8, states=False)
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
                      "local_devices": len(jax.local_devices()), "nll": np.asarray(out["nll"]).tolist(),
                      "logits": np.asarray(out["logits"]).tolist(), "ids": out["ids"].tolist()}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["host"] and len(sys.argv) == 5:
        host(*map(int, sys.argv[2:]))
    elif sys.argv[1:] == ["all"]:
        main()
    else:
        raise SystemExit("usage: python -m tests.refs.sharding_check all|host PROCESS PROCESSES PORT")
