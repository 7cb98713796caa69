"""kvpolicies: long-context KV-cache policies as pure-JAX, jit-static dataclasses.

`attend(policy, state, q, k, v, pos, rope)` runs one attention step of any JAX model through a
policy. The registry maps short names to policy classes; `get("sink", n_sink=4, window=4096)`
builds one. Adding a policy is one file (its class) and one line in `_REGISTRY` below.
"""

from __future__ import annotations

import dataclasses
import importlib

from kvpolicies.attend import attend, record_visible
from kvpolicies.base import EMPTY, Policy, RopePositions, Seen, SlotState, View, check_codec
from kvpolicies.codecs import CODECS, Codec, Identity, get_codec
from kvpolicies.rope import Rope

# registry name -> "module:Class" inside this package (one line per policy)
_REGISTRY = {
    "full": "full:Full",
    "window": "window:Window",
    "sink": "sink:Sink",
    "multires": "multires:MultiRes",  # ours (not a published method); alias "hier"
    "quest": "quest:Quest",
    "h2o": "h2o:H2O",
    "tova": "tova:TOVA",
    "snapkv": "snapkv:SnapKV",
    "pyramidkv": "pyramidkv:PyramidKV",
    "knorm": "knorm:Knorm",
    "keydiff": "keydiff:KeyDiff",
    "think": "think:ThinK",  # key channels pruned (ThinK): stores fewer key channels, every token
    "qfilter": "qfilter:QFilter",  # Q-Filters (its filters: evals.qfilter)
    "lagkv": "lagkv:LagKV",
    "finch": "finch:Finch",
    "cur": "cur:CUR",
    "compactor": "compactor:Compactor",
    "simlayerkv": "simlayerkv:SimLayerKV",
    "cap": "cap:Cap",
    "random": "random_keep:RandomKeep",
    "observed": "observed:Observed",
    "expected": "expected:Expected",
    "adakv": "adakv:AdaKV",
    "critical": "critical:Critical",  # CriticalKV over an inner scorer (the model hands it W_o: base.ReadsValues)
    "kvzip": "kvzip:KVzip",
    "kvcompose": "kvcompose:KVCompose",  # kvzip's kind of pass (the context fed again), layer counts chosen over all layers
    "kvgrad": "kvgrad:KVgrad",  # KVzip's reconstruction, scored by attention x ||v W_o|| x gradient (models.gradient)
    "kvzap": "kvzap:KVzap",  # a learned surrogate of kvzip's scores (weights: evals.train_kvzap)
    "duo": "duo:Duo",
    "kivi": "kivi:Kivi",
    "paged": "paged:Paged",  # a storage layout: full/window/sink over a block pool (vLLM-style pages)
}

POLICIES: dict[str, type[Policy]] = {
    name: getattr(importlib.import_module(f"kvpolicies.{spec.split(':')[0]}"), spec.split(":")[1])
    for name, spec in _REGISTRY.items()
}
globals().update({cls.__name__: cls for cls in POLICIES.values()})  # kvpolicies.Sink, kvpolicies.H2O, ...


# old names that still build their policy (not registered twice: the registry lists each once)
ALIASES = {"hier": "multires"}


def check_fields(name: str, kwargs: dict) -> type[Policy]:
    """The class of policy `name` (or an alias); unknown names or fields raise ValueError listing the choices."""
    name = ALIASES.get(name, name)
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}: must be one of {sorted(POLICIES)}")
    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"codec"}
    bad = sorted(set(kwargs) - fields)
    if bad:
        raise ValueError(f"policy {name!r} has no field(s) {bad}; its fields are {sorted(fields)}")
    return cls


def get(name: str, codec: str | Codec = "none", **kwargs) -> Policy:
    """A policy by registry name; unknown names or fields raise ValueError listing the choices."""
    policy = check_fields(name, kwargs)(codec=get_codec(codec), **kwargs)
    check_codec(policy)
    return policy


__all__ = ["ALIASES", "CODECS", "EMPTY", "POLICIES", "Codec", "Identity", "Policy", "Rope", "RopePositions", "Seen",
           "SlotState", "View", "attend", "check_fields", "get", "get_codec", "record_visible",
           *(cls.__name__ for cls in POLICIES.values())]
