"""A Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/3, SmolLM2, Gemma 3) in Flax NNX, one cache
policy per layer.

Shapes: B batch, T tokens in this step, V vocab, d model width, F MLP width, L layers,
N query heads, K kv heads, D head dim.

Qwen3 is Llama with QK-norm (`qk_norm`). Gemma 3's differences are config fields too
(models/config.py): GeGLU (`act`), QK-norm, post-attention and post-MLP norms, scaled embeddings,
and local layers with their own RoPE base. A local layer's sliding window is its cache policy's
(`models.stacks.model_stack` gives it `window(512)`, which stores 512 slots), so the model has no
second masking path.

Weights of all layers are stacked on a leading L axis; consecutive layers with the same policy
form a run that is one `lax.scan` (so a 30-layer model compiles one layer body). The cache is a
tuple with one stacked `SlotState` per run, passed in and returned explicitly. A run whose
policy only appends in this step (`View.append` with a start: full, a ring's decode step)
reads its layers' stored slots as scan inputs and returns just the new slots, written into the
stacked cache after the scan (`attend(..., defer=True)`): no per-layer copy of the cache.
A run whose policy has `PrefixSlots` (full) reads only the first `reach` slots of its cache when
the step says all its positions are below `reach` (length buckets, chosen by the engine).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, reads_values
from kvpolicies import Rope, attend
from kvpolicies.attend import Deferred, write_deferred
from kvpolicies.prompt import with_query_sums
from kvpolicies.rope import RopeTable
from kvpolicies.slots import has_prefix_slots
from models.config import LlamaConfig
from models.protocol import Cache  # noqa: F401  (one state per run of identical policies; re-exported)

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")
QK_NORM_KEYS = ("q_norm", "k_norm")
POST_NORM_KEYS = ("post_attn_norm", "post_mlp_norm")


def layer_keys(cfg: LlamaConfig) -> tuple[str, ...]:
    """The per-layer weight names a config implies."""
    return (LAYER_KEYS + (BIAS_KEYS if cfg.qkv_bias else ()) + (QK_NORM_KEYS if cfg.qk_norm else ())
            + (POST_NORM_KEYS if cfg.post_norms else ()))


def init_params(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Random weights in the canonical layout (see models/config.py)."""
    rng = np.random.default_rng(seed)
    L, d, F, N, K, D = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    w = lambda *s: (rng.standard_normal(s) * std).astype(np.float32)  # noqa: E731
    layers = {
        "attn_norm": 1 + w(L, d), "wq": w(L, d, N * D), "wk": w(L, d, K * D), "wv": w(L, d, K * D),
        "wo": w(L, N * D, d), "mlp_norm": 1 + w(L, d), "w_gate": w(L, d, F), "w_up": w(L, d, F),
        "w_down": w(L, F, d),
    }
    if cfg.qkv_bias:
        layers.update(bq=w(L, N * D), bk=w(L, K * D), bv=w(L, K * D))
    if cfg.qk_norm:
        layers.update(q_norm=1 + w(L, D), k_norm=1 + w(L, D))
    if cfg.post_norms:
        layers.update(post_attn_norm=1 + w(L, d), post_mlp_norm=1 + w(L, d))
    params = {"embed": w(cfg.vocab_size, d), "layers": layers, "final_norm": 1 + w(d)}
    if not cfg.tie_embeddings:
        params["lm_head"] = w(d, cfg.vocab_size)
    return params


