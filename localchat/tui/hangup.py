"""Leaving when the terminal goes away: SIGHUP, SIGTERM, or a terminal that hung up.

Measured before this existed: the chat UI started in tmux (`make chat`), then the tmux
session killed. The kernel's hangup signal reaches only the session leader (make), so
localchat was never told; Textual's input thread then spun on a terminal whose reads
return at once with nothing, the writer blocked on it, and the process stayed for 40
minutes at 82% of a core, holding the model's memory, until killed by hand.

So the app watches for itself: SIGHUP and SIGTERM, and a thread blocked in poll() on the
terminal with no events asked for (a hang-up is always reported, input is never taken
from the UI's own reader). On any of them it stops the answer in flight (the engine
thread saves the partial answer as it ends, as on a normal quit), asks the app to exit,
and if the app has not gone `grace` seconds after the answer was saved (its writer may be
stuck on the dead terminal) ends the process itself. What was saved is in SQLite already: nothing is lost.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading

# Exit codes as a shell reports a process ended by these signals: 128 + the signal.
EXIT_HANGUP, EXIT_TERMINATED = 128 + signal.SIGHUP, 128 + signal.SIGTERM


class HangupGuard:
    def __init__(self, app, grace: float = 0.8, save_wait: float = 5.0):
        self.app = app
        self.grace = grace
        self.save_wait = save_wait
        self._fired = threading.Event()
        self._done = threading.Event()
        self._old: dict[int, object] = {}

    def install(self) -> "HangupGuard":
        """Signal handlers (call on the main thread) and the terminal watcher."""
        for sig in (signal.SIGHUP, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_signal)
        fd = _terminal_fd()
        if fd is not None:
            threading.Thread(target=self._watch, args=(fd,), name="localchat-hangup", daemon=True).start()
        return self

    def uninstall(self) -> None:
        self._done.set()
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _on_signal(self, signum, frame) -> None:
        self.leave(EXIT_HANGUP if signum == signal.SIGHUP else EXIT_TERMINATED)

    def _watch(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, 0)               # no events: POLLHUP/POLLERR are reported anyway
        while not self._done.is_set():
            try:
                events = poller.poll(500)
            except OSError:
                return
            if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events):
                self.leave(EXIT_HANGUP)
                return

    def leave(self, code: int) -> None:
        """Stop the answer, let it be saved, exit; force the exit after `grace` seconds."""
        if self._fired.is_set():
            return
        self._fired.set()
        app = self.app
        app._quitting.set()
        if app.chat is not None:
            app.chat.cancel()
        threading.Thread(target=self._finish, args=(code,), name="localchat-leave", daemon=True).start()

    def _finish(self, code: int) -> None:
        app = self.app
        # The engine thread saves the partial answer when its step ends: milliseconds for
        # a resident model, longer for a streamed pass, so this wait is the longer one.
        app.wait_for_generation(self.save_wait)
        threading.Thread(target=self._ask_exit, args=(code,), daemon=True).start()
        if not self._done.wait(self.grace):
            # The app could not shut down in time (its writer is blocked on a dead
            # terminal): everything is committed, so end the process here.
            os._exit(code)

    def _ask_exit(self, code: int) -> None:
        try:
            self.app.call_from_thread(self.app.exit, None, code)   # blocks if the loop is stuck
        except Exception:             # the loop has gone already: the main thread is leaving
            pass


def _terminal_fd() -> int | None:
    for stream in (sys.stdin, sys.stdout):
        try:
            if stream is not None and stream.isatty():
                return stream.fileno()
        except (ValueError, OSError):
            continue
    return None
