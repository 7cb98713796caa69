"""Configuration of a Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 3).

The canonical parameter layout every loader produces (numpy or jax arrays, float32):

    embed        [V, d]
    layers/      stacked over L layers
      attn_norm  [L, d]
      wq [L, d, N*D]  wk [L, d, K*D]  wv [L, d, K*D]  wo [L, N*D, d]   (x @ W convention)
      bq [L, N*D]  bk [L, K*D]  bv [L, K*D]                            (only if qkv_bias)
      q_norm [L, D]  k_norm [L, D]                                     (only if qk_norm)
      post_attn_norm [L, d]                                             (only if post_norms)
      mlp_norm   [L, d]
      w_gate [L, d, F]  w_up [L, d, F]  w_down [L, F, d]
      post_mlp_norm  [L, d]                                             (only if post_norms)
    final_norm   [d]
    lm_head      [d, V]                                                 (absent if tied)

Norm weights are the multipliers themselves: Gemma's "(1 + w)" convention is resolved by the loaders
(GGUF files store 1 + w already; HF Gemma checkpoints get 1 added).

Architecture features are fields that compose (no subclass per model): Qwen3 is Llama with
`qk_norm=True` (RMSNorm over each head's q and k before RoPE) and an explicit `head_dim`; Llama 3.1
and 3.2 are Llama with the llama3 `rope_scaling` (3.2 with tied embeddings); Gemma 3 is
`act="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=sqrt(d)`, `layer_types` with five
"local" layers of `sliding_window` tokens per "global" one, and `rope_theta_local` for the local
layers. Which cache a local layer gets is the caller's choice of per-layer policy
(`models.stacks.model_stack` gives each local layer `window(sliding_window)`).

Q and K projections use the "rotate-half" RoPE layout of transformers (GGUF files store them
permuted for interleaved pairs; the GGUF loader undoes that).
"""

from __future__ import annotations

import dataclasses
from typing import Any


ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("global", "local")


def gemma3_layer_types(n_layers: int, period: int = 6) -> tuple[str, ...]:
    """Gemma 3's pattern: every `period`-th layer global, the others local (5 local : 1 global)."""
    return tuple("global" if (i + 1) % period == 0 else "local" for i in range(n_layers))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    # Llama-3 style scaling as a hashable tuple of (key, value) pairs, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position: int = 4096  # training context length
    bos_id: int | None = None
    eos_id: int | None = None
    name: str = "llama"
    # -- features beyond Llama (defaults: plain Llama) --
    act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma 2/3)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(d_model))
    attn_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5
    layer_types: tuple[str, ...] = ()  # per layer "global" or "local" (sliding window); () = all global
    sliding_window: int | None = None  # tokens a local layer sees, itself included
    rope_theta_local: float | None = None  # RoPE base of the local layers; None: rope_theta
    # how attention runs its steps (kvpolicies.attention.Tuning: blocks, skipping; never what it
    # computes); static, so an engine over a model with another one compiles its own steps. None: defaults
    attention: Any = None

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig.{f}={v!r}: must be a positive int")
        if not isinstance(self.max_position, int) or isinstance(self.max_position, bool) or self.max_position < 1:
            raise ValueError(f"LlamaConfig.max_position={self.max_position!r}: must be a positive int")
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"LlamaConfig.{f}={v!r}: must be a positive finite number")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim}: must be even for RoPE")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.act not in ACTIVATIONS:
            raise ValueError(f"LlamaConfig.act={self.act!r}: must be one of {ACTIVATIONS}")
        for f in ("embed_scale", "attn_scale", "rope_theta_local"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ValueError(f"LlamaConfig.{f}={v!r}: must be a positive finite number")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"LlamaConfig.layer_types: {len(self.layer_types)} entries for n_layers={self.n_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"LlamaConfig.layer_types: {bad[0]!r} is not one of {LAYER_TYPES}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"LlamaConfig.sliding_window={w!r}: must be a positive int or None")
        if "local" in self.layer_types and w is None:
            raise ValueError("LlamaConfig.layer_types has local layers: sliding_window must be set")

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.n_heads // self.n_kv_heads

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a local (sliding-window) layer."""
        return tuple(t == "local" for t in self.layer_types) if self.layer_types else (False,) * self.n_layers

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


def smollm2_135m() -> LlamaConfig:
    """SmolLM2-135M(-Instruct): the embedded default model."""
    return LlamaConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
        d_ff=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
        max_position=8192, name="SmolLM2-135M-Instruct",
    )


def _llama3(factor: float) -> dict[str, Any]:
    """Llama 3.1 / 3.2's published rope_scaling (config.json), with `factor` (8 for 3.1, 32 for 3.2)."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# The published config.json shapes of the leaderboard's model families (and their smallest sizes),
# for random-weight models of the real shape (timing without a checkpoint). Ids: the Instruct
# models' bos and first eos.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
        rope_theta=500000.0, rope_scaling=_llama3(8.0), norm_eps=1e-5, max_position=131072,
        bos_id=128000, eos_id=128001, name="Llama-3.1-8B-Instruct",
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192,
        rope_theta=500000.0, rope_scaling=_llama3(32.0), norm_eps=1e-5, tie_embeddings=True, max_position=131072,
        bos_id=128000, eos_id=128001, name="Llama-3.2-1B-Instruct",
    ),
    "qwen3-8b": dict(
        vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
        rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_position=40960,
        bos_id=151643, eos_id=151645, name="Qwen3-8B",
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072,
        rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, tie_embeddings=True, max_position=40960,
        bos_id=151643, eos_id=151645, name="Qwen3-0.6B",
    ),
}


def shape_config(name: str) -> LlamaConfig:
    """The LlamaConfig of a published model's shape (`SHAPES`: llama-3.1-8b, llama-3.2-1b, qwen3-8b,
    qwen3-0.6b): layers, heads, head_dim, widths, vocabulary, RoPE base and scaling, QK-norm, tying.
    `Llama(shape_config("qwen3-8b"))` is a random-weight model of the real shape (no checkpoint)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in SHAPES:
        raise ValueError(f"shape_config name={name!r}: known shapes are {sorted(SHAPES)}")
    return LlamaConfig(**SHAPES[key])


def expected_shapes(config: LlamaConfig) -> dict[str, Any]:
    """The canonical tree of shapes a config implies (the contract of every loader)."""
    c = config
    L, d, F, V = c.n_layers, c.d_model, c.d_ff, c.vocab_size
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv), "wo": (L, q, d),
        "mlp_norm": (L, d), "w_gate": (L, d, F), "w_up": (L, d, F), "w_down": (L, F, d),
    }
    if c.qkv_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if c.qk_norm:
        layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
    if c.post_norms:
        layers.update(post_attn_norm=(L, d), post_mlp_norm=(L, d))
    shapes: dict[str, Any] = {"embed": (V, d), "layers": layers, "final_norm": (d,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (d, V)
    return shapes