def device_params(cfg: LlamaConfig, seed: int = 0, std: float = 0.02, dtype=jnp.bfloat16) -> dict:
    """Random weights in the canonical layout drawn with `jax.random` on the default device, in
    `dtype` (norms 1 + noise, the rest noise of `std`): a model of a real shape
    (`models.config.shape_config`) for timing, built in seconds on an accelerator and without host
    memory. `init_params` draws on the host in float32 (4 bytes a parameter, minutes for 8B
    parameters); the two draws differ (init_params' numbers stay what they were)."""
    from models.config import expected_shapes

    shapes = expected_shapes(cfg)
    named = tuple(((), k, s) for k, s in shapes.items() if k != "layers")
    named += tuple((("layers",), k, s) for k, s in shapes["layers"].items())
    return _draw(named, jnp.dtype(dtype), jax.random.key(seed), jnp.float32(std))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draw(named, dtype, key, std):
    """One program for the whole tree (one compilation per shape set and dtype)."""
    out: dict = {"layers": {}}
    for k, (where, name, shape) in zip(jax.random.split(key, len(named)), named):
        w = jax.random.normal(k, shape, dtype) * std.astype(dtype)
        (out["layers"] if where else out)[name] = w + jnp.asarray(1, dtype) if name.endswith("norm") else w
    return out


ROPE_TABLE_BYTES = 32 << 20  # the largest RoPE cos/sin table `rope_tables` builds (bytes)


def policy_runs(policies: Policy | Sequence[Policy], n_layers: int) -> tuple[tuple[int, int, Policy], ...]:
    """(start, end, policy) for each run of consecutive layers sharing one policy."""
    if isinstance(policies, Policy):
        policies = (policies,) * n_layers
    policies = tuple(policies)
    if len(policies) != n_layers:
        raise ValueError(f"policies: got {len(policies)} policies for a model of {n_layers} layers")
    runs, start = [], 0
    for pol, grp in itertools.groupby(policies):
        n = len(list(grp))
        runs.append((start, start + n, pol))
        start += n
    return tuple(runs)


def rms_norm(x: Float[Array, "*b d"], w: Float[Array, "d"], eps: float) -> Float[Array, "*b d"]:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


ACT = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def block(cfg: LlamaConfig, policy: Policy, rope: Rope | RopeTable, w: dict, x, pos, state):
    """One decoder layer: attention through `policy`, then the gated MLP (SwiGLU or GeGLU)."""
    B, T, _ = x.shape
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
    if getattr(policy, "reads_hidden", False):  # a scorer of the layer's input (kvzap's prompt phase)
        state = policy.read_hidden(state, h, pos, w)
    if "wqkv" in w:  # fused (models.engine.layer_weights): one product, split
        nd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = jnp.split(h @ w["wqkv"], [nd, nd + kd], axis=-1)
    else:
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]  # [B, T, N*D], [B, T, K*D] x2
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)  # [B, T, N, D]
    k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)  # [B, T, K, D]
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)  # [B, T, K, D]
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg.norm_eps), rms_norm(k, w["k_norm"], cfg.norm_eps)
    if reads_values(policy):  # a scorer of v W_o (critical's prompt phase): the values and this layer's wo
        state = policy.read_values(state, v, pos, w["wo"])
    # defer: a step that only appends returns its new slots, which `hidden` writes after the
    # layer loop (the stored cache is then read in place, not copied through the scan)
    o, state = attend(policy, state, q, k, v, pos, rope, cfg.attn_scale, defer=True, tuning=cfg.attention)  # [B, T, N, D]
    o = o.reshape(B, T, -1) @ w["wo"]  # [B, T, d]
    if "attn_delta" in w:  # a perturbation of the attention output (kvgrad's gradient pass, models.gradient)
        o = o + w["attn_delta"]
    if cfg.post_norms:
        o = rms_norm(o, w["post_attn_norm"], cfg.norm_eps)
    x = x + o
    h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
    g, u = jnp.split(h @ w["w_gu"], 2, axis=-1) if "w_gu" in w else (h @ w["w_gate"], h @ w["w_up"])  # [B, T, F] x2
    m = (ACT[cfg.act](g) * u) @ w["w_down"]  # [B, T, d]
    if cfg.post_norms:
        m = rms_norm(m, w["post_mlp_norm"], cfg.norm_eps)
    return x + m, state


def with_tuning(model: "Llama", tuning) -> "Llama":
    """The same model (its weights shared, not copied) whose attention runs with `tuning`
    (`kvpolicies.attention.Tuning`): an Engine over it compiles its own steps."""
    import dataclasses

    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)
    out.cfg = dataclasses.replace(model.cfg, attention=tuning)
    return out


