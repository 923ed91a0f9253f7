"""One stderr line for a model download: bytes of the whole model, rate and time left.
On a terminal it redraws in place (at most ten times a second); elsewhere (a log, a pipe)
it writes a line every 10% so the log shows progress without thousands of lines."""
from __future__ import annotations

import sys
import time

from .format import human_bytes


class DownloadBar:
    def __init__(self, name: str, stream=None):
        self.name, self.stream = name, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = None
        self.first_done = 0
        self.shown_tenth = -1
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start, self.first_done = now, done       # resumed bytes are not this run's rate
        finished = total and done >= total
        if self.tty:
            if not finished and self.last is not None and now - self.last < 0.1:
                return
        else:
            tenth = int(10 * done / total) if total else 0
            if tenth == self.shown_tenth and not finished:
                return
            self.shown_tenth = tenth
        self.last = now
        self._draw(done, total, now, finished)

    def _draw(self, done: int, total: int, now: float, finished: bool) -> None:
        elapsed = now - self.start
        rate = (done - self.first_done) / elapsed if elapsed > 0.2 else 0.0
        line = f"downloading {self.name}: {human_bytes(done)} of {human_bytes(total)}"
        if total:
            line += f" ({100 * done / total:.0f}%)"
        if rate > 0:
            line += f" · {human_bytes(rate)}/s"
            if not finished and total:
                left = (total - done) / rate
                line += f" · {int(left // 60)}:{int(left % 60):02d} left"
        end = "\n" if finished or not self.tty else ""
        print(("\r\033[K" if self.tty else "") + line, end=end, file=self.stream, flush=True)
        self.drawn = not finished and self.tty

    def close(self) -> None:
        """End a line that a failure left open, so the error starts on its own line."""
        if self.drawn:
            print(file=self.stream, flush=True)
            self.drawn = False
