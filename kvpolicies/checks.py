"""Hyperparameter validation shared by policies and codecs (imports nothing from kvpolicies).

Each helper raises ValueError naming the owner, the field, its value and the allowed range,
e.g. "int4.group=1: must be an int >= 2", so `__post_init__` of any frozen config is one line a field.
"""

from __future__ import annotations

from typing import Any

SCALE_DTYPES = ("float32", "bfloat16", "float16")


def check_int(owner: str, name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raise ValueError naming the field, its value and the allowed range."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{owner}.{name}={value!r}: must be an int {rng}")


def check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name}={value!r}: must be one of {choices}")


def check_scale_dtype(owner: str, value: Any) -> None:
    if value not in SCALE_DTYPES:
        raise ValueError(f"{owner}.scale_dtype={value!r}: must be one of {SCALE_DTYPES}")
