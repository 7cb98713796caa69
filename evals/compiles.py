"""How many programs a run compiled and how long compilation took, from JAX's own compilation
events (`jax.monitoring`): tracing (`jaxpr_trace_duration`), lowering to MLIR
(`jaxpr_to_mlir_module_duration`) and XLA's backend compile (`backend_compile_duration`, one
event per program compiled; a program read back from the persistent compilation cache sends
none). Counted, never timed against a clock in tests.

    with CompileLog() as log:
        ...                        # any JAX work
    print(log.line(total_seconds))  # "compiled 12 programs in 31.4 s (38 % of 82 s)"
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
