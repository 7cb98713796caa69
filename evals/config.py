"""The configuration of `python -m evals.run`: its schema, the config groups, Hydra composition,
and validation with errors in our words.

Groups (`configs/`): model/ (smollm2, gguf, hf, tiny_random, tiny_recall; built by
`evals.zoo`), task/ (perplexity, passkey, niah, multikey, recall, the RULER-style ruler_* and
multiquery of evals/ruler.py; run by the `evals.common.Task`s of `TASKS`), data/ (austen, mobydick, pg, path), and policy/, which has no files: `register_configs`
derives one option per registered policy (`kvpolicies.POLICIES`) from its dataclass fields, so a
new policy needs no config file. `policy_config` says what an option holds: every field at its
dataclass default, except the fields of its `RUN_KEYS` entry, which follow the run-level key
they name (sink's `window: ${window}` and `n_sink: ${n_sink}`), and
`codec`, which follows the run's `${codec}`. So `window=1024` reaches whichever policy uses it and
`policy.<field>=x` sets any field. A file `configs/policy/<name>.yaml`, if one is added, replaces
the derived option of that name (none ships). The typed top-level keys are `RunConfig`.

`budget` (unset by default) sizes the run's policy (`resolve_policy`): an int is tokens per layer
and kv head (the bytes of that many full-precision tokens), a float in (0, 1] the fraction of the
full cache's bytes at the run's length; the policy is sized by `kvpolicies.budgets.sized` so
that its stored bytes (everything it stores) are at most the budget and within one slot of it.
A field set on the command line that the sizing would set is an error, even at its default value
(`validate` records the fields the overrides name in the plain config's `_explicit`); a policy
without a token budget (full, quest, kivi, multires) runs as configured, the run prints a note and
its row says `sized: false`. A budget smaller than the policy's fixed part lowers a field of
`SHRINKABLE` (snapkv-style `max_new`) not given on the command line, down to the run's generation
length, recorded in the row's `budget.shrunk`; otherwise the error names a value that fits
(`size_policy`). Misspelt names get a difflib "did you mean" (`did_you_mean`).

`ratio` (unset by default; not with `budget`) is kvpress's axis: the fraction of the prompt's
tokens removed. A prompt compressor (snapkv, pyramidkv, knorm, random, observed, expected,
adakv, kvzip) gets its `ratio` field: each prompt of n tokens keeps max(1, int(n (1 - ratio))) tokens
per kv head, windows and sinks included (`PromptScored.kept_for`; kvzip: K n - int(K n ratio) per
layer, shared by its heads). A sizable streaming policy (window, sink, h2o, tova) is sized by `for_tokens(int(n (1 - ratio)))` for the run's
longest prompt n (`task_extent`). Others run as configured ("not sized").

`validate` checks what Hydra does not (task and model names, ranges, the task's own keys, the
policy as built), so a bad command line fails before anything runs, with one `ConfigError` that
names the valid choices. Then `check_inputs` (called by `validate`) checks what the run will read
and write, still before any weights load or compute: the model's files (`evals.zoo.describe`),
the text (exists, readable, UTF-8, long enough in bytes for `tokens`), retrieval lengths within
the model's trained context (`max_position`; `task.extrapolate=true` allows longer), a memory estimate
against this machine, and that the results location is writable. What needs the tokenizer (the
exact token count of the text, prompts too short for their template) is `check_text`, run once
the tokenizer has loaded and before the weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

import kvpolicies
from kvpolicies.budgets import budget_field_of
from kvpolicies.presets import stack_of
from kvpolicies.prompt import prompt_policy_of

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "policy", "task", "data")

# Task name -> its `evals.common.Task` (what runs it and the hooks the run asks it), or "module:NAME"
# of one, imported when a run needs it. A task of your own: docs/guide/eval-task.md.
TASKS: dict[str, Any] = {
    "perplexity": "evals.perplexity:TASK",
    "passkey": "evals.retrieval:PASSKEY",
    "niah": "evals.retrieval:NIAH",
    "multikey": "evals.retrieval:MULTIKEY",
    "recall": "evals.retrieval:RECALL",
    # RULER-style tasks and the SCBench-style multi-query task (evals/ruler.py), one Task
    **{name: "evals.ruler:TASK" for name in ("ruler_niah_single", "ruler_niah_multikey", "ruler_niah_multivalue",
                                              "ruler_niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe",
                                              "multiquery")},
    # RULER's 13 tasks under RULER's own names (evals/ruler13.py; kvpress's leaderboard)
    **{name: f"evals.ruler:NAMED_TASKS.{name}" for name in (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")},
    "multiturn": "evals.multiturn:TASK",  # one context, N turns of question + answer (evals/multiturn.py)
    "longgen": "evals.longgen:TASK",  # long greedy generations against full's own (evals/longgen.py)
}
RULER_TASKS = tuple(n for n, f in TASKS.items() if f == "evals.ruler:TASK")


@dataclasses.dataclass
class RunConfig:
    """The schema of configs/config.yaml: the groups, then typed top-level keys."""

    model: Any = MISSING
    policy: Any = MISSING
    task: Any = MISSING
    data: Any = MISSING
    window: int = 4096
    n_sink: int = 4
    codec: str = "none"
    budget: Any = None  # int tokens per layer and kv head, or float fraction of full's bytes
    ratio: Any = None  # kvpress's compression ratio: the fraction of the prompt's tokens removed
    tokens: int = 12288
    chunk: int = 512
    seed: int = 0
    results: str = "results/results.jsonl"
    progress: bool = True
    force: bool = False
    mesh: Any = None  # [data, model]: run the engines sharded on that many devices (models/sharding.py)
    distributed: str = "off"  # off | auto | I/N@HOST:PORT: one model over N processes (jax.distributed; evals.run)
    fit: int = 0  # n >= 1: store each prompt's layers at what they kept (kvzap's threshold), n tokens per head


class ConfigError(ValueError):
    """A configuration problem, reported as one message (no traceback) by the CLI."""


def did_you_mean(word: Any, choices: Any) -> str:
    """' (did you mean 'sink'?)' for the closest of `choices` to `word` (difflib), else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- config store and composition ---------------------------------------------------------------


