"""Stop strings (the `stop` field): the answer ends before the first of them, and a stream
never shows part of one. Text that could still become a stop string is held back until
it cannot (at most the longest stop string's length less one character)."""
from __future__ import annotations


class StopWatch:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def push(self, text: str) -> str:
        """The text that can be shown now ("" once a stop string was hit)."""
        if self.hit:
            return ""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = len(self._pending) - self._hold
        if keep <= 0:
            return ""
        out, self._pending = self._pending[:keep], self._pending[keep:]
        return out

    def flush(self) -> str:
        out, self._pending = ("" if self.hit else self._pending), ""
        return out
