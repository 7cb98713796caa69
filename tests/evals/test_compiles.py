"""`evals.compiles`: programs counted from JAX's compilation events (a fresh program counts once, a
cached call not at all), and the persistent compilation cache of the evals commands (its folder,
the switch that turns it off, a cache already set is kept), and their XLA flags (added unless set,
their switch, and no float of the peer models moved by them), and glibc's allocator settings of the peer
commands (one re-execution, undone for kvpress's worker), and the freed heap handed back (release_memory)."""

from __future__ import annotations

import os
import pathlib
import platform
import sys

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


def test_the_fast_compile_flags_and_their_switch(monkeypatch):
    """use_fast_compile adds FAST_FLAGS to $XLA_FLAGS unless a flag of the same name is already
    there, and does nothing when KVP_FAST_COMPILE=0 or once XLA's backends exist."""
    env = {}
    assert compiles.use_fast_compile(env, initialized=False) == list(compiles.FAST_FLAGS)
    assert env["XLA_FLAGS"] == " ".join(compiles.FAST_FLAGS)
    assert compiles.use_fast_compile(env, initialized=False) == []  # already there: not twice
    assert env["XLA_FLAGS"] == " ".join(compiles.FAST_FLAGS)
    mine = {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true --xla_backend_optimization_level=0"}
    assert compiles.use_fast_compile(mine, initialized=False) == []  # the user's own value wins
    assert mine["XLA_FLAGS"] == "--xla_cpu_use_fusion_emitters=true --xla_backend_optimization_level=0"
    other = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    compiles.use_fast_compile(other, initialized=False)
    assert other["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2", *compiles.FAST_FLAGS]
    for off in ("0", "false", "none"):
        assert compiles.use_fast_compile(e := {compiles.FLAGS_ENV: off}, initialized=False) == [] and "XLA_FLAGS" not in e
    assert compiles.use_fast_compile(e := {}, initialized=True) == [] and "XLA_FLAGS" not in e  # too late: left alone
    assert jnp.ones(1).sum() == 1  # this process's backend exists: the real check says so
    assert compiles.use_fast_compile({}) == []


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2"] + (["qwen"] if os.environ.get("KVP_KVPRESS_FULL") else []))
def test_fast_compile_flags_change_no_float_of_the_peer_models(model, tmp_path):
    """The evals commands' FAST_FLAGS against XLA's defaults, each in a process of its own, on the
    models of the peer tables: int4 perplexity (4-bit codes flip with an ulp), a staged prompt of 3
    pieces compressed by SnapKV and ExpectedAttention, its state, logits and greedy answer: every
    array bit for bit (tests/refs/flag_outputs.py). Qwen (2.5 min more) with the longer checks,
    KVP_KVPRESS_FULL=1."""
    import subprocess

    got = {}
    for name, flags in (("default", ""), ("fast", " ".join(compiles.FAST_FLAGS))):
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # each compiles its own
        out = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, "-m", "tests.refs.flag_outputs", str(out), model], env=env | {"XLA_FLAGS": flags},
                           cwd=pathlib.Path(compiles.__file__).resolve().parents[1], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        got[name] = dict(np.load(out))
    assert sorted(got["default"]) == sorted(got["fast"]) and len(got["default"]) >= 10
    for k, a in got["default"].items():
        np.testing.assert_array_equal(got["fast"][k], a, err_msg=k)


def test_reuse_memory_re_executes_once_with_glibc_tunables(tmp_path):
    """A peer command's `__main__` re-executes itself once with MALLOC_TUNABLES (not when KVP_MALLOC=0,
    when the caller set GLIBC_TUNABLES, or inside the re-executed process); its children that are not
    ours get the caller's environment back (caller_env)."""
    import subprocess

    calls = []
    compiles.reuse_memory("evals.peer", ["samples=2"], env={"A": "1"}, execve=lambda *a: calls.append(a))
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        (exe, argv, env), = calls
        assert argv == [exe, "-m", "evals.peer", "samples=2"] and env["GLIBC_TUNABLES"] == compiles.MALLOC_TUNABLES
        assert env["A"] == "1" and compiles.caller_env(env) == {"A": "1"}
    for env in ({compiles.MALLOC_ENV: "0"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"},
                {compiles._BEFORE: "", "GLIBC_TUNABLES": compiles.MALLOC_TUNABLES}):
        calls.clear()
        compiles.reuse_memory("evals.peer", [], env=env, execve=lambda *a: calls.append(a))
        assert calls == [], env
    assert compiles.caller_env({compiles._BEFORE: "x=1", "GLIBC_TUNABLES": "y", "B": "2"}) == {"GLIBC_TUNABLES": "x=1", "B": "2"}
    # for real: a module that re-executes itself prints what its second process sees
    (tmp_path / "probe_reuse.py").write_text(
        "import os, sys\nfrom evals.compiles import caller_env, reuse_memory\n"
        "if __name__ == '__main__':\n    reuse_memory('probe_reuse', sys.argv[1:])\n"
        "    print(os.environ.get('GLIBC_TUNABLES'), caller_env(dict(os.environ)).get('GLIBC_TUNABLES'), sys.argv[1:])\n")

    repo = pathlib.Path(compiles.__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", compiles.MALLOC_ENV, compiles._BEFORE)}
    out = subprocess.run([sys.executable, "-m", "probe_reuse", "x=1", "y"], capture_output=True, text=True, check=True,
                         env=env | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}).stdout.split()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert out == [compiles.MALLOC_TUNABLES, "None", "['x=1',", "'y']"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_release_memory_returns_a_finished_sides_freed_heap_under_the_peer_tunables(tmp_path):
    """Under MALLOC_TUNABLES glibc keeps every freed block: 200 MB of 64 KB arrays freed (one in 50 kept, so
    the heap's top cannot shrink) stay resident until `release_memory` hands them back (the peer commands call
    it once our side is done, before kvpress's worker needs the memory)."""
    import subprocess

    probe = ("import gc, numpy as np\nfrom evals.compiles import release_memory, resident_bytes\n"
             "xs = [np.ones(1 << 16, np.uint8) for _ in range(3200)]\nkeep = xs[::50]\nbefore = resident_bytes()\n"
             "del xs\ngc.collect()\nfreed = resident_bytes()\nprint(before, freed, release_memory(), resident_bytes())\n")
    repo = pathlib.Path(compiles.__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"GLIBC_TUNABLES": compiles.MALLOC_TUNABLES}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=repo, env=env)
    before, freed, released, after = map(int, out.stdout.split())
    if platform.libc_ver()[0] == "glibc":
        assert freed > before - 20e6  # glibc kept the freed heap
        assert released > 150e6 and after < freed - 150e6
    else:
        assert released >= 0
