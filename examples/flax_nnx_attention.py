"""Your own Flax NNX attention layer, made KV-cache-policy-aware with one call to `kvpolicies.attend`.

Shapes: B batch, T new tokens, E model width, N query heads = K kv heads x G groups, D head dim.

The layer keeps its projections; the cache is the policy's state, passed in and returned
explicitly (a pytree of arrays, so the step jits and compiles once). `dense` is the same layer
written as plain causal softmax attention over a whole sequence, the reference the policy path
is checked against (tests/examples/test_flax_nnx_attention.py). Run: `python examples/flax_nnx_attention.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kvpolicies


class Attention(nnx.Module):
    """Multi-head self-attention with grouped-query heads (GQA/MQA when n_kv_heads < n_heads) and RoPE."""

    def __init__(self, dim, n_heads, n_kv_heads, policy, *, theta=10000.0, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q = nnx.Linear(dim, n_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(dim, n_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(dim, n_kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(n_heads * self.head_dim, dim, use_bias=False, rngs=rngs)
        self.theta, self.policy = theta, policy  # the policy is a frozen dataclass: static under jit
        self.rope = kvpolicies.Rope(self.head_dim, theta)  # rotate-half layout (Llama/HF), like this file's reference `rope` below

    def qkv(self, x):
        B, T, _ = x.shape
        q = self.q(x).reshape(B, T, self.n_heads, self.head_dim)  # [B, T, N, D]
        k = self.k(x).reshape(B, T, self.n_kv_heads, self.head_dim)  # [B, T, K, D]
        v = self.v(x).reshape(B, T, self.n_kv_heads, self.head_dim)  # [B, T, K, D]
        return q, k, v

    def __call__(self, x, pos, cache_state):
        """x [B, T, E] new tokens at absolute positions pos [B, T] -> (y [B, T, E], new cache_state)."""
        q, k, v = self.qkv(x)  # un-rotated: kvpolicies applies RoPE, at the positions the policy gives
        out, cache_state = kvpolicies.attend(self.policy, cache_state, q, k, v, pos, self.rope)  # [B, T, N, D]
        return self.o(out.reshape(*x.shape[:2], -1)), cache_state  # [B, T, E]

    def dense(self, x, pos):
        """Reference: plain causal attention over the whole sequence x [B, T, E], no cache."""
        q, k, v = self.qkv(x)
        out = causal_attention(rope(q, pos, self.theta), rope(k, pos, self.theta), v, pos)  # [B, T, N, D]
        return self.o(out.reshape(*x.shape[:2], -1))  # [B, T, E]


def rope(x, pos, theta):
    """Rotary embedding, rotate-half layout (channel i pairs with i + D/2): x [B, T, H, D], pos [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
    ang = pos.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, D/2]
    x1, x2 = jnp.split(x, 2, axis=-1)  # [B, T, H, D/2] each
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def causal_attention(q, k, v, pos):
    """Softmax attention of q [B, T, N, D] over k, v [B, T, K, D]; query head n reads kv head n // G."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # [B, T, N, D]
    logits = jnp.einsum("BTND,BSND->BNTS", q, k) / jnp.sqrt(q.shape[-1])  # [B, N, T, S]
    causal = pos[:, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, S]: key position <= query position
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)  # [B, N, T, S]
    return jnp.einsum("BNTS,BSND->BTND", probs, v)  # [B, T, N, D]


@nnx.jit
def step(layer, x, pos, cache_state):
    """One jitted step (prefill when T > 1, decode when T = 1); compiles once per T."""
    return layer(x, pos, cache_state)


def main(prompt=60, steps=12, max_len=1024, dim=64, n_heads=4, n_kv_heads=2, n_sink=4, window=64, seed=0):
    """Prefill `prompt` tokens and decode `steps` more under StreamingLLM (`n_sink` sinks + `window`
    recent tokens) and under `full`, caches sized for up to `max_len` tokens; returns
    max |sink - full| per decoded position (zero until the first eviction)."""
    rngs, total = nnx.Rngs(seed), prompt + steps
    layers = {name: Attention(dim, n_heads, n_kv_heads, kvpolicies.get(name, **kw), rngs=nnx.Rngs(seed))
              for name, kw in [("full", {}), ("sink", dict(n_sink=n_sink, window=window))]}  # same weights
    x = jax.random.normal(rngs.data(), (1, total, dim))  # [B, T, E] stand-in token embeddings
    pos = jnp.arange(total, dtype=jnp.int32)[None]  # [B, T]
    ys, nbytes = {}, {}
    for name, layer in layers.items():
        state = layer.policy.init(1, n_kv_heads, dim // n_heads, jnp.float32, max_len)
        y, state = step(layer, x[:, :prompt], pos[:, :prompt], state)  # prefill, [B, prompt, E]
        outs = [y]
        for t in range(prompt, total):  # decode, one token at a time
            y, state = step(layer, x[:, t:t + 1], pos[:, t:t + 1], state)  # [B, 1, E]
            outs.append(y)
        ys[name] = jnp.concatenate(outs, axis=1)  # [B, T, E]
        nbytes[name] = sum(a.nbytes for a in jax.tree.leaves(state))  # the state is a pytree of arrays
    diff = jnp.abs(ys["sink"] - ys["full"]).max(axis=(0, 2))[prompt:]  # [steps]
    print(f"cache bytes for up to {max_len} tokens: full {nbytes['full']:,}, sink {nbytes['sink']:,}")
    for t, d in zip(range(prompt, total), diff.tolist()):
        note = f"  (positions {n_sink}..{t - window} evicted)" if t >= n_sink + window else ""
        print(f"position {t}: max |sink - full| = {d:.1e}{note}")
    return diff


if __name__ == "__main__":
    main()
