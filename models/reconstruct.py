"""The repeat inputs of KVzip's context reconstruction (`kvpolicies.kvzip`), as token ids.

Shapes: B batch, T context tokens, C = repeat_chunk, R repeat-input tokens.

The prompts are the authors' (snu-mllab/KVzip, model/wrapper.py `self_task`): the first chunk is
asked with "\\n\\nRepeat the previous context exactly.", every later one with "\\n\\nRepeat the
part of the previous context exactly, starting with " followed by the previous chunk's last
`tail` tokens; then the chat template's assistant header (the suffix that follows a user turn),
then the chunk itself, whose tokens the model is to reproduce. `reconstruct` runs the pass for
an engine: each chunk's repeat input after the context, the cache read and never written. What
each layer does in it is the reconstructors' (`kvpolicies.prompt.Reconstructor`'s hooks); this
module names no policy.

`style="kvpress"`: kvpress 0.5.5's `KVzipPress.prepare` — the second prompt without the trailing
space, and the context's leading chat prefix (what the chat template puts before a user message,
`start` tokens) neither reconstructed nor scored; chunks are cut from `start` on.

`style="none"`: no prompt and no suffix, the context chunk alone (KVCompose's pass,
`kvpolicies.kvcompose`, feeds the whole context again after itself); no tokenizer is needed.
With `repeat_chunk = 0` the pass feeds nothing and only the reconstructors' `after_pass` runs (a
choice over all layers of scores taken in the prefill: `kvpolicies.fastkvzip`, `layerwise=False`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Int

from kvpolicies.prompt import Reconstructor, reads_gradients
from models.gradient import attention_gradients

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
STYLES = ("authors", "kvpress", "none")


@dataclasses.dataclass(frozen=True)
class RepeatPrompts:
    """Token ids of the two repeat prompts and of the chat suffix that follows them."""

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]
    start: int = 0  # leading context tokens neither reconstructed nor scored (kvpress: the chat prefix)


def repeat_prompts(tok: Any, style: str = "authors") -> RepeatPrompts:
    """The repeat prompts in `tok`'s ids (`style`: "authors", "kvpress" or "none", see the module
    docstring); the suffix is what the chat template puts after a user message (its generation
    prompt included), as kvpress derives it; "\\n" without a template."""
    if style not in STYLES:
        raise ValueError(f"repeat_prompts: style={style!r} must be one of {list(STYLES)}")
    if style == "none":
        return RepeatPrompts((), (), ())
    suffix, prefix = "\n", ""
    template = getattr(tok, "chat_template", None)
    if template is not None and hasattr(tok, "apply_chat_template"):
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True)
        head, suffix = text.split(sep)[0], text.split(sep)[-1]
        prefix = head.split(dummy)[0]
    ids = lambda text: tuple(int(i) for i in tok.encode(text))  # noqa: E731
    if style == "authors":
        return RepeatPrompts(ids(FIRST), ids(NEXT), ids(suffix))
    return RepeatPrompts(ids(FIRST), ids(NEXT.rstrip(" ")), ids(suffix), start=len(ids(prefix)) if prefix else 0)


def repeat_inputs(context: Int[np.ndarray, "B T"], prompts: RepeatPrompts, chunk: int, tail: int
                  ) -> list[tuple[int, int, Int[np.ndarray, "B R"]]]:
    """(lo, hi, ids) per chunk [lo, hi) of the context from `prompts.start` on: ids = prompt +
    suffix + context[:, lo:hi]. chunk 0: none (a reconstructor that scored the prompt during the
    prefill: only its `after_pass` runs)."""
    b, t = context.shape
    out = []
    if chunk == 0:
        return out
    for i, lo in enumerate(range(min(prompts.start, t), t, chunk)):
        hi = min(lo + chunk, t)
        head = np.asarray(prompts.first if i == 0 else prompts.next, np.int32)
        head = np.broadcast_to(head, (b, head.size))
        if i and tail:
            head = np.concatenate([head, context[:, max(lo - tail, prompts.start):lo]], axis=1)
        suffix = np.broadcast_to(np.asarray(prompts.suffix, np.int32), (b, len(prompts.suffix)))
        out.append((lo, hi, np.concatenate([head, suffix, context[:, lo:hi]], axis=1).astype(np.int32)))
    return out


RECON_BUCKET = 128  # repeat inputs are padded to a multiple of this (one reconstruction trace per bucket)


def engine_prompts(zippers: tuple, repeat: Any) -> RepeatPrompts | None:
    """The repeat prompts of an engine whose kvzip layers are `zippers`: `repeat` as given
    (RepeatPrompts or None), or a tokenizer's ids in those layers' style."""
    if not zippers:
        return None
    if {p.prompts for p in zippers} == {"none"} and not isinstance(repeat, RepeatPrompts):
        return RepeatPrompts((), (), ())  # the context alone: no tokenizer needed
    if repeat is None or isinstance(repeat, RepeatPrompts):
        return repeat
    if not hasattr(repeat, "encode"):
        raise ValueError(f"Engine repeat={type(repeat).__name__}: give models.reconstruct.RepeatPrompts or a "
                         "tokenizer (with encode)")
    styles = {p.prompts for p in zippers}
    if len(styles) > 1:
        raise ValueError(f"kvzip layers with different repeat-prompt styles {sorted(styles)}: one pass serves all")
    return repeat_prompts(repeat, styles.pop())


def scored_runs(reconstructors: tuple, runs) -> list[bool]:
    """Per run of the pass's layers (`runs`: (start, end, policy)), whether it scores (its state
    is kept: `Reconstructor.scores_in_pass`)."""
    return [bool(reconstructors) and reconstructors[0].scores_in_pass(p) for _, _, p in runs]


def reconstruct(engine: Any, cache: tuple, tokens: np.ndarray, runs: list) -> tuple:
    """The context reconstruction over a prompt-phase cache holding `tokens` [B, T], for an
    engine (`engine.repeat`, `engine.reconstructors`, its jitted `recon_step`); `runs`: the
    reconstruction policies' runs of layers. Each chunk's repeat input runs after the context
    (positions T..); returns the cache with every scoring layer's scores (kvzip: `extra["zip"]`
    [B, K, M] and, for scope="model", its kept tokens `extra["zip_kept"]`)."""
    zippers: tuple[Reconstructor, ...] = engine.reconstructors
    chunks = {(p.repeat_chunk, p.repeat_tail) for p in zippers}
    if len(chunks) > 1:
        raise ValueError(f"kvzip layers with different repeat_chunk/repeat_tail {sorted(chunks)}: one pass serves all")
    (chunk, tail), = chunks
    if len(runs) != len(cache):
        raise ValueError("reconstruct: the cache does not have this engine's prompt-phase layout")
    scored = scored_runs(zippers, runs)
    t = tokens.shape[1]
    for lo, hi, ids in repeat_inputs(tokens, engine.repeat, chunk, tail):
        # pads at the end, to a multiple of RECON_BUCKET (at most max_len tokens, as a layer of
        # another policy may write the input into its slots): one trace per bucket, not per
        # prompt length; no real repeat query sees them (causal), their own queries score nothing
        r = ids.shape[1]
        padded = np.pad(ids, ((0, 0), (0, min(-r % RECON_BUCKET, max(engine.max_len - r, 0)))))
        cache = tuple(zippers[0].before_chunk(st, lo, hi, t + r) if z else st for st, z in zip(cache, scored))
        pos = jnp.broadcast_to(jnp.arange(t, t + padded.shape[1], dtype=jnp.int32), padded.shape)
        if any(reads_gradients(p) for _, _, p in runs):  # kvgrad: each layer's attention-output gradient norms
            cache = attention_gradients(engine, cache, jnp.asarray(padded), pos, t + r)
        new = engine.recon_step(engine.params, cache, jnp.asarray(padded), pos)
        cache = tuple(n if z else st for st, n, z in zip(cache, new, scored))
        engine.reconstruct_tokens += ids.size
        engine.reconstruct_pad_tokens += padded.size - ids.size
    return model_scope(zippers, cache, scored)


def model_scope(zippers: tuple, cache: tuple, scored: list[bool]) -> tuple:
    """What follows the pass's last input (`Reconstructor.after_pass`; kvzip with scope="model":
    one choice over all its layers' scores, kvpress's default)."""
    return zippers[0].after_pass(zippers, cache, scored) if zippers else cache
