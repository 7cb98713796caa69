"""`evals.compiles`: programs counted from JAX's compilation events (a fresh program counts once, a
cached call not at all), and the persistent compilation cache of the evals commands (its folder,
the switch that turns it off, a cache already set is kept)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from evals import compiles


def test_a_fresh_program_counts_once():
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1.2578125)  # compiled nowhere else (a cache on disk: no hit)
    with compiles.CompileLog() as log:
        f(np.ones(7, np.float32))
        mark = log.mark()
        f(np.ones(7, np.float32))  # the same shape: no new program
        assert log.since(mark) == (0, 0.0)
        f(np.ones(9, np.float32))  # another shape: one more
    assert log.programs == 2 and log.seconds > 0
    f(np.ones(11, np.float32))  # after the log closed: not counted
    assert log.programs == 2
    assert log.line(10.0).startswith("compiled 2 programs in ")


class Config:
    """A stand-in for jax.config (the process's own cache is left alone: tests share it)."""

    def __init__(self, folder=None):
        self.jax_compilation_cache_dir = folder

    def update(self, name, value):
        setattr(self, name, value)


def test_the_persistent_cache_folder_and_its_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(compiles.CACHE_ENV, "none")
    assert compiles.use_persistent_cache(config=(cfg := Config())) is None and cfg.jax_compilation_cache_dir is None
    monkeypatch.setenv(compiles.CACHE_ENV, str(tmp_path / "c"))
    assert compiles.use_persistent_cache(config=cfg) == str(tmp_path / "c") == cfg.jax_compilation_cache_dir
    monkeypatch.delenv(compiles.CACHE_ENV)
    assert compiles.use_persistent_cache(config=Config("/elsewhere")) == "/elsewhere"  # a cache already set wins
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiles.default_cache_dir() == str(tmp_path / "xdg" / "kvpolicies" / "jax")
    assert compiles.use_persistent_cache(config=(cfg := Config())) == str(tmp_path / "xdg" / "kvpolicies" / "jax")
