"""Capacity planner: how many concurrent requests of a given context fit on one GPU, per policy.

    python -m evals.planner --model llama-3-8b --context 32768 --gpu-gb 80 --overhead-gb 12 \
        --policy full sink:window=4096 window:window=8192 full:codec=int8

The arithmetic of capacity planning, with every byte taken from `kvpolicies.memory.state_bytes`
(the policy's real state, shaped with `jax.eval_shape`, nothing allocated), so each policy and
codec is counted exactly as it is stored:

    per request  = kv (codes + scales) + meta (slot positions, policy bookkeeping), for
                   sequences up to `context` tokens (window/sink caps the slots, codecs shrink them)
    weights      = 2 bytes x parameter count (bf16), or --weights-gb
    available    = gpu - weights - overhead (activations, workspace, fragmentation)
    requests     = floor(available / per request); cache total = requests x per request

With `--block N` (`plan(..., block=N)`) every row whose policy has a paged layout (full, window,
sink, or `paged` itself: kvpolicies/paged.py) also gets the paged numbers, from the same exact
state shapes and the closed form of the blocks a sequence holds (`live_blocks`):

    block        = one block of all layers: keys + values (codes + scales) of N tokens, their
                   N slot positions and the block's refcount
    per request  = peak blocks x block + its block table (int32 per entry and layer)
    unwritten    = the newest block's empty slots at `context` (internal fragmentation, < N)
    shared       = with `--shared-prefix P`: the prefix's full blocks still live at `context`,
                   stored once for all requests (prefix sharing)
    requests     = floor((available - shared x block - pool flags) / (per request - shared x block))

Every request is counted at its peak (all at `context` tokens at once); paging saves memory when
requests are shorter than the dense reservation or share a prefix, not otherwise (a block's
rounding and the tables cost a little: the columns show how much).

Units: MB/GB are 1e6/1e9 bytes, MiB/GiB 2^20/2^30. A policy spec is `name[:field=value,...]`:
`sink:n_sink=4,window=4096`, `full:codec=int4,codec.group=64` (`codec.` fields go to the codec).
"cache only" columns count the KV cache alone; "GPU total" adds the weights and the overhead.

Equal memory: `--budget 0.25` (a fraction of the full cache's bytes at --context, or an int of
tokens) sizes every policy as `evals.run budget=` does (`evals.config.size_policy`, the same
code), or per spec `sink:budget=0.25`; the table shows each policy as resolved ("resolved as")
and how ("sized", a lowered max_new, or "not sized" for a policy without a token budget). A spec
that cannot be planned is an error line under the table; the others are still planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from kvpolicies.base import Policy
from kvpolicies.budgets import budget_field_of
from kvpolicies.full import Full
from kvpolicies.memory import state_bytes, tree_nbytes
from kvpolicies.paged import Paged
from kvpolicies.sink import Sink
from kvpolicies.window import Window
from models.config import LlamaConfig, shape_config, smollm2_135m
from models.loading import expected_shapes, hf_config

MB, MIB, GB, GIB = 10**6, 2**20, 10**9, 2**30
SCALE_LEAVES = ("scale", "zero")  # leaf names inside k/v that are quantization metadata, not codes
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # config.json model types whose parameters we can count


# ----------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: the cache shape per layer and the parameter count."""

    name: str
    n_layers: int
    kv_heads: int
    head_dim: int
    params: int | None = None  # None when unknown (then weights must be given)
    n_heads: int | None = None  # query heads (None: unknown); kv heads must divide them

    @property
    def weight_bytes(self) -> int | None:
        """bf16 weights: 2 bytes per parameter."""
        return None if self.params is None else 2 * self.params


def count_params(config: LlamaConfig) -> int:
    """Parameters of a Llama-family model: the sum over the canonical layout's tensor shapes."""
    return sum(math.prod(s) for s in jax.tree.leaves(expected_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))


def from_config(config: LlamaConfig) -> ModelShape:
    return ModelShape(config.name, config.n_layers, config.n_kv_heads, config.head_dim, count_params(config),
                      config.n_heads)


