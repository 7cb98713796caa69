"""SmolLM2's prompt step over two processes joined by `jax.distributed` (one CPU device each, one
data=1 x model=2 mesh: the MLP and the vocabulary split across the processes, the 3 kv heads
replicated), for tests/models/test_distributed.py to hold against one process on one device.

    python -m tests.refs.distributed_step host I 2 PORT     # process I of 2; prints its last logits as JSON
"""

from __future__ import annotations

import json
import sys

import numpy as np

PROMPT = np.array([[1, 504, 3458, 282, 253, 4193, 30, 378, 3456, 2114, 314, 1489, 8049, 28, 284, 260]], np.int32)
MAX_LEN = 32


def last_logits(mesh=None) -> np.ndarray:
    """SmolLM2 (float32) under `full`: the last logits [1, V] of PROMPT's prompt step."""
    import kvpolicies
    from models.engine import Engine
    from models.loading import load_default_model

    model, _ = load_default_model("float32")
    eng = Engine(model, kvpolicies.get("full"), MAX_LEN, mesh=mesh)
    return np.asarray(eng.prompt(PROMPT).logits)


def host(pid: int, nproc: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)
    from models.sharding import make_mesh

    logits = last_logits(make_mesh(data=1, model=nproc))
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": len(jax.devices()), "logits": logits.tolist()}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["host"] and len(sys.argv) == 5:
        host(*map(int, sys.argv[2:]))
    else:
        raise SystemExit("usage: python -m tests.refs.distributed_step host PROCESS PROCESSES PORT")
