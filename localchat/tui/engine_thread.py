"""The one thread the chat UI runs the engine on (loading, answers, a new drafter).

Why one: each thread that runs a parallel torch op keeps an OpenMP team for as long as
it lives, and with two teams in the process libgomp throttles their spin-wait on a
machine with few cores; a decode step's small matmuls then run ~3x slower. Why a daemon
thread and not a ThreadPoolExecutor: the interpreter joins executor threads at exit, so
quitting while a large model loads would wait minutes for a load nobody wants. An answer
in flight is different: the app stops it and waits for it to be saved before exiting."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class EngineThread:
    """Runs submitted jobs in order on one daemon thread, started on first use."""

    def __init__(self, name: str = "localchat-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue a job; False once closed. The job must catch its own exceptions."""
        if self._closed:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return True

    def close(self) -> None:
        """Take no more jobs; the running one finishes, queued ones are dropped."""
        self._closed = True
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None and not self._closed:
            job()
