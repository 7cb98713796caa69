"""The model protocol: what `models.engine.Engine` calls on a model, stated once.

Shapes: B batch, T tokens in this step, d model width, V vocab, L layers, K kv heads, D head dim,
n tabulated positions.

A model family is a Flax NNX module (the engine splits it into a graph and its weights with
`nnx.split`, and merges them inside every jitted step) with these methods and a config of these
fields. `models.llama.Llama` satisfies it; docs/guide/model-family.md builds a tiny family that
does, from scratch. The cache is a tuple of one stacked `SlotState` per run of consecutive layers
sharing one policy (`models.llama.policy_runs`), passed in and returned: the model owns no cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int

from kvpolicies.base import Policy, SlotState
from kvpolicies.rope import RopeTable

Cache = tuple[SlotState, ...]  # one state per run of identical policies, leaves [L_run, ...]


class ModelConfig(Protocol):
    """The config fields the engine reads (`LlamaConfig` has them): the sizes, which layers are
    local (their own RoPE, `rope_tables()["local"]`), and `attention`: a
    `kvpolicies.attention.Tuning` or None (the engine replaces it with `dataclasses.replace`, so
    the config is a dataclass)."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position: int
    attention: Any

    @property
    def local_layers(self) -> tuple[bool, ...]: ...


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder the engine runs: whole steps (`hidden`, then `logits`), and the same computation
    one layer at a time (`embed_tokens`, `layer` over `layer_weights()`, then `final` and
    `logits`), which the engine's default layer-by-layer decoding calls. Both must give the same
    numbers."""

    cfg: ModelConfig
    dtype: Any  # the cache's dtype when the engine is given none

    def init_cache(self, policies: Sequence[Policy], batch: int, max_len: int, dtype: Any = None) -> Cache:
        """An empty cache: per run of identical policies, the policy's `init` stacked over its layers."""
        ...

    def rope_tables(self, n: int) -> dict[str, RopeTable]:
        """cos/sin of positions [0, n) as {"global": RopeTable, "local": RopeTable} (the local
        layers' RoPE; the global one again for a model without local layers)."""
        ...

    def hidden(self, tokens: Int[Array, "B T"], pos: Int[Array, "B T"], cache: Cache, policies: Sequence[Policy],
               tables: dict[str, RopeTable] | None = None, reach: int | None = None
               ) -> tuple[Float[Array, "B T d"], Cache]:
        """Final-norm hidden states of the T new tokens at positions `pos`, and the new cache:
        each layer's attention goes through its policy (`kvpolicies.attend`). `tables`: those of
        `rope_tables`, or None (compute cos/sin); `reach`: every position is below it (a policy
        with `PrefixSlots` may read only its first `reach` slots; ignoring it is correct)."""
        ...

    def final(self, x: Float[Array, "B T d"]) -> Float[Array, "B T d"]:
        """The last layer's output -> what `logits` reads (the final norm)."""
        ...

    def logits(self, h: Float[Array, "B T d"]) -> Float[Array, "B T V"]:
        """Logits (float32) of final-norm hidden states."""
        ...

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T d"]:
        """The first layer's input."""
        ...

    def layer_weights(self) -> tuple[dict[str, Array], ...]:
        """Each layer's weights as arrays of their own, in the form `layer` takes them (the engine
        asks once per model and keeps them)."""
        ...

    def layer(self, policy: Policy, local: bool, w: dict[str, Array], x: Float[Array, "B T d"],
              pos: Int[Array, "B T"], state: SlotState, tables: dict[str, RopeTable] | None = None,
              reach: int | None = None) -> tuple[Float[Array, "B T d"], Any]:
        """One layer on its weights `w` and state (no L axis; `local`: a local-RoPE layer): x after
        the layer, and the layer's new state (or its `kvpolicies.attend.Deferred` writes)."""
        ...
