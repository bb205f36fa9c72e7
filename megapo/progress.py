"""Progress of a long command: its lines as they are, and on a terminal a bar with the ETA under them.

    bar = Progress(total=350, label="train")
    bar.line("step 1/350 | reward 0.14 ...", done=1)   # the line; on a terminal the bar is redrawn below it
    bar.close()

Not a terminal (a log file, CI, a pipe): only the lines, exactly as given, so logs stay greppable. On a
terminal the bar is one line, `train [#####.........] 12/350 3% 0:41 elapsed, ETA 19:14`, rewritten in place
(carriage return, erase line) and cleared before each line is printed. The ETA is the elapsed time per finished
unit times the units left, counted from the first `line` (start-up is not a unit). Inside `around_logs()` the bar
is erased before each log record, for commands that also log (the stability grid's cells).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TextIO

WIDTH = 24  # characters of the bar


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    def __init__(self, total: int | None, label: str, stream: TextIO | None = None, clock=time.monotonic):
        self.total, self.label = total, label
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._start: float | None = None
        self._first = 0
        self._bar_shown = False

    def line(self, text: str, done: int | None = None) -> None:
        """Print `text`; with `done` (units finished so far) redraw the bar on a terminal."""
        self.clear()
        print(text, file=self.stream, flush=True)
        if done is not None:
            self.update(done)

    def update(self, done: int) -> None:
        now = self._clock()
        if self._start is None:
            self._start, self._first = now, done
        if self.tty and self.total:
            self.stream.write("\r\033[K" + self.bar(done, now))
            self.stream.flush()
            self._bar_shown = True

    def bar(self, done: int, now: float | None = None) -> str:
        """The bar's text for `done` units."""
        now = self._clock() if now is None else now
        total = max(self.total or 1, 1)
        filled = min(WIDTH, WIDTH * done // total)
        elapsed = now - (self._start if self._start is not None else now)
        counted = done - self._first
        eta = f", ETA {_clock(elapsed / counted * (total - done))}" if counted > 0 and done < total else ""
        return (f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total} {100 * done // total}% "
                f"{_clock(elapsed)} elapsed{eta}")

    def clear(self) -> None:
        """Erase the bar (before another writer prints to the same terminal; the next update redraws it)."""
        if self._bar_shown:
            self.stream.write("\r\033[K")
            self._bar_shown = False

    @contextlib.contextmanager
    def around_logs(self, logger: logging.Logger | None = None):
        """While inside: the bar is erased before each record the handlers of `logger` (the root logger by
        default) write, so a log line never lands after the bar's text; the next line or update redraws it."""
        handlers = list((logger or logging.getLogger()).handlers) if self.tty else []
        clear = _ClearFirst(self)
        for handler in handlers:
            handler.addFilter(clear)
        try:
            yield self
        finally:
            for handler in handlers:
                handler.removeFilter(clear)

    def close(self) -> None:
        """End the bar's line (a terminal keeps its last state)."""
        if self._bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_shown = False


class _ClearFirst(logging.Filter):
    """A handler filter that erases the bar before the record is written (and lets every record through)."""

    def __init__(self, bar: Progress):
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear()
        return True