class Llama(nnx.Module):
    """Llama-family decoder. `Llama(cfg, params)` wraps canonical-layout weights as nnx.Params.
    It satisfies `models.protocol.LanguageModel`, what the engine calls."""

    def __init__(self, cfg: LlamaConfig, params: dict | None = None, dtype=jnp.float32):
        params = init_params(cfg) if params is None else params
        self.cfg = cfg
        self.dtype = dtype
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        local_theta = cfg.rope_theta if cfg.rope_theta_local is None else cfg.rope_theta_local
        self.rope_local = Rope(cfg.head_dim, local_theta)  # Gemma 3: unscaled, base 10k, on local layers
        p = lambda a: nnx.Param(jnp.asarray(a, dtype))  # noqa: E731
        self.embed = p(params["embed"])  # [V, d]
        self.final_norm = p(params["final_norm"])  # [d]
        self.lm_head = p(params["lm_head"]) if "lm_head" in params else None  # [d, V]
        keys = layer_keys(cfg)
        self.layers = nnx.Dict({name: p(params["layers"][name]) for name in keys})  # each [L, ...]

    def init_cache(self, policies, batch: int, max_len: int, dtype=None) -> Cache:
        """An empty cache: one stacked state per run of identical policies."""
        dtype = self.dtype if dtype is None else dtype
        cfg = self.cfg
        out = []
        for a, b, pol in policy_runs(policies, cfg.n_layers):
            st = with_query_sums(pol, pol.init(batch, cfg.n_kv_heads, cfg.head_dim, dtype, max_len),
                                 cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
            out.append(jax.tree.map(lambda x, n=b - a: jnp.broadcast_to(x, (n,) + x.shape).copy(), st))
        return tuple(out)

    def rope_tables(self, n: int) -> dict[str, RopeTable]:
        """cos/sin of the global and local RoPE for positions [0, n) (host-computed arrays), for
        `hidden(..., tables=)`: a step then gathers instead of computing trigonometry per layer.
        At most ROPE_TABLE_BYTES per table (131,072 positions at head_dim 64): a step whose
        positions go past it computes cos/sin (a million-token stream does not hold a 256 MB table)."""
        n = max(1, min(n, ROPE_TABLE_BYTES // (self.cfg.head_dim * 4)))  # cos + sin, D/2 float32 each
        return {"global": self.rope.table(n), "local": self.rope_local.table(n)}

    def hidden(
        self, tokens: Int[Array, "B T"], pos: Int[Array, "B T"], cache: Cache, policies,
        tables: dict[str, RopeTable] | None = None, reach: int | None = None,
    ) -> tuple[Float[Array, "B T d"], Cache]:
        """Final-norm hidden states of the T new tokens, and the updated cache (`tables`: the
        RoPE tables of `rope_tables`, or None to compute cos/sin in the step). `reach` (static):
        every position of this step is below it, so a run whose policy has `PrefixSlots` reads
        and writes only its first `reach` slots (the step's cost follows the filled length)."""
        cfg = self.cfg
        rope, rope_local = (self.rope, self.rope_local) if tables is None else (tables["global"], tables["local"])
        runs = policy_runs(policies, cfg.n_layers)
        if len(cache) != len(runs):
            raise ValueError(f"cache has {len(cache)} runs, policies give {len(runs)}")
        x = self.embed_tokens(tokens)  # [B, T, d]
        weights = {k: v[...] for k, v in self.layers.items()}  # each [L, ...]
        local = np.asarray(cfg.local_layers)  # [L] bool
        new_cache = []
        for (a, b, pol), state in zip(runs, cache):
            # a run of some layers reads its layers' weights out of the stacked ones inside the loop
            # (a slice [a:b] taken outside would copy the run's weights at every step)
            whole = (a, b) == (0, cfg.n_layers)
            wr = weights if whole else {}
            if getattr(pol, "reads_hidden", False):  # its own per-layer weights ride with the layer's
                wr = {**wr, **pol.hidden_weights(cfg.d_model, cfg.n_kv_heads, cfg.n_layers, a, b)}
            kinds = set(local[a:b].tolist())
            cut = reach is not None and has_prefix_slots(pol) and reach < state.slots

            def body(x, inp, pol=pol, kinds=kinds, cut=cut, whole=whole):
                w, st, is_local, i = inp
                if not whole:
                    w = {**jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False), weights), **w}
                if cut:  # the layer's first `reach` slots (sliced inside the loop: one copy, of reach slots)
                    st = pol.head(st, reach)
                if len(kinds) == 1:  # a run of one layer type (the usual case): its RoPE, static
                    return block(cfg, pol, rope_local if kinds == {True} else rope, w, x, pos, st)
                # One policy over local and global layers (e.g. `full` everywhere): pick the RoPE per layer.
                return jax.lax.cond(
                    is_local,
                    lambda: block(cfg, pol, rope_local, w, x, pos, st),
                    lambda: block(cfg, pol, rope, w, x, pos, st),
                )

            x, out = jax.lax.scan(body, x, (wr, state, jnp.asarray(local[a:b]), jnp.arange(a, b)))
            # an appending policy's layers return only their new slots: written here, in place
            if isinstance(out, Deferred):
                out = write_deferred(state, out, lead=1)
            elif cut:
                out = pol.with_head(state, out, lead=1)
            new_cache.append(out)
        return self.final(x), tuple(new_cache)

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T d"]:
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.embed_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)  # Gemma: sqrt(d), in the compute dtype
        return x

    def final(self, x: Float[Array, "B T d"]) -> Float[Array, "B T d"]:
        """The final norm (before `logits`)."""
        return rms_norm(x, self.final_norm[...], self.cfg.norm_eps)

    def layer_weights(self) -> tuple[dict, ...]:
        """Each layer's weights as separate arrays (a copy of the stacked layer weights, through
        host memory, no compilation), with the q/k/v projections and the MLP's gate/up each
        concatenated into one matrix (`wqkv`, `w_gu`: one matvec instead of three and two; `block`
        splits the products): what `layer` takes (`models.engine.layers.layer_weights` keeps them)."""
        stacked = {k: np.asarray(v[...]) for k, v in self.layers.items()}  # each [L, ...]
        fused = {"wqkv": ("wq", "wk", "wv"), "w_gu": ("w_gate", "w_up")}
        for name, parts in fused.items():
            stacked[name] = np.concatenate([stacked.pop(k) for k in parts], axis=-1)
        return tuple({k: jnp.array(a[i]) for k, a in stacked.items()} for i in range(self.cfg.n_layers))

    def layer(self, policy: Policy, local: bool, w: dict, x: Float[Array, "B T d"], pos: Int[Array, "B T"],
              state, tables: dict[str, RopeTable] | None = None, reach: int | None = None):
        """One layer on its own weights `w` and state (each without the L axis; `local`: a local
        RoPE layer): x after the layer, and the layer's `Deferred` writes or new state (the
        caller writes them: `models.engine`'s layer-by-layer decoding). `reach` as in `hidden`."""
        cfg = self.cfg
        kind = "local" if local else "global"
        rope = (self.rope_local if local else self.rope) if tables is None else tables[kind]
        cut = reach is not None and has_prefix_slots(policy) and reach < state.slots
        x, out = block(cfg, policy, rope, w, x, pos, policy.head(state, reach) if cut else state)
        if cut and not isinstance(out, Deferred):
            out = policy.with_head(state, out)
        return x, out

    def logits(self, h: Float[Array, "B T d"]) -> Float[Array, "B T V"]:
        if self.lm_head is None:  # tied: contract with the embedding's rows as stored (no [d, V] transpose)
            return jnp.einsum("BTd,Vd->BTV", h, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("BTd,dV->BTV", h, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(self, tokens, pos, cache, policies, tables=None):
        """Logits [B, T, V] of the T new tokens, and the updated cache."""
        h, cache = self.hidden(tokens, pos, cache, policies, tables)
        return self.logits(h), cache
