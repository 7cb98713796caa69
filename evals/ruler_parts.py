"""The pieces evals.ruler (RULER-style tasks) and evals.ruler13 (RULER's own tasks) share: RULER's
scoring (post-processing, string_match_all / string_match_part), the protocols, needle keys and
values, and the token pieces of the list tasks. Lowest of the two: neither imports the other here."""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from evals import retrieval as R

PROTOCOLS = ("query_aware", "query_agnostic")


def postprocess(pred: str) -> str:
    """RULER's post-processing: control characters become newlines; stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """RULER's score of one prediction: the fraction of `refs` that occur in it (case-insensitive)."""
    low = postprocess(pred).lower()
    return sum(r.lower() in low for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """RULER's QA score of one prediction: 1 if any of `refs` occurs in it (case-insensitive)."""
    low = postprocess(pred).lower()
    return float(max(r.lower() in low for r in refs))


def word_keys(rng: np.random.Generator, n: int) -> list[str]:
    pick = rng.choice(len(R.ADJECTIVES) * len(R.NOUNS), n, replace=False)
    return [f"{R.ADJECTIVES[i // len(R.NOUNS)]}-{R.NOUNS[i % len(R.NOUNS)]}" for i in pick]


def needle_values(rng: np.random.Generator, n: int, kind: str) -> list[str]:
    if kind == "uuid":
        return [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n)]
    return [str(v) for v in rng.integers(1_000_000, 10_000_000, n)]


def join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


@functools.lru_cache(maxsize=4)
def essay_words(text: str) -> tuple[str, ...]:
    """The distinct lowercase alphabetic words of 4-10 letters of a text, sorted (cwe's vocabulary)."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", text))))


def pad_id(tok: Any) -> int:
    for s in ("\n", " ", "."):
        ids = tok.encode(s)
        if len(ids) == 1:
            return int(ids[0])
    raise ValueError("the tokenizer has no single-token newline, space or period to pad a list with")


class Pieces:
    """Token ids of text pieces, each encoded once."""

    def __init__(self, tok: Any):
        self.tok, self.cache = tok, {}

    def __call__(self, s: str) -> list[int]:
        if s not in self.cache:
            self.cache[s] = list(self.tok.encode(s))
        return self.cache[s]


def zeta_of(alpha: float) -> float:
    from scipy.special import zeta

    return float(zeta(alpha))
