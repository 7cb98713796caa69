"""kvpress's `RestoreKVPress` (Baek, Shin, Kong, "RestoreKV: Recovering Full-Cache Behavior Under Aggressive
Query-Agnostic KV Cache Eviction", arXiv:2608.01247; cvsp-lab/RestoreKV): KVzip plus n learned restore tokens.
Reached through `kvpolicies.compat.kvpress("RestoreKVPress", r, restore_model_name=<file>)`; not registered (it
is `kvzip` plus one prompt-side pass and a shifted count).

Shapes: B batch, K kv heads, M = max_len (the prompt phase's slots), L layers, n restore tokens, d model
width, r LoRA rank, I / O a projection's input / output width.

The method (kvpress 0.5.5's, its defaults; the paper's form): after the context of t tokens is prefilled and
KVzip has scored it (its reconstruction pass, over the context alone), n restore embeddings [n, d] go through
the model ONCE at positions t..t+n-1, with a LoRA adapter on (W + (alpha / r) B A on every q, k, v, o, gate,
up and down projection; off for everything else), attending to the whole uncompressed context; their keys
and values are appended to every layer's cache. KVzip then removes the lowest-scored (token, kv head) pairs of
the CONTEXT at the compression ratio raised by n / t (budget-matched: the n restore slots are paid out of the
budget), min(1, r + n / t): over all layers, int(L K t (r + n / t)) pairs (kvpress's default; `layerwise=True`:
int(K t (r + n / t)) per layer). The restore slots are never scored nor removed (kvpress's scores cover the
context only). The question then follows at position t + n.

Here: the engine runs the pass (`kvpolicies.prompt.Appends`: `Engine.compress` and `generate`, after the
reconstruction; `models.lora.restore(engine, state)` runs it on an `Engine.prompt` state by hand), then keeps from
the scores with this policy's `after_pass` / `after_prompt`; the kept pairs
are stored as kvzip's head pool (scope="model", kvpress's default: every layer at full size, as kvpress which
masks; layerwise: each layer's K t (1 - r) + 1 slots, the restore tokens included). Deviations: the LoRA is
merged into a copy of the weights for the pass (PEFT adds its product to the base output: the same up to float
rounding), and kvzip's (the sinks never removed, ties keep the newer token).

The arrays (`restore` / kvpress's `restore_model_name`): kvpress downloads the authors' from the Hugging Face
hub (`higokri/RestoreKV-<model>`: restore_embeddings.safetensors and a PEFT LoRA adapter) for two
checkpoints; ours are trained by the paper's self-distillation, `python -m evals.train_restorekv model=<name>`
(`$KVP_DATA/restorekv/<model>.npz`), an .npz of "restore_embeddings" [n, d], per adapted projection
"lora_A.<name>" [L, r, I] and "lora_B.<name>" [L, O, r] (PEFT's lora_A / lora_B weights, stacked over layers;
names `LORA_MODULES`), and "lora_alpha".
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvpolicies.adakv import prompt_pool
from kvpolicies.kvzip import KVzip, model_scope_keep
from kvpolicies.prompt import Appends, PromptState

# our per-layer weight name -> the module PEFT adapts (the authors' LORA_TARGET_SUFFIXES)
LORA_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w_gate": "gate_proj",
                "w_up": "up_proj", "w_down": "down_proj"}


@functools.lru_cache(maxsize=8)
def load_restore(path: str) -> dict:
    """{"embeddings": [n, d], "lora_A": {name: [L, r, I]}, "lora_B": {name: [L, O, r]}, "alpha": float} (float32)
    from an .npz file (see the module docstring)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"restorekv: restore={path!r}: no such file; train the arrays with `python -m "
                         "evals.train_restorekv model=<name>` (kvpress downloads the authors')")
    with np.load(p) as z:
        if "restore_embeddings" not in z.files or "lora_alpha" not in z.files:
            raise ValueError(f"restorekv: {path!r} lacks 'restore_embeddings' or 'lora_alpha' ({z.files})")
        emb = np.asarray(z["restore_embeddings"], np.float32)
        names = [f.split(".", 1)[1] for f in z.files if f.startswith("lora_A.")]
        bad = sorted(set(names) - set(LORA_MODULES)) + sorted(n for n in names if f"lora_B.{n}" not in z.files)
        if bad or emb.ndim != 2 or not emb.shape[0]:
            raise ValueError(f"restorekv: {path!r}: embeddings {emb.shape} must be [n >= 1, d]; LoRA names "
                             f"{sorted(names)} must be among {sorted(LORA_MODULES)}, each with its lora_B ({bad})")
        a = {n: np.asarray(z[f"lora_A.{n}"], np.float32) for n in names}
        b = {n: np.asarray(z[f"lora_B.{n}"], np.float32) for n in names}
        return {"embeddings": emb, "lora_A": a, "lora_B": b, "alpha": float(z["lora_alpha"])}


