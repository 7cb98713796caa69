"""The visibility recorder: the most keys any query attended, measured from the masks attention
applied, by a host callback compiled only into steps traced while a recorder is open."""

from __future__ import annotations

import contextlib

import jax

_RECORDERS: list[dict[str, int]] = []  # open `record_visible` contexts (host side)


def _report(visible) -> None:
    for rec in _RECORDERS:
        rec["max_visible"] = max(rec["max_visible"], int(visible))


def recording() -> bool:
    """Whether a `record_visible` context is open (steps traced now report what they attended)."""
    return bool(_RECORDERS)


def report(visible) -> None:
    """Inside a traced step: report `visible` (int32 scalar) to every open recorder (if any is open
    while the step is traced; nothing is compiled in otherwise)."""
    if _RECORDERS:
        jax.debug.callback(_report, visible)


@contextlib.contextmanager
def record_visible():
    """Record the most keys any query attended, as {"max_visible": n}, over the attention steps
    run inside the context. Measured from the masks attention applied (causal, the view's own
    mask, empty slots, `select`), by a host callback compiled only into steps traced while a
    recorder is open (a step traced outside records nothing; nothing is compiled in otherwise)."""
    rec = {"max_visible": 0}
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)
