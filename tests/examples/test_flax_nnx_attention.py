"""A user's own Flax model calling `kvpolicies.attend`: examples/flax_nnx_attention.py (NNX) and the
linen snippet of README's "Using a policy in your own Flax model", checked against dense attention.

Under `full` the NNX layer equals its own dense causal path (prefill + decode, chunks); under
`sink` it equals an independent float64 numpy oracle with StreamingLLM's visibility mask; wrong
masks, RoPE positions or head grouping are shown to give different answers, so the checks can fail.

Shapes: B batch, T tokens, E model width, N query heads = K kv heads x G groups, D head dim.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvpolicies

ROOT = Path(__file__).resolve().parents[2]
B, T, E, N, K = 2, 20, 32, 4, 2  # D = E // N = 8, G = 2
N_SINK, WINDOW = 2, 6
ATOL = 1e-5


def load_example():
    spec = importlib.util.spec_from_file_location("flax_nnx_attention", ROOT / "examples" / "flax_nnx_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = load_example()


DOCS = ["README.md", "docs/guide/your-model.md"]  # both show the NNX lines and the linen snippet


def readme_blocks(doc: str = "README.md") -> list[str]:
    """The ```python blocks of the section "Using a policy in your own Flax model" of `doc`."""
    text = (ROOT / doc).read_text()
    start = re.search(r"^#+ Using a policy in your own Flax model", text, flags=re.M).end()
    end = min(i for i in (text.find("\n# ", start), text.find("\n## ", start), text.find("\n### ", start),
                          len(text)) if i >= 0)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


# ---- an independent float64 numpy oracle ---------------------------------------------------------

def causal(p, j):
    return j <= p


def sink_rule(p, j):
    """StreamingLLM: the first N_SINK tokens and the newest WINDOW (p itself included)."""
    return j <= p and (j < N_SINK or j > p - WINDOW)


def numpy_attention(x, wq, wk, wv, wo, n_heads, n_kv, visible, theta=10000.0, kv_head=None, shift=0):
    """x [B, T, E] through projections (kernels [in, out]), RoPE (complex form of rotate-half) at
    positions 0..T-1 (+shift for queries), softmax over the keys with visible(p, j); query head n
    reads kv head n // G unless kv_head(n) says otherwise."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    d = wq.shape[1] // n_heads
    q = (x @ wq).reshape(b, t, n_heads, d)  # [B, T, N, D]
    k = (x @ wk).reshape(b, t, n_kv, d)  # [B, T, K, D]
    v = (x @ wv).reshape(b, t, n_kv, d)  # [B, T, K, D]

    def rope(a, s):
        ang = (np.arange(t) + s)[:, None] * theta ** (-np.arange(0, d, 2) / d)  # [T, D/2]
        z = (a[..., : d // 2] + 1j * a[..., d // 2:]) * np.exp(1j * ang)[None, :, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    q, k = rope(q, shift), rope(k, 0)
    mask = np.array([[visible(p, j) for j in range(t)] for p in range(t)])  # [T, T]
    kv_head = kv_head or (lambda n: n // (n_heads // n_kv))
    out = np.empty_like(q)
    for n in range(n_heads):
        kh = kv_head(n)
        logits = np.einsum("BTD,BSD->BTS", q[:, :, n], k[:, :, kh]) / np.sqrt(d)  # [B, T, S]
        logits = np.where(mask, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("BTS,BSD->BTD", w / w.sum(-1, keepdims=True), v[:, :, kh])
    return out.reshape(b, t, -1) @ wo  # [B, T, E]


def nnx_weights(layer):
    return [np.asarray(m.kernel[...], np.float64) for m in (layer.q, layer.k, layer.v, layer.o)]


# ---- running the layers ---------------------------------------------------------------------------

def inputs(seed=1):
    x = jax.random.normal(jax.random.key(seed), (B, T, E), jnp.float32)  # [B, T, E]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))  # [B, T]
    return x, pos


def run_chunks(step, state, x, pos, chunks):
    """Feed x in chunks of the given sizes (the last one cycles); returns y [B, T, E] as numpy."""
    ys, start, i = [], 0, 0
    while start < x.shape[1]:
        c = min(chunks[min(i, len(chunks) - 1)], x.shape[1] - start)
        y, state = step(x[:, start:start + c], pos[:, start:start + c], state)
        ys.append(np.asarray(y))
        start, i = start + c, i + 1
    return np.concatenate(ys, axis=1)


def run_nnx(policy, chunks, seed=0):
    layer = ex.Attention(E, N, K, policy, rngs=nnx.Rngs(seed))
    x, pos = inputs()
    state = policy.init(B, K, E // N, jnp.float32, T)
    y = run_chunks(lambda xc, pc, s: ex.step(layer, xc, pc, s), state, x, pos, chunks)
    return layer, x, pos, y


CHUNKINGS = {"prefill5+decode": [5, 1], "one_by_one": [1], "chunks": [3, 7, 1, 4, 5], "whole": [T]}


# ---- (a) full: equals the layer's own dense causal attention -------------------------------------

@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_full_equals_dense(chunks):
    layer, x, pos, y = run_nnx(kvpolicies.get("full"), chunks)
    dense = np.asarray(layer.dense(x, pos))  # [B, T, E]
    np.testing.assert_allclose(y, dense, rtol=0, atol=ATOL)
    assert np.abs(dense).max() > 0.1  # not trivially small


def test_dense_path_is_right_and_checks_can_fail():
    """The example's dense path equals the numpy oracle; a wrong mask, RoPE offset or head grouping does not."""
    layer = ex.Attention(E, N, K, kvpolicies.get("full"), rngs=nnx.Rngs(0))
    x, pos = inputs()
    dense = np.asarray(layer.dense(x, pos))
    w = nnx_weights(layer)
    np.testing.assert_allclose(dense, numpy_attention(x, *w, N, K, causal), rtol=0, atol=ATOL)
    wrong = {
        "sees one future token": numpy_attention(x, *w, N, K, lambda p, j: j <= p + 1),
        "query rotated one position late": numpy_attention(x, *w, N, K, causal, shift=1),
        "head n reads kv head n % K": numpy_attention(x, *w, N, K, causal, kv_head=lambda n: n % K),
    }
    for name, ref in wrong.items():
        assert np.abs(dense - ref).max() > 1e-3, name


# ---- (b) sink: equals a numpy oracle with the StreamingLLM mask ----------------------------------

@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_sink_equals_numpy_oracle(chunks):
    policy = kvpolicies.get("sink", n_sink=N_SINK, window=WINDOW, positions="original")
    layer, x, _, y = run_nnx(policy, chunks)
    w = nnx_weights(layer)
    np.testing.assert_allclose(y, numpy_attention(x, *w, N, K, sink_rule), rtol=0, atol=ATOL)
    wrong = {
        "full causal": causal,
        "window one token wider": lambda p, j: j <= p and (j < N_SINK or j >= p - WINDOW),
        "no sinks": lambda p, j: j <= p and j > p - WINDOW,
    }
    for name, rule in wrong.items():
        assert np.abs(y - numpy_attention(x, *w, N, K, rule)).max() > 1e-3, name


# ---- (c) the example's main ------------------------------------------------------------------------

def test_example_main_runs(capsys):
    diff = np.asarray(ex.main())  # prompt 60, 12 decode steps, sink 4 + 64 vs full
    out = capsys.readouterr().out
    assert "cache bytes" in out and "position 71" in out
    assert diff.shape == (12,)
    assert diff[:8].max() < ATOL  # positions 60..67: nothing evicted yet, sink == full
    assert diff[8:].min() > 1e-3  # from position 68 on the window has dropped tokens


# ---- README: the NNX lines shown are the example's; the linen snippet works ----------------------

@pytest.mark.parametrize("doc", DOCS)
def test_readme_nnx_lines_are_the_example(doc):
    nnx_block = readme_blocks(doc)[0]
    source = (ROOT / "examples" / "flax_nnx_attention.py").read_text()
    lines = [ln.strip() for ln in nnx_block.splitlines() if ln.strip() and not ln.strip().startswith("...")]
    assert "kvpolicies.attend(" in nnx_block
    missing = [ln for ln in lines if ln not in source]
    assert not missing, f"README lines not in the example: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_readme_linen_snippet_equals_numpy_oracle(doc):
    blocks = readme_blocks(doc)
    assert len(blocks) == 2, "expected the NNX block and the linen block"
    mod = types.ModuleType("readme_linen")
    sys.modules[mod.__name__] = mod  # linen modules are dataclasses: their module must be importable
    exec(compile(blocks[1], "README.md (linen)", "exec", dont_inherit=True), mod.__dict__)
    ns = mod.__dict__
    policy = kvpolicies.get("sink", n_sink=N_SINK, window=WINDOW, positions="original")
    layer = ns["Attention"](n_heads=N, n_kv_heads=K, head_dim=E // N, policy=policy)
    x, pos = inputs()
    state = policy.init(B, K, E // N, jnp.float32, T)
    params = layer.init(jax.random.key(0), x[:, :1], pos[:, :1], state)["params"]
    apply = jax.jit(layer.apply)
    y = run_chunks(lambda xc, pc, s: apply({"params": params}, xc, pc, s), state, x, pos, [5, 1])
    w = [np.asarray(params[n]["kernel"], np.float64) for n in ("q", "k", "v", "o")]
    w = [a.reshape(E, -1) for a in w[:3]] + [w[3].reshape(-1, E)]  # [E, H*D] and [N*D, E]
    np.testing.assert_allclose(y, numpy_attention(x, *w, N, K, sink_rule), rtol=0, atol=ATOL)
    assert np.abs(y - numpy_attention(x, *w, N, K, causal)).max() > 1e-3
