"""`Engine`: a `Llama` run through a per-layer policy tuple (the class that joins the jobs:
checks, steps, staged prompts, generation)."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvpolicies.base import Policy
from kvpolicies.budgets import Fits
from kvpolicies.presets import stack_of
from kvpolicies.prompt import KeptTable, pass_policies, prompt_policy_of, reconstructs, shape_class_of, step_phase
from models.llama import Llama, policy_runs
from models.reconstruct import RepeatPrompts, engine_prompts
from models.tokenizer import tokenizer_of
from models.engine.checks import MAX_LEN, ArgumentChecks, check_int, check_policies
from models.engine.generation import Generation
from models.engine.staged import Staged
from models.engine.layers import LayerSteps, write_layers
from models.engine.steps import Steps


# per model, weak references to the engines whose jitted steps later engines of the same model and
# key take (`Engine._share_steps`); an engine that took them keeps its donor's steps alive
_STEP_DONORS: "weakref.WeakKeyDictionary[Llama, dict]" = weakref.WeakKeyDictionary()


def grid_slots(policies: Sequence[Policy | Sequence[Policy]], n_layers: int, max_len: int) -> int:
    """The slots of one shape class that holds every layer with a kept table (`KeptTable`) of
    every policy of a grid (the largest such state's capacity at `max_len`): `Engine(slots=)`
    for each of them then runs one set of compiled steps per press, whatever its ratios, budgets
    or per-layer schedule. 0 where no layer has a table."""
    out = 0
    for pol in policies:
        layers = stack_of(pol, n_layers) if isinstance(pol, Policy) else tuple(pol)
        for p in dict.fromkeys(layers):
            if isinstance(p, KeptTable) and p.kept_table(max_len) is not None:
                out = max(out, p.capacity(max_len))
    return out


class Engine(ArgumentChecks, Steps, LayerSteps, Staged, Generation):
    """Runs a `Llama` with a fixed per-layer policy tuple and maximum length (`decode_loop`: how
    generation runs its decode steps, "layers" or "scan"; the module docstring).

    `fit` (n >= 1): `generate` stores each fresh prompt at what its layers kept (`fitted`, each
    layer's policy rounded up to a multiple of n tokens per kv head), for policies that `Fits`.

    `policies`: one per layer (or runs of them, `policy_runs`), or one `Policy` for the whole
    model, which the engine expands with `stack_of(policy, n_layers)`: itself in every layer, or a
    model-level preset's layers (pyramidkv's per-depth budgets, quest's and knorm's dense first
    layers, duo's per-layer head pattern). To run a preset's compressor in every layer instead,
    pass the tuple `(policy,) * n_layers`.

    `slots` (S >= 1, 0: off): shape classes. Every layer whose prompt compressor has a table of
    what it keeps (`kvpolicies.prompt.KeptTable`: the prompt scorers, snapkv's family, pyramidkv's
    layers, adakv; at any ratio or budget whose state fits S slots per kv head) is stored at S
    slots and keeps, after the prompt, the counts of its table, given as data: the engine runs
    `shape_class(S)` policies (`policies`; the exact ones are `exact_policies`), so engines of one
    press at different ratios, and pyramidkv's layers, run the same compiled steps. The same
    tokens are kept and decoded alike as long as at most `max_new` tokens follow the compression
    (`feed`, `continue_generate` and `generate` refuse more; `step` and `score`, whose streams
    recompress, are refused). What a state stores against what it allocates:
    `kvpolicies.memory.filled_bytes(state.cache)` against `tree_nbytes(state.cache)`.

    `share_steps=True`: this engine takes the jitted steps of an earlier engine of the same model
    with equal policies, max_len, cache dtype and RoPE tables that also shares (not on a mesh), so a
    grid's engines compile a step once per shape class, whatever the number of engines; `traces`
    is then the shared count. Off by default: what a step records while it is traced (`attend`'s
    `record_visible`, kvzap's prompt scores in models.llama) is recorded only by the engine that
    traced it."""

    def __init__(self, model: Llama, policies: Policy | Sequence[Policy], max_len: int, cache_dtype=None,
                 repeat: RepeatPrompts | Any = None, rope_tables: bool = True, mesh=None,
                 decode_loop: str = "layers", fit: int = 0, slots: int = 0, share_steps: bool = False):
        self.cfg = model.cfg
        check_policies(policies)
        if isinstance(policies, Policy):  # one policy for the model: its per-layer stack (a model-level
            policies = stack_of(policies, model.cfg.n_layers)  # preset: pyramidkv's budgets, quest's and knorm's dense layers)
        self.policies = tuple(p for a, b, p in policy_runs(policies, model.cfg.n_layers) for _ in range(b - a))
        self.exact_policies = self.policies
        self.max_len = check_int("Engine max_len", max_len, 1)
        if self.max_len > MAX_LEN:
            raise ValueError(f"Engine max_len={self.max_len}: positions are int32, so a sequence holds at most "
                             f"MAX_LEN={MAX_LEN} tokens (2^31 - 2^16: room for kvzip's repeat inputs after it)")
        self.slots = check_int("Engine slots", slots, 0)
        self.keep_tables = None  # per run of `policies`: the kept counts given to a shape class, or None
        self.slot_limit = None  # tokens a slots engine may append after a compression (min max_new)
        if self.slots:
            self._shape_classes(fit, mesh)
        # A fresh prompt is held by each policy's prompt phase, then `after_prompt` (once); the
        # same policies for streaming policies, a dense phase for prompt compressors (snapkv).
        # (`step_phase`: a dense phase whatever it serves, so pyramidkv's layers prefill as one run)
        self.prompt_policies = tuple(step_phase(prompt_policy_of(p)) for p in self.policies)
        self.compresses = self.prompt_policies != self.policies  # some layer's prompt phase differs
        # kvzip: a reconstruction pass between the prompt phase and after_prompt (models.reconstruct
        # reads `reconstructors`, `repeat` and the jitted `recon_step`)
        self.reconstructors = tuple(dict.fromkeys(p for p in self.policies if reconstructs(p)))
        self.repeat = engine_prompts(self.reconstructors, repeat if repeat is not None else tokenizer_of(model))
        self.recon_policies = pass_policies(self.reconstructors, self.prompt_policies)
        self.reconstruct_tokens = 0  # repeat-input tokens fed by reconstruction passes
        self.reconstruct_pad_tokens = 0  # and the pads that bucket their lengths (models.reconstruct.RECON_BUCKET)
        self.prompts_compressed = 0  # how many times after_prompt ran (once per fresh prompt)
        self.prefills = 0  # fresh prompts prefilled (prefill, generate, prompt)
        self.prefills_shared = 0  # prompt states another engine prefilled for this one (evals.prefills)
        self.prefill_tokens = 0  # tokens those prefills and extend_prompt / continue_generate fed
        self.cache_dtype = cache_dtype
        self.graphdef, state = nnx.split(model)
        # each step's arguments: the weights and the RoPE cos/sin tables of positions [0, max_len)
        # (every position this engine feeds, but kvzip's repeat inputs, which fall back to cos/sin)
        # (rope_tables=False: cos/sin computed in every step, the slower path; benchmarks.decode_profile)
        self.params = (state, model.rope_tables(self.max_len) if rope_tables else None)
        self.traces: collections.Counter = collections.Counter()
        self._model = model
        if decode_loop not in ("layers", "scan"):
            raise ValueError(f"Engine decode_loop={decode_loop!r}: expected 'layers' or 'scan'")
        self.decode_loop = decode_loop
        # fit > 0: `generate` stores each fresh prompt's layers at what they kept (`fitted`, rounded
        # to `fit` tokens per kv head); fit_records: one record per fitted prompt (evals' rows)
        self.fit = check_int("Engine fit", fit, 0)
        if self.fit and not any(isinstance(p, Fits) for p in self.policies):
            raise ValueError(f"Engine fit={fit}: no layer's policy can be fit to what it keeps (kvzap); got "
                             f"{sorted({type(p).__name__ for p in self.policies})}")
        self.fit_records: list[dict] = []
        self.shares_layer_steps = False  # a fitted engine's: another engine's layer steps (`share_layer_steps`)
        self.placement = None  # a models.sharding.Placement once on a mesh (`shard`)
        self._jit_steps()
        if share_steps and mesh is None:
            self._share_steps(rope_tables)
        if mesh is not None:
            self.shard(mesh)

    def _shape_classes(self, fit: int, mesh) -> None:
        """`slots`: each layer's policy -> its shape class and kept table (`shape_class_of`)."""
        if fit or mesh is not None:
            raise ValueError(f"Engine slots={self.slots}: not with fit= or mesh= (shape classes run the staged "
                             "protocol on one process's devices)")
        pairs = [shape_class_of(p, self.max_len, self.slots) for p in self.policies]
        if all(t is None for _, t in pairs):
            raise ValueError(f"Engine slots={self.slots}: no layer's policy has a kept table that fits {self.slots} "
                             f"slots per kv head (KeptTable: prompt scorers sized by ratio or budget); got "
                             f"{sorted({type(p).__name__ for p in self.policies})} needing "
                             f"{sorted({p.capacity(self.max_len) for p in self.policies})} slots")
        self.policies = tuple(p for p, _ in pairs)
        self.slot_limit = min(getattr(p, "max_new", 0) for p, (_, t) in zip(self.exact_policies, pairs) if t is not None)
        tables = []
        for a, b, _ in policy_runs(self.policies, self.cfg.n_layers):
            run = [t for _, t in pairs[a:b]]
            tables.append(None if run[0] is None else jnp.asarray(np.stack(run)))  # [n, ...] per layer of the run
        self.keep_tables = tuple(tables)

    def _jit_steps(self) -> None:
        donate = dict(donate_argnums=(1,))
        self._logits_step = jax.jit(self._logits_impl, static_argnames=("prompt", "reach"), **donate)
        self._after_prompt = jax.jit(self._after_prompt_impl)  # new shapes: nothing to donate into
        self._nll_step = jax.jit(self._nll_impl, static_argnames=("reach",), **donate)
        self._decode_n = jax.jit(self._decode_n_impl, static_argnums=(4, 5), **donate)
        self.recon_step = jax.jit(self._recon_impl)  # the prompt state stays usable: no donation
        # layer-by-layer generation (`_decode_layers`): each step is one call per layer, then one
        # call writing every layer's new slots (policy, RoPE kind and bucket static)
        self._layer_step = jax.jit(self._layer_impl, static_argnames=("policy", "local", "reach"))
        # a layer whose token is written in place (kvpolicies.slots.SpareSlot): its state donated
        self._layer_step_in_place = jax.jit(self._layer_impl, static_argnames=("policy", "local", "reach"),
                                            donate_argnums=(1,))
        self._embed_step = jax.jit(self._embed_impl)
        self._next_step = jax.jit(self._next_impl)
        self._head_step = jax.jit(self._head_impl)
        self._write_layers = jax.jit(write_layers, donate_argnums=0)

    _STEPS = ("_logits_step", "_after_prompt", "_nll_step", "_decode_n", "recon_step", "_layer_step",
              "_layer_step_in_place", "_embed_step",
              "_next_step", "_head_step", "_write_layers", "traces")

    def _share_steps(self, rope_tables: bool) -> None:
        """Take the jitted steps of an earlier engine of this model whose steps compute the same
        things (the key below), or offer ours to later ones."""
        key = (self.policies, self.prompt_policies, self.recon_policies, self.max_len, str(self.cache_dtype),
               bool(rope_tables), self.fit)
        donors = _STEP_DONORS.setdefault(self._model, {})
        donor = donors[key]() if key in donors else None  # a weak reference: the registry keeps no engine
        if donor is None:  # (nor, through it, the model that keys it) alive
            donors[key] = weakref.ref(self)
            return
        for name in self._STEPS:
            setattr(self, name, getattr(donor, name))
        self.__dict__["_held_step"] = donor.__dict__.get("_held_step")
        if self.__dict__["_held_step"] is None:
            del self.__dict__["_held_step"]

    def shard(self, mesh) -> "Engine":
        """Put this engine on a `jax.sharding.Mesh` with axes (data, model), or [data, model] devices
        (models.sharding: weights split by their logical axes, batch on data, kv heads on model);
        every step then places its cache and inputs first. Returns the engine."""
        from models.sharding import Placement

        if self.placement is not None:
            raise ValueError(f"Engine.shard: the engine is already on a mesh ({self.placement})")
        pl = Placement(self.cfg, mesh)
        self.params = pl.params(self.params)
        self._logits_step, self._nll_step, self._decode_n = map(pl.step, (self._logits_step, self._nll_step,
                                                                          self._decode_n))
        self.recon_step = pl.step(self.recon_step, returns_cache_only=True)
        self.placement = pl  # (_after_prompt's cache comes from placed steps: jit keeps its shardings)
        return self
