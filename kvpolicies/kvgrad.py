"""`kvgrad`: KVgrad (OpenReview cg1wTCJjjk; kvpress 0.5.5 `KVgradPress`, NVIDIA/kvpress PR #279) — KVzip's
context reconstruction (`kvpolicies.kvzip`), each cached token scored by an input x gradient attribution of
what it writes into the residual stream of the repeat queries, instead of their attention alone.

Shapes: B batch, K kv heads, G query heads per kv head, M = max_len (the prompt phase's slots), T repeat-input
tokens, D head dim, d model width, L layers.

The score of context token c in layer l (kvpress's `KVgradPress._update_scores`):

    S[l, c] = max over the G query heads g of c's kv head and the repeat queries p of
              A[l, g, p, c] * ||v_c W_o^(g)||_2 * ||dPhi / da_p^l||_2

A: the reconstruction attention (KVzip's: a softmax restricted to the sinks, the chunk and the repeat input);
||v_c W_o^(g)||_2: the norm of what c's value writes into the residual stream through query head g's rows of
the layer's output projection (W_o reaches the pass through `kvpolicies.base.ReadsValues`, as for critical);
dPhi / da_p^l: the gradient of Phi = sum_p ||h_p^L||^2 (the last layer's output before the final norm, over
the repeat input's tokens) with respect to layer l's attention output at repeat token p. The gradient is the
engine's (`models.gradient`: a `jax.grad` of the repeat input's forward through a zero perturbation added to
every layer's attention output), handed to each scoring layer before its repeat input
(`kvpolicies.prompt.ReadsGradients`). The choice after the pass is KVzip's (head-wise, sinks kept;
`scope="model"`: kvpress's default, one choice over all layers).

Defaults: kvpress's (the method's implementation): context chunks of 512 tokens (`repeat_chunk`), kvpress's
repeat prompts (`prompts="kvpress"`), n_sink 4. Deviations, named: those of `kvzip` (uniform layer budgets by
default, `scope="layer"`, memory really saved; the newest token kept; float32 scores; ties keep the newer
token); with a codec the values are read decoded. Streams past `max_new` recompress by kvzip's rule (the most
attention a slot received): no gradient is taken mid-stream. kvpress's `kvzip_plus_normalization` does not
apply (kvpress fixes it off).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvpolicies.base import ReadsValues
from kvpolicies.kvzip import LOWEST, KVzip, Reconstruct
from kvpolicies.prompt import PromptState, ReadsGradients


def value_output_norms(v: Float[Array, "B K M D"], wo: Float[Array, "ND d"]) -> Float[Array, "B K G M"]:
    """||v W_o^(g)||_2 of each slot's value through each query head g's rows of the output projection, per kv
    head (kvpress's `KVzipPress._compute_value_output_norm`), float32."""
    kh, d = v.shape[1], v.shape[3]
    w = wo.astype(jnp.float32).reshape(kh, wo.shape[0] // (kh * d), d, wo.shape[-1])  # [K, G, D, d]
    out = jnp.einsum("BKMD,KGDE->BKGME", v.astype(jnp.float32), w)  # [B, K, G, M, d]
    return jnp.sqrt(jnp.sum(out * out, axis=-1))  # [B, K, G, M]


@dataclasses.dataclass(frozen=True)
class KVgrad(KVzip):
    """Keep, per layer, the K x budget tokens with the largest KVgrad score (KVzip's reconstruction pass, its
    attention weighted by ||v W_o|| and the gradient norm of the repeat query's attention output)."""

    repeat_chunk: int = 512
    prompts: str = "kvpress"

    def reconstruction(self) -> "GradReconstruct":
        """The layer's policy while the engine feeds the repeat inputs."""
        return GradReconstruct(codec=self.codec, of=self)

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """kvzip's (`scope="model"`: one choice over all layers), the last input's gradient norms dropped."""
        states = tuple(dataclasses.replace(st, extra={k: x for k, x in st.extra.items() if k != "grad"})
                       if isinstance(st, PromptState) else st for st in states)
        return super().after_pass(reconstructors, states, scored)


@dataclasses.dataclass(frozen=True)
class GradReconstruct(Reconstruct, ReadsValues, ReadsGradients):
    """A kvgrad layer during the reconstruction pass: kvzip's `Reconstruct`, whose score of a chunk's token is
    its restricted-softmax attention from each repeat query and query head times ||v W_o^(g)||_2 (the model
    hands W_o: `read_values`) times the repeat query's gradient norm (`extra["grad"]` [B, T], set before the
    input by the engine's gradient pass: `read_gradients`), maximised over G and the real repeat queries."""

    of: KVgrad | None = None

    def gradient_policy(self) -> Reconstruct:
        """This layer in the gradient pass: the same attention over the prompt and the repeat input, no score."""
        return Reconstruct(codec=self.codec)

    def read_gradients(self, state: PromptState, norms: Float[Array, "B T"]) -> PromptState:
        return dataclasses.replace(state, extra={**state.extra, "grad": norms.astype(jnp.float32)})

    def read_values(self, state: PromptState, v: Float[Array, "B T K D"], pos: Int[Array, "B T"],
                    wo: Float[Array, "ND d"]) -> PromptState:
        """The prompt's stored values through W_o (`extra["vo"]` [B, K, G, M], for this step's `compact` only)."""
        vals = self.codec.decode(state.v, jnp.float32)  # [B, K, M, D]
        return dataclasses.replace(state, extra={**state.extra, "vo": value_output_norms(vals, wo)})

    def compact(self, view, seen):
        state = view.carry
        extra = {k: x for k, x in state.extra.items() if k != "vo"}  # the step's only: the cache keeps its layout
        if "grad" not in extra:
            raise ValueError("kvgrad: the reconstruction pass has no gradient norms (run it through "
                             "models.engine.Engine, whose pass takes them: models.gradient)")
        m = state.slots
        lo, hi, end = (extra["zip_range"][:, i, None, None] for i in (0, 1, 2))  # [B, 1, 1]
        p = view.pos  # [B, 1, M + T]
        repeat = jnp.arange(p.shape[-1]) >= m  # the repeat input's own slots
        scored = ((p >= 0) & (p < self.of.n_sink)) | ((p >= lo) & (p < hi)) | repeat  # [B, 1, M + T]
        lg = jnp.where(scored[:, :, None, None, :], seen.logits, LOWEST)  # [B, K, G, T, M + T]
        probs = jax.nn.softmax(lg, axis=-1)[..., :m]  # [B, K, G, T, M]
        grad = extra["grad"][:, None, None, :, None]  # [B, 1, 1, T, 1]
        weighted = probs * state.extra["vo"][:, :, :, None, :] * grad  # [B, K, G, T, M]
        real = (p[..., m:] < end)[:, :, None, :, None]  # [B, 1, 1, T, 1]: not a pad of the repeat input
        score = jnp.where(real, weighted, 0.0).max(axis=(2, 3))  # [B, K, M]
        chunk = (state.pos >= lo) & (state.pos < hi)  # [B, 1, M]
        return dataclasses.replace(state, extra={**extra, "zip": jnp.where(chunk, score, extra["zip"])})