def _llama(name: str, V: int, d: int, L: int, N: int, K: int, F: int, **kw: Any) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=N, n_kv_heads=K, head_dim=d // N, d_ff=F,
                       name=name, **kw)


# Published architectures (their config.json); parameter counts follow from the shapes.
PRESET_CONFIGS: dict[str, LlamaConfig] = {
    "llama-3-8b": _llama("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336),  # 8,030,261,248 params
    "llama-3-70b": _llama("Llama-3-70B", 128256, 8192, 80, 64, 8, 28672),  # 70,553,706,496
    "mistral-7b": _llama("Mistral-7B-v0.1", 32000, 4096, 32, 32, 8, 14336),  # 7,241,732,096
    "qwen2-7b": _llama("Qwen2-7B", 152064, 3584, 28, 28, 4, 18944, qkv_bias=True),  # 7,615,616,512
    "smollm2-135m": smollm2_135m(),  # 134,515,008 (tied embeddings)
    "llama-3.1-8b": shape_config("llama-3.1-8b"),  # 8,030,261,248 (Llama-3-8B's shapes, llama3 RoPE scaling)
    "qwen3-8b": shape_config("qwen3-8b"),  # 8,190,735,360 (q/k-norm weights included)
}
PRESETS: dict[str, ModelShape] = {k: from_config(c) for k, c in PRESET_CONFIGS.items()}


def read_hf_config(path: str | pathlib.Path) -> ModelShape:
    """A ModelShape from an HF config.json (or the folder holding one).

    Reads num_hidden_layers, num_key_value_heads (default: num_attention_heads) and head_dim
    (default: hidden_size / num_attention_heads); multimodal configs are read from `text_config`.
    Parameters are counted for the model types the loader reads (llama, mistral, qwen2, qwen3:
    `models.loading.hf_config`, so Qwen2's q/k/v biases and Qwen3's q/k-norm weights count) whose
    config has vocab_size and intermediate_size; otherwise, or where the loader refuses the config,
    they are unknown and weights must be given.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a config.json (a JSON object), got a JSON {type(cfg).__name__}")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
    for key in ("num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"{path}: config.json has no {key!r}")
    n_heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if "hidden_size" not in cfg:
            raise ValueError(f"{path}: config.json has neither 'head_dim' nor 'hidden_size'")
        if int(cfg["hidden_size"]) % n_heads:
            raise ValueError(f"{path}: hidden_size={cfg['hidden_size']} is not divisible by num_attention_heads={n_heads}")
        head_dim = int(cfg["hidden_size"]) // n_heads
    name = str(cfg.get("_name_or_path") or path.parent.name or path.stem)
    shape = ModelShape(name, int(cfg["num_hidden_layers"]), kv_heads, int(head_dim), n_heads=n_heads)
    if cfg.get("model_type") in HF_LLAMA_TYPES and all(k in cfg for k in ("vocab_size", "hidden_size", "intermediate_size")):
        with warnings.catch_warnings():  # a sliding window the loader ignores changes no parameter
            warnings.simplefilter("ignore")
            try:  # no tie flag: counted with an lm_head (the library default, tie_word_embeddings=false)
                config = hf_config(cfg, name, has_lm_head=not cfg.get("tie_word_embeddings", False))
            except ValueError:  # a config the loader refuses (another activation, an o_proj bias)
                return shape
        shape = dataclasses.replace(shape, params=count_params(config))
    return shape


def resolve_model(model: str | pathlib.Path | LlamaConfig | ModelShape) -> ModelShape:
    """A preset name, a config.json path (or its folder), a LlamaConfig or a ModelShape."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, LlamaConfig):
        return from_config(model)
    if isinstance(model, str) and model.lower() in PRESETS:
        return PRESETS[model.lower()]
    p = pathlib.Path(model)
    if p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return read_hf_config(p)
    from evals.config import did_you_mean

    raise ValueError(f"model={str(model)!r}: not a preset{did_you_mean(str(model).lower(), PRESETS)} "
                     f"{sorted(PRESETS)} nor a config.json path")


# ----------------------------------------------------------------------------------------------
# Policies


def _coerce(value: str) -> Any:
    """'4096' -> 4096, '0.5' -> 0.5, 'true'/'false' -> bool, anything else stays a string."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def parse_policy(spec: str) -> Policy:
    """`name[:field=value,...]` -> kvpolicies.get(name, **fields); `codec.f=v` go to the codec.

    Unknown names or fields raise the registry's ValueError, which lists the choices.
    """
    name, fields, codec = parse_spec(spec)
    return kvpolicies.get(name, codec=codec, **fields)


def parse_spec(spec: str) -> tuple[str, dict[str, Any], Any]:
    """(name, fields, codec) of a spec `name[:field=value,...]`; an unknown name is a ValueError
    with a "did you mean"."""
    from evals.config import did_you_mean

    name, _, rest = spec.strip().partition(":")
    if name not in kvpolicies.POLICIES and name not in kvpolicies.ALIASES:
        raise ValueError(f"policy {name!r}: not registered{did_you_mean(name, kvpolicies.POLICIES)}; must be one of "
                         f"{', '.join(sorted(kvpolicies.POLICIES))}")
    fields: dict[str, Any] = {}
    codec_fields: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"policy spec {spec!r}: {item!r} is not field=value")
        key = key.strip()
        if key.startswith("codec."):
            codec_fields[key[len("codec."):]] = _coerce(value.strip())
        elif key == "codec":
            fields[key] = value.strip()
        else:
            fields[key] = _coerce(value.strip())
    codec = fields.pop("codec", "none")
    if codec_fields:
        codec = kvpolicies.get_codec(codec, **codec_fields)
    return name, fields, codec


def sized_policy(spec: str, budget: int | float | None, m: ModelShape, context: int, dtype: Any
                 ) -> tuple[Policy, str]:
    """The policy of `spec` at `budget` (the spec's own `budget=`, unless the policy has a field of
    that name, wins over the run-wide one), sized exactly as `evals.run budget=` sizes it
    (`evals.config.size_policy`: max_len = context, no generated tokens); (policy, how): how is ""
    (no budget), "sized", "sized; max_new 256->64" or "not sized: <why>" (a policy without a token
    budget keeps its spec)."""
    from evals.config import size_policy

    name, fields, codec = parse_spec(spec)
    cls = kvpolicies.POLICIES[kvpolicies.ALIASES.get(name, name)]
    own = {f.name for f in dataclasses.fields(cls)}
    if "budget" in fields and "budget" not in own:
        b = fields.pop("budget")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0 or (isinstance(b, float) and b > 1):
            raise ValueError(f"{spec}: budget={b!r} must be an int >= 1 (tokens) or a float in (0, 1]")
        budget = b
    if budget is None:
        return kvpolicies.get(name, codec=codec, **fields), ""
    if budget_field_of(cls) is None:
        return kvpolicies.get(name, codec=codec, **fields), f"not sized: {name} has no token budget"
    pol, shrunk = size_policy(cls.__name__.lower() if name not in kvpolicies.POLICIES else name, budget, gen=0,
                              fixed=fields, codec=codec, max_len=context, kv_heads=m.kv_heads, head_dim=m.head_dim,
                              dtype=dtype, n_layers=m.n_layers)
    how = "sized" + "".join(f"; {f} {a}->{b}" for f, (a, b) in (shrunk or {}).items())
    return pol, how


def label_of(policy: Policy) -> str:
    """A policy as a spec string: its name, the fields that differ from defaults, and its codec."""
    name = next((k for k, cls in kvpolicies.POLICIES.items() if type(policy) is cls), type(policy).__name__.lower())
    parts = []
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if f.name == "codec" or value == f.default:
            continue
        parts.append(f"{f.name}={value}")
    codec = getattr(policy, "codec", None)
    if codec is not None and codec.name != "none":
        parts.append(f"codec={codec.name}")
        parts += [f"codec.{f.name}={getattr(codec, f.name)}" for f in dataclasses.fields(codec)
                  if f.name != "name" and getattr(codec, f.name) != f.default]
    return name + (":" + ",".join(parts) if parts else "")


# ----------------------------------------------------------------------------------------------
# Bytes


@dataclasses.dataclass(frozen=True)
class RequestBytes:
    """Cache bytes of `batch` sequences of up to `context` tokens, all layers."""

    kv: int  # encoded keys and values: codes + scales
    scales: int  # of which quantization scales/zero points
    meta: int  # slot positions and policy bookkeeping
    slots: int  # cache slots per layer and sequence

    @property
    def codes(self) -> int:
        return self.kv - self.scales

    @property
    def total(self) -> int:
        return self.kv + self.meta


def _scale_bytes(policy: Policy, m: ModelShape, context: int, batch: int, dtype: Any) -> int:
    """Bytes of the k/v leaves named like quantization metadata (scale, zero), all layers."""
    state = jax.eval_shape(lambda: policy.init(batch, m.kv_heads, m.head_dim, dtype, context))
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path((state.k, state.v))[0]:
        names = {getattr(p, "name", getattr(p, "key", None)) for p in path}
        if names & set(SCALE_LEAVES):
            total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    return total * m.n_layers


def kv_bytes(
    model: str | pathlib.Path | LlamaConfig | ModelShape,
    context: int,
    policy: str | Policy = "full",
    dtype: Any = "bfloat16",
    batch: int = 1,
) -> RequestBytes:
    """Exact cache bytes of `batch` sequences of up to `context` tokens under `policy`."""
    m = resolve_model(model)
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    if context < 1:
        raise ValueError(f"context={context}: must be >= 1")
    dt = jnp.dtype(dtype)
    sb = state_bytes(pol, kv_heads=m.kv_heads, head_dim=m.head_dim, max_len=context, n_layers=m.n_layers,
                     batch=batch, dtype=dt)
    return RequestBytes(kv=sb.kv, scales=_scale_bytes(pol, m, context, batch, dt), meta=sb.meta,
                        slots=pol.capacity(context))


# ----------------------------------------------------------------------------------------------
# Paged layout (kvpolicies/paged.py)


def paged_layout(policy: Policy, block: int) -> Paged | None:
    """The paged layout of a policy, blocks of `block` tokens: full, window and sink (codec and
    position mode kept) over pages, a `paged` policy as it is; None for any other policy."""
    if isinstance(policy, Paged):
        return policy
    if type(policy) is Full:
        return Paged(block=block, codec=policy.codec)
    if type(policy) is Window:
        return Paged(block=block, window=policy.window, codec=policy.codec)
    if type(policy) is Sink:
        return Paged(block=block, window=policy.window, n_sink=policy.n_sink, positions=policy.positions,
                     codec=policy.codec)
    return None


def live_blocks(pg: Paged, last: np.ndarray | int) -> np.ndarray:
    """Blocks one sequence holds after writing position `last` (closed form of Paged's freeing
    rule): full every block so far; window/sink the ceil(n_sink / N) sink blocks written so far,
    plus the blocks whose last token is still inside the next query's window."""
    last = np.asarray(last, np.int64)
    hi = last // pg.block  # the newest block
    if pg.window is None:
        return hi + 1
    ns = -(-pg.n_sink // pg.block)
    lo = np.maximum((last - pg.window + 2) // pg.block, ns)  # the oldest live window block
    return np.minimum(ns, hi + 1) + np.maximum(hi - lo + 1, 0)


def _shared_live(pg: Paged, last: int, prefix_blocks: int) -> int:
    """Of the blocks live after `last`, how many are full blocks of the shared prefix."""
    hi = last // pg.block
    if pg.window is None:
        return min(prefix_blocks, hi + 1)
    ns = -(-pg.n_sink // pg.block)
    lo = max((last - pg.window + 2) // pg.block, ns)
    return min(ns, hi + 1, prefix_blocks) + max(min(hi, prefix_blocks - 1) - lo + 1, 0)


@dataclasses.dataclass(frozen=True)
class PagedBytes:
    """A paged request of up to `context` tokens (all layers)."""

    block: int  # tokens per block
    block_bytes: int  # one block: keys + values (codes + scales), slot positions, refcount
    blocks: int  # the most blocks the request holds at once
    table_bytes: int  # its block table
    unwritten: int  # empty slots of its newest block at `context` (internal fragmentation)
    shared_blocks: int  # of its blocks at `context`, full blocks of the shared prefix (stored once)
    pool_bytes: int  # per pool: the exhaustion flag of every layer

    @property
    def total(self) -> int:
        """Bytes of one request alone (nothing shared)."""
        return self.blocks * self.block_bytes + self.table_bytes


def paged_bytes(
    model: str | pathlib.Path | LlamaConfig | ModelShape,
    context: int,
    policy: str | Policy,
    block: int = 16,
    dtype: Any = "bfloat16",
    shared_prefix: int = 0,
) -> PagedBytes | None:
    """Exact bytes of a request under the paged layout of `policy` (None: it has none), from the
    layout's real state shapes (`jax.eval_shape`) and `live_blocks`."""
    m = resolve_model(model)
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    pg = paged_layout(pol, block)
    if pg is None:
        return None
    if context < 1:
        raise ValueError(f"context={context}: must be >= 1")
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix={shared_prefix}: must be >= 0")
    one = jax.eval_shape(lambda: dataclasses.replace(pg, blocks=1).init(1, m.kv_heads, m.head_dim, jnp.dtype(dtype),
                                                                         context))
    block_bytes = tree_nbytes((one.k, one.v, one.pos, one.refs)) * m.n_layers
    peak = int(live_blocks(pg, np.arange(context)).max())
    last = context - 1
    unwritten = (last // pg.block + 1) * pg.block - context  # the newest block's empty tail
    shared = _shared_live(pg, last, min(shared_prefix, context) // pg.block)
    return PagedBytes(block=pg.block, block_bytes=block_bytes, blocks=peak,
                      table_bytes=tree_nbytes(one.table) * m.n_layers, unwritten=unwritten,
                      shared_blocks=shared, pool_bytes=tree_nbytes(one.overflow) * m.n_layers)


def paged_fit(pb: PagedBytes, available: int, shared: bool) -> int:
    """Requests at their peak that fit in `available` bytes (sharing the prefix blocks or not)."""
    s = pb.shared_blocks if shared else 0
    room = available - s * pb.block_bytes - pb.pool_bytes
    return max(room // (pb.total - s * pb.block_bytes), 0)


def plan(
    model: str | pathlib.Path | LlamaConfig | ModelShape,
    context: int,
    gpu_gb: float,
    overhead_gb: float,
    policies: Sequence[str | Policy] = ("full",),
    batch: int = 1,
    dtype: Any = "bfloat16",
    weights_gb: float | None = None,
    block: int | None = None,
    shared_prefix: int = 0,
    budget: int | float | None = None,
) -> list[dict[str, Any]]:
    """One row per policy: bytes per request, how many requests of `context` tokens fit, and
    whether `batch` concurrent requests fit. All byte counts are ints (GB = 1e9 bytes). With
    `block`, the paged numbers too (`paged_*` keys; None for a policy without a paged layout).
    With `budget` (or a spec's own `budget=`), each policy is sized to it as `evals.run` does
    (`sized_policy`): the row's `resolved` is the policy's spec as sized, `sizing` how. A spec that
    cannot be planned is a row with `error` (the others are still planned)."""
    m = resolve_model(model)
    for what, v, lo in (("gpu_gb", gpu_gb, 0.0), ("overhead_gb", overhead_gb, 0.0), ("weights_gb", weights_gb, 0.0)):
        if v is not None and (not math.isfinite(v) or v < lo or (what == "gpu_gb" and v == 0)):
            raise ValueError(f"--{what.replace('_', '-')}={v:g}: must be {'> 0' if what == 'gpu_gb' else '>= 0'}")
    if weights_gb is not None:
        weights = int(round(weights_gb * GB))
    elif m.weight_bytes is not None:
        weights = m.weight_bytes
    else:
        raise ValueError(f"model {m.name!r}: parameter count unknown; give weights_gb (--weights-gb)")
    gpu, overhead = int(round(gpu_gb * GB)), int(round(overhead_gb * GB))
    if gpu - weights - overhead <= 0:
        raise ValueError(f"--gpu-gb={gpu_gb:g}: weights ({fmt_bytes(weights)}) and overhead ({fmt_bytes(overhead)}) "
                         "leave nothing for the cache")
    available = gpu - weights - overhead
    rows = []
    for spec in policies:
        label = spec.strip() if isinstance(spec, str) else label_of(spec)
        try:
            if isinstance(spec, str):
                pol, how = sized_policy(spec, budget, m, context, dtype)
            else:
                pol, how = spec, ""
            one = kv_bytes(m, context, pol, dtype)
        except (ValueError, TypeError) as e:  # this spec: an error row, the others still planned
            rows.append(dict(policy=label, model=m.name, context=context, dtype=str(jnp.dtype(dtype)), error=str(e),
                             batch=batch, gpu_bytes=gpu, weight_bytes=weights, overhead_bytes=overhead,
                             available_bytes=available))
            continue
        many = kv_bytes(m, context, pol, dtype, batch=batch) if batch != 1 else one
        n = available // one.total
        rows.append(dict(
            policy=label, model=m.name, context=context, dtype=str(jnp.dtype(dtype)), slots=one.slots,
            kv_bytes=one.kv, scale_bytes=one.scales, meta_bytes=one.meta, bytes_per_request=one.total,
            gpu_bytes=gpu, weight_bytes=weights, overhead_bytes=overhead, available_bytes=available,
            max_requests=int(n), total_bytes=int(n) * one.total,
            batch=batch, batch_bytes=many.total, batch_fits=many.total <= available,
            headroom_bytes=available - many.total, resolved=label_of(pol), sizing=how,
        ))
        if block is not None:
            pb = paged_bytes(m, context, pol, block, dtype, shared_prefix)
            rows[-1].update(
                paged_block=block, paged_blocks=None if pb is None else pb.blocks,
                paged_block_bytes=None if pb is None else pb.block_bytes,
                paged_unwritten_slots=None if pb is None else pb.unwritten,
                paged_bytes_per_request=None if pb is None else pb.total,
                paged_max_requests=None if pb is None else int(paged_fit(pb, available, False)),
                shared_prefix=shared_prefix, paged_shared_blocks=None if pb is None else pb.shared_blocks,
                paged_max_requests_shared=None if pb is None else int(paged_fit(pb, available, True)),
            )
    return rows


# ----------------------------------------------------------------------------------------------
# CLI


def fmt_bytes(n: float, binary: bool = False) -> str:
    """3 significant digits in the largest unit below n: 134217728 -> '134 MB' (or '128 MiB'),
    17179869184 -> '17.2 GB' (or '16.0 GiB')."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "kB", "MB", "GB", "TB"))
    sign, n = ("-" if n < 0 else ""), abs(n)
    i = 0
    while n >= base * 0.9995 and i < len(units) - 1:  # 999.7 MB prints as 1.00 GB, not 1.00e+03 MB
        n, i = n / base, i + 1
    if not i:
        return f"{sign}{int(n)} B"
    decimals = max(0, 2 - int(math.floor(math.log10(n)))) if n > 0 else 2
    return f"{sign}{n:.{decimals}f} {units[i]}"


def parse_context(text: str) -> int:
    """'32768', '32K' or '32k' (x1024), '1M' (x2^20)."""
    t = text.strip().lower()
    mult = {"k": 2**10, "m": 2**20}.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"context {text!r}: an integer, optionally with K or M (x1024)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"context {text!r}: must be >= 1")
    return value


def format_table(rows: list[dict[str, Any]]) -> str:
    """The plan as aligned text; "cache only" columns count the KV cache alone, "GPU total" adds
    the weights and the overhead. An error row says its error across the columns."""
    batch = rows[0]["batch"]
    ok = [r for r in rows if "error" not in r]
    resolved = any(r.get("sizing") for r in ok)
    head = ["policy"] + (["resolved as", "sizing"] if resolved else []) + [
        "slots", "kv/request", "(scales)", "meta/request", "cache/request", "fit", "cache at fit",
        "GPU total at fit"]
    if batch != 1:
        head += [f"{batch} requests", "fits?"]
    paged = bool(ok) and "paged_block" in ok[0]
    if paged:
        head += [f"blocks of {ok[0]['paged_block']}", "unwritten", "paged/request", "fit (paged)"]
        if ok[0]["shared_prefix"]:
            head += [f"fit (shared {ok[0]['shared_prefix']:,})"]
    body, errors = [], []
    for r in rows:
        if "error" in r:
            errors.append(f"{r['policy']}: error: {r['error']}")
            continue
        line = [r["policy"]] + ([r["resolved"], r["sizing"] or "-"] if resolved else []) + [
            f"{r['slots']:,}", fmt_bytes(r["kv_bytes"]),
            fmt_bytes(r["scale_bytes"]) if r["scale_bytes"] else "-", fmt_bytes(r["meta_bytes"]),
            f"{fmt_bytes(r['bytes_per_request'])} ({fmt_bytes(r['bytes_per_request'], binary=True)})",
            f"{r['max_requests']:,}", fmt_bytes(r["total_bytes"]),
            fmt_bytes(r["weight_bytes"] + r["overhead_bytes"] + r["total_bytes"]),
        ]
        if batch != 1:
            line += [fmt_bytes(r["batch_bytes"]), "yes" if r["batch_fits"] else "no"]
        if paged:
            if r["paged_blocks"] is None:
                line += ["-"] * (4 + bool(r["shared_prefix"]))
            else:
                line += [f"{r['paged_blocks']:,}", f"{r['paged_unwritten_slots']}",
                         fmt_bytes(r["paged_bytes_per_request"]), f"{r['paged_max_requests']:,}"]
                if r["shared_prefix"]:
                    line += [f"{r['paged_max_requests_shared']:,}"]
        body.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    left = 3 if resolved else 1
    out = ["  ".join(x.ljust(w) if j < left else x.rjust(w) for j, (x, w) in enumerate(zip(line, widths)))
           for line in (head, *body)]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out + errors)


def format_header(m: ModelShape, rows: list[dict[str, Any]]) -> str:
    r = rows[0]
    if "error" in r:
        r = {**r, "dtype": r["dtype"], "context": r["context"]}
    params = f"{m.params:,} params, bf16" if m.params is not None and r["weight_bytes"] == m.weight_bytes else "given"
    return "\n".join([
        f"model    {m.name}: {m.n_layers} layers x {m.kv_heads} kv heads x head_dim {m.head_dim}, cache {r['dtype']}",
        f"context  {r['context']:,} tokens per request",
        f"GPU      {fmt_bytes(r['gpu_bytes'])} - weights {fmt_bytes(r['weight_bytes'])} ({params})"
        f" - overhead {fmt_bytes(r['overhead_bytes'])} = {fmt_bytes(r['available_bytes'])} for the cache",
        "columns  cache/request, cache at fit: the KV cache only; GPU total at fit: weights + overhead + that cache",
    ])


def _list() -> str:
    lines = ["presets:"]
    for key, m in PRESETS.items():
        lines.append(f"  {key:14s} {m.n_layers:3d} layers, {m.kv_heads:2d} kv heads, head_dim {m.head_dim:3d}, "
                     f"{m.params:,} params ({fmt_bytes(m.weight_bytes)} bf16)")
    lines.append(f"policies: {', '.join(sorted(kvpolicies.POLICIES))}")
    lines.append(f"codecs:   {', '.join(sorted(kvpolicies.CODECS))}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.planner", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-3-8b", help=f"preset: {', '.join(PRESETS)} (default llama-3-8b)")
    src.add_argument("--config", help="an HF config.json (or its folder) instead of a preset")
    ap.add_argument("--context", type=parse_context, default=32768, help="tokens per request: 32768, 32K, 128K")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, GB (1e9 bytes)")
    ap.add_argument("--overhead-gb", type=float, default=12.0, help="activations, workspace, fragmentation (GB)")
    ap.add_argument("--weights-gb", type=float, help="override the bf16 weight size (GB)")
    ap.add_argument("--kv-heads", type=int, help="what-if: override the kv heads (e.g. 32 for MHA); weights unchanged")
    ap.add_argument("--batch", type=int, default=1, help="also check whether this many concurrent requests fit")
    ap.add_argument("--dtype", default="bfloat16", help="cache dtype before any codec (default bfloat16)")
    ap.add_argument("--policy", nargs="+", default=["full"], metavar="SPEC",
                    help="name[:field=value,...], e.g. full sink:window=4096 full:codec=int8")
    ap.add_argument("--block", type=int, help="also the paged layout (kvpolicies/paged.py) in blocks of this many tokens")
    ap.add_argument("--shared-prefix", type=parse_context, default=0,
                    help="with --block: tokens of a prompt prefix every request shares (stored once)")
    ap.add_argument("--budget", type=_budget_arg,
                    help="size every policy to the same stored bytes, as evals.run budget= does: a float in (0, 1] "
                         "(that fraction of the full cache's bytes at --context) or an int (tokens per layer and kv "
                         "head); a spec's own budget= (sink:budget=0.25) overrides it")
    ap.add_argument("--list", action="store_true", help="list presets, policies and codecs, then exit")
    args = ap.parse_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.batch < 1:
        ap.error(f"--batch={args.batch}: must be >= 1")
    if args.block is not None and args.block < 1:
        ap.error(f"--block={args.block}: must be >= 1")
    if args.shared_prefix and args.block is None:
        ap.error("--shared-prefix needs --block (prefix sharing is a paged layout's)")
    try:
        m = resolve_model(args.config if args.config else args.model)
        if args.kv_heads is not None:
            if args.kv_heads < 1:
                raise ValueError(f"--kv-heads={args.kv_heads}: must be >= 1")
            if m.n_heads and m.n_heads % args.kv_heads:
                ok = [k for k in range(1, m.n_heads + 1) if m.n_heads % k == 0]
                raise ValueError(f"--kv-heads={args.kv_heads}: {m.name}'s {m.n_heads} query heads cannot be grouped "
                                 f"over {args.kv_heads} kv heads (kv heads must divide them: {ok})")
            m = dataclasses.replace(m, kv_heads=args.kv_heads, name=f"{m.name} ({args.kv_heads} kv heads)")
        jnp.dtype(args.dtype)
        rows = plan(m, args.context, args.gpu_gb, args.overhead_gb, args.policy, batch=args.batch, dtype=args.dtype,
                    weights_gb=args.weights_gb, block=args.block, shared_prefix=args.shared_prefix,
                    budget=args.budget)
    except (ValueError, TypeError, FileNotFoundError) as e:
        ap.error(str(e))
    print(format_header(m, rows))
    print()
    print(format_table(rows))
    return 1 if all("error" in r for r in rows) else 0


def _budget_arg(text: str) -> int | float:
    try:
        v: int | float = int(text)
    except ValueError:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a float in (0, 1] or an int of tokens") from None
    if v <= 0 or (isinstance(v, float) and v > 1):
        raise argparse.ArgumentTypeError(f"{text}: a float budget must be in (0, 1], an int >= 1")
    return v


if __name__ == "__main__":
    sys.exit(main())
