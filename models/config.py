"""Configuration of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

The canonical parameter layout every loader produces (numpy or jax arrays, float32):

    embed        [V, d]
    layers/      stacked over L layers
      attn_norm  [L, d]
      wq [L, d, N*D]  wk [L, d, K*D]  wv [L, d, K*D]  wo [L, N*D, d]   (x @ W convention)
      bq [L, N*D]  bk [L, K*D]  bv [L, K*D]                            (only if qkv_bias)
      mlp_norm   [L, d]
      w_gate [L, d, F]  w_up [L, d, F]  w_down [L, F, d]
    final_norm   [d]
    lm_head      [d, V]                                                 (absent if tied)

Q and K projections use the "rotate-half" RoPE layout of transformers (GGUF files store them
permuted for interleaved pairs; the GGUF loader undoes that).
"""

from __future__ import annotations

import dataclasses
from typing import Any


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

    @property
    def groups(self) -> int:
        """Query heads per KV head (G)."""
        return self.n_heads // self.n_kv_heads

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
