"""Task `perplexity`: stream a long text through the cache policy and score every next token.

The first `tokens` + 1 token ids of the text are fed `ctx.chunk` at a time (Engine.score: the
per-position masks make this equal to token-by-token decoding for every exact policy), giving
`tokens` per-token negative log-likelihoods: entry i is -log p(id[i+1] | ids <= i), predicted
by the query at position i.

Task keys: tokens (stream length, positions 0..tokens-1), segment (tokens per point of the
perplexity-vs-position curve).

Metrics: ppl and nll over the whole stream; ppl_in / ppl_out over the queries at positions
below / at or above the model's training length (`LlamaConfig.max_position`, only when the
stream passes it); ppl_last (the perplexity of the last `segment` tokens); tokens_per_s (scored
tokens over the scoring wall time less its compile time), compile_s (that compile time: JAX's
tracing, lowering and XLA compilation, `evals.common.compile_time`), score_s (the scoring wall time). Curves: `position` (end of each segment) and `ppl` per segment. Arrays: `nll`.
"""

from __future__ import annotations

import math
import time

import numpy as np

from evals.common import Task, TaskContext, TaskResult, compile_time

KEYS = ("name", "tokens", "segment")


def token_prefix(tokenizer, text: str, n: int) -> np.ndarray:
    """The first n ids of `text`, tokenizing only a prefix of it (grown until it has n ids plus
    a margin, so the cut cannot change them)."""
    margin = 64
    chars = 8 * (n + margin)
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=True)  # the BOS a model asks for (gemma3; none for smollm2, qwen)
        if len(ids) >= n + margin or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"perplexity: the text has only {len(ids)} tokens; tokens={n - 1} needs {n}")
    return np.asarray(ids[:n], np.int32)


def segment_ppl(nll: np.ndarray, segment: int) -> tuple[list[int], list[float]]:
    """(end position, perplexity) of each consecutive `segment` of the NLL stream (last may be short)."""
    ends = list(range(segment, len(nll), segment)) + [len(nll)]
    starts = [0] + ends[:-1]
    return ends, [math.exp(float(np.mean(nll[a:b]))) for a, b in zip(starts, ends)]


def summarize(nll: np.ndarray, segment: int, train_len: int | None) -> tuple[dict[str, float], dict[str, list]]:
    """Metrics and curves of a per-token NLL stream (see the module docstring)."""
    ends, ppl = segment_ppl(nll, segment)
    metrics = {"ppl": math.exp(float(np.mean(nll))), "nll": float(np.mean(nll)), "tokens": len(nll),
               "ppl_last": ppl[-1]}
    if train_len is not None and len(nll) > train_len:
        metrics["ppl_in"] = math.exp(float(np.mean(nll[:train_len])))
        metrics["ppl_out"] = math.exp(float(np.mean(nll[train_len:])))
    return metrics, {"position": ends, "ppl": ppl}


def throughput(tokens: int, seconds: float, compile_s: float) -> dict[str, float]:
    """tokens_per_s over the scoring time less its compile time (compile_s, reported apart);
    score_s is the wall time of the whole scoring."""
    compute = max(seconds - compile_s, 1e-9)
    return {"tokens_per_s": tokens / compute, "compile_s": compile_s, "score_s": seconds}


def check(task: dict) -> tuple[int, int]:
    """(tokens, segment) of a task config; unknown keys or bad values raise ValueError."""
    unknown = sorted(set(task) - set(KEYS))
    if unknown:
        raise ValueError(f"task perplexity: unknown key(s) {unknown}; its keys are {list(KEYS)}")
    tokens, segment = task.get("tokens"), task.get("segment", 1024)
    for name, v in (("tokens", tokens), ("segment", segment)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"task.{name}={v!r}: must be an int >= 1")
    return tokens, segment


def run(ctx: TaskContext) -> TaskResult:
    tokens, segment = check(dict(ctx.task))
    if ctx.tokenizer is None or ctx.text is None:
        raise ValueError("task perplexity needs a text and a tokenizer (this model has no tokenizer: "
                         "use a text model such as model=smollm2)")
    ids = token_prefix(ctx.tokenizer, ctx.text, tokens + 1)
    engine = ctx.engine(tokens)
    start = time.perf_counter()
    with compile_time() as compiled:
        nll = engine.score(ids, chunk=ctx.chunk, progress=ctx.progress)  # [tokens]
    seconds = time.perf_counter() - start
    metrics, curves = summarize(nll, segment, ctx.model.cfg.max_position)
    metrics.update(throughput(tokens, seconds, compiled.seconds))
    return TaskResult(metrics=metrics, arrays={"nll": nll.astype(np.float32)}, curves=curves)


def check_text(conf: dict, tokenizer, text: str | None) -> None:
    """The text has `tokens` + 1 tokens (the stream and its next token)."""
    if text is None:
        return
    n = conf["task"]["tokens"]
    try:
        token_prefix(tokenizer, text, n + 1)
    except ValueError as e:
        data = conf["data"]
        where = f"data.path={data['spec']}" if data.get("name") == "path" else \
            f"data={data.get('name')} (spec {data['spec']!r})"
        raise ValueError(f"tokens={n}: {e} ({where})") from None


TASK = Task(run=run, check=check, extent=lambda task: (f"tokens={task['tokens']}", task["tokens"], 0, 1),
            cells=lambda task: 1, check_text=check_text)
