"""Console output that shares the terminal with tqdm progress bars.

`TqdmHandler` is a logging handler that writes through `tqdm.write` (which clears the bars,
prints, then redraws them); configs/config.yaml makes it Hydra's console handler, so Hydra's log
lines ("Launching 3 jobs", "#1 : ...") never overwrite the sweep / task / tokens bars.
`warnings_as_lines(prog)` prints warnings (e.g. a skipped line of a results file) the same way,
as one line "<prog>: warning: <message>" on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

from tqdm.auto import tqdm


class TqdmHandler(logging.StreamHandler):
    """A StreamHandler that writes each record with tqdm.write."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001  (logging's contract: report, never raise)
            self.handleError(record)


@contextlib.contextmanager
def warnings_as_lines(prog: str) -> Iterator[None]:
    """Within this block, a warning prints as one line "<prog>: warning: <message>" (through
    tqdm.write, on stderr) instead of Python's two-line "file:line: UserWarning" form."""
    def show(message, category, filename, lineno, file=None, line=None):
        kind = "" if category is UserWarning else f" ({category.__name__})"
        tqdm.write(f"{prog}: warning: {message}{kind}", file=file or sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