def save_restore(path, embeddings: np.ndarray, lora_a: dict, lora_b: dict, alpha: float,
                 meta: dict | None = None) -> pathlib.Path:
    """Write the arrays file `load_restore` reads (`meta`: settings stored beside them, as "meta.<key>")."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"restore_embeddings": np.asarray(embeddings, np.float32), "lora_alpha": np.float32(alpha)}
    arrays.update({f"lora_A.{n}": np.asarray(x, np.float32) for n, x in lora_a.items()})
    arrays.update({f"lora_B.{n}": np.asarray(x, np.float32) for n, x in lora_b.items()})
    np.savez(path, **arrays, **{f"meta.{k}": np.asarray(v) for k, v in (meta or {}).items()})
    load_restore.cache_clear()
    return path


@dataclasses.dataclass(frozen=True)
class RestoreKV(KVzip, Appends):
    """KVzip whose prompt is followed by n learned restore tokens (`Appends`: the engine's restore pass), kept
    always; the context's pairs removed at min(1, ratio + n / t). `restore`: the arrays file (the module
    docstring)."""

    restore: str = ""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.restore, str) or not self.restore:
            raise ValueError("restorekv: give restore=<an .npz of restore embeddings and LoRA>, from `python -m "
                             "evals.train_restorekv model=<name>`")

    def restore_arrays(self) -> dict:
        """The restore embeddings and LoRA (`load_restore`)."""
        return load_restore(self.restore)

    def appended(self) -> dict:
        return self.restore_arrays()

    def after_append(self, state: PromptState, t: int) -> PromptState:
        """The state marked with the context's length t (`extra["restored"]`, per layer and row)."""
        return dataclasses.replace(state, extra={**state.extra, "restored": jnp.full(state.pos.shape[:-2], t,
                                                                                      jnp.int32)})

    @property
    def n_restore(self) -> int:
        return int(self.restore_arrays()["embeddings"].shape[0])

    def effective_ratio(self, t: int) -> float:
        """kvpress's compression ratio for a t-token context: min(1, ratio + n / t) (as its float arithmetic)."""
        return min(1.0, self.ratio + self.n_restore / t)

    def after_pass(self, reconstructors: tuple, states: tuple, scored: list[bool]) -> tuple:
        """scope="model": once the restore tokens are in (`extra["restored"]`, the context's length t), the
        int(L K t min(1, ratio + n / t)) lowest-scored context pairs of all layers removed, the restore slots
        kept (`extra["zip_kept"]`); before them (the pass's own call) nothing."""
        if any(not isinstance(p, RestoreKV) for p in reconstructors):
            raise ValueError("restorekv: an engine's reconstructing layers must all be restorekv (one restore pass)")
        runs = [st for st, z in zip(states, scored) if z]
        if self.scope != "model" or not runs or any("restored" not in st.extra for st in runs):
            return states
        if len({(p.ratio, p.n_sink, p.scope, p.restore) for p in reconstructors}) > 1:
            raise ValueError("restorekv scope='model': every layer must share ratio, n_sink, scope and restore")
        t = int(np.asarray(runs[0].extra["restored"]).max())  # eager here: the restore pass's context length
        pos = jnp.concatenate([st.pos for st in runs])  # [L, B, 1, M]
        ctx = jnp.where(pos < t, pos, -1)  # the restore slots out of the choice (never removed)
        kept = model_scope_keep(jnp.concatenate([st.extra["zip"] for st in runs]), ctx, self.effective_ratio(t),
                                self.n_sink) | (pos >= t)  # [L, B, K, M]
        out, i = [], 0
        for st, z in zip(states, scored):
            if z:
                n = st.pos.shape[0]
                st = dataclasses.replace(st, extra={**st.extra, "zip_kept": kept[i:i + n]})
                i += n
            out.append(st)
        return tuple(out)

    def after_prompt(self, state: PromptState):
        if "restored" not in state.extra:
            raise ValueError("restorekv: the prompt has no restore tokens (an Engine's compress or generate appends "
                             "them after its reconstruction pass; models.lora.restore by hand)")
        if not self.ratio:
            raise ValueError("restorekv needs ratio > 0 (kvpress's compression_ratio; at 0 kvpress does nothing)")
        if self.scope == "model":
            return super().after_prompt(state)  # zip_kept: after_pass's choice, the restore slots in it
        m = state.slots
        kh = jax.tree.leaves(state.k)[0].shape[1]
        b = state.pos.shape[0]
        pos = jnp.broadcast_to(state.pos, (b, kh, m))  # [B, K, M]
        filled = pos >= 0
        t = state.extra["restored"][:, None, None]  # [B, 1, 1]
        ctx = filled & (pos < t)
        nr = self.n_restore
        table = np.asarray([max(kh * n - int(kh * n * min(1.0, self.ratio + nr / n)), kh * min(self.n_sink, n))
                            if n else 0 for n in range(m + 1)], np.int32)  # kvpress layerwise, per context length
        kept = self.keep(state.extra["zip"], jnp.where(ctx, pos, -1), jnp.asarray(table)[t[:, 0, 0]][:, None])
        kept = (kept & ctx) | (filled & ~ctx)
        return prompt_pool(state, kept, jnp.where(filled, state.extra["zip"], 0.0), kh * self.capacity(m))


def from_kvpress(r: float, max_new: int, fields: dict) -> RestoreKV:
    """`kvpolicies.compat.kvpress("RestoreKVPress", r, restore_model_name=<file>)` with KVzipPress's fields
    (layerwise, n_sink, chunk_size; kvzip_plus_normalization=True refused, as for KVzipPress)."""
    if fields.pop("kvzip_plus_normalization", False):
        raise NotImplementedError("kvpolicies.compat.kvpress: RestoreKVPress(kvzip_plus_normalization=True)")
    arrays = fields.pop("restore_model_name", "")
    if not arrays:
        raise ValueError("kvpress('RestoreKVPress'): give restore_model_name= (an .npz of restore embeddings and "
                         "LoRA: `python -m evals.train_restorekv model=<name>` writes "
                         "$KVP_DATA/restorekv/<model>.npz); "
                         "kvpress downloads the authors' from the Hugging Face hub")
    layerwise = fields.pop("layerwise", False)
    return RestoreKV(ratio=r, max_new=max_new, n_sink=fields.pop("n_sink", 4),
                     repeat_chunk=fields.pop("chunk_size", 2048),
                     scope="layer" if layerwise else "model", keep_last=False, prompts="kvpress", restore=str(arrays))
