"""The engines, one answer at a time, for many HTTP clients.

The server's model loads on a thread of its own when the server starts (GET /health says
loading, then ready); any other model a request names loads there on its first request,
the request waiting in the queue meanwhile (server/models.py decides what stays loaded). Answers run one after another on a single engine thread: one KV cache, one
OpenMP team. Requests wait in a bounded queue (count and time); one that finds
it full is refused at once (503 with Retry-After), one that waits too long is refused
then. A job cancelled by its client (a closed connection) stops at the engine's next step.

Every answer runs on one Chat whose conversation is replaced by the request's
(Chat.restore): a stateless client resends the whole conversation each turn, and the
cached prefix of the last request is kept, so turn 5 prefills what turn 1 did, not the
history."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..common import sampling as resolve_sampling
from .requests import ApiError, ChatRequest
from .stops import StopWatch


@dataclass
class Job:
    request: ChatRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    slot: object = None                  # models.Slot: the model it asked for
    queued_at: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False

    def push(self, item) -> None:
        """From the engine thread to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:                 # the loop is gone (the server is stopping)
            self.cancelled.set()


class Runner:
    def __init__(self, open_engine, models, max_queue: int = 4, queue_timeout_s: float = 120.0,
                 max_tokens: int = 1024):
        """open_engine(settings) -> an engine; models: server/models.Models."""
        self._open = open_engine
        self.models = models
        self.max_queue, self.queue_timeout_s, self.default_max_tokens = max_queue, queue_timeout_s, max_tokens
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._busy = False
        self.answer_seconds = 30.0           # a recent answer's length: what Retry-After says
        self._thread = threading.Thread(target=self._main, name="localchat-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float = 0.0) -> None:
        """No more jobs; the engine thread keeps each loaded model's conversation (to resume
        warm) and ends. `wait_s`: how long to wait for that."""
        self._jobs.put(None)
        if wait_s and self._thread.is_alive():
            self._thread.join(wait_s)

    # the server's own model (the one it was started with)
    @property
    def state(self) -> str:
        return self.models.default.state if self.models.default.state != "unloaded" else "ready"

    @property
    def error(self) -> str:
        return self.models.default.error

    @property
    def engine(self):
        return self.models.default.engine

    # -- admission (the event loop's thread)
    def submit(self, job: Job) -> None:
        slot = job.slot or self.models.default
        job.slot = slot
        if slot is self.models.default and slot.state in ("loading", "failed"):
            # (another model loads while its request waits; one that failed is tried again)
            raise ApiError(503, f"the model {slot.name!r} is {slot.state}" + (f": {slot.error}" if slot.error else ""),
                           kind="server_error", code="model_" + slot.state, headers={"Retry-After": "5"})
        with self._lock:
            if self._waiting >= self.max_queue:
                wait = int(self.answer_seconds * (self._waiting + self._busy)) + 1
                raise ApiError(503, f"the server is busy: {self._waiting} requests are waiting (--max-queue "
                               f"{self.max_queue}); try again later", kind="server_error", code="queue_full",
                               headers={"Retry-After": str(wait)})
            self._waiting += 1
        self._jobs.put(job)

    def queued(self) -> int:
        return self._waiting

    # -- the engine thread
    def _main(self) -> None:
        try:
            self.models.load(self.models.default, self._open)
        except Exception:                   # told to every request for it and to /health (Slot.error)
            pass
        tick = min(self.models.keep_alive, 5.0) if self.models.keep_alive else None
        while True:
            try:
                job = self._jobs.get(timeout=tick)
            except queue.Empty:
                self.models.expire()
                continue
            if job is None:
                for slot in self.models.slots.values():
                    if slot.chat is not None:
                        slot.chat.keep()
                return
            with self._lock:
                self._waiting -= 1
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._busy = False

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.push(("done", None))
            return
        if time.monotonic() - job.queued_at > self.queue_timeout_s:
            job.push(("error", ApiError(503, f"waited {self.queue_timeout_s:.0f} s in the queue; try again later",
                                        kind="server_error", code="queue_timeout",
                                        headers={"Retry-After": str(int(self.answer_seconds) + 1)})))
            return
        job.started = True
        import engine
        slot = job.slot
        if slot.engine is None:
            try:
                self.models.load(slot, self._open)
            except Exception as exc:
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                job.push(("error", ApiError(503, f"the model {slot.name!r} could not be loaded: {why}",
                                            kind="server_error", code="model_failed")))
                return
        r, chat = job.request, slot.chat
        t0 = time.monotonic()
        asked = r.max_tokens or self.default_max_tokens
        room = getattr(getattr(slot.engine, "target", None), "max_positions", None) or asked
        note = (f"max_tokens {asked} is over the context ({room} tokens): held to it; the answer ends with "
                "finish_reason length where the context is full") if asked > room else ""
        sampling = dict(max_new_tokens=min(asked, room),
                        seed=None if r.seed is None else r.seed % (1 << 63),
                        **resolve_sampling(self.models.settings, slot.engine,
                                           {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}))
        try:
            if r.prompt is not None:                     # /v1/completions: plain text, no template
                events = chat.complete(r.prompt, grammar=r.grammar, **sampling)
            else:
                chat.restore(r.messages)
                chat.thinking = r.thinking
                events = chat.reply(grammar=r.grammar, tools=r.tools, tool_choice=r.tool_choice,
                                    parallel_tool_calls=r.parallel_tool_calls, **sampling)
        except engine.BadRequest as exc:
            code = "context_length_exceeded" if "context" in str(exc) else None
            param = "messages" if r.prompt is None else "prompt"
            for name in ("response_format", "tools", "tool_choice"):
                if str(exc).startswith(name):
                    param = name
            job.push(("error", ApiError(400, str(exc), param=param, code=code)))
            return
        watch = StopWatch(r.stop)
        reason = None
        try:
            for ev in events:
                if job.cancelled.is_set():
                    chat.cancel()
                if isinstance(ev, engine.TextDelta) and ev.reasoning:
                    job.push(("reasoning", ev.text))          # stop sequences watch the answer only
                elif isinstance(ev, engine.TextDelta):
                    text = watch.push(ev.text)
                    if text:
                        job.push(("text", text))
                    if watch.hit:
                        reason = "stop"
                        chat.cancel()
                elif isinstance(ev, engine.Done):
                    tail = watch.flush()
                    if tail:
                        job.push(("text", tail))
                    if ev.reason == "error":
                        job.push(("error", ApiError(500, f"the answer failed: {ev.error}", kind="server_error")))
                        return
                    if ev.tool_error:
                        job.push(("tool_error", ev.tool_error))
                    if ev.tool_calls:
                        job.push(("tool_calls", ev.tool_calls))
                        reason = reason or "tool_calls"
                    if reason is None:
                        reason = {"stop": "stop", "length": "length"}.get(ev.reason, "stop")
        finally:
            self.answer_seconds = 0.7 * self.answer_seconds + 0.3 * (time.monotonic() - t0)
            slot.last_used = time.monotonic()
        done = chat.last_done
        job.push(("done", {"finish_reason": reason or "stop", "stats": chat.last_stats,
                           "cancelled": job.cancelled.is_set(), "note": note,
                           "reasoning_tokens": getattr(done, "reasoning_tokens", 0) if done else 0}))