# registry name -> {field: the run-level config key it follows in `python -m evals.run`}: `window=1024`
# reaches sink's and window's `window`; every other field takes its dataclass default, and `codec`
# always follows the run's codec. A CLI concern, so it lives here rather than on the policy classes.
RUN_KEYS: dict[str, dict[str, str]] = {
    "window": {"window": "window"},
    "sink": {"window": "window", "n_sink": "n_sink"},
    "multires": {"window": "window"},
}


def run_keys(name: str) -> dict[str, str]:
    """{field: run-level key} of policy `name` (or an alias): the fields that follow a run-level key."""
    return RUN_KEYS.get(kvpolicies.ALIASES.get(name, name), {})


def policy_config(name: str) -> dict[str, Any]:
    """The `policy=<name>` option, derived from the registered class: `name`, each field at its
    default or `${key}` for a field of `run_keys(name)`, then `codec: ${codec}`. A field without a
    default is required (`???`); one whose default is not a scalar (bool, int, float, str) is left
    out (it keeps its default and cannot be set from the command line), and so is a field the engine
    sets (`metadata={"engine": True}`: a shape class's `slots`)."""
    cls = kvpolicies.POLICIES[name]
    follows = run_keys(name)
    node: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(cls):
        if f.name == "codec" or not f.init or f.metadata.get("engine"):  # engine-set (a shape class's slots)
            continue
        if f.name in follows:
            node[f.name] = "${" + follows[f.name] + "}"
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            node[f.name] = MISSING
        elif isinstance(f.default, (bool, int, float, str)):
            node[f.name] = f.default
    node["codec"] = "${codec}"
    return node


