"""A tiny random Llama's outputs under whatever $XLA_FLAGS this process starts with, for
tests/evals/test_compiles.py to compare across compiler flags, bit for bit: streaming NLL under int4
keys and values (the tiny model: also the full cache and a sliding window; chunks of 7); a staged prompt in pieces of
16, 8, 4 and 2 tokens (a real model: 512, 64, 4) compressed by SnapKV and ExpectedAttention, then a question and greedy ids.

    python -m tests.refs.flag_outputs OUT.npz
"""

from __future__ import annotations

import sys

import numpy as np


def outputs(which: str = "tiny") -> dict[str, np.ndarray]:
    import jax

    import kvpolicies
    from kvpolicies.compat import kvpress
    from models.config import LlamaConfig
    from models.engine import Engine
    from models.llama import Llama

    if which != "tiny":  # a model of evals.peer's (smollm2, qwen)
        from evals import peer, zoo

        model, _ = zoo.load_model(peer.parse([f"model={which}", "kvpress=false"]).mconf)
    else:
        model = Llama(LlamaConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=96))
    n = 50 if which == "tiny" else 600
    rng = np.random.default_rng(7)
    text = rng.integers(0, 97, n).astype(np.int32)
    out: dict[str, np.ndarray] = {}
    scored = [("int4", kvpolicies.get("full", codec="int4"))]  # 4-bit codes: an ulp of a key flips some
    if which == "tiny":
        scored += [("full", kvpolicies.get("full")), ("window", kvpolicies.get("window", window=16))]
    for name, pol in scored:
        out[f"nll_{name}"] = np.asarray(Engine(model, pol, max_len=n + 14).score(text, chunk=7 if n < 100 else 64))
    ctx, question = text[None, :n - 20], text[None, n - 20:n - 14]
    for press in ("SnapKVPress", "ExpectedAttentionPress"):
        eng = Engine(model, kvpress(press, 0.5, n_layers=model.cfg.n_layers, max_new=12), max_len=n + 14)
        st = eng.compress(eng.prompt(ctx, chunk=[16, 8, 4, 2] if n < 100 else [512, 64, 4]))
        out[f"{press}_logits"] = np.asarray(st.logits)
        for i, leaf in enumerate(jax.tree.leaves(st.cache)):
            out[f"{press}_state{i}"] = np.asarray(leaf)
        out[f"{press}_ids"] = np.asarray(eng.continue_generate(st, question, 6))
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m tests.refs.flag_outputs OUT.npz [tiny|smollm2|qwen]")
    np.savez(sys.argv[1], **outputs(*sys.argv[2:]))
