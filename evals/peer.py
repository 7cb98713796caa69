"""`python -m evals.peer`: kvpress 0.5.5 (NVIDIA's reference library, PyTorch) beside kvpolicies on
the same prompts, press by press: each side's accuracy, how often the two give the same answer,
and how much of the same context each keeps.

    python -m evals.peer                                   # SmolLM2, ruler_niah_single, 2048 tokens, 20 samples
    python -m evals.peer presses=[SnapKVPress,TOVAPress] ratios=[0.5] samples=4
    python -m evals.peer task=ruler_vt gen=16 samples=10

Keys (key=value):

    model=smollm2                 smollm2 (SmolLM2-135M-Instruct), qwen (Qwen2.5-Coder-0.5B-Instruct
                                  Q4_K_M; `bash scripts/setup.sh long`), tiny (a random 3-layer
                                  Llama with SmolLM2's tokenizer, built by the worker: tests), or hf
                                  with model_path=<an HF folder> (Llama 3.x, Qwen2/3, ...: on a GPU)
    dtype=float32                 our side's dtype (bfloat16 on a GPU; kvpress's side stays float32)
    task=ruler_niah_single        a RULER task of evals.ruler: ruler_niah_single, ruler_niah_multikey,
                                  ruler_niah_multivalue, ruler_niah_multiquery, ruler_vt, ruler_cwe, ruler_fwe,
                                  or one of RULER's own task names (niah_single_1 ... fwe: kvpress's
                                  leaderboard, `evals.ruler.LEADERBOARD_TASKS`)
    tokens=2048                   each prompt + answer (RULER's exact length)
    samples=20                    prompts per cell (the task's trials, seed `seed`)
    ratios=[0.25,0.5,0.75,0.875]  kvpress compression ratios in (0, 1); the full cache (ratio 0) always runs
    presses=[...]                 default: PEER_PRESSES (kvpolicies.compat's but Random, PerLayerCompression; DuoAttentionPress
                                  with a seeded random head pattern on both sides, `duo_pattern`; none for
                                  model=hf); RandomPress is also accepted (its draw is not kvpress's), and
                                  the rest of compat's catalogue, CATALOGUE (`catalogue_args`: ThinKPress,
                                  the hub presses with our arrays, the decoding presses, SimLayerKVPress, ...);
                                  a row may set a press's own fields, on both sides: Press+field=value
                                  (KVComposePress+structured=false, FastKVzipPress+layerwise=true; values
                                  true / false, numbers or words; `variant`)
    gen=<task's>                  greedy tokens after the question (ruler_niah_single: 32)
    seed=0  chunk=512             the samples' seed; our prefill chunk (never changes a result; the rest
                                  of a context in power-of-two pieces, `pieces`, and the question of a
                                  press's own steps in power-of-two pieces, `question_pieces`: shapes
                                  compiled once, not per sample; through a canonical form, answer=shared
                                  or pooled, in one step)
    compile_cache=<out>/.jax-cache  JAX's persistent compilation cache for our side (a resumed run
                                  loads the steps it compiled before instead of compiling them again;
                                  `none`: off)
    prefill=shared                how the kvpress worker prefills: shared (one prefill per sample, each
                                  press's own forward hook on its own copy of every layer's cache;
                                  KVzipPress: one reconstruction pass for all its ratios) or per_press
                                  (kvpress's pipeline, one prefill per press: slower, same result)
    out=results/peer name=<stem>  where the files go; stem default peer_<model>_<task>_<tokens>
    overwrite=false               replace the files of another configuration under that stem (without
                                  it: an error before anything runs)
    table_only=false              compute nothing: the table of the samples both sides saved so far
    qa_file=<path>                task=qa_1 / qa_2: RULER's own SQuAD / HotpotQA file (squad.json /
                                  hotpotqa.json; no package ships them)
    query_aware=false             kvpress's --query_aware: the question is part of the compressed context;
                                  after the compression come only the chat template's tail and the answer
                                  prefix (files under <stem>_query_aware)
    eos_stop=false                true: both sides stop after an end-of-sequence id, as kvpress's pipeline does
                                  (not after the first id): kvpress's side after its generation config's, ours
                                  after the tokenizer's (a batch once all its rows have; each answer saved
                                  through its end); ids compared up to the side that stopped first; the same
                                  texts and scores, faster (evals.leaderboard's default)
    ties=newer                    torch_cpu: our prompt scorers (and ChunkKV's and EntropyGatedChunkKV's own
                                  top-k calls) break exact ties at the compression as torch.topk does on the
                                  CPU (`kvpolicies.ties`; newer: the newer token); refused for the catalogue
                                  rows and presses whose own choices break ties otherwise (files under
                                  <stem>_ties_torch_cpu)
    kvpress=true                  false: our side alone (kvpress's columns left empty; no kvpress needed,
                                  but for model=tiny, whose checkpoint its worker builds)
    progress=true
    answer=pooled                 how our side answers: pooled (the rows of every press of a sample whose
                                  compressed states share a canonical append-only form, `evals.shared_answers`,
                                  as one batch of at most POOL_ROWS = 16 rows through that form's engine: one
                                  set of question and decode steps for all, a step reads the weights once for
                                  every row), shared (the same engines, a press's ratios per batch: a prompt scorer's
                                  own floats bit for bit) or press (a press's ratios through the press's own
                                  compiled steps). Canonical forms: the shape classes' prompt scorers (the
                                  same slots); head pools, adakv and adascored, and the full cache as per-head
                                  rows of max_len slots (float32 rounding apart). A batch of another shape rounds
                                  otherwise, so pooled and shared agree to float32 rounding: the same ids on
                                  issue 57's grids. kvzip, kvzap and duo answer through their own steps.
    executor=ray                  our side's items on Ray actors, a press's items per task, each actor's
                                  lines in its own shard of .ours.jsonl (evals.peer_grid); default
                                  executor=local: in this process, Ray not imported
    ray.address=local|auto|<host:port>  ray.workers=2    as evals.compare's (docs/guide/scale.md)

Protocol (kvpress's pipeline, query-agnostic): each RULER prompt is split where its question starts;
the context is prefilled and compressed once, then the question is appended at the following
positions and `gen` greedy tokens are decoded, nothing compressed again. kvpress runs in its own
environment (`.venv/kvpress-ref`, transformers 5.2.0; `bash scripts/setup.sh test`) through
`evals/kvpress_worker.py` in a subprocess, in float32 on the CPU with half of the cores' threads
(`worker_threads`; every core once our side is done), at the same time as ours
(`kvpolicies.compat.kvpress(press, ratio)` through `models.engine.Engine`: prompt, compress,
kept_positions, feed, continue_generate; prompt compressors that share a prompt phase share its
prefill, and a press's ratios one shape class, `Engine(slots=)`: one set of compiled steps per
press, not per ratio). Each line records its wall seconds and our side's phases (prefill,
compress, kept, question, decode; compile: seconds and programs compiled inside them);
`python -m benchmarks.peer_speed` times each side alone.

Files (`<out>/<stem>.*`): `.kvpress.jsonl` and `.ours.jsonl`, one line per (sample, press, ratio) as
each finishes (answer ids, kept-position masks): an interrupted run resumes where it stopped, and a
re-run computes nothing new; `.jsonl`, one record per (press, ratio, sample) joining both sides (texts,
scores, same answer, kept-set Jaccard per layer and kv head); `.md` and `.csv`, the table. Per cell:
each side's accuracy (RULER's string_match_all) with its Wilson 95 % interval; the fraction of
samples whose answers are the same text (the main number), the same ids, the same score; the kept-set
Jaccard per (layer, kv head), mean (min) over samples, layers and heads. The full-cache row is a
sanity check: its answers must be the same text.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from evals.config import ConfigError
from evals.peer_grid import read_lines, repair  # noqa: F401  (the line files' reader and repair, re-exported)

ROOT = pathlib.Path(__file__).resolve().parents[1]
REF = ROOT / ".venv" / "kvpress-ref"
WORKER = ROOT / "evals" / "kvpress_worker.py"
MODELS = ("smollm2", "qwen", "tiny", "hf")
DTYPES = ("float32", "bfloat16")
PREFILLS = ("shared", "per_press")
OWN_KEYS = ("model", "task", "tokens", "samples", "ratios", "presses", "gen", "seed", "chunk", "prefill", "out",
            "compile_cache", "name", "overwrite", "table_only", "progress", "query_aware", "kvpress", "model_path",
            "dtype", "qa_file")
DEFAULT_RATIOS = (0.25, 0.5, 0.75, 0.875)  # kvpress's leaderboard's ratios
# the tiny random Llama of model=tiny (the parity tests' shape, SmolLM2's vocabulary)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
SIDES = ("kvpress", "ours")
OWN_KEYS += ("executor", "ray.address", "ray.workers")  # evals.peer_grid: our side on Ray actors
OWN_KEYS += ("answer", "ties", "eos_stop")  # our side's answers: a press's ratios per batch (press, shared) or a sample's (pooled)
ANSWERS = ("press", "shared", "pooled")
POOL_ROWS = 16  # answer=pooled: the most rows of one batch (a sample's states are held until answered)


# -- the command line -------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """A checked command line, the samples built (context and question ids), nothing loaded."""

    model: str
    task: dict[str, Any]
    tokens: int
    samples: int
    ratios: list[float]
    presses: list[str]
    gen: int
    seed: int
    chunk: int
    prefill: str
    out: pathlib.Path
    stem: str
    overwrite: bool
    progress: bool
    table_only: bool = False
    query_aware: bool = False  # the question compressed with the context (kvpress's --query_aware)
    kvpress: bool = True  # run kvpress's side too (false: ours alone, no kvpress needed)
    model_path: str | None = None  # model=hf: the HF folder (config.json, safetensors, tokenizer)
    dtype: str = "float32"  # our side's weights and activations (kvpress's side: float32)
    ties: str = "newer"  # our prompt scorers' exact ties at the compression (`PromptScored.ties`)
    eos_stop: bool = False  # both sides stop after an end-of-sequence id, as kvpress's pipeline does (`eos_stop=`)
    eos_id: int | None = None  # the tokenizer's end-of-sequence id (`prepare`): where an answer's text ends
    answer: str = "press"  # our side's answering batches: a press's ratios (press) or every press alike (shared)
    compile_cache: pathlib.Path | None = None  # JAX's persistent compilation cache for our side
    config: str = ""  # the hash of everything that determines the numbers
    contexts: list[np.ndarray] = dataclasses.field(default_factory=list)
    questions: list[np.ndarray] = dataclasses.field(default_factory=list)
    refs: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    argv: list[str] = dataclasses.field(default_factory=list)
    ray: Any = None  # executor=ray's options (evals.ray_grid.RayOptions, from argv), else None: ours in this process

    def __post_init__(self):
        from evals.peer_grid import options

        self.ray = options(self.argv)

    def path(self, suffix: str) -> pathlib.Path:
        return self.out / f"{self.stem}{suffix}"

    @property
    def mconf(self) -> dict[str, Any]:
        """The `evals.zoo` model config of our side (the config hash's model part)."""
        if self.model == "hf":
            return {"name": "hf", "path": self.model_path, "dtype": self.dtype}
        return model_config(self.model) | ({"dtype": self.dtype} if self.dtype != "float32" else {})

    @property
    def sides(self) -> tuple[str, ...]:
        """The sides this run computes and tables: both, or ours alone (kvpress=false)."""
        return SIDES if self.kvpress else ("ours",)

    @property
    def cells(self) -> list[tuple[str, float]]:
        """(press, ratio) of every row, the full cache first."""
        return [("full", 0.0)] + [(p, r) for p in self.presses for r in ((0.0,) if base_row(p) in RATIOLESS else self.ratios)]

    def sample_id(self, i: int) -> str:
        """'<config>/<index>/<hash of the sample's ids>': what a saved line belongs to."""
        h = hashlib.sha256(np.concatenate([self.contexts[i], [-1], self.questions[i]]).astype(np.int64).tobytes())
        return f"{self.config}/{i}/{h.hexdigest()[:12]}"


def _int(key: str, text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(f"{key}={text}: expected an integer >= {lo}") from None
    if v < lo:
        raise ConfigError(f"{key}={text}: expected an integer >= {lo}")
    return v


def _bool(key: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ConfigError(f"{key}={text}: expected true or false")
    return text.lower() == "true"


# every press kvpolicies.compat reproduces, but RandomPress (torch's draw is not ours: the kept sets
# differ by construction) and PerLayerCompressionPress (per-layer ratios per model; kvpress raises
# on the question when they differ)
PEER_PRESSES = ("SnapKVPress", "PyramidKVPress", "KnormPress", "StreamingLLMPress", "ExpectedAttentionPress",
                "ObservedAttentionPress", "TOVAPress", "AdaKVPress", "KVzipPress", "DuoAttentionPress",
                "KeyDiffPress", "LagKVPress", "CURPress", "NonCausalAttnPress", "CapPress")
# compat's presses beyond PEER_PRESSES that `presses=` also accepts: RandomPress (a floor on kvpress's
# leaderboard), CompactorPress and LeverageScorePress (their sketches are our draw: kept sets and answers
# differ from kvpress's by construction), and wrappers over an
# inner press, named "Wrapper:Inner" (kvpress's leaderboard rows chunkkv, adakv_expected_attention,
# critical_snapkv, critical_adakv_snapkv; kvpress's CriticalAdaKVPress raises on the tiny model's questions)
EXTRA_PRESSES = ("RandomPress", "CompactorPress", "LeverageScorePress", "ChunkKVPress:SnapKVPress", "AdaKVPress:ExpectedAttentionPress",
                 "KeyRerotationPress:ExpectedAttentionPress", "EntropyGatedChunkKVPress:SnapKVPress",
                 "CriticalKVPress:SnapKVPress", "CriticalAdaKVPress:SnapKVPress",
                 # kvpress fails on the questions after KVComposePress (uneven layers) and, on the tiny model, after
                 # KVgradPress and RestoreKVPress (its fake keys): kept sets and answers in their parity tests
                 "KVgradPress", "KVComposePress", "RestoreKVPress")
# the rest of compat.PRESSES (issue 58), each row as both sides get it (`catalogue_args`): our side runs them
# one engine per (press, ratio), `run_catalogue`, the worker as its `catalogue_press` and `run_own` say
CATALOGUE = ("ThinKPress", "QFilterPress", "ExpectedAttentionStatsPress", "KVzapPress", "FastKVzipPress",
             "DecodingPress:KeyDiffPress", "CompressionRatioDecodingPress:KeyDiffPress",
             "PrefillDecodingPress:SnapKVPress", "SimLayerKVPress", "FinchPress", "MergingPress:KeyDiffPress",
             "ChunkPress:KeyDiffPress", "BlockPress:KeyDiffPress", "ComposedPress", "PerLayerCompressionPress:KeyDiffPress",
             "LUKVPress", "DMSPress")
EXTRA_PRESSES += CATALOGUE
# rows without a compression ratio to set (kvpress's is read-only or absent): one row each, at ratio 0
RATIOLESS = ("DecodingPress:KeyDiffPress", "SimLayerKVPress", "DMSPress")
HUB = {"QFilterPress": "qfilters", "ExpectedAttentionStatsPress": "expected_stats", "KVzapPress": "kvzap",
       "FastKVzipPress": "fastkvzip"}  # the presses whose arrays kvpress downloads: ours, one file per model
HUB_COMMANDS = {"qfilters": "python -m evals.qfilter model={m}", "expected_stats": "python -m evals.expected_stats model={m}",
                "kvzap": "python -m evals.train_kvzap model={m} kind=linear",
                "fastkvzip": "python -m evals.train_fastkvzip model={m}"}
DECODING_INTERVAL = 4  # the decoding presses' compression_interval (steps: the question is one, each id one)
DUO_SEED = 0  # the head pattern both sides get for DuoAttentionPress (`duo_pattern`)


def duo_pattern(model: str) -> list[list[float]]:
    """DuoAttentionPress's head pattern, [layers][kv heads] gate values, the same on both sides:
    kvpress downloads the authors' trained gates for six 7-8B checkpoints (none for these models)
    or scores BookSum on the fly (not reachable offline), so both get numpy's default_rng(0)
    uniform values, rounded to 3 digits (tests/kvpolicies/test_kvpress_parity.py's SmolLM2
    pattern). A parity check of the rule that picks and trims the streaming heads, not a trained
    pattern: its accuracy says nothing of DuoAttention's."""
    from evals import zoo

    if model == "tiny":
        shape = (TINY["num_hidden_layers"], TINY["num_key_value_heads"])
    else:
        cfg = zoo.describe(model_config(model))
        shape = (cfg.n_layers, cfg.n_kv_heads)
    return np.random.default_rng(DUO_SEED).random(shape).round(3).tolist()


def check_ties(ties: str, presses: list[str]) -> None:
    """ties= before anything runs (ConfigError): one of TIES, and with torch_cpu every press a prompt scorer
    that `kvpolicies.compat.kvpress(..., ties=)` accepts, none of the catalogue rows (`run_catalogue`)."""
    from kvpolicies.compat import kvpress
    from kvpolicies.ties import TIES

    if ties not in TIES:
        raise ConfigError(f"ties={ties}: must be one of {list(TIES)}")
    if ties == "newer":
        return
    for c in presses:
        if base_row(c) in CATALOGUE or press_name(c) == "DuoAttentionPress":  # (Duo's needs the model's pattern)
            raise ConfigError(f"ties={ties}: for prompt scorers, not {c}")
        try:
            row, own = variant(c)
            inner = {"press": row.split(":", 1)[1]} if ":" in row else {}
            kvpress(press_name(c), 0.5, n_layers=2, ties=ties, **inner, **own)
        except ValueError as e:
            if "ties=" in str(e):
                raise ConfigError(f"presses: {c}: {e}") from None


def variant(press: str) -> tuple[str, dict[str, Any]]:
    """(the row without its own fields, those fields): "KVComposePress+structured=false" is KVComposePress with
    structured=False on both sides ("+a=1+b=x": several; values true / false, ints, floats, else strings)."""
    row, *parts = press.split("+")
    fields: dict[str, Any] = {}
    for part in parts:
        key, eq, text = part.partition("=")
        if not (eq and key.isidentifier() and text):
            raise ConfigError(f"presses: {press}: a row's own fields are +field=value (e.g. "
                              "KVComposePress+structured=false)")
        low = text.lower()
        if low in ("true", "false"):
            fields[key] = low == "true"
            continue
        try:
            fields[key] = int(text)
        except ValueError:
            try:
                fields[key] = float(text)
            except ValueError:
                fields[key] = text
    return row, fields


def base_row(press: str) -> str:
    """The row `press` sets its own fields on ("FastKVzipPress+layerwise=true" -> "FastKVzipPress")."""
    return press.split("+", 1)[0]


def press_name(press: str) -> str:
    """The kvpress class of a row's press: "ChunkKVPress:SnapKVPress" names a wrapper over an inner press."""
    return base_row(press).split(":", 1)[0]


def press_fields(model: str, press: str) -> dict[str, Any]:
    """The fields both sides give `press` beyond kvpress's defaults: a wrapper's inner press
    ("Wrapper:Inner" names), Duo's head pattern (and on the tiny model, whose prompts are shorter
    than kvpress's sink 128 + recent 256, sink 16 + recent 64), and the row's own (`variant`)."""
    press, own = variant(press)
    if ":" in press:
        return {"press": press.split(":", 1)[1]} | own
    if press == "RestoreKVPress":  # our arrays (evals.train_restorekv); model=tiny: seeded random ones
        return {"restore_model_name": str(restore_arrays(model))} | own
    if press != "DuoAttentionPress":
        return own
    return {"head_scores": duo_pattern(model)} | ({"sink_size": 16, "recent_size": 64} if model == "tiny" else {}) | own


def hub_file(p: "Plan", what: str) -> pathlib.Path:
    """The file of our arrays `what` (HUB's values) for the run's model: for model=tiny seeded random arrays of
    its shapes (`tiny_arrays`, as duo_pattern's: a check of the rule, not of trained arrays); else what
    evals.qfilter, evals.expected_stats, evals.train_kvzap (kind=linear) and evals.train_fastkvzip write."""
    from evals.data import data_dir

    if p.model == "tiny":
        return tiny_arrays(p)[what]
    if what == "kvzap":
        from kvpolicies.kvzap import weight_file

        return weight_file(f"{p.model}_linear")
    return data_dir() / what / f"{p.model}.npz"


def tiny_arrays(p: "Plan") -> dict[str, pathlib.Path]:
    """model=tiny's arrays for the hub presses and LUKVPress's curve, seeded (numpy's default_rng), written
    under <out>/tiny_arrays/ once: q_filters [L, K, D]; mu [L, N, D] and PSD cov [L, N, D, D]; a linear kvzap
    surrogate (nonzero biases); FastKVzip gates (kvpolicies.fastkvzip's format); LU-KV's curve [99, L, K]."""
    from kvpolicies.kvzap import random_surrogate

    folder = p.out / "tiny_arrays"
    folder.mkdir(parents=True, exist_ok=True)
    n, kh, nh, d = TINY["num_hidden_layers"], TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["hidden_size"]
    hd, g, e = d // nh, nh // kh, 16
    out = {k: folder / f"{k}.npz" for k in HUB.values()} | {"lukv": folder / "lukv.npy"}
    if all(f.is_file() for f in out.values()):
        return out
    rng = np.random.default_rng(0)
    r = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    np.savez(out["qfilters"], q_filters=r(n, kh, hd))
    a = r(n, nh, hd, hd, scale=0.25)
    np.savez(out["expected_stats"], mu=r(n, nh, hd), cov=(a @ np.swapaxes(a, -1, -2)).astype(np.float32))
    zap = random_surrogate("linear", d, kh, n, seed=1)
    zap["b"] = r(n, kh, scale=0.1)
    np.savez(out["kvzap"], kind="linear", d_model=d, kv_heads=kh, n_layers=n, **zap)
    np.savez(out["fastkvzip"], q_w=r(n, d, kh * g * e, scale=d ** -0.5), q_b=r(n, kh * g * e, scale=0.1),
             k_w=r(n, d, kh * e, scale=d ** -0.5), q_norm=1 + r(n, e, scale=0.1), k_norm=1 + r(n, e, scale=0.1),
             k_base=r(n, kh, 16, e), b=r(n, kh, g, scale=0.5))
    u = rng.random((99, n, kh))
    np.save(out["lukv"], np.clip(np.arange(1, 100)[:, None, None] / 100 + 0.4 * (u - 0.5), 0, 0.99).astype(np.float32))
    return out


def lukv_curve(p: "Plan") -> pathlib.Path:
    """LUKVPress's budget curve [99, L, K] for the run's model (kvpress downloads one, for Llama-3.1-8B): seeded
    random prune ratios spread around (i + 1) / 100 in row i (the parity test's), the same on both sides."""
    if p.model == "tiny":
        return tiny_arrays(p)["lukv"]
    from evals import zoo

    cfg = zoo.describe(p.mconf)
    path = p.out / f"lukv_{p.model}.npy"
    if not path.is_file():
        p.out.mkdir(parents=True, exist_ok=True)
        u = np.random.default_rng(0).random((99, cfg.n_layers, cfg.n_kv_heads))
        np.save(path, np.clip(np.arange(1, 100)[:, None, None] / 100 + 0.4 * (u - 0.5), 0, 0.99).astype(np.float32))
    return path


def catalogue_args(p: "Plan", press: str, ratio: float) -> tuple[str, float, dict[str, Any], dict[str, Any]]:
    """(kvpress class, compression_ratio, our fields for `kvpolicies.compat.kvpress`, the worker's JSON fields) of
    a CATALOGUE row at `ratio`: both sides get the same press, fields and arrays. ThinKPress: the ratio is
    kvpress's read-only compression_ratio, key_channel_compression_ratio / 2 (below 0.5). The hub presses: our
    arrays' files (`hub_file`); FastKVzipPress at its default (layerwise=False). Decoding presses: KeyDiffPress
    re-scoring every DECODING_INTERVAL steps (DecodingPress: back to a quarter of `tokens`; CompressionRatioDecodingPress: the
    ratio of the tokens seen; PrefillDecodingPress: SnapKVPress at the ratio, then back to half of what it
    kept). SimLayerKVPress: n_recent an eighth of `tokens`, lazy_threshold 0.1 (tiny) or 0.5. FinchPress:
    a 32-token window ending the context (the question comes after the compression here), keys not
    re-rotated. ChunkPress 256-token chunks; ComposedPress SnapKVPress then KeyDiffPress, each at
    1 - sqrt(1 - ratio); PerLayerCompressionPress ratios spread linearly over the layers around the ratio
    (mean: the ratio); LUKVPress a seeded curve (`lukv_curve`); DMSPress over KVzapPress (our surrogate),
    threshold 0 (tiny) or -6, window 64 (tiny) or 128."""
    press, own = variant(press)
    name, inner = (press.split(":", 1) + [None])[:2]
    tiny = p.model == "tiny"
    fields: dict[str, Any] = {"press": inner} if inner and name in ("MergingPress", "ChunkPress", "BlockPress",
                                                                   "PerLayerCompressionPress") else {}
    if name == "QFilterPress":
        fields = {"q_filters": str(hub_file(p, "qfilters").resolve())}
    elif name == "ExpectedAttentionStatsPress":
        fields = {"stats_folder": str(hub_file(p, "expected_stats").resolve())}
    elif name in ("KVzapPress", "DMSPress"):
        fields = {"model_type": "linear", "kvzap_model_name": str(hub_file(p, "kvzap").resolve())}
        if name == "DMSPress":
            fields |= {"press": "KVzapPress", "threshold": 0.0 if tiny else -6.0, "sliding_window_size": 64 if tiny else 128}
    elif name == "FastKVzipPress":
        fields = {"gates": str(hub_file(p, "fastkvzip").resolve())}  # kvpress's default layerwise=False
    elif name == "DecodingPress":
        fields = {"base_press": inner, "compression_interval": DECODING_INTERVAL, "target_size": p.tokens // 4}
    elif name == "CompressionRatioDecodingPress":
        fields = {"base_press": inner, "compression_interval": DECODING_INTERVAL}
    elif name == "PrefillDecodingPress":
        kept = max(1, int(min(len(c) for c in p.contexts) * (1 - ratio)) // 2) if p.contexts else p.tokens // 4
        dec = ["DecodingPress", 0.0, {"base_press": "KeyDiffPress", "compression_interval": DECODING_INTERVAL,
                                      "target_size": kept}]
        from kvpolicies.compat import kvpress

        ours = {"prefilling_press": inner, "decoding_press": kvpress(dec[0], dec[1], **dec[2])}
        return name, ratio, ours | own, {"prefilling_press": inner, "decoding_press": dec} | own
    elif name == "SimLayerKVPress":
        fields = {"lazy_threshold": 0.1 if tiny else 0.5, "n_recent": p.tokens // 8, "n_last": 1, "n_initial": 4}
    elif name == "FinchPress":
        fields = {"window_size": 32, "rerotate_keys": False}
    elif name == "ChunkPress":
        fields["chunk_length"] = 256
    elif name == "ComposedPress":
        each = 1 - float(np.sqrt(1 - ratio))
        fields = {"presses": [["SnapKVPress", each], ["KeyDiffPress", each]]}
    elif name == "PerLayerCompressionPress":
        layers = TINY["num_hidden_layers"] if tiny else model_layers(p)
        spread = min(ratio, 1 - ratio) / 2
        fields["compression_ratios"] = [float(x) for x in ratio + spread * np.linspace(-1, 1, layers)]
    elif name == "LUKVPress":
        fields = {"budget_curves": str(lukv_curve(p).resolve())}
    fields |= own
    return name, ratio, dict(fields), json.loads(json.dumps(fields))


def model_layers(p: "Plan") -> int:
    from evals import zoo

    return zoo.describe(p.mconf).n_layers


def check_catalogue(p: "Plan") -> None:
    """Before anything runs (ConfigError): the arrays of the hub presses asked for, with the command that
    makes them (model=tiny's are drawn here), and the ratios ThinKPress can take."""
    for press in map(base_row, p.presses):
        what = HUB.get(press) or ("kvzap" if press == "DMSPress" else None)
        if what and p.model == "hf":
            raise ConfigError(f"presses: {press} needs our arrays ({what}) for the model, made by our commands for "
                              "smollm2 and qwen only; leave it out for model=hf")
        if what and p.model != "tiny" and not hub_file(p, what).is_file():
            raise ConfigError(f"presses: {press} needs our {what} arrays for model={p.model} ({hub_file(p, what)} is "
                              f"missing; kvpress downloads the authors'): make them with `"
                              f"{HUB_COMMANDS[what].format(m=p.model)}`")
        if press == "ThinKPress" and max(p.ratios) >= 0.5:
            raise ConfigError(f"ratios: ThinKPress's compression_ratio is key_channel_compression_ratio / 2 (the keys' "
                              f"share of the cache): below 0.5, got {max(p.ratios):g}")


def check_variants(p: "Plan") -> None:
    """Before anything runs (ConfigError): a row's own fields (`variant`) make our policy at every ratio (kvpress's
    side takes the same fields; a name it does not know fails there, as its constructor says)."""
    from kvpolicies.compat import kvpress

    for c in p.presses:
        if not variant(c)[1]:
            continue
        layers = TINY["num_hidden_layers"] if p.model == "tiny" else model_layers(p)
        for r in ((0.0,) if base_row(c) in RATIOLESS else p.ratios):
            fields = catalogue_args(p, c, r)[2] if base_row(c) in CATALOGUE else press_fields(p.model, c)
            try:
                kvpress(press_name(c), r, n_layers=layers, **fields)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise ConfigError(f"presses: {c}: {e}") from None


def restore_arrays(model: str) -> pathlib.Path:
    """RestoreKVPress's arrays file: `$KVP_DATA/restorekv/<model>.npz` (evals.train_restorekv); for model=tiny
    seeded random ones (written once), the same on both sides."""
    from evals.data import data_dir
    from kvpolicies.restorekv import save_restore

    path = data_dir() / "restorekv" / f"{model}.npz"
    if model == "tiny" and not path.is_file():
        rng = np.random.default_rng(0)
        d, f, nl = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
        kd = TINY["num_key_value_heads"] * d // TINY["num_attention_heads"]
        dims = {"wq": (d, d), "wk": (d, kd), "wv": (d, kd), "wo": (d, d), "w_gate": (d, f), "w_up": (d, f),
                "w_down": (f, d)}
        save_restore(path, rng.normal(0, 1.0, (8, d)), {k: rng.normal(0, i ** -0.5, (nl, 4, i)) for k, (i, o) in dims.items()},
                     {k: rng.normal(0, 0.05, (nl, o, 4)) for k, (i, o) in dims.items()}, 8.0)
    return path


def parse(argv: Sequence[str]) -> Plan:
    """Check the command line (ConfigError naming the key); the task's samples are built later."""
    from evals import ruler
    from evals.compare import list_value
    from evals.config import did_you_mean
    supported = PEER_PRESSES + EXTRA_PRESSES

    own: dict[str, str] = {}
    for item in argv:
        if "=" not in item or item.startswith("-"):
            raise ConfigError(f"{item}: expected key=value; the keys: {', '.join(OWN_KEYS)}")
        key, value = item.split("=", 1)
        if key not in OWN_KEYS:
            raise ConfigError(f"{key}: unknown key{did_you_mean(key, OWN_KEYS)}; the keys: {', '.join(OWN_KEYS)}")
        own[key] = value
    model = own.get("model", "smollm2")
    if model not in MODELS:
        raise ConfigError(f"model={model}: must be one of {list(MODELS)}{did_you_mean(model, MODELS)}")
    if (model == "hf") != ("model_path" in own):
        raise ConfigError("model=hf needs model_path=<an HF folder>" if model == "hf" else
                          f"model_path= is for model=hf (model={model} is found by its package)")
    dtype = own.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype}: must be one of {list(DTYPES)}")
    task = own.get("task", "ruler_niah_single")
    named = tuple(ruler.RULER_SET) + tuple(leaderboard_names())
    if task in getattr(ruler, "MISSING", {}) and "qa_file" not in own:
        raise ConfigError(f"task={task}: {ruler.MISSING[task]} (here: qa_file=<the file>)")
    if task not in named and task not in getattr(ruler, "MISSING", {}):
        raise ConfigError(f"task={task}: must be a RULER task, one of {list(named)}{did_you_mean(task, named)}")
    presses = list_value("presses", own["presses"]) if "presses" in own else list(PEER_PRESSES)
    if model == "hf" and "presses" not in own:
        presses.remove("DuoAttentionPress")  # no head pattern for a folder's model (`duo_pattern`)
    for p in presses:
        if variant(p)[0] not in supported:
            raise ConfigError(f"presses: {p!r} is not a kvpress press kvpolicies.compat reproduces"
                              f"{did_you_mean(base_row(p), supported)}; choose from {list(supported)}")
    if model == "hf" and any(press_name(p) == "DuoAttentionPress" for p in presses):
        raise ConfigError("presses: DuoAttentionPress needs a head pattern, which evals.peer draws for its own "
                          "models only (`duo_pattern`); leave it out for model=hf")
    ratios = []
    for r in (list_value("ratios", own["ratios"]) if "ratios" in own else [str(x) for x in DEFAULT_RATIOS]):
        try:
            v = float(r)
        except ValueError:
            raise ConfigError(f"ratios: {r!r} is not a number (a compression ratio in (0, 1))") from None
        if not 0 <= v < 1:
            raise ConfigError(f"ratios: {r}: a compression ratio is in (0, 1) (the fraction of the context removed)")
        if v > 0 and v not in ratios:
            ratios.append(v)  # 0, the full cache, always runs
    answer = own.get("answer", "pooled")
    if answer not in ANSWERS:
        raise ConfigError(f"answer={answer}: must be one of {list(ANSWERS)}")
    prefill = own.get("prefill", "shared")
    if prefill not in PREFILLS:
        raise ConfigError(f"prefill={prefill}: must be one of {list(PREFILLS)}")
    tokens = _int("tokens", own.get("tokens", "2048"), 64)
    try:
        gen = {"gen": _int("gen", own["gen"], 1)} if "gen" in own else {}
        if task in ruler.RULER_SET:
            cfg = ruler.check({"name": task, "lengths": [tokens], "trials": 1, "protocol": "query_agnostic"} | gen)
        else:  # RULER's own task names (kvpress's leaderboard): their configs, RULER's tokens to generate
            cfg = ruler.check(ruler.leaderboard_task(task, tokens, 1, qa_file=own.get("qa_file")) | gen)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    samples = _int("samples", own.get("samples", "20"), 1)
    cfg["trials"] = cfg["batch"] = samples
    query_aware = _bool("query_aware", own.get("query_aware", "false"))
    ties = own.get("ties", "newer")
    check_ties(ties, presses)
    stem = own.get("name") or f"peer_{model}_{task}_{tokens}" + ("_query_aware" if query_aware else "") + (
        f"_ties_{ties}" if ties != "newer" else "")
    out = pathlib.Path(own.get("out", "results/peer"))
    cache_key = own.get("compile_cache", str(out / ".jax-cache"))
    cache = None if cache_key.strip().lower() in ("none", "") else pathlib.Path(cache_key)
    return Plan(model, cfg, tokens, samples, ratios, presses, cfg["gen"], _int("seed", own.get("seed", "0"), 0),
                _int("chunk", own.get("chunk", "512"), 1), prefill, out,
                stem, _bool("overwrite", own.get("overwrite", "false")), _bool("progress", own.get("progress", "true")),
                _bool("table_only", own.get("table_only", "false")), query_aware=query_aware,
                kvpress=_bool("kvpress", own.get("kvpress", "true")), model_path=own.get("model_path"), dtype=dtype,
                compile_cache=cache, answer=answer, ties=ties, eos_stop=_bool("eos_stop", own.get("eos_stop", "false")),
                argv=list(argv))


def leaderboard_names() -> tuple[str, ...]:
    """RULER's own task names (niah_single_1, ..., kvpress's leaderboard) that evals.ruler generates."""
    from evals import ruler

    return tuple(getattr(ruler, "AVAILABLE", ()))


def check_reference() -> None:
    """kvpress 0.5.5 installed in its own environment, or a ConfigError saying how to install it."""
    if not (REF / "kvpress").is_dir():
        raise ConfigError(f"kvpress 0.5.5 is not installed ({REF / 'kvpress'} is missing): install it with "
                          "`bash scripts/setup.sh test` (its own transformers 5.2.0 in .venv/kvpress-ref)")


def model_config(model: str) -> dict[str, Any]:
    return {"name": "smollm2" if model == "tiny" else model, "dtype": "float32"}


def prepare(p: Plan) -> Plan:
    """The tokenizer, the samples (split into context and question), the config hash; no weights."""
    from evals import ruler, zoo
    from evals.results import config_key

    mc = p.mconf
    try:
        if p.model != "tiny":
            zoo.describe(mc)  # the model file is there and whole
        tok = zoo.load_tokenizer(mc)
        p.eos_id = getattr(tok, "eos_id", None)
        ruler.check_prompts(p.task, tok, p.seed)
        samples = ruler.samples(p.task, tok, None, p.tokens, p.seed)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    try:
        splits = [question_end(tok, s.tokens, s.split) if p.query_aware else s.split for s in samples]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p.contexts = [np.asarray(s.tokens[:k], np.int32) for s, k in zip(samples, splits)]
    p.questions = [np.asarray(s.tokens[k:], np.int32) for s, k in zip(samples, splits)]
    p.refs = [tuple(s.refs) for s in samples]
    task = {k: v for k, v in p.task.items() if k not in ("trials", "batch")}  # sample i is the same for any count
    p.config = config_key({"model": mc if p.model != "tiny" else {"tiny": TINY, "vocab": tok.vocab_size},
                           "task": task, "tokens": p.tokens, "seed": p.seed} | ({"query_aware": True} if p.query_aware
                                                                                  else {}) | (
                               {"ties": p.ties} if p.ties != "newer" else {}))
    check_catalogue(p)
    check_variants(p)
    return p


def question_end(tok, tokens: np.ndarray, split: int) -> int:
    """Where the question's text ends in a prompt whose question starts at `split`: the start of the
    last occurrence of what the chat template puts after the user's message (its end-of-turn and
    the assistant's header; the answer prefix follows). kvpress's --query_aware appends the
    question to the context, so the context is compressed with the question in it and only this
    tail and the answer prefix come after the compression."""
    from evals.retrieval import has_chat_template

    sentinel = "\x00END\x00"
    if has_chat_template(tok):
        after = tok.apply_chat_template([{"role": "user", "content": f"x{sentinel}"}],
                                        add_generation_prompt=True).split(sentinel)[1]
    else:
        after = "\n"  # evals.retrieval.frame's prompt without a chat template
    want = list(tok.encode(after))
    if not want:
        raise ValueError(f"query_aware=true: the chat template puts no tokens after the user's message ({after!r})")
    ids = [int(x) for x in tokens]
    for k in range(len(ids) - len(want), split - 1, -1):
        if ids[k:k + len(want)] == want:
            return k
    raise ValueError(f"query_aware=true: the chat template's tail {after!r} is not in the prompt's question part "
                     "(a task whose answer prefix is not after the template's assistant header?)")


# -- the saved lines ---------------------------------------------------------------------------------


def saved(p: Plan, side: str) -> dict[tuple[int, str, float], dict[str, Any]]:
    """{(sample index, press, ratio): line} of this configuration in a side file and its shards
    (executor=ray's, `evals.peer_grid.lines`)."""
    from evals.peer_grid import lines

    ids = {p.sample_id(i): i for i in range(p.samples)}
    return {(ids[x["sample"]], x["press"], float(x["ratio"])): x for x in lines(p.path(f".{side}.jsonl"))
            if x["sample"] in ids}


def check_outputs(p: Plan) -> None:
    """Refuse (ConfigError) files of another configuration under this stem, unless overwrite=true
    (then they are removed); lines of this configuration are kept (resume)."""
    files = [p.path(s) for s in (".kvpress.jsonl", ".ours.jsonl", ".jsonl", ".md", ".csv")]
    foreign = [f for f in files[:2] if any(not x["sample"].startswith(p.config + "/") for x in read_lines(f))]
    if not foreign and p.path(".csv").is_file():
        try:
            with open(p.path(".csv"), newline="", encoding="utf-8") as f:
                configs = {r.get("config") for r in csv.DictReader(f)}
        except (OSError, ValueError):
            configs = {None}
        if configs - {p.config}:
            foreign = [p.path(".csv")]
    if not foreign:
        return
    if not p.overwrite:
        raise ConfigError(f"out={p.out} name={p.stem}: {foreign[0]} holds another configuration (other model, "
                          "task, tokens, gen or seed); pass name=<another stem> or out=<another folder>, or "
                          "overwrite=true to replace it")
    for f in files + [p.path(".kvpress.log"), p.path(".kvpress-job.json")]:
        if f.exists():
            f.unlink()


def pack(mask: np.ndarray) -> str:
    """[K, n] bool -> base64 of np.packbits (the worker's format)."""
    return base64.b64encode(np.packbits(mask).tobytes()).decode()


def unpack(text: str, k: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))[:k * n].reshape(k, n).astype(bool)


# -- the two sides -------------------------------------------------------------------------------------


def pending(p: Plan, side: str) -> list[tuple[int, str, float]]:
    have = saved(p, side)
    return [(i, c, r) for i in range(p.samples) for c, r in p.cells if (i, c, r) not in have]


def tiny_dir(p: Plan) -> pathlib.Path:
    """model=tiny's checkpoint (kvpress's worker builds it, seed 0): one per folder and length, shared
    by the runs there (`evals.leaderboard`'s tasks)."""
    return p.out / f"tiny_{max(p.tokens, 512)}.model"


def worker_job(p: Plan, todo: Sequence[tuple[int, str, float]]) -> dict[str, Any]:
    """The worker's multi-sample job for the (sample, press, ratio) items `todo`."""
    by: dict[int, list] = {}
    fields = {(c, r): catalogue_args(p, c, r)[3] if base_row(c) in CATALOGUE else press_fields(p.model, c)
              for c, r in dict.fromkeys((c, r) for _, c, r in todo)}
    for i, c, r in todo:
        by.setdefault(i, []).append([c, r, fields[(c, r)]])
    job: dict[str, Any] = {"n_new": p.gen, "prefill": p.prefill, "eos_stop": p.eos_stop,
                           # every core once our side is done, unless the environment sets the threads
                           "every_core_when": None if "OMP_NUM_THREADS" in os.environ else str(p.path(".ours-done")),
                           "samples": [{"id": p.sample_id(i), "context": p.contexts[i].tolist(),
                                        "question": p.questions[i].tolist(), "presses": ps} for i, ps in by.items()]}
    if p.model == "tiny":
        from evals import zoo

        vocab = zoo.load_tokenizer(p.mconf).vocab_size
        job |= {"checkpoint": None, "save_to": str(tiny_dir(p)),
                "tiny": {"kind": "llama", "seed": 0, "config": TINY | {
                    "vocab_size": vocab, "max_position_embeddings": max(p.tokens, 512)}}}
        tok = _gguf("smollm2")  # KVzipPress's repeat prompts: the tokenizer the tiny model's ids come from
        job["tokenizer_from"] = {"checkpoint": str(tok.parent), "gguf_file": tok.name}
    elif p.model == "hf":
        job |= {"checkpoint": str(pathlib.Path(p.model_path).expanduser())}
    else:
        path = _gguf(p.model)
        job |= {"checkpoint": str(path.parent), "gguf_file": path.name}
    return job


def _gguf(model: str) -> pathlib.Path:
    if model == "qwen":
        from models import packages

        return packages.qwen_gguf_path()
    from models.loading import smollm2_gguf_path

    return smollm2_gguf_path()


def worker_threads() -> int:
    """torch's threads in the kvpress worker: half of the cores, as it runs beside our side.
    torch's default, every core, has the two sides' threads fight over them (SmolLM2, ruler_vt at
    2,048 tokens, 2 cores, beside a running evals.peer: 27.9 s an item with 2 threads, 3.3 s with
    1, the same answers). When our side is done, the worker takes every core (`<stem>.ours-done`,
    checked between its items). OMP_NUM_THREADS in the environment wins (and the count stays)."""
    return max(1, (os.cpu_count() or 2) // 2)


def start_worker(p: Plan, todo: Sequence[tuple[int, str, float]]) -> subprocess.Popen:
    """kvpress's side in a subprocess (its own environment); it appends to <stem>.kvpress.jsonl."""
    job = p.path(".kvpress-job.json")
    job.write_text(json.dumps(worker_job(p, todo)), encoding="utf-8")
    from evals.compiles import caller_env

    env = {**caller_env(dict(os.environ)), "PYTHONPATH": str(REF), "CUDA_VISIBLE_DEVICES": "", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(worker_threads()))}
    log = open(p.path(".kvpress.log"), "w", encoding="utf-8")
    return subprocess.Popen([sys.executable, str(WORKER), str(job), str(p.path(".kvpress.jsonl"))], env=env,
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def load_ours(p: Plan):
    """(our Llama, tokenizer) of the run's model."""
    from evals import zoo

    if p.model == "tiny":
        from models.llama import Llama
        from models.loading import load_hf

        from models.tokenizer import attach

        cfg, params = load_hf(tiny_dir(p))
        tok = zoo.load_tokenizer(p.mconf)
        return attach(Llama(cfg, params), tok), tok  # kvzip's repeat prompts read the model's tokenizer
    return zoo.load_model(p.mconf)


def pieces(n: int, chunk: int) -> list[int]:
    """Lengths that feed n tokens: chunks of `chunk`, then the rest in decreasing powers of two
    (1994 at 512: 512, 512, 512, 256, 128, 64, 8, 2): the samples' contexts differ in length by a
    few tokens, and a step is compiled once per shape, so these shapes recur where a last chunk
    of n mod chunk tokens would compile anew for every sample (a chunk never changes a result)."""
    out = [chunk] * (n // chunk)
    rest = n % chunk
    while rest:
        out.append(1 << (rest.bit_length() - 1))
        rest -= out[-1]
    return out


def prompt_in_pieces(eng, ctx: np.ndarray, chunk: int):
    """`eng.prompt` of the context [n], fed in `pieces` (one prefill, each piece a step)."""
    return eng.prompt(ctx[None], chunk=pieces(len(ctx), chunk))


def question_pieces(n: int) -> list[int]:
    """The question's steps: n in powers of two, largest first (38: 32, 4, 2). Questions differ in
    length from sample to sample, and a step compiles once per length, so these shapes recur (at
    most log2(n) + 1 steps, each reading the weights once; a chunk never changes a result)."""
    from models.engine.layers import pieces as powers

    return powers(n)


class Phases:
    """Wall seconds of an item's phases (prefill, compress, kept, question, decode) and the
    compilation inside them (`compile`: seconds, `programs`), from `evals.compiles.CompileLog`."""

    def __init__(self, log):
        self.log, self.out = log, {}
        self.t, self.mark = time.time(), log.mark()

    def __call__(self, phase: str, value=None):
        """End `phase` now (after `value` is ready on the device); returns `value`."""
        import jax

        if value is not None:  # a Prompted: its cache and logits (dispatch is asynchronous)
            jax.block_until_ready((value.cache, value.logits) if hasattr(value, "cache") else value)
        now = time.time()
        self.out[phase] = round(self.out.get(phase, 0.0) + now - self.t, 3)
        self.t = now
        return value

    def done(self) -> dict[str, float]:
        programs, secs = self.log.since(self.mark)
        return self.out | {"compile": round(secs, 3), "programs": programs}


def engine_slots(p: Plan, model, max_len: int, max_new: int) -> dict[str, int]:
    """Per press, the slots of the shape class that serves all of its ratios (`models.engine.grid_slots`:
    the largest state among them; 0 for presses without kept tables: kvzip, duo)."""
    from kvpolicies.compat import kvpress
    from models.engine import grid_slots

    return {c: grid_slots([kvpress(press_name(c), r, n_layers=model.cfg.n_layers, max_new=max_new,
                                   **press_fields(p.model, c))
                           for r in p.ratios], model.cfg.n_layers, max_len) for c in p.presses if base_row(c) not in CATALOGUE}


def catalogue_slots(p: Plan, model, max_len: int, max_new: int) -> dict[str, int]:
    """`engine_slots` for CATALOGUE rows (`catalogue_args`' presses): per press, the slots of the shape class that
    serves all of its ratios and layers (PerLayerCompressionPress's and LUKVPress's per-layer and per-head budgets,
    QFilterPress's ratios...), or 0 for a press without kept tables (channel, merging, decoding presses...)."""
    from kvpolicies.compat import kvpress
    from models.engine import grid_slots

    out = {}
    for c in p.presses:
        if base_row(c) not in CATALOGUE:  # a plan may also run other presses (the leaderboard's query-aware runs): `engine_slots`
            continue
        pols = []
        for r in ((0.0,) if base_row(c) in RATIOLESS else p.ratios):
            name, kr, fields, _ = catalogue_args(p, c, r)
            pols.append(kvpress(name, kr, n_layers=model.cfg.n_layers, max_new=max_new, **fields))
        out[c] = grid_slots(pols, model.cfg.n_layers, max_len)
    return out


def shared_phase(model, engines, max_len: int, steps: list[int], memo: dict):
    """The engine of the prompt phase that covers the prompt phases of `engines` (one prefill for
    snapkv, adakv, pyramidkv, knorm, tova, streamingllm and expected attention: their slots are
    the same bit for bit, `kvpolicies.prompt.covers`), or None: fewer than two phases to cover, or
    a 1-token step in `steps` (a step of one token attends in one piece, where what a phase
    observes could change the outputs' rounding: each phase then prefills its own)."""
    from kvpolicies.prompt import superset
    from models.engine import Engine

    if min(steps) < 2:
        return None
    wide = superset({q for e in engines for q in e.prompt_policies})
    if wide is None:
        return None
    if wide not in memo:
        memo[wide] = Engine(model, wide, max_len=max_len)
    return memo[wide]


def run_ours(p: Plan, model, todo: Sequence[tuple[int, str, float]], tick=lambda: None) -> None:
    """Our side of the items `todo`, one line appended to <stem>.ours.jsonl per item (its answer,
    kept positions, seconds, `phases`, and the compressed state's `bytes`: stored, in its filled
    slots, and allocated). An engine per (press, ratio), kept across samples; the
    ratios of a press run one shape class (`Engine(slots=)`, `engine_slots`), so they share their
    compiled steps; per sample, the prompt compressors whose prompt phases one phase covers
    (`shared_phase`), or that share a prompt phase, compress one prefill (full last: it takes any
    dense prompt state), and kvzip's ratios one reconstruction pass (`Engine.reconstruct`). A press's
    ratios answer as one batch as soon as they are compressed, and their states are freed then, except
    with `answer=pooled` (the default), where the rows of every press of the sample that share a canonical
    append-only form (`evals.shared_answers.canonical`: the shape classes' prompt scorers, and head pools
    as per-head rows) wait for one batch through that form's engine, answered at POOL_ROWS rows or at the
    sample's end: at most POOL_ROWS - 1 such states wait per form (the leaderboard's 17 presses x 4 ratios
    at 4K, all held at once, took 15.5 GB). With `answer=shared` a press's batch of ratios goes through
    the canonical engine (one set of compiled question and decode steps for every press of one slot
    count and batch, not one per press); with `answer=press` through its own steps."""
    import jax

    from evals.compiles import CompileLog
    from kvpolicies.compat import kvpress
    from kvpolicies.memory import filled_bytes, tree_nbytes
    from models.engine import Engine
    from evals.shared_answers import canonical_of
    from models.llama import policy_runs

    restore = any(press_name(c) == "RestoreKVPress" for c in p.presses)
    max_len = max(len(c) + len(q) for c, q in zip(p.contexts, p.questions)) + p.gen + 8 * restore
    max_new = max(len(q) for q in p.questions) + p.gen
    slots = engine_slots(p, model, max_len, max_new)
    engines: dict[tuple[str, float], Engine] = {}
    shared: dict[Any, Engine] = {}  # the engines of covering prompt phases (`shared_phase`)
    by: dict[int, list[tuple[str, float]]] = {}
    for i, c, r in todo:
        by.setdefault(i, []).append((c, r))
    with open(p.path(".ours.jsonl"), "a", encoding="utf-8") as f, jax.default_matmul_precision("highest"), \
            CompileLog() as log:
        for i, cells in by.items():
            ctx, q = p.contexts[i], p.questions[i]
            states: list = []  # (engine, uncompressed prompt state) of this sample
            for c, r in cells:
                if (c, r) not in engines:
                    pol = kvpress("SnapKVPress" if c == "full" else press_name(c), r, n_layers=model.cfg.n_layers,
                                  max_new=max_new, ties=p.ties, **press_fields(p.model, c))
                    engines[(c, r)] = Engine(model, pol, max_len=max_len, slots=slots.get(c, 0), share_steps=True)
            wide = shared_phase(model, [engines[x] for x in cells], max_len, pieces(len(ctx), p.chunk), shared)
            ready: dict[Any, list] = {}  # per set of shared steps: (press, ratio, engine, state, kept, phases, seconds)
            pool: dict[Any, list] = {}  # answer=pooled: per canonical form, the rows of every press of the sample
            order = sorted(cells, key=lambda x: x[0] == "full")
            for k, (c, r) in enumerate(order):
                t0 = time.time()
                ph = Phases(log)
                eng = engines[(c, r)]
                # shares_prompt compares layer by layer; the state's runs of layers must match too (a
                # stack whose prompt phases differ by layer has a run per layer: it cannot adopt one run)
                runs = len(policy_runs(eng.prompt_policies, model.cfg.n_layers))
                j = next((j for j, (e, s) in enumerate(states) if len(s.cache) == runs and eng.shares_prompt(e)), None)
                if j is None:  # a prefill: the covering phase's when it serves this engine, else its own
                    src = wide if wide is not None and eng.shares_prompt(wide) else eng
                    states.append((src, ph("prefill", prompt_in_pieces(src, ctx, p.chunk))))
                    j = len(states) - 1
                if eng.reconstructors:  # kvzip: one reconstruction pass a sample, its scores kept for every ratio
                    states[j] = (states[j][0], eng.reconstruct(states[j][1]))
                st = ph("compress", eng.compress(states[j][1]))  # (RestoreKVPress: its restore pass in compress)
                mask = np.zeros((model.cfg.n_kv_heads, len(ctx)), bool)
                kept = []
                for layer in eng.kept_positions(st):
                    m = mask.copy()
                    for h, pos in enumerate(layer):
                        pos = np.asarray(pos)
                        m[h, pos[pos < len(ctx)]] = True  # RestoreKVPress's restore slots: not the context's
                    kept.append(pack(m))
                ph("kept")
                # a press's ratios (one shape class, the same steps) answer as the rows of one batch
                held = {"stored": filled_bytes(st.cache), "allocated": tree_nbytes(st.cache)}  # after the compression
                ready.setdefault((eng.policies, eng.max_len) if eng.slots else (c, r), []).append(
                    (c, r, eng, st, (kept, held), ph.done(), time.time() - t0))
                last = k + 1 == len(order)
                if last or order[k + 1][0] != c:  # a press's ratios are compressed: answer them,
                    for group in ready.values():  # then free their states (a sample's grid never held at once)
                        form = canonical_of(group[0][2]) if p.answer != "press" else None
                        if p.answer == "pooled" and form is not None:  # held for one batch of the sample's rows
                            pool.setdefault((form, group[0][2].max_len), []).extend(group)
                        else:
                            _answer_group(p, i, group, q, len(ctx), log, f, tick, mode=p.answer if form else None)
                    ready.clear()
                    for key, rows in list(pool.items()):  # a pool answers when full or at the sample's end
                        while len(rows) >= POOL_ROWS or last and rows:
                            _answer_group(p, i, rows[:POOL_ROWS], q, len(ctx), log, f, tick, mode="pooled")
                            del rows[:POOL_ROWS]


def _answer_group(p: Plan, i: int, group: list, q: np.ndarray, n: int, log, f, tick, mode: str | None = None) -> None:
    """The greedy answers of one batch of compressed states, a line each: a press's ratios through its own
    steps (`mode` None) or through their canonical form's engine (`evals.shared_answers`; "shared"), or
    the rows of several presses through it ("pooled")."""
    t1 = time.time()
    eng, ph = group[0][2], Phases(log)
    ids = answer_rows(eng, [x[3] for x in group], q, p.gen, ph, engines=[x[2] for x in group] if mode else None,
                      until=until_answered(p))
    share = {k: v / len(group) for k, v in ph.done().items()}  # the batch's time, shared out
    secs = (time.time() - t1) / len(group)
    for (c, r, _, _, (kept, held), own, spent), row in zip(group, ids):
        phases = {k: round(own.get(k, 0) + share.get(k, 0), 3) for k in own.keys() | share.keys()}
        line = {"sample": p.sample_id(i), "press": c, "ratio": r, "n": n,
                "answer": answered(p, row), "kept": kept, "bytes": held,
                "seconds": round(spent + secs, 2), "phases": phases | {"batch": len(group)}}
        if mode:
            line["answer_mode"] = mode
        f.write(json.dumps(line) + "\n")
        f.flush()
        tick()


def run_catalogue(p: Plan, model, todo: Sequence[tuple[int, str, float]], tick=lambda: None) -> None:
    """Our side of the CATALOGUE items `todo`, one line each in <stem>.ours.jsonl (run_ours's format): per
    (press, ratio) an engine of `kvpress(*catalogue_args(...))`, kept across samples (a press with kept tables:
    its ratios and layers one shape class, `catalogue_slots`, one set of compiled steps); per item the context's
    prefill (shared with the sample's earlier items of the same prompt phase, `shared_prefill`: a press's ratios
    prefill once), the compression, the kept positions, the greedy answer after the question. A channel press's
    line also has "channels", [layer] the packed [kv head, D] mask of the key channels it keeps (ThinK's
    `chan`); a decoding press's "kept" is what it holds after the last id fed (the question as one step, then
    one id a step, as kvpress's pipeline: `Engine.feed`), "kept_prefill" what it held after the prefill. Our
    side raising is a line with its error (the table shows it)."""
    import jax

    from evals.compiles import CompileLog
    from kvpolicies.compat import kvpress
    from kvpolicies.decoding import Decoding
    from kvpolicies.memory import filled_bytes, tree_nbytes
    from kvpolicies.think import ThinK
    from models.engine import Engine

    max_len = max(len(c) + len(q) for c, q in zip(p.contexts, p.questions)) + p.gen
    max_new = max(len(q) for q in p.questions) + p.gen
    engines: dict[tuple[str, float], Any] = {}
    slots = None
    states: list = []  # the sample's newest prompt states, (engine, state): a press's ratios share one prefill
    sample = None
    with open(p.path(".ours.jsonl"), "a", encoding="utf-8") as f, jax.default_matmul_precision("highest"), \
            CompileLog() as log:
        for i, c, r in todo:
            ctx, q = p.contexts[i], p.questions[i]
            if i != sample:
                states, sample = [], i
            t0 = time.time()
            ph = Phases(log)
            line: dict[str, Any] = {"sample": p.sample_id(i), "press": c, "ratio": r, "n": len(ctx)}
            try:
                if (c, r) not in engines:
                    name, kr, fields, _ = catalogue_args(p, c, r)
                    pol = kvpress(name, kr, n_layers=model.cfg.n_layers, max_new=max_new, **fields)
                    if slots is None:  # a press's ratios and layers as one shape class (`catalogue_slots`)
                        slots = catalogue_slots(p, model, max_len, max_new)
                    engines[(c, r)] = (Engine(model, pol, max_len=max_len, slots=slots[c], share_steps=True), pol)
                eng, pol = engines[(c, r)]
                st = ph("compress", eng.compress(shared_prefill(eng, states, ctx, p.chunk, ph)))
                held = {"stored": filled_bytes(st.cache), "allocated": tree_nbytes(st.cache)}
                kept = _packed(eng.kept_positions(st), model.cfg.n_kv_heads, len(ctx))
                ph("kept")
                fed = ph("question", eng.feed(st, q[None]))  # one step, as kvpress's (a decoding press counts steps)
                ids = answered(p, ph("decode", eng.continue_generate(fed, np.zeros((1, 0), np.int32), p.gen,
                                                                     until=until_answered(p)))[0])
                line |= {"answer": ids, "kept": kept, "bytes": held}
                pols = pol if isinstance(pol, tuple) else (pol,)
                if any(isinstance(x, Decoding) for x in pols):  # the state after the question and the ids, step by step
                    for x in ids[:-1]:
                        fed = eng.feed(fed, np.asarray([[x]], np.int32))
                    line |= {"kept": _packed(eng.kept_positions(fed), model.cfg.n_kv_heads, len(ctx)),
                             "kept_prefill": kept, "bytes": {"stored": filled_bytes(fed.cache),
                                                             "allocated": tree_nbytes(fed.cache)}}
                    ph("kept")
                if isinstance(pol, ThinK):  # [L, B, K, D]: each head's kept channels, then its pruned ones
                    chan = np.asarray(st.cache[0].chan)[:, 0]
                    on = np.zeros(chan.shape, bool)  # [L, K, D]
                    c_kept = pol.kept_channels(chan.shape[-1])
                    for layer in range(chan.shape[0]):
                        for h in range(chan.shape[1]):
                            on[layer, h, chan[layer, h, :c_kept]] = True
                    line["channels"] = [pack(m) for m in on]
            except (ValueError, NotImplementedError, TypeError) as e:  # our side refusing is a result too
                line["error"] = f"{type(e).__name__}: {e}"
            line |= {"seconds": round(time.time() - t0, 2), "phases": ph.done() | {"batch": 1}}
            f.write(json.dumps(line) + "\n")
            f.flush()
            tick()


def shared_prefill(eng, states: list, ctx: np.ndarray, chunk: int, ph, keep: int = 4):
    """The uncompressed prompt state of the context for `eng`: one of `states` (the sample's newest (engine,
    state) pairs, at most `keep`) whose engine `eng` shares the prompt with (`Engine.shares_prompt`, the same
    runs of layers: the same prompt phase, so the same slots bit for bit; `compress` leaves it usable), else
    its own prefill in `pieces`, added to `states`."""
    from models.llama import policy_runs

    runs = len(policy_runs(eng.prompt_policies, eng.cfg.n_layers))
    for e, st in states:
        if len(st.cache) == runs and eng.shares_prompt(e):
            return st
    st = ph("prefill", prompt_in_pieces(eng, ctx, chunk))
    states[:] = [*states[1 - keep:], (eng, st)] if keep > 1 else [(eng, st)]
    return st


def _packed(kept: list, heads: int, n: int) -> list[str]:
    """[layer][kv head] positions -> per layer the packed [kv head, n] mask of the positions below n."""
    out = []
    for layer in kept:
        m = np.zeros((heads, n), bool)
        for h, pos in enumerate(layer):
            pos = np.asarray(pos)
            m[h, pos[pos < n]] = True
        out.append(pack(m))
    return out


def ray_side() -> dict[str, Any]:
    """What a Ray actor of `evals.peer_grid` runs of our side (handed to it: peer_grid imports no peer)."""
    return {"saved": saved, "load": load_ours, "run": run_ours}


def answer_rows(eng, states: list, q: np.ndarray, gen: int, ph, engines: list | None = None,
                question: Sequence[int] | None = None, until=None) -> np.ndarray:
    """Greedy ids [len(states), gen] after the question `q` of one-row compressed states of
    engines that run `eng`'s steps (a press's ratios in one shape class), decoded as the rows of
    one batch: a step reads the weights once for every row (rows of a batch answer as each row
    alone: tests/models/test_shape_classes.py). `engines` (one per state, of any presses with one
    canonical append-only form): the rows go through that form's engine instead
    (`evals.shared_answers.shared_rows`), the question then in one step. `question`: its pieces instead
    (e.g. [len(q)] through a press's own steps too)."""
    import jax.numpy as jnp

    if engines is not None:
        from evals.shared_answers import shared_rows

        eng, st = shared_rows(list(zip(engines, states, strict=True)), len(q) + gen - 1)
    elif len(states) == 1:
        st = states[0]
    else:
        cache = tuple(type(run[0]).join_rows(list(run)) for run in zip(*[s.cache for s in states]))
        st = dataclasses.replace(states[0], cache=cache, logits=jnp.concatenate([s.logits for s in states]),
                                 tokens=None)
    # through a canonical form the question goes in one step, as kvpress's (one program per question length
    # and form, reading the weights once: 0.68x the time of 32 + 4 + 2 for 15 rows); a press's own steps in
    # `question_pieces`
    chunk = question if question is not None else None if engines is not None else question_pieces(len(q))
    # a batch built here (`shared_rows`, `join_rows`) is used once: its buffers go to the question's step
    fed = ph("question", eng.feed(st, np.repeat(q[None], len(states), 0), chunk=chunk,
                                 fork=engines is None and len(states) == 1))
    return ph("decode", eng.continue_generate(fed, np.zeros((len(states), 0), np.int32), gen, until=until))


def answer_end(ids: Sequence[int], eos: int | None) -> int | None:
    """How many of an answer's greedy ids it keeps once it has ended: through its first `eos` after the first id
    (kvpress's pipeline's stop, and where the text ends: `ruler.ids_text` cuts at the first `eos`); None while
    it goes on."""
    hit = np.flatnonzero(np.asarray(ids[1:]) == eos) if eos is not None else []
    return int(hit[0]) + 2 if len(hit) else None


def until_answered(p: Plan):
    """With `eos_stop`: `Engine.continue_generate`'s `until`, true once every row of a batch has ended
    (`answer_end`): the ids after that decide no text, score or `same_ids`. None otherwise (every `gen` id)."""
    if not p.eos_stop or p.eos_id is None:
        return None
    return lambda ids: all(answer_end(row, p.eos_id) is not None for row in ids)


def answered(p: Plan, ids) -> list[int]:
    """A row's saved answer ids: with `eos_stop`, through its end (`answer_end`: a batch's rows end at different
    steps; the saved ids do not depend on the batch), else all of them."""
    end = answer_end(ids, p.eos_id) if p.eos_stop else None
    return [int(x) for x in ids[:end]]


# -- the records and the table -------------------------------------------------------------------------


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a & b| / |a | b| of two boolean masks (1 for two empty sets)."""
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0


def kept_jaccard(lines: dict[str, dict[str, Any]]) -> list[list[float]]:
    """[layer][kv head] Jaccard of the two sides' kept sets: of the context positions, or of the key channels
    where both lines have "channels" (a channel press keeps every token)."""
    k = len(lines["ours"]["kept"])
    heads = len(base64.b64decode(lines["ours"]["kept"][0])) * 8 // lines["ours"]["n"] if k else 0
    what = "channels" if all("channels" in lines[s] for s in SIDES) else "kept"
    js = []
    for a, b in zip(lines["kvpress"][what], lines["ours"][what], strict=True):
        n = lines["ours"]["n"] if what == "kept" else len(base64.b64decode(b)) * 8 // heads
        ma, mb = unpack(a, heads, n), unpack(b, heads, n)
        js.append([jaccard(ma[h], mb[h]) for h in range(heads)])
    return js


def records(p: Plan, tok) -> list[dict[str, Any]]:
    """One record per (press, ratio, sample) whose both sides are saved: each side's answer ids,
    text (cut at EOS), score (or kvpress's error), whether they agree, and the kept-set Jaccard
    per [layer][kv head]."""
    from evals import ruler

    sides = {s: saved(p, s) for s in p.sides}
    out = []
    for c, r in p.cells:
        for i in range(p.samples):
            lines = {s: sides[s].get((i, c, r)) for s in p.sides}
            if any(v is None for v in lines.values()):
                continue
            rec: dict[str, Any] = {"config": p.config, "press": c, "ratio": r, "sample": i,
                                   "n_context": len(p.contexts[i]), "n_question": len(p.questions[i]),
                                   "refs": list(p.refs[i])}
            for s, line in lines.items():
                if "error" in line:
                    rec[s] = {"error": line["error"], "seconds": line.get("seconds")}
                    continue
                text = ruler.ids_text(tok, line["answer"])
                rec[s] = {"ids": line["answer"], "text": text, "score": score(p, text, p.refs[i]),
                          "seconds": line.get("seconds")}
            if any("error" in rec[s] for s in p.sides) or len(p.sides) < 2:
                if len(p.sides) == 2 and all("kept" in lines[s] for s in SIDES):  # compressed, then kvpress raised
                    rec["jaccard_before_error"] = kept_jaccard(lines)
                out.append(rec)
                continue
            k = len(lines["ours"]["kept"])
            js = kept_jaccard(lines)
            if all("channels" in lines[s] for s in SIDES):
                rec["jaccard_of"] = "channels"
            rec |= {"same_text": rec["kvpress"]["text"] == rec["ours"]["text"],
                    "same_ids": same_ids(rec["kvpress"]["ids"], rec["ours"]["ids"]),
                    "same_score": rec["kvpress"]["score"] == rec["ours"]["score"],
                    "jaccard": js, "jaccard_mean": float(np.mean(js)) if k else 1.0}
            out.append(rec)
    return out


def same_ids(theirs: Sequence[int], ours: Sequence[int]) -> bool:
    """Whether the two sides' greedy ids agree where both decoded them: all of them, or up to the side that stopped
    first (`eos_stop`: kvpress's side after an id of its generation config's eos_token_id, ours after the
    tokenizer's; lines saved before our side stopped hold every `gen` id): the ids after an end decide no text
    or score."""
    n = min(len(theirs), len(ours))
    return list(ours[:n]) == list(theirs[:n])


def summarize(p: Plan, recs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (press, ratio) cell with its samples: accuracies with Wilson intervals,
    agreement fractions, Jaccard mean and min, and kvpress's errors."""
    from evals.common import accuracy_record

    rows = []
    for c, r in p.cells:
        rs = [x for x in recs if x["press"] == c and x["ratio"] == r]
        ok = [x for x in rs if all("error" not in x[s] for s in p.sides)]
        row: dict[str, Any] = {"press": c, "ratio": r, "samples": len(rs), "compared": len(ok), "config": p.config}
        for s in SIDES:
            acc = accuracy_record([x[s]["score"] for x in ok] if s in p.sides else [])
            row |= {f"{s}_accuracy": acc["accuracy"], f"{s}_ci_low": acc["ci_low"], f"{s}_ci_high": acc["ci_high"]}
        both = ok if len(p.sides) == 2 else []
        for what in ("same_text", "same_ids", "same_score"):
            row[what] = sum(x[what] for x in both) / len(both) if both else float("nan")
        js = [j for x in both for layer in x["jaccard"] for j in layer]
        row["jaccard_mean"] = float(np.mean(js)) if js else float("nan")
        row["jaccard_min"] = float(np.min(js)) if js else float("nan")
        row["jaccard_of"] = "channels" if any(x.get("jaccard_of") == "channels" for x in both) else "positions"
        before = [j for x in rs if "jaccard_before_error" in x for layer in x["jaccard_before_error"] for j in layer]
        row["jaccard_before_error"] = (float(np.mean(before)), float(np.min(before))) if before else None
        errs = sorted({x[s]["error"] for x in rs for s in p.sides if "error" in x[s]})
        for side in SIDES:  # wall seconds per item (its share of a shared prefill included), mean over samples
            secs = [x[side]["seconds"] for x in rs if side in x and x[side].get("seconds") is not None]
            row[f"{side}_seconds"] = round(float(np.mean(secs)), 2) if secs else float("nan")
        for side in SIDES:
            row[f"{side}_errors"] = sum("error" in x.get(side, {}) for x in rs)
        row["error"] = errs[0] if errs else ""
        rows.append(row)
    return rows


CSV_COLUMNS = ("press", "ratio", "samples", "compared", "kvpress_accuracy", "kvpress_ci_low", "kvpress_ci_high",
               "ours_accuracy", "ours_ci_low", "ours_ci_high", "same_text", "same_ids", "same_score", "jaccard_mean",
               "jaccard_min", "kvpress_errors", "ours_errors", "error", "kvpress_seconds", "ours_seconds", "config")


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([r[c] for c in CSV_COLUMNS])
    return buf.getvalue()


def csv_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows `csv_text` wrote, with their numbers back as numbers (nan where a side has none)."""
    text = {"press", "error", "config"}
    whole = {"samples", "compared", "kvpress_errors", "ours_errors"}
    with open(path, newline="", encoding="utf-8") as f:
        return [{c: v if c in text else int(v) if c in whole else float(v) for c, v in r.items()}
                for r in csv.DictReader(f)]


def _acc(r: dict[str, Any], s: str) -> str:
    a = r[f"{s}_accuracy"]
    return "-" if a != a else f"{a:.2f} [{r[f'{s}_ci_low']:.2f}, {r[f'{s}_ci_high']:.2f}]"


def _frac(v: float, n: int) -> str:
    return "-" if v != v else f"{round(v * n)}/{n}"


def _secs(v: float) -> str:
    return "-" if v != v else f"{v:.2f}"


def command(p: Plan) -> str:
    return "python -m evals.peer" + "".join(f" {a}" for a in p.argv)


def markdown(p: Plan, rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """The table: one row per (press, ratio), the full cache first; then the notes."""
    head = ["press", "ratio", "samples", "kvpress accuracy", "ours accuracy", "same answer text", "same ids", "same score",
            "kept Jaccard mean (min)", "s/item kvpress", "s/item ours"]
    lines = ([f"**{title}**", ""] if title else []) + ["| " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * 8]
    notes = []
    for r in rows:
        n = r["compared"]
        if r["samples"] and not n:
            before = r.get("jaccard_before_error")
            cells = [f"kvpress raised ({r['kvpress_errors']}/{r['samples']})" if r["kvpress_errors"] else
                     f"ours raised ({r['ours_errors']}/{r['samples']})"] + ["-"] * 4 + [
                "-" if not before else f"{before[0]:.4f} ({before[1]:.4f}) before the error"]
            notes.append(f"{r['press']} at {r['ratio']:g}: {r['error']}")
        else:
            j = "-" if n == 0 or r["jaccard_mean"] != r["jaccard_mean"] else f"{r['jaccard_mean']:.4f} ({r['jaccard_min']:.4f})"
            j += " channels" if j != "-" and r.get("jaccard_of") == "channels" else ""
            cells = [_acc(r, "kvpress"), _acc(r, "ours"), _frac(r["same_text"], n), _frac(r["same_ids"], n),
                     _frac(r["same_score"], n), j]
            if r["kvpress_errors"] or r["ours_errors"]:
                notes.append(f"{r['press']} at {r['ratio']:g}: {r['kvpress_errors']} kvpress / {r['ours_errors']} "
                             f"ours errors left out: {r['error']}")
        secs = [_secs(r.get(f"{side}_seconds", float("nan"))) for side in SIDES]
        lines.append("| " + " | ".join([r["press"], f"{r['ratio']:g}", str(r["samples"])] + cells + secs) + " |")
    protocol = ("kvpress's protocol with --query_aware: the context and the question compressed together, the chat "
                "template's tail and the answer prefix appended" if p.query_aware else
                "kvpress's protocol: the context compressed once, the question appended")
    if p.ties != "newer":
        protocol += f"; our exact ties at the compression broken as torch.topk breaks them on the CPU (ties={p.ties})"
    finished = "both sides" if p.kvpress else "our side (kvpress=false: kvpress not run)"
    lines += ["", f"{p.model}, {p.task.get('ruler_name', p.task['name'])} at {p.tokens} tokens (prompt + {p.gen} "
              f"greedy tokens), samples: the prompts {finished} finished (of {p.samples}, seed {p.seed}), {protocol}. "
              f"Accuracy: RULER's {p.task.get('metric', 'string_match_all')}, Wilson 95 % interval in brackets. "
              "Same answer text / ids / score: samples where kvpress 0.5.5 and kvpolicies give the same decoded "
              "answer (cut at EOS) / the same greedy ids / the same score. Kept Jaccard: |A ∩ B| / |A ∪ B| of "
              "the context positions each keeps, per (layer, kv head), mean (min) over samples, layers and heads "
              "(\"channels\": of the key channels a channel press keeps, every token kept; a decoding press: "
              "what it holds after the last id fed). "
              "s/item: each side's wall seconds per (sample, press, ratio) item, mean over samples, as this run ran "
              "them (both sides at once, each its share of a shared prefill and its compilations included: "
              "`python -m benchmarks.peer_speed` times each side alone)."]
    if notes:
        lines += [""] + [f"- {x}" for x in notes]
    return "\n".join(lines) + "\n"


def score(p: Plan, text: str, refs: Sequence[str]) -> float:
    """RULER's score of an answer for the run's task: string_match_part for QA, else string_match_all."""
    from evals import ruler

    if p.task.get("metric") == "string_match_part":
        return ruler.string_match_part(text, refs)
    return ruler.string_match_all(text, refs)


def write(p: Plan, tok) -> list[dict[str, Any]]:
    """The joined records (<stem>.jsonl) and the table (<stem>.md, .csv) from the saved lines."""
    recs = records(p, tok)
    rows = summarize(p, recs)
    p.path(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    p.path(".csv").write_text(csv_text(rows), encoding="utf-8")
    p.path(".md").write_text(f"`{command(p)}`\n\n" + markdown(p, rows), encoding="utf-8")
    return rows


# -- running ----------------------------------------------------------------------------------------


def _count(p: Plan, side: str) -> int:
    """The plan's items a side has saved (not the lines of other ratios or presses in its file)."""
    return len(saved(p, side).keys() & {(i, c, r) for i in range(p.samples) for c, r in p.cells})


MAP_COUNT = pathlib.Path("/proc/sys/vm/max_map_count")
MAP_COUNT_MIN = 262144  # a 31-row grid's compiled steps held by one process: ~1,500 memory maps per row


def map_count_note() -> str:
    """A note when Linux's limit on a process's memory maps is below MAP_COUNT_MIN (XLA's CPU
    backend maps memory for every compiled step, and our side keeps each row's engine for all
    samples): past the limit LLVM fails with "Cannot allocate memory" and the run stops (its
    saved lines resume). Empty where the limit is high enough or unknown."""
    try:
        limit = int(MAP_COUNT.read_text())
    except (OSError, ValueError):
        return ""
    if limit >= MAP_COUNT_MIN:
        return ""
    return (f"[evals.peer] note: vm.max_map_count is {limit}; a full grid's compiled steps can exhaust it (LLVM: "
            f"'Cannot allocate memory', the run stops; rerun to resume). Raise it: sudo sysctl -w "
            f"vm.max_map_count={4 * MAP_COUNT_MIN}")


def run(p: Plan, model=None) -> list[dict[str, Any]]:
    """Both sides of every missing item (kvpress in a subprocess while ours runs here), then the
    records and the table; `model`: our model already loaded (`load_ours`), else loaded here."""
    from tqdm.auto import tqdm

    from evals import zoo
    from evals.compiles import CompileLog

    p.out.mkdir(parents=True, exist_ok=True)
    if p.table_only:
        return write(p, zoo.load_tokenizer(p.mconf))
    p.path(".ours-done").unlink(missing_ok=True)  # a killed run's
    for s in SIDES:
        repair(p.path(f".{s}.jsonl"))
    todo = {s: pending(p, s) if s in p.sides else [] for s in SIDES}
    total = p.samples * len(p.cells)
    print(f"[evals.peer] {len(p.cells)} rows (full + {len(p.presses)} presses x ratios "
          f"{', '.join(f'{r:g}' for r in p.ratios)}) x {p.samples} samples; to run: kvpress "
          f"{len(todo['kvpress'])}, ours {len(todo['ours'])} of {total}; files {p.path('.*')}")
    if todo["ours"] and (note := map_count_note()):
        print(note, file=sys.stderr)
    if todo["ours"]:
        from evals.compiles import MALLOC_TUNABLES

        malloc = os.environ.get("GLIBC_TUNABLES") == MALLOC_TUNABLES
        print(f"[evals.peer] our side: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, glibc "
              f"{'reusing freed memory (KVP_MALLOC=0: off)' if malloc else 'as the caller set it'}")
    t0 = time.time()
    bars = {s: tqdm(total=total, initial=total - len(todo[s]), desc=s, unit="run", position=k,
                    disable=not p.progress or s not in p.sides) for k, s in enumerate(SIDES)}
    worker = None
    try:
        if todo["kvpress"] or (p.model == "tiny" and not tiny_dir(p).is_dir()):  # the tiny model: the worker builds it
            worker = start_worker(p, todo["kvpress"])
            if p.model == "tiny":  # our side loads the checkpoint the worker saves
                _wait(p, worker, bars["kvpress"], total)
                worker = None

        def tick():
            bars["ours"].update()
            bars["kvpress"].n = _count(p, "kvpress")
            bars["kvpress"].refresh()

        mine = [x for x in todo["ours"] if base_row(x[1]) in CATALOGUE]  # an engine per (press, ratio): `run_catalogue`
        rest = [x for x in todo["ours"] if base_row(x[1]) not in CATALOGUE]
        with CompileLog() as compiled:  # our side's compilations in this process (not on Ray actors)
            if rest and p.ray is not None:  # on Ray actors, a shard each, merged at the end
                from evals.peer_grid import run_ours as on_ray

                on_ray(p, rest, tick, say=tqdm.write, side=ray_side())
            elif rest:
                if model is None:
                    model, _ = load_ours(p)
                run_ours(p, model, rest, tick)
            if mine:
                if model is None:
                    model, _ = load_ours(p)
                run_catalogue(p, model, mine, tick)
        if todo["ours"]:
            tqdm.write(f"[evals.peer] our side {compiled.line()}")
        if worker is not None:
            if todo["ours"]:  # our side's peak heap back to the system for the worker
                from evals.compiles import release_memory

                tqdm.write(f"[evals.peer] our side done: {release_memory() / 2**30:.1f} GiB released")
            p.path(".ours-done").touch()  # our side is done: the worker takes every core (`worker_job`)
            _wait(p, worker, bars["kvpress"], total)
            worker = None
    except KeyboardInterrupt:  # the table of what both sides saved so far, then the usual one line
        for b in bars.values():
            b.close()
        if worker is not None and worker.poll() is None:
            worker.terminate()
        write(p, zoo.load_tokenizer(p.mconf))
        print(f"[evals.peer] interrupted: {p.path('.md')} holds the samples both sides finished", file=sys.stderr)
        raise
    finally:
        if worker is not None and worker.poll() is None:
            worker.terminate()
        p.path(".ours-done").unlink(missing_ok=True)
        for b in bars.values():
            b.close()
    rows = write(p, zoo.load_tokenizer(p.mconf))
    print(f"[evals.peer] done in {time.time() - t0:.0f} s")
    full = rows[0]
    if full["compared"] and full["same_text"] < 1:
        differ = full["compared"] - round(full["same_text"] * full["compared"])
        print(f"[evals.peer] warning: the full cache's answers differ on {differ} sample(s): the two models "
              "do not compute the same thing", file=sys.stderr)
    return rows


def _wait(p: Plan, worker: subprocess.Popen, bar, total: int) -> None:
    while worker.poll() is None:
        bar.n = _count(p, "kvpress")
        bar.refresh()
        time.sleep(2)
    bar.n = _count(p, "kvpress")
    bar.refresh()
    if worker.returncode != 0:
        log = p.path(".kvpress.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
        tail = "\n".join(log[-15:])
        raise RuntimeError(f"the kvpress worker failed (exit {worker.returncode}); the lines it wrote are kept "
                           f"(run again to resume); the end of {p.path('.kvpress.log')}:\n{tail}")


def use_compile_cache(p: Plan, config: Any = None) -> None:
    """JAX's persistent compilation cache at `p.compile_cache` for this process, unless it is off or
    a cache is already set (JAX_COMPILATION_CACHE_DIR): a resumed run loads the steps it compiled
    before (each engine compiles its own, and the run restarts with none)."""
    import jax

    config = jax.config if config is None else config
    if p.compile_cache is not None and not config.jax_compilation_cache_dir:
        config.update("jax_compilation_cache_dir", str(p.compile_cache))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the command line `argv` (default sys.argv[1:]); returns the table's rows."""
    from evals.progress import warnings_as_lines
    from evals.run import interrupt_as_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return []
    from evals.compiles import use_fast_compile

    use_fast_compile()
    with warnings_as_lines("evals.peer"), interrupt_as_line("evals.peer"):
        try:
            p = parse(argv)
            if p.kvpress or p.model == "tiny":  # the tiny model is built (and saved) by the kvpress worker
                check_reference()
            prepare(p)
            check_outputs(p)
        except ConfigError as e:
            print(f"evals.peer: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        use_compile_cache(p)
        try:
            rows = run(p)
        except RuntimeError as e:
            print(f"evals.peer: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    print(markdown(p, rows))
    for s in (".md", ".csv", ".jsonl"):
        print(f"wrote {p.path(s)}")
    return rows


if __name__ == "__main__":
    from evals.compiles import reuse_memory

    reuse_memory("evals.peer", sys.argv[1:])  # glibc's allocator reusing its blocks: once, at the start
    main()
