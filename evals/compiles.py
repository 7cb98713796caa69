"""How many programs a run compiled and how long compilation took, from JAX's own compilation
events (`jax.monitoring`): tracing (`jaxpr_trace_duration`), lowering to MLIR
(`jaxpr_to_mlir_module_duration`) and XLA's backend compile (`backend_compile_duration`, one
event per program compiled; a program read back from the persistent compilation cache sends
none). Counted, never timed against a clock in tests.

    with CompileLog() as log:
        ...                        # any JAX work
    print(log.line(total_seconds))  # "compiled 12 programs in 31.4 s (38 % of 82 s)"

Also the compiler settings of the evals commands: JAX's persistent compilation cache
(`use_persistent_cache`) and XLA:CPU flags that compile faster and compute the same floats
(`use_fast_compile`), glibc's allocator settings of the peer commands (`reuse_memory`), and the memory a
finished side hands back (`release_memory`).
"""

from __future__ import annotations

import threading
import time

import jax.monitoring

BACKEND = "/jax/core/compile/backend_compile_duration"
EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration", BACKEND)


class CompileLog:
    """Counts XLA compilations (`programs`) and sums the seconds of tracing, lowering and
    compiling (`seconds`) while it is open; `mark()` / `since(mark)` read them for a part of a run."""

    def __init__(self):
        self.programs = 0
        self.seconds = 0.0
        self._open = False
        self._lock = threading.Lock()
        self.started = time.time()

    def _listen(self, event: str, duration: float, **_kw) -> None:
        if not self._open or event not in EVENTS:
            return
        with self._lock:
            self.seconds += duration
            self.programs += event == BACKEND

    def __enter__(self) -> "CompileLog":
        self._open = True
        self.started = time.time()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        self._open = False
        try:
            jax.monitoring.unregister_event_duration_listener(self._listen)
        except (AssertionError, ValueError):  # already gone (jax.monitoring.clear_event_listeners)
            pass

    def mark(self) -> tuple[int, float]:
        return self.programs, self.seconds

    def since(self, mark: tuple[int, float]) -> tuple[int, float]:
        """(programs, seconds) compiled since `mark()`."""
        return self.programs - mark[0], self.seconds - mark[1]

    def line(self, total: float | None = None) -> str:
        """One line for the end of a run: programs compiled, seconds, and the share of `total`."""
        total = time.time() - self.started if total is None else total
        share = f" ({100 * self.seconds / total:.0f} % of the run's {total:.0f} s)" if total > 0 else ""
        return f"compiled {self.programs} programs in {self.seconds:.1f} s{share}"


CACHE_ENV = "KVP_COMPILE_CACHE"  # a folder, or "none": the persistent compilation cache of evals.* commands


