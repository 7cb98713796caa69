"""`evals.compiles`: programs counted from JAX's compilation events (a fresh program counts once, a
cached call not at all), and the persistent compilation cache of the evals commands (its folder,
the switch that turns it off, a cache already set is kept)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from evals import compiles


@pytest.fixture
def no_disk_cache():
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)


def test_a_fresh_program_counts_once(no_disk_cache):
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1.25)
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


def test_the_persistent_cache_folder_and_its_switch(monkeypatch, tmp_path):
    cfg = jax.config
    was = cfg.jax_compilation_cache_dir
    try:
        cfg.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(compiles.CACHE_ENV, "none")
        assert compiles.use_persistent_cache() is None and not cfg.jax_compilation_cache_dir
        monkeypatch.setenv(compiles.CACHE_ENV, str(tmp_path / "c"))
        assert compiles.use_persistent_cache() == str(tmp_path / "c") == cfg.jax_compilation_cache_dir
        monkeypatch.delenv(compiles.CACHE_ENV)
        assert compiles.use_persistent_cache() == str(tmp_path / "c")  # a cache already set is kept
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert compiles.default_cache_dir() == str(tmp_path / "xdg" / "kvpolicies" / "jax")
    finally:
        cfg.update("jax_compilation_cache_dir", was)
