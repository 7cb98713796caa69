"""`python -m evals.run`: evaluate one model x policy x task (or a sweep of them) and append
one JSON line per run to a results file.

    python -m evals.run policy=sink window=4096     # perplexity over 12288 tokens of Pride & Prejudice
    python -m evals.run -m policy=full,window,sink window=1024,4096 task=perplexity tokens=8192
    python -m evals.run task=passkey policy=sink window=1024
    python -m evals.run model=hf model.path=/ckpt/folder data=mobydick
    python -m evals.run model=tiny_recall task=recall policy=window window=16
    python -m evals.table results/results.jsonl --out results/table
    python -m evals.plots results/results.jsonl --out results/plots

The default stream, tokens=12288, goes past SmolLM2's 8192-token training context; `sink` over
it took 332 s of CPU time (model load included) on a shared 2-core machine: about 3 minutes of
wall time on two idle cores (estimated from the CPU time, not measured on an idle machine).

Configuration is Hydra (`configs/`): groups model/ (smollm2, gguf, hf, tiny_random,
tiny_recall), policy/ (one per registered policy; a registered policy without a yaml gets its
dataclass defaults), task/ (perplexity, passkey, niah, multikey, recall), data/ (austen,
mobydick, path), and the typed top-level keys of `RunConfig`. Policy files read the top-level
`window`, `n_sink`, `budget` and `codec`, so `window=1024` reaches whichever policy uses one.

Before anything runs, every job of the command line is composed and validated, so a wrong
group option, key, type or policy field stops the whole command with one error that names the
valid choices. A run whose config key is already in the results file is skipped (`force=true`
redoes it). Hydra's own output (logs, the composed config) goes to `outputs/` (git-ignored);
the job does not change directory.

`model=tiny_random` is a tiny random Llama over UTF-8 bytes (`ByteTokenizer`: token = byte,
vocab 256), for tests and smoke runs without any download.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm.auto import tqdm

import kvpolicies
from evals import results as R
from evals.common import TaskContext, TaskResult

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "policy", "task", "data")

# Task name -> "module:function" taking a TaskContext and returning a TaskResult (imported lazily).
TASKS: dict[str, str] = {
    "perplexity": "evals.perplexity:run",
    "passkey": "evals.retrieval:passkey",
    "niah": "evals.retrieval:niah",
    "multikey": "evals.retrieval:multikey",
    "recall": "evals.retrieval:recall",
}

# Optional config checks run before any job ("module:function" taking the task dict, raising ValueError).
TASK_CHECKS: dict[str, str] = {"perplexity": "evals.perplexity:check", "passkey": "evals.retrieval:check",
                               "niah": "evals.retrieval:check", "multikey": "evals.retrieval:check",
                               "recall": "evals.retrieval:check"}

# Top-level keys whose values determine a run's numbers (the resume key hashes these).
KEY_FIELDS = ("model", "data", "policy", "task", "chunk", "seed")


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
    budget: int = 1024
    tokens: int = 12288
    chunk: int = 512
    seed: int = 0
    results: str = "results/results.jsonl"
    progress: bool = True
    force: bool = False


class ConfigError(ValueError):
    """A configuration problem, reported as one message (no traceback) by the CLI."""


# -- config store and composition ---------------------------------------------------------------


def _policy_default_node(name: str) -> dict[str, Any]:
    """A policy config for a registered policy that has no yaml: its dataclass defaults."""
    node: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(kvpolicies.POLICIES[name]):
        if f.name == "codec":
            node["codec"] = "${codec}"
        elif isinstance(f.default, (bool, int, float, str)):
            node[f.name] = f.default
    return node


def register_configs() -> None:
    """Put the schema and any registered policy without a yaml into Hydra's ConfigStore (idempotent:
    called before every composition, so policies registered later are seen)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    have = {p.stem for p in (CONFIG_DIR / "policy").glob("*.yaml")}
    for name in kvpolicies.POLICIES:
        if name not in have:
            cs.store(group="policy", name=name, node=_policy_default_node(name))


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
            return hydra_compose(config_name="config", overrides=list(overrides))
        except Exception as e:  # Hydra / OmegaConf errors: explain them in our words
            raise ConfigError(explain(e, list(overrides))) from None


