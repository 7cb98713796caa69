"""The repeat inputs of KVzip's context reconstruction (`kvpolicies.kvzip`), as token ids.

Shapes: B batch, T context tokens, C = repeat_chunk, R repeat-input tokens.

The prompts are the authors' (snu-mllab/KVzip, model/wrapper.py `self_task`): the first chunk is
asked with "\\n\\nRepeat the previous context exactly.", every later one with "\\n\\nRepeat the
part of the previous context exactly, starting with " followed by the previous chunk's last
`tail` tokens; then the chat template's assistant header (the suffix that follows a user turn),
then the chunk itself, whose tokens the model is to reproduce.

`style="kvpress"`: kvpress 0.5.5's `KVzipPress.prepare` — the second prompt without the trailing
space, and the context's leading chat prefix (what the chat template puts before a user message,
`start` tokens) neither reconstructed nor scored; chunks are cut from `start` on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jaxtyping import Int

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
STYLES = ("authors", "kvpress")


@dataclasses.dataclass(frozen=True)
class RepeatPrompts:
    """Token ids of the two repeat prompts and of the chat suffix that follows them."""

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]
    start: int = 0  # leading context tokens neither reconstructed nor scored (kvpress: the chat prefix)


def repeat_prompts(tok: Any, style: str = "authors") -> RepeatPrompts:
    """The repeat prompts in `tok`'s ids (`style`: "authors" or "kvpress", see the module
    docstring); the suffix is what the chat template puts after a user message (its generation
    prompt included), as kvpress derives it; "\\n" without a template."""
    if style not in STYLES:
        raise ValueError(f"repeat_prompts: style={style!r} must be one of {list(STYLES)}")
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
    suffix + context[:, lo:hi]."""
    b, t = context.shape
    out = []
    for i, lo in enumerate(range(min(prompts.start, t), t, chunk)):
        hi = min(lo + chunk, t)
        head = np.asarray(prompts.first if i == 0 else prompts.next, np.int32)
        head = np.broadcast_to(head, (b, head.size))
        if i and tail:
            head = np.concatenate([head, context[:, max(lo - tail, prompts.start):lo]], axis=1)
        suffix = np.broadcast_to(np.asarray(prompts.suffix, np.int32), (b, len(prompts.suffix)))
        out.append((lo, hi, np.concatenate([head, suffix, context[:, lo:hi]], axis=1).astype(np.int32)))
    return out