def register_configs() -> None:
    """Put the schema and a derived option per registered policy (see `policy_config`) into Hydra's
    ConfigStore, except a policy with its own configs/policy/<name>.yaml, and the `defaults` of each
    task of TASKS without its configs/task/<name>.yaml. Idempotent: called before every
    composition, so policies and tasks registered later are seen."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    files = {p.stem for p in (CONFIG_DIR / "policy").glob("*.yaml")}
    for name in [*kvpolicies.POLICIES, *kvpolicies.ALIASES]:  # policy=hier builds multires (its row says so)
        if name not in files:
            cs.store(group="policy", name=name, node=policy_config(kvpolicies.ALIASES.get(name, name)))
    from kvpolicies.compat import SUPPORTED

    for press in SUPPORTED:  # policy=kvpress.SnapKVPress ratio=0.5: kvpolicies.compat.kvpress
        cs.store(group="policy", name=f"kvpress.{press}", node={"name": f"kvpress.{press}", "ratio": "${ratio}"})
    task_files = {p.stem for p in (CONFIG_DIR / "task").glob("*.yaml")}
    for name in TASKS:  # a task registered in code, without configs/task/<name>.yaml: its Task's defaults
        if name not in task_files and load_task(name).defaults is not None:
            cs.store(group="task", name=name, node={**load_task(name).defaults, "name": name})


def group_options(group: str) -> list[str]:
    """The options of a config group (yaml files and ConfigStore entries)."""
    register_configs()
    from hydra.core.config_store import ConfigStore

    files = {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}
    try:
        stored = {n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)}
    except OSError:  # nothing stored in this group
        stored = set()
    return sorted(files | stored)


def compose(overrides: list[str] = ()) -> DictConfig:
    """The composed config for these overrides (Hydra's compose API), errors as ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        except Exception as e:  # Hydra / OmegaConf errors: explain them in our words
            raise ConfigError(explain(e, list(overrides))) from None
    _COMPOSED.append((cfg, list(overrides)))  # what was given, for `validate` (explicit fields)
    del _COMPOSED[:-64]
    return cfg


# The last configs `compose` returned, with their overrides: `validate` reads which policy fields the
# command line set (an explicit value equal to the default is still explicit).
_COMPOSED: list[tuple[DictConfig, list[str]]] = []


def _given_overrides(cfg: Any) -> list[str] | None:
    """The overrides that composed `cfg`: from `compose`, or Hydra's job overrides inside a Hydra job;
    None when unknown (a plain dict)."""
    for c, over in reversed(_COMPOSED):
        if c is cfg:
            return over
    if isinstance(cfg, DictConfig):
        try:
            from hydra.core.hydra_config import HydraConfig

            return list(HydraConfig.get().overrides.task)
        except (ValueError, AttributeError):  # not inside a Hydra job
            return None
    return None


def overridden_fields(name: str, overrides: list[str]) -> list[str]:
    """The fields of policy `name` set by `overrides`: `policy.<field>=...`, or a run-level key that
    the field follows (`window=...` for sink's and window's `window`), whatever the value."""
    out = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.startswith("policy."):
            out.append(key[len("policy."):])
        out += [f for f, k in run_keys(name).items() if k == key]
    return sorted(set(out) - {"name", "codec"})


def _typename(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def explain(exc: Exception, overrides: list[str]) -> str:
    """One clear message for a Hydra/OmegaConf composition error, with the valid choices."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group = Path(exc.missing_cfg_file or "").parent.name or "?"
        bad = Path(exc.missing_cfg_file or "").name
        return (f"{group}={bad}: no such {group}{did_you_mean(bad, exc.options)}; choose one of: "
                f"{', '.join(sorted(exc.options))}")
    cause = exc.__cause__ or exc.__context__ or exc
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and full_key:
        parent = getattr(cause, "parent_node", None)
        valid = sorted(str(k) for k in parent.keys() if k != "hydra") if isinstance(parent, DictConfig) else []
        if "." in full_key:
            where = full_key.rsplit(".", 1)[0]
            name = OmegaConf.select(parent, "name", default=None) if isinstance(parent, DictConfig) else None
            scope = f"{where} {name!r}" if name else where
        else:
            scope, valid = "the config", sorted(set(valid) | set(GROUPS))
        return f"{full_key}: unknown key{did_you_mean(full_key.rsplit('.', 1)[-1], valid)}; {scope} has keys: " \
            f"{', '.join(valid)}"
    if isinstance(cause, ValidationError) and full_key:
        fields = {f.name: f.type for f in dataclasses.fields(RunConfig)}
        want = fields.get(full_key)
        value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == full_key), None)
        if want is not None:
            return f"{full_key}={value}: {full_key} must be {_typename(want)}"
        return f"{full_key}={value}: {cause.msg if hasattr(cause, 'msg') else cause}"
    from hydra.errors import OverrideParseException

    if isinstance(exc, OverrideParseException) or isinstance(cause, OverrideParseException):
        e = exc if isinstance(exc, OverrideParseException) else cause
        return f"{getattr(e, 'override', '') or ''}: not a valid override ({' '.join(str(e.message if hasattr(e, 'message') else e).split())})".lstrip(": ")
    return " ".join(str(exc).split())


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data; a required value left at ??? is a ConfigError."""
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required: pass {e.full_key}=...") from None
    except InterpolationResolutionError as e:
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {e.msg if hasattr(e, 'msg') else e}") from None


# -- validation ---------------------------------------------------------------------------------


def build_policy(pcfg: dict[str, Any]) -> kvpolicies.Policy:
    """A policy from its config group (`name`, `codec`, fields); bad names/fields: ConfigError."""
    fields = dict(pcfg)
    name, codec = fields.pop("name", None), fields.pop("codec", "none")
    if isinstance(name, str) and name.startswith("kvpress."):
        from kvpolicies.compat import kvpress

        if fields.get("ratio") is None:
            raise ConfigError(f"policy={name}: give ratio= (kvpress's compression ratio, e.g. ratio=0.5)")
        try:
            return kvpress(name.removeprefix("kvpress."), fields.pop("ratio"), **fields)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise ConfigError(f"policy={name}: {e}") from None
    try:
        return kvpolicies.get(name, codec=codec, **fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"policy: {e}") from None


def resolve_policy(conf: dict[str, Any]) -> tuple[kvpolicies.Policy, dict[str, Any] | None]:
    """The run's policy and, when `budget` is set, how it was sized ({budget, sized, target_bytes,
    stored_bytes} per layer, or sized=False with the reason). See the module docstring."""
    from kvpolicies import budgets
    from kvpolicies.memory import state_bytes

    from evals import zoo

    policy = build_policy(conf["policy"])
    if conf["policy"]["name"].startswith("kvpress."):  # kvpolicies.compat: sized by ratio already
        from kvpolicies.budgets import context_kept

        extent = task_extent(conf)
        return policy, {"ratio": conf["ratio"], "sized": True, "rule": conf["policy"]["name"],
                        "prompt_tokens": extent[1] if extent else None,
                        "kept_per_head": context_kept(policy, extent[1]) if extent else None}
    if conf.get("ratio") is not None:
        return ratio_policy(conf, policy)
    b = conf.get("budget")
    if b is None:
        return policy, None
    name = conf["policy"]["name"]
    cls = kvpolicies.POLICIES[name]
    field = budget_field_of(cls)
    if field is None:
        return policy, {"budget": b, "sized": False, "why": f"{name} has no token budget (it cannot be sized)"}
    extent = task_extent(conf)
    try:
        mc = zoo.describe(conf["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if extent is None or mc is None:
        raise ConfigError(f"budget={b}: task={conf['task']['name']} with model={conf['model']['name']} declares no "
                          "length or dimensions to size a cache for")
    explicit = explicit_fields(conf)
    if field in explicit:
        via = f" (policy.{field} also follows {run_keys(name)[field]}=)" if field in run_keys(name) else ""
        raise ConfigError(f"budget={b} and policy.{field}={explicit[field]} both size the cache of {name}: give "
                          f"one of them{via}")
    kw = dict(max_len=extent[1] + extent[2], kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, dtype=zoo.dtype(conf["model"]))
    try:
        sized, shrunk = size_policy(name, b, gen=extent[2], codec=conf["policy"].get("codec", "none"), fixed=explicit,
                                    prefix="policy.", n_layers=mc.n_layers, **kw)
    except ValueError as e:
        raise ConfigError(f"budget={b}: {e}") from None
    target = budgets.target_bytes(b, **{k: kw[k] for k in ("max_len", "kv_heads", "head_dim", "dtype")})
    stored = state_bytes(sized, **kw).total
    return sized, {"budget": b, "sized": True, "target_bytes": target, "stored_bytes": stored,
                   "slots": sized.capacity(kw["max_len"]), **({"shrunk": shrunk} if shrunk else {})}


SHRINKABLE = ("max_new",)  # fields the sizing may lower to fit a budget, down to the run's generation length


def size_policy(name: str, budget: int | float, *, gen: int, fixed: dict[str, Any], codec: Any = "none",
                prefix: str = "", max_len: int, kv_heads: int, head_dim: int, dtype, n_layers: int | None = None
                ) -> tuple[kvpolicies.Policy, dict[str, list[int]] | None]:
    """`_size_layer`, and for a preset whose stack keeps other layers (knorm's dense first layers;
    given `n_layers`) the compressor's layers sized to what the budget leaves after those layers'
    stored bytes, so that the model's total stays within n_layers x the per-layer budget."""
    from kvpolicies import budgets
    from kvpolicies.memory import state_bytes

    dims = dict(max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    args = dict(gen=gen, fixed=fixed, codec=codec, prefix=prefix, **dims)
    pol, shrunk = _size_layer(name, budget, **args)
    if n_layers is None:
        return pol, shrunk
    stack = stack_of(pol, n_layers)
    others = [p for p in stack if p != pol]
    if not others or len(others) == len(stack):
        return pol, shrunk
    target = budgets.target_bytes(budget, **dims)
    left = n_layers * target - sum(state_bytes(p, **dims).total for p in others)
    if left <= 0:
        raise budgets.BudgetTooSmall(f"{name}'s {len(others)} uncompressed layers alone store more than the model's budget of "
                         f"{n_layers * target:,} bytes: raise the budget")
    per_layer = left / (len(stack) - len(others)) / budgets.target_bytes(1.0, **dims)
    return _size_layer(name, per_layer, **args)


def _size_layer(name: str, budget: int | float, *, gen: int, fixed: dict[str, Any], codec: Any = "none",
                prefix: str = "", max_len: int, kv_heads: int, head_dim: int, dtype
                ) -> tuple[kvpolicies.Policy, dict[str, list[int]] | None]:
    """`kvpolicies.budgets.sized`, and when the budget is too small for the policy's fixed part: a
    field of SHRINKABLE not in `fixed` (snapkv's `max_new` decode slots) halved until the policy fits,
    never below `gen` (the tokens the run generates after its prompt) nor 1. Returns (policy,
    {field: [from, to]} or None). Still too small: ValueError naming a field value that would fit
    (`snapkv.max_new=16`, or `policy.max_new=16` with `prefix` "policy." for evals.run) or says to
    raise the budget."""
    from kvpolicies import budgets

    dims = dict(max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, codec=codec)
    try:
        return budgets.sized(name, budget, **dims, **fixed), None
    except ValueError as e:
        if not isinstance(e, budgets.BudgetTooSmall):
            raise
        error = str(e)
    cls = kvpolicies.POLICIES[name]
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if isinstance(f.default, int)
                and not isinstance(f.default, bool)}

    def fits(**extra) -> kvpolicies.Policy | None:
        try:
            return budgets.sized(name, budget, **dims, **fixed, **extra)
        except ValueError:
            return None

    for field in SHRINKABLE:
        if field in defaults and field not in fixed:
            v = defaults[field] // 2
            while v >= max(gen, 1):
                pol = fits(**{field: v})
                if pol is not None:
                    return pol, {field: [defaults[field], v]}
                v //= 2
    # no automatic way out: name a field value that fits, else the budget it needs
    for field, default in defaults.items():
        if field == budget_field_of(cls):
            continue
        v = fixed.get(field, default) // 2
        while v >= (max(gen, 1) if field in SHRINKABLE else 1):
            try:
                budgets.sized(name, budget, **dims, **{**fixed, field: v})
            except ValueError:
                v //= 2
                continue
            hint = f"{prefix}{field}={v}" if prefix else f"{name}.{field}={v}"
            raise budgets.BudgetTooSmall(f"{error}; it fits with {hint} (or a larger budget)")
    raise budgets.BudgetTooSmall(f"{error}; raise the budget (no smaller setting of {name}'s fixed fields fits it)")


def explicit_fields(conf: dict[str, Any]) -> dict[str, Any]:
    """The policy fields set on the command line: those the overrides name (`validate` records
    them in `_explicit`), else those that differ from the option as derived with the defaults."""
    if "_explicit" in conf:
        return {f: conf["policy"][f] for f in conf["_explicit"] if f in conf["policy"]}
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    derived = policy_config(conf["policy"]["name"])
    explicit = {}
    for field, value in conf["policy"].items():
        if field in ("name", "codec"):
            continue
        d = derived.get(field)
        if isinstance(d, str) and d.startswith("${"):
            d = defaults.get(d[2:-1])
        if value != d:
            explicit[field] = value
    return explicit


def ratio_policy(conf: dict[str, Any], policy: kvpolicies.Policy) -> tuple[kvpolicies.Policy, dict[str, Any]]:
    """The run's policy sized by `ratio` (kvpress's compression ratio; the module docstring), and
    how: {ratio, sized, rule, prompt_tokens, kept_per_head} or sized=False with the reason."""
    from kvpolicies.budgets import context_kept

    r = conf["ratio"]
    name = conf["policy"]["name"]
    cls = type(policy)
    fields = {f.name for f in dataclasses.fields(cls)}
    extent = task_extent(conf)
    n = extent[1] if extent else None
    if "ratio" in fields:
        if "ratio" in explicit_fields(conf):
            raise ConfigError(f"ratio={r} and {name}.ratio={conf['policy']['ratio']} both size the cache: give one")
        sized = dataclasses.replace(policy, ratio=r)
        return sized, {"ratio": r, "sized": True, "rule": "per prompt: max(1, int(n (1 - ratio))) per kv head",
                       "prompt_tokens": n, "kept_per_head": context_kept(sized, n) if n else None}
    if budget_field_of(cls) is None:
        return policy, {"ratio": r, "sized": False, "why": f"{name} has no token budget (it cannot be sized)"}
    if n is None:
        raise ConfigError(f"ratio={r}: task={conf['task']['name']} declares no prompt length to size {name} for")
    explicit = explicit_fields(conf)
    kept = max(1, int(n * (1 - r)))
    try:
        sized = cls.for_tokens(kept, codec=policy.codec, **explicit)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"ratio={r}: {name}: {e}") from None
    return sized, {"ratio": r, "sized": True, "rule": f"for_tokens(int(n (1 - ratio))), n = {n}",
                   "prompt_tokens": n, "kept_per_head": context_kept(sized, n)}


def load_task(name: str):
    """The `evals.common.Task` of TASKS[name] (imported now; a plain function there is its `run`).
    Calling it runs the task."""
    from evals.common import Task

    spec = TASKS[name]
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        try:
            spec = importlib.import_module(module)
            for part in attr.split("."):  # "module:NAME" or "module:DICT.key"
                spec = spec[part] if isinstance(spec, dict) else getattr(spec, part)
        except (ImportError, AttributeError, KeyError) as e:
            raise ConfigError(f"task={name}: cannot load {TASKS[name]} ({e})") from None
    return spec if isinstance(spec, Task) else Task(run=spec)


def task_later_keys(task: dict[str, Any]) -> dict[str, Any]:
    """The keys of a task config added after saved rows were keyed, with their defaults (the task's
    `later_keys`): at its default, such a key is left out of the run key."""
    return dict(load_task(task["name"]).later_keys)


def task_cells(task: dict[str, Any]) -> int:
    """How many sequences of its longest extent a task config's run computes (the task's `cells`)."""
    return load_task(task["name"]).cells(task)


DATA_KEYS = {"name", "spec", "path"}


def validate(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """Resolve and check what Hydra does not: unknown keys, the task name, the model kind, the
    policy (built, so its own range checks run), the top-level ranges; then `check_inputs`.
    Returns the plain config."""
    from evals.zoo import MODELS

    conf = to_plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    overrides = _given_overrides(cfg)
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(k for k in set(conf) - known if not k.startswith("_"))
    if unknown:  # `+foo=1` adds a key Hydra's schema does not stop
        raise ConfigError(f"{unknown[0]}: unknown key{did_you_mean(unknown[0], known)}; the config has keys: "
                          f"{', '.join(sorted(known))}")
    if isinstance(conf["task"].get("tasks"), list):
        listed = ", ".join(map(str, conf["task"]["tasks"]))
        raise ConfigError(f"task={conf['task'].get('name')}: a set of tasks ({listed}); "
                          f"run it with `python -m evals.suite tasks={conf['task'].get('name')} ...`, or pick one task")
    if conf["task"].get("name") not in TASKS:
        raise ConfigError(f"task.name={conf['task'].get('name')!r}: must be one of {sorted(TASKS)}"
                          f"{did_you_mean(conf['task'].get('name'), TASKS)}")
    if conf["model"].get("name") not in MODELS:
        raise ConfigError(f"model.name={conf['model'].get('name')!r}: must be one of {sorted(MODELS)}"
                          f"{did_you_mean(conf['model'].get('name'), MODELS)}")
    unknown = sorted(set(conf["data"]) - DATA_KEYS)
    if unknown:
        raise ConfigError(f"data.{unknown[0]}: unknown key; data {conf['data'].get('name')!r} has keys: "
                          f"{', '.join(sorted(set(conf['data']) - set(unknown)))}")
    for key, lo in (("tokens", 1), ("chunk", 1), ("window", 1), ("n_sink", 0), ("seed", 0)):
        if conf[key] < lo:
            raise ConfigError(f"{key}={conf[key]}: must be >= {lo}")
    b = conf.get("budget")
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0
                          or (isinstance(b, float) and b > 1)):
        raise ConfigError(f"budget={b!r}: must be an int >= 1 (tokens per layer and kv head) or a float in "
                          "(0, 1] (fraction of the full cache's bytes)")
    r = conf.get("ratio")
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1):
        raise ConfigError(f"ratio={r!r}: must be a number in [0, 1) (kvpress's compression ratio: the fraction "
                          "of the prompt's tokens removed)")
    if r is not None and b is not None:
        raise ConfigError(f"ratio={r} and budget={b}: give one (ratio: tokens kept, kvpress's axis; budget: bytes)")
    task = load_task(conf["task"]["name"])  # importable now, not after a long sweep
    if task.check is not None:
        try:
            task.check(dict(conf["task"]))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if conf["data"].get("name") == "path" and not Path(conf["data"]["spec"]).is_file():
        what = "a folder, not a text file" if Path(conf["data"]["spec"]).is_dir() else "no such file"
        raise ConfigError(f"data.path={conf['data']['spec']}: {what}")
    if conf["codec"] not in kvpolicies.CODECS:
        raise ConfigError(f"codec={conf['codec']!r}: must be one of {sorted(kvpolicies.CODECS)}")
    check_distributed(conf.get("distributed", "off"))
    check_mesh(conf.get("mesh"))
    if overrides is not None and conf["policy"].get("name") in kvpolicies.POLICIES:
        conf["_explicit"] = overridden_fields(conf["policy"]["name"], overrides)
    policy, _ = resolve_policy(conf)
    check_fit(conf, policy)
    check_inputs(conf, policy)
    return conf


def check_fit(conf: dict[str, Any], policy: kvpolicies.Policy) -> None:
    """`fit` is an int >= 0, and a policy that can be fit to what it keeps when it is set."""
    from kvpolicies.budgets import Fits

    f = conf.get("fit", 0)
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ConfigError(f"fit={f!r}: must be an int >= 0 (0: off; n: layers stored at what they kept, "
                          "rounded to n tokens per kv head)")
    if f and not isinstance(policy, Fits):
        raise ConfigError(f"fit={f}: policy {type(policy).__name__} is not fit to what it keeps; fit applies to "
                          "kvzap (policy.rule=threshold)")


# -- inputs and outputs, before anything loads --------------------------------------------------


def _data_field(conf: dict[str, Any]) -> str:
    return f"data.path={conf['data']['spec']}" if conf["data"].get("name") == "path" else \
        f"data={conf['data'].get('name')} (spec {conf['data']['spec']!r})"


def task_extent(conf: dict[str, Any]) -> tuple[str, int, int, int] | None:
    """(the config field, prompt or stream length, tokens generated after it, batch) of the run's
    longest sequence, or None for a task that declares none (the task's `extent`)."""
    task = load_task(conf["task"]["name"])
    return None if task.extent is None else task.extent(conf["task"])


def memory_limit() -> tuple[int, str]:
    """(bytes, what): the memory of the device the run computes on (an accelerator's limit, else
    this machine's physical RAM)."""
    import jax

    d = jax.local_devices()[0]  # (distributed=: this process's device)
    stats = d.memory_stats() if d.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"the {d.device_kind}'s memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def memory_estimate(mc, policy: kvpolicies.Policy, max_len: int, batch: int, chunk: int, dtype) -> dict[str, int]:
    """A lower bound on the bytes a run needs at once (model config `mc`): the cache of every layer
    (exact state bytes of the policy, and of its prompt phase if larger, for `batch` sequences of
    `max_len` tokens), one layer's attention scores for a chunk (float32, chunk x slots per query
    head), the chunk's logits (float32) and the weights."""
    import jax.numpy as jnp

    from kvpolicies import memory as km

    from models.stacks import model_stack

    dtype = jnp.dtype(dtype)
    chunk = min(chunk, max_len)
    layers = model_stack(mc, policy)  # the per-layer policies the run uses (presets, duo's patterns, hybrids)

    def nbytes(p: kvpolicies.Policy) -> int:
        return km.state_bytes(p, kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=max_len, batch=batch,
                              dtype=dtype).total

    per_layer = {p: max(nbytes(p), nbytes(prompt_policy_of(p))) for p in set(layers)}
    cache = sum(per_layer[p] for p in layers)
    slots = max(max(p.capacity(max_len), prompt_policy_of(p).capacity(max_len)) for p in set(layers))
    d, L = mc.d_model, mc.n_layers
    params = mc.vocab_size * d * (1 if mc.tie_embeddings else 2) + L * (
        d * mc.head_dim * 2 * (mc.n_heads + mc.n_kv_heads) + 3 * d * mc.d_ff)
    return {"cache": int(cache), "scores": batch * mc.n_heads * chunk * (slots + chunk) * 4,
            "logits": batch * chunk * mc.vocab_size * 4, "weights": params * dtype.itemsize}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_inputs(conf: dict[str, Any], policy: kvpolicies.Policy | None = None) -> None:
    """What the run will read and write, checked before any weights load (see the module
    docstring); each problem is one ConfigError naming the field, file or path."""
    from evals import results as R
    from evals import zoo
    from evals.data import load_text

    policy = policy if policy is not None else build_policy(conf["policy"])
    try:
        mc = zoo.describe(conf["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mc is not None:
        from models.stacks import model_stack

        try:  # the per-layer policies now (a model-level preset's: duo reads and checks its pattern file)
            model_stack(mc, policy)
        except ValueError as e:
            raise ConfigError(f"policy={policy_name(policy)}: {e}") from None
    if zoo.has_tokenizer(conf["model"]):
        try:
            text = load_text(conf["data"]["spec"])
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{_data_field(conf)}: {e}") from None
        if conf["task"]["name"] == "perplexity":
            n, nbytes = conf["task"]["tokens"], len(text.encode("utf-8"))
            if nbytes < n:  # at most one token per byte (+ a prefix): nbytes + 1 tokens, and the stream needs n + 1
                raise ConfigError(f"tokens={n}: the text of {_data_field(conf)} has {nbytes} bytes, so at most "
                                  f"{nbytes + 1} tokens; tokens={n} needs {n + 1} (the stream and its next token)")
    extent = task_extent(conf)
    if mc is not None and extent is not None:
        field, length, gen, batch = extent
        if gen and length > mc.max_position and not conf["task"].get("extrapolate"):  # perplexity may stream past
            raise ConfigError(f"{field}: {length} tokens is past the trained context length of "
                              f"model={conf['model']['name']} ({mc.max_position} tokens, its max_position); "
                              "pass task.extrapolate=true to run it anyway")
        est = memory_estimate(mc, policy, length + gen, batch, conf["chunk"], conf["model"].get("dtype", "float32"))
        limit, where = memory_limit()
        if sum(est.values()) > limit:
            parts = ", ".join(f"{k} {_gb(v)}" for k, v in est.items())
            raise ConfigError(f"{field}: needs at least {_gb(sum(est.values()))} ({parts}; {length + gen} tokens x "
                              f"batch {batch} under policy={policy_name(policy)}), more than {where} "
                              f"({_gb(limit)}); ask for fewer tokens or use a bounded policy (e.g. policy=sink)")
    try:
        R.check_writable(conf["results"])
    except OSError as e:
        raise ConfigError(f"results={conf['results']}: {e}") from None


def check_mesh(mesh: Any) -> None:
    """`mesh` is null or [data, model], two ints >= 1 whose product is the number of devices (a
    ConfigError listing the devices otherwise), checked before anything loads."""
    if mesh is None:
        return
    if not (isinstance(mesh, (list, tuple)) and len(mesh) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh)):
        raise ConfigError(f"mesh={_list(mesh)}: must be [data, model], two ints >= 1 (e.g. mesh=[2,4]), or null")
    from models.sharding import make_mesh

    try:
        make_mesh(*mesh)
    except ValueError as e:
        raise ConfigError(f"mesh={_list(mesh)}: {e}") from None


DISTRIBUTED = "off | auto | I/N@HOST:PORT (process I of N, the coordinator at HOST:PORT)"


def distributed_args(value: Any) -> dict[str, Any] | None:
    """`distributed`'s arguments of `jax.distributed.initialize`: None for off (one process), {} for
    auto (JAX finds the cluster: SLURM's srun, Open MPI's mpirun, a TPU pod, Kubernetes; the coordinator
    from $JAX_COORDINATOR_ADDRESS where set), and coordinator_address, num_processes, process_id for
    I/N@HOST:PORT. ConfigError for anything else."""
    import re

    text = str(value).strip()
    if text.lower() in ("off", "none", "false"):
        return None
    if text.lower() == "auto":
        return {}
    m = re.fullmatch(r"(\d+)/(\d+)@(\S+):(\d+)", text)
    if m is None or not int(m[1]) < int(m[2]):
        raise ConfigError(f"distributed={value}: must be {DISTRIBUTED}, with 0 <= I < N (e.g. "
                          "distributed=0/2@host0:1234)")
    return {"coordinator_address": f"{m[3]}:{m[4]}", "num_processes": int(m[2]), "process_id": int(m[1])}


def check_distributed(value: Any) -> None:
    """`distributed` parses (`distributed_args`), and when it is not off, jax.distributed was started by
    the command (evals.run starts it before anything else; other commands do not), with the number of
    processes it names. ConfigError otherwise."""
    args = distributed_args(value)
    if args is None:
        return
    import jax

    if not jax.distributed.is_initialized():
        raise ConfigError(f"distributed={value}: only `python -m evals.run` starts jax.distributed (one command per "
                          "process, docs/guide/scale.md); this command runs in one process")
    if "num_processes" in args and jax.process_count() != args["num_processes"]:
        raise ConfigError(f"distributed={value}: {args['num_processes']} processes named, {jax.process_count()} "
                          "joined")


def policy_name(policy: kvpolicies.Policy) -> str:
    return next((n for n, cls in kvpolicies.POLICIES.items() if type(policy) is cls), type(policy).__name__.lower())


def check_text(conf: dict[str, Any], tokenizer: Any, text: str | None) -> None:
    """The checks that need the tokenizer (run after it loads, before the weights), the task's own
    (`check_text`: perplexity's text has `tokens` + 1 tokens; a retrieval task's shortest prompt
    fits its template, needles and question). ConfigError naming the field."""
    if tokenizer is None:
        return
    task = load_task(conf["task"]["name"])
    if task.check_text is not None:
        try:
            task.check_text(conf, tokenizer, text)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _list(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)