def default_cache_dir() -> str:
    """$KVP_COMPILE_CACHE, else $XDG_CACHE_HOME/kvpolicies/jax (~/.cache/kvpolicies/jax)."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(CACHE_ENV) or os.path.join(base, "kvpolicies", "jax")


def use_persistent_cache(folder: str | None = None, config=None) -> str | None:
    """Turn on JAX's persistent compilation cache at `folder` (default `default_cache_dir()`), so that
    a second run of the same grid reads its programs back instead of compiling them; nothing when
    $KVP_COMPILE_CACHE is "none" or a cache is already set (JAX_COMPILATION_CACHE_DIR, a caller's).
    Returns the folder in use, or None. `config`: jax.config (or a stand-in, in tests)."""
    import os

    import jax

    config = jax.config if config is None else config
    if os.environ.get(CACHE_ENV, "").strip().lower() == "none":
        return None
    if config.jax_compilation_cache_dir:
        return config.jax_compilation_cache_dir
    folder = folder or default_cache_dir()
    config.update("jax_compilation_cache_dir", folder)
    return folder


FLAGS_ENV = "KVP_FAST_COMPILE"  # "0": evals.* commands leave XLA's compiler flags as they are
# XLA:CPU's older loop emitters instead of its fusion emitters: SmolLM2's covering 2K prompt (7
# programs) compiles in 8.6 s instead of 12.2 s. On SmolLM2 and Qwen2.5-0.5B every output we compared is
# bit for bit XLA's default one (tests/evals/test_compiles.py; docs/results/speed.md, "XLA:CPU's loop
# emitters"); on a 64-wide random model it is not (last-ulp differences: its small dots fuse).
FAST_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def use_fast_compile(env: dict | None = None, initialized: bool | None = None) -> list[str]:
    """Add `FAST_FLAGS` to $XLA_FLAGS for this process, each unless $XLA_FLAGS already sets it;
    nothing when $KVP_FAST_COMPILE is 0, or once JAX's backends exist (XLA reads its flags when its
    CPU client starts: call this first in a command's main). Returns the flags added. `env`,
    `initialized`: stand-ins for tests. The flags are XLA:CPU's: a GPU or TPU ignores them."""
    import os

    env = os.environ if env is None else env
    if env.get(FLAGS_ENV, "1").strip().lower() in ("0", "false", "no", "none", "off"):
        return []
    if initialized is None:
        from jax._src import xla_bridge

        initialized = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
    if initialized:
        return []
    have = env.get("XLA_FLAGS", "")
    names = {f.split("=", 1)[0] for f in have.split()}
    added = [f for f in FAST_FLAGS if f.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join([have.strip(), *added]).strip()
    return added


MALLOC_ENV = "KVP_MALLOC"  # "0": the peer commands keep glibc's allocator as it is
# glibc's malloc for a process that allocates the same large arrays sample after sample: one arena,
# no mmap for large blocks and no trimming, so a freed block is reused instead of mapped anew. Each
# fresh mapping faults its pages in (zeroed by the kernel): 7-8 GB a sample of issue 57's grid on
# SmolLM2, 5-6 s of system time; with these, none after the second sample (docs/results/speed.md,
# "glibc's allocator"). The cost: memory is not given back to the system until the process ends.
MALLOC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=68719476736:glibc.malloc.top_pad=268435456")
_BEFORE = "KVP_GLIBC_TUNABLES_BEFORE"  # set by the re-execution: the caller's GLIBC_TUNABLES ("" if none)


def reuse_memory(module: str, argv: list[str], env: dict | None = None, execve=None) -> None:
    """Re-execute `python -m module argv` once with GLIBC_TUNABLES=MALLOC_TUNABLES (glibc reads them
    only when a process starts), for a command's `__main__` block; nothing when $KVP_MALLOC is 0, off
    Linux's glibc, when the caller set GLIBC_TUNABLES, or in the re-executed process. Child processes
    that are not ours (kvpress's worker) get the caller's environment back: `caller_env`. `env`,
    `execve`: stand-ins for tests."""
    import os
    import platform
    import sys

    env = os.environ if env is None else env
    if env.get(MALLOC_ENV, "1").strip().lower() in ("0", "false", "no", "none", "off") or _BEFORE in env \
            or env.get("GLIBC_TUNABLES") or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    (execve or os.execve)(sys.executable, [sys.executable, "-m", module, *argv],
                          {**env, "GLIBC_TUNABLES": MALLOC_TUNABLES, _BEFORE: ""})


def caller_env(env: dict) -> dict:
    """`env` as the caller of a `reuse_memory` re-execution had it: glibc's tunables undone."""
    if _BEFORE not in env:
        return dict(env)
    out = {k: v for k, v in env.items() if k not in (_BEFORE, "GLIBC_TUNABLES")}
    return out | ({"GLIBC_TUNABLES": env[_BEFORE]} if env[_BEFORE] else {})


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc/self/statm; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory(clear_jax: bool = True) -> int:
    """Hand the memory a finished side holds back to the system, before another process needs it: the
    garbage collected, JAX's compiled programs and traces dropped (`clear_jax`; the persistent cache reads
    them back), and glibc's free heap returned (`malloc_trim`: under `MALLOC_TUNABLES` glibc never returns
    freed memory on its own). Returns the resident bytes released (0 where /proc or glibc is missing)."""
    import ctypes
    import gc

    before = resident_bytes()
    if clear_jax:
        jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return max(0, before - resident_bytes())
