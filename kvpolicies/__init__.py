"""kvpolicies: long-context KV-cache policies as pure-JAX, jit-static dataclasses.

A registry maps short names to policy classes; `get("sink", n_sink=4, window=4096)` builds one.
"""

from __future__ import annotations

import dataclasses

from kvpolicies.attend import attend
from kvpolicies.base import EMPTY, Policy, RopePositions, SlotState
from kvpolicies.codecs import CODECS, Codec, Identity, get_codec
from kvpolicies.full import Full
from kvpolicies.h2o import H2O
from kvpolicies.hier import Hier
from kvpolicies.kivi import Kivi
from kvpolicies.quest import Quest
from kvpolicies.rope import Rope
from kvpolicies.sink import Sink
from kvpolicies.snapkv import SnapKV
from kvpolicies.tova import TOVA
from kvpolicies.window import Window

POLICIES: dict[str, type[Policy]] = {
    "full": Full,
    "window": Window,
    "sink": Sink,
    "hier": Hier,
    "quest": Quest,
    "h2o": H2O,
    "tova": TOVA,
    "snapkv": SnapKV,
    "kivi": Kivi,
}


def get(name: str, codec: str | Codec = "none", **kwargs) -> Policy:
    """A policy by registry name; unknown names or fields raise ValueError listing the choices."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}: must be one of {sorted(POLICIES)}")
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"codec"}
    bad = sorted(set(kwargs) - fields)
    if bad:
        raise ValueError(f"policy {name!r} has no field(s) {bad}; its fields are {sorted(fields)}")
    return cls(codec=get_codec(codec), **kwargs)


__all__ = ["EMPTY", "CODECS", "POLICIES", "Codec", "Full", "H2O", "Hier", "Identity", "Kivi", "Policy", "Quest",
           "Rope", "RopePositions", "Sink", "SlotState", "SnapKV", "TOVA", "Window", "attend", "get", "get_codec"]
