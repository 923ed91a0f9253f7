"""Draining an answer's engine events on the engine thread, in batches for the UI. Mixed
into ChatApp (app.py's docstring says how the two threads share the work): text and
stats are posted as `ChatApp.Progress` messages at most every FLUSH_SECONDS and never
more than one in flight, and the finished answer is saved before the UI is told."""
from __future__ import annotations

import time

import engine

from .widgets import AssistantMessage

FLUSH_SECONDS = 1 / 10      # at most 10 UI updates a second while an answer streams


class AnswerStreaming:
    def _generate(self, events, reply: AssistantMessage, replaces_answer: bool) -> None:
        """On the engine thread: drain the engine's events, hand them to the UI in
        batches, save the answer."""
        try:
            stats, done = self._drain(events, reply)
            self.store.save_answer(done.text, done.reason, done.error, stats.as_dict() if stats else None,
                                   replace_last=replaces_answer, reasoning=done.reasoning)
            # The last batch must be drawn before the final full render replaces it.
            deadline = time.monotonic() + 5
            while self._ui_busy.is_set() and time.monotonic() < deadline and self.is_running:
                time.sleep(0.005)
            self._to_ui(self._end_answer, reply, stats, done)
        finally:
            self._idle.set()

    def _drain(self, events, reply: AssistantMessage) -> tuple[engine.Stats | None, engine.Done]:
        pending: list[str] = []
        thought: list[str] = []                  # reasoning not yet handed over
        stats = last_stats = None
        done: engine.Done | None = None
        last_flush = 0.0
        try:
            for event in events:
                if isinstance(event, engine.TextDelta):
                    (thought if event.reasoning else pending).append(event.text)
                elif isinstance(event, engine.Stats):
                    stats = last_stats = event
                elif isinstance(event, engine.Done):
                    done = event
                if self._quitting.is_set():
                    # Checked here, not only when posting: a batch the closing UI never
                    # drew keeps _ui_busy set, and no post would find out.
                    self.chat.cancel()
                now = time.monotonic()
                if (done is None and (pending or thought or stats) and now - last_flush >= FLUSH_SECONDS
                        and not self._ui_busy.is_set()):
                    # Hand the batch over without waiting for it to be drawn: the engine
                    # keeps decoding while the UI renders (on two cores, waiting for each
                    # repaint cost a third of the speed). While a batch is still being
                    # drawn, text accumulates here and goes in the next one.
                    self._ui_busy.set()
                    if not self.post_message(self.Progress(reply, "".join(pending), stats, "".join(thought))):
                        # The UI could not take it (the app is closing): end the answer
                        # here; the engine records it as cancelled and keeps the text.
                        self._ui_busy.clear()
                        events.close()
                        done = self.chat.last_done
                        break
                    pending, thought, stats, last_flush = [], [], None, now
        except Exception as exc:   # the engine turns its own failures into Done('error'); this is a bug
            events.close()
            done = engine.Done("error", text=reply_text_fallback(self.chat, pending),
                               error=f"{type(exc).__name__}: {exc}")
        if done is None:           # the generator ended without Done: should not happen
            done = engine.Done("error", text=reply_text_fallback(self.chat, pending),
                               error="the answer ended without a final event")
        return last_stats, done



def reply_text_fallback(chat: engine.Chat | None, pending: list[str]) -> str:
    """The partial answer after an unexpected failure: what the engine kept in the
    conversation, else what had arrived."""
    if chat is not None and chat.messages and chat.messages[-1]["role"] == "assistant":
        return chat.messages[-1]["content"]
    return "".join(pending)