def _typename(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def explain(exc: Exception, overrides: list[str]) -> str:
    """One clear message for a Hydra/OmegaConf composition error, with the valid choices."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group = Path(exc.missing_cfg_file or "").parent.name or "?"
        bad = Path(exc.missing_cfg_file or "").name
        return f"{group}={bad}: no such {group}; choose one of: {', '.join(sorted(exc.options))}"
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
        return f"{full_key}: unknown key; {scope} has keys: {', '.join(valid)}"
    if isinstance(cause, ValidationError) and full_key:
        fields = {f.name: f.type for f in dataclasses.fields(RunConfig)}
        want = fields.get(full_key)
        value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == full_key), None)
        if want is not None:
            return f"{full_key}={value}: {full_key} must be {_typename(want)}"
        return f"{full_key}={value}: {cause.msg if hasattr(cause, 'msg') else cause}"
    return str(exc).strip()


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data; a required value left at ??? is a ConfigError."""
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required: pass {e.full_key}=...") from None
    except InterpolationResolutionError as e:
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {e.msg if hasattr(e, 'msg') else e}") from None


def build_policy(pcfg: dict[str, Any]) -> kvpolicies.Policy:
    """A policy from its config group (`name`, `codec`, fields); bad names/fields: ConfigError."""
    fields = dict(pcfg)
    name, codec = fields.pop("name", None), fields.pop("codec", "none")
    try:
        return kvpolicies.get(name, codec=codec, **fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"policy: {e}") from None


def validate(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """Resolve and check what Hydra does not: the task name, the model kind, the policy (built,
    so its own range checks run), the top-level ranges. Returns the plain config."""
    conf = to_plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    if conf["task"].get("name") not in TASKS:
        raise ConfigError(f"task.name={conf['task'].get('name')!r}: must be one of {sorted(TASKS)}")
    if conf["model"].get("name") not in MODELS:
        raise ConfigError(f"model.name={conf['model'].get('name')!r}: must be one of {sorted(MODELS)}")
    for key, lo in (("tokens", 1), ("chunk", 1), ("window", 1), ("n_sink", 0), ("budget", 1), ("seed", 0)):
        if conf[key] < lo:
            raise ConfigError(f"{key}={conf[key]}: must be >= {lo}")
    load_task(conf["task"]["name"])  # importable now, not after a long sweep
    check = TASK_CHECKS.get(conf["task"]["name"])
    if check:
        module, _, fn = check.partition(":")
        try:
            getattr(importlib.import_module(module), fn)(dict(conf["task"]))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if conf["data"].get("name") == "path" and not Path(conf["data"]["spec"]).is_file():
        raise ConfigError(f"data.path={conf['data']['spec']}: no such file")
    if conf["codec"] not in kvpolicies.CODECS:
        raise ConfigError(f"codec={conf['codec']!r}: must be one of {sorted(kvpolicies.CODECS)}")
    build_policy(conf["policy"])
    return conf


# -- models -------------------------------------------------------------------------------------


class ByteTokenizer:
    """Token = UTF-8 byte (vocab 256), no special tokens: the tokenizer of `model=tiny_random`."""

    bos_id = None
    eos_id = None
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _dtype(m: dict[str, Any]):
    import jax.numpy as jnp

    return jnp.dtype(m.get("dtype", "float32"))


def _load_smollm2(m):
    from models.engine import load_default_model

    return load_default_model(_dtype(m).name)


def _load_gguf(m):
    from models.llama import Llama
    from models.loading import load_gguf
    from models.tokenizer import Tokenizer

    cfg, params = load_gguf(m["path"])
    return Llama(cfg, params, dtype=_dtype(m)), Tokenizer.from_gguf(m["path"])


def _load_hf(m):
    from models.llama import Llama
    from models.loading import load_hf
    from models.tokenizer import Tokenizer

    cfg, params = load_hf(m["path"])
    return Llama(cfg, params, dtype=_dtype(m)), Tokenizer.from_hf(m["path"])


def _load_tiny_random(m):
    from models.config import LlamaConfig
    from models.llama import Llama, init_params

    shape = {k: v for k, v in m.items() if k not in ("name", "seed", "dtype")}
    cfg = LlamaConfig(**shape, name="tiny-random")
    return Llama(cfg, init_params(cfg, seed=m.get("seed", 0)), dtype=_dtype(m)), ByteTokenizer()


def _load_tiny_recall(m):
    from models.train import load_or_train

    model, _ = load_or_train(**{k: v for k, v in m.items() if k != "name"})
    return model, None


MODELS = {"smollm2": _load_smollm2, "gguf": _load_gguf, "hf": _load_hf, "tiny_random": _load_tiny_random,
          "tiny_recall": _load_tiny_recall}


@functools.lru_cache(maxsize=2)
def _load_model_cached(blob: str):
    m = json.loads(blob)
    return MODELS[m["name"]](m)


def load_model(mcfg: dict[str, Any]):
    """(Llama, tokenizer or None) for a model config; cached, so a sweep loads it once."""
    return _load_model_cached(json.dumps(mcfg, sort_keys=True))


def load_task(name: str):
    """The task function of TASKS[name], imported now."""
    module, _, fn = TASKS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task={name}: cannot load {TASKS[name]} ({e})") from None


# -- one run --------------------------------------------------------------------------------------


@dataclasses.dataclass
class RecordingContext(TaskContext):
    """A TaskContext that remembers the largest max_len of the engines the task built (the
    memory of the row is computed for it)."""

    max_len: int = 0

    def engine(self, max_len: int):
        self.max_len = max(self.max_len, max_len)
        return super().engine(max_len)


def declared_max_len(task: dict[str, Any]) -> int | None:
    """The longest sequence a task config asks for (`tokens`, or the largest of `lengths`), for a
    task that built its engines without `ctx.engine`; None if it declares none."""
    if isinstance(task.get("tokens"), int):
        return task["tokens"]
    lengths = [n for n in task.get("lengths") or () if isinstance(n, int)]
    return max(lengths) if lengths else None


def policy_params(record: dict[str, Any]) -> str:
    """'n_sink=4 window=4096 positions=cache': a policy's fields except name and codec."""
    return " ".join(f"{k}={v}" for k, v in record.items() if k not in ("name", "codec"))


def run_key(conf: dict[str, Any], policy: kvpolicies.Policy) -> str:
    keyed = {k: conf[k] for k in KEY_FIELDS}
    keyed["policy"] = R.policy_record(policy)  # as built: defaults included, interpolations resolved
    return R.config_key(keyed)


def run_config(conf: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Run one validated plain config; returns (row, ran). A config already in the results file
    is not run again unless conf["force"]: its stored row is returned with ran=False."""
    say = tqdm.write
    policy = build_policy(conf["policy"])
    key = run_key(conf, policy)
    results = conf["results"]
    if not conf["force"] and key in R.done_keys(results):
        row = next(r for r in reversed(R.read(results)) if r.get("key") == key)
        say(f"[evals.run] skip {key}: already in {results} (force=true redoes it)")
        return row, False
    record = R.policy_record(policy)
    task_name = conf["task"]["name"]
    say(f"[evals.run] {task_name} | {conf['model']['name']} | {record['name']} {policy_params(record)} "
        f"| codec={conf['codec']} | key {key}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model, tokenizer = load_model(conf["model"])
    timings["load_model_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    from evals.data import load_text

    text = load_text(conf["data"]["spec"]) if tokenizer is not None else None
    timings["load_text_s"] = time.perf_counter() - t1
    fn = load_task(task_name)
    ctx = RecordingContext(model=model, tokenizer=tokenizer, policies=policy, task=dict(conf["task"]), text=text,
                           seed=conf["seed"], chunk=conf["chunk"], progress=conf["progress"])
    t2 = time.perf_counter()
    res: TaskResult = fn(ctx)
    timings["task_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - t0

    from models.llama import policy_runs

    mc = model.cfg
    stack = tuple(p for a, b, p in policy_runs(policy, mc.n_layers) for _ in range(b - a))
    max_len = ctx.max_len or declared_max_len(conf["task"])
    memory = None
    if max_len:
        memory = R.memory(stack, kv_heads=mc.n_kv_heads, head_dim=mc.head_dim, max_len=max_len, dtype=model.dtype)
    arrays = {name: R.save_array(results, key, name, a) for name, a in res.arrays.items()}
    row = {
        "key": key,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "task": task_name,
        "policy": record,
        "params": policy_params(record),
        "model": {"name": conf["model"]["name"], "arch": mc.name, "layers": mc.n_layers, "kv_heads": mc.n_kv_heads,
                  "head_dim": mc.head_dim, "max_position": mc.max_position, "dtype": _dtype(conf["model"]).name},
        "config": {k: v for k, v in conf.items() if k not in ("results", "progress", "force")},
        **R.environment(),
        "metrics": res.metrics,
        "memory": memory,
        "timings": timings,
        "grid": res.grid,
        "curves": res.curves,
        "arrays": arrays,
    }
    R.append(results, row)
    return R._clean(row), True


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra job: validate, run (or skip), print the row's table."""
    import logging

    from evals.table import markdown

    logging.getLogger("jax").setLevel(logging.WARNING)  # Hydra's logging would show jax's INFO lines
    conf = validate(cfg)
    row, ran = run_config(conf)
    if ran:
        tqdm.write(markdown([row]))
        tqdm.write(f"[evals.run] appended to {conf['results']}")
    return row


# -- the command line -------------------------------------------------------------------------------

_SKIP_PREFLIGHT = {"--help", "-h", "--hydra-help", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                   "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p"}


def job_overrides(argv: list[str]) -> list[list[str]] | None:
    """The overrides of every job the command line launches (sweeps expanded under -m), or None
    when the command is not a plain run/sweep (help, another config...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    multirun = "-m" in argv or "--multirun" in argv
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _SKIP_PREFLIGHT or a.split("=", 1)[0] in _SKIP_PREFLIGHT:
            return None
        elif a in _VALUE_FLAGS:
            skip = True
        elif not a.startswith("-"):
            args.append(a)
    parsed = OverridesParser.create().parse_overrides(args)
    choices = []
    for o, text in zip(parsed, args):
        if o.key_or_group.startswith("hydra"):
            continue
        if multirun and o.is_sweep_override():
            if o.is_discrete_sweep() or o.is_range_sweep():
                choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
            else:
                return None  # glob/interval sweeps: leave them to Hydra
        else:
            choices.append([text])
    return [list(c) for c in itertools.product(*choices)]


def preflight(argv: list[str]) -> tuple[int, bool]:
    """Compose and validate every job first; returns (number of jobs, progress) or raises ConfigError."""
    jobs = job_overrides(argv)
    if jobs is None:
        return 1, True
    progress = True
    for overrides in jobs:
        conf = validate(compose(overrides))
        progress = conf["progress"]
    return len(jobs), progress


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the rows of its jobs."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        n_jobs, progress = preflight(argv)
    except ConfigError as e:
        print(f"evals.run: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    register_configs()
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=n_jobs, desc="sweep", unit="job", disable=n_jobs < 2 or not progress)

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        rows.append(run_job(cfg))
        bar.update()

    saved = sys.argv
    sys.argv = [saved[0] if saved else "evals.run"] + argv
    try:
        job()
    finally:
        sys.argv = saved
        bar.close()
    if len(rows) > 1:
        from evals.table import markdown

        print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
