"""KVzip's prefill overhead: the context-reconstruction pass next to the prefill it follows.

    python -m benchmarks.kvzip_overhead --model smollm2 --tokens 4096
    python -m benchmarks.kvzip_overhead --model qwen --tokens 4096

One context of `--tokens` tokens of the default text inside the model's chat template, held by
kvzip's prompt phase (`Engine.prompt`), then `Engine.compress` (the reconstruction pass over
chunks of 2,000 tokens, then the head-wise compression). Each is run twice and the second, warm
run is timed (compilation excluded); reports seconds, the tokens each fed and the ratio
compress / prefill. Wall-clock on a shared machine: read the ratio, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

import kvpolicies
from models.engine import Engine
from models.reconstruct import repeat_prompts


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready((out.cache, out.logits))  # a Prompted state: wait for its arrays
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen", "gemma3"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.25, help="kept fraction of the context")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    args = ap.parse_args(argv)

    from evals import zoo
    from evals.data import default_text

    import yaml

    conf = pathlib.Path(__file__).resolve().parents[1] / "configs" / "model" / f"{args.model}.yaml"
    mcfg = yaml.safe_load(conf.read_text())
    model, tok = zoo.load_model(mcfg)
    ids = np.asarray(tok.encode(default_text()), np.int32)[: args.tokens][None]
    pol = kvpolicies.get("kvzip", budget=max(int(args.budget * args.tokens), 5))
    eng = Engine(model, pol, max_len=args.tokens + 64, repeat=repeat_prompts(tok))
    res = {}
    for run in ("cold", "warm"):
        state, t_prefill = _timed(lambda: eng.prompt(ids, chunk=args.chunk))
        before, pads = eng.reconstruct_tokens, eng.reconstruct_pad_tokens
        _, t_compress = _timed(lambda: eng.compress(state))
        res[run] = dict(prefill_s=round(t_prefill, 2), compress_s=round(t_compress, 2),
                        prefill_tokens=int(ids.size), reconstruct_tokens=eng.reconstruct_tokens - before,
                        reconstruct_pad_tokens=eng.reconstruct_pad_tokens - pads)
    w = res["warm"]
    res["overhead"] = round(w["compress_s"] / w["prefill_s"], 2)
    res.update(model=args.model, tokens=args.tokens, policy=repr(pol))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
