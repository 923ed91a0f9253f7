"""The chat TUI: a conversation, an input line and a status bar, on top of the engine.

Threads. Textual widgets belong to the UI thread (the asyncio loop). The engine blocks
(loading a model takes seconds, every decoding step a few milliseconds), so it runs in
thread workers:

- `_load` calls `load_engine()` once at start, so the window opens at once;
- `_generate` iterates `Chat.send(...)` and posts what it got to the UI thread as
  `Progress` messages, at most every `FLUSH_SECONDS` and never more than one in flight,
  without waiting for them to be drawn, so decoding and drawing overlap and a fast model
  does not flood the event loop with one repaint per token.

`Chat.cancel()` is the one engine call made from the UI thread while a worker runs
(Esc, Ctrl+L, quitting): it is a thread-safe flag the decode loop checks between steps.

Layout (ids are what app.tcss styles and later features hook into):

    #body (Horizontal)          a sidebar of saved conversations will dock here
      #chat (Vertical)
        Conversation #conversation
        Input #prompt
    StatusBar #status           docked at the bottom
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.containers import Horizontal, Vertical
from textual.widgets import Input
from textual.worker import get_current_worker

import engine
from localchat.config import Settings

from .widgets import AssistantMessage, Conversation, StatusBar

FLUSH_SECONDS = 1 / 10      # at most 10 UI updates a second while an answer streams
LOADING = "Loading model…"
GENERATING = "generating"


class ChatApp(App):
    """Chat with a local model. `load_engine` is called in a worker thread at start;
    it may raise `engine.EngineError`, which is shown and leaves the app open."""

    # Absolute, so a subclass defined elsewhere (a test, a later screen) finds it too.
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "localchat"
    AUTO_FOCUS = "#prompt"
    BINDINGS = [
        Binding("escape", "stop", "Stop answer"),
        Binding("ctrl+l", "clear", "Clear conversation"),
    ]

    def __init__(self, load_engine: Callable[[], engine.Engine], settings: Settings) -> None:
        super().__init__()
        self._load_engine = load_engine
        self.settings = settings
        self.engine: engine.Engine | None = None
        self.chat: engine.Chat | None = None
        self.load_error: str | None = None
        self._reply: AssistantMessage | None = None     # the answer being written, if any
        self._clear_when_done = False
        self._ui_busy = threading.Event()               # a Progress batch is being drawn

    # -- layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield Input(placeholder="Message · Enter send · Esc stop · Ctrl+L clear · Ctrl+Q quit",
                            id="prompt")
        yield StatusBar(id="status")

    @property
    def conversation(self) -> Conversation:
        return self.query_one("#conversation", Conversation)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one("#status", StatusBar)

    @property
    def generating(self) -> bool:
        return self._reply is not None

    def on_mount(self) -> None:
        if self.settings.theme and self.settings.theme != self.theme:
            if self.settings.theme in self.available_themes:
                self.theme = self.settings.theme
            else:
                self.notify(f"theme {self.settings.theme!r} is unknown; using {self.theme}",
                            severity="warning")
        self.status_bar.activity = LOADING
        self._load()

    def on_unmount(self) -> None:
        # Quitting mid-answer: let the generation thread end at its next step.
        if self.chat is not None:
            self.chat.cancel()

    # -- loading the model

    @work(thread=True, name="load", group="load", exit_on_error=False)
    def _load(self) -> None:
        try:
            eng = self._load_engine()
            chat = eng.chat(system=self.settings.system)
            context_max = int(eng.describe().get("context_max") or 0)
        except engine.EngineError as exc:
            self._to_ui(self._load_failed, str(exc))
            return
        except Exception as exc:   # a bug or a library failure: one line, not a traceback over the UI
            self._to_ui(self._load_failed, f"{type(exc).__name__}: {exc}")
            return
        self._to_ui(self._loaded, eng, chat, context_max)

    def _loaded(self, eng: engine.Engine, chat: engine.Chat, context_max: int) -> None:
        self.engine, self.chat = eng, chat
        status = self.status_bar
        status.model = eng.name
        status.context_max = context_max
        status.activity = ""

    async def _load_failed(self, message: str) -> None:
        message = " ".join(message.split())      # one line, whatever the exception carried
        self.load_error = message
        status = self.status_bar
        status.activity = "no model loaded"
        await self.conversation.add_notice(message, error=True)
        self.notify(message, title="Could not load the model", severity="error", timeout=10)

    # -- sending

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.chat is None:
            if self.load_error:
                self.notify(f"No model loaded: {self.load_error}", severity="error")
            else:
                self.notify("The model is still loading…", severity="warning")
            return
        if self.generating:
            self.notify("An answer is still being written: wait, or press Esc to stop it.",
                        severity="warning")
            return
        s = self.settings
        try:
            # send() checks its arguments before it changes the conversation: a bad
            # setting is refused here, with nothing on screen to undo.
            events = self.chat.send(prompt, max_new_tokens=s.max_tokens, temperature=s.temperature,
                                    top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        except engine.EngineError as exc:
            self.notify(str(exc), severity="error")
            return
        event.input.clear()
        await self.conversation.add_user(prompt)
        reply = await self.conversation.add_assistant()
        reply.start()
        self._reply = reply
        self.status_bar.activity = GENERATING
        self._generate(events, reply)

    @work(thread=True, name="generate", group="generate", exit_on_error=False)
    def _generate(self, events, reply: AssistantMessage) -> None:
        """Drain the engine's events; hand them to the UI in batches."""
        worker = get_current_worker()
        pending: list[str] = []
        stats: engine.Stats | None = None
        done: engine.Done | None = None
        last_flush = 0.0
        try:
            for event in events:
                if isinstance(event, engine.TextDelta):
                    pending.append(event.text)
                elif isinstance(event, engine.Stats):
                    stats = event
                elif isinstance(event, engine.Done):
                    done = event
                if worker.is_cancelled:
                    self.chat.cancel()
                now = time.monotonic()
                if (done is None and (pending or stats) and now - last_flush >= FLUSH_SECONDS
                        and not self._ui_busy.is_set()):
                    # Hand the batch over without waiting for it to be drawn: the engine
                    # keeps decoding while the UI renders (on two cores, waiting for each
                    # repaint cost a third of the speed). While a batch is still being
                    # drawn, text accumulates here and goes in the next one.
                    self._ui_busy.set()
                    if not self.post_message(self.Progress(reply, "".join(pending), stats)):
                        # The UI could not take it (the app is closing): end the answer
                        # here; the engine records it as cancelled and keeps the text.
                        self._ui_busy.clear()
                        events.close()
                        done = self.chat.last_done
                        break
                    pending, stats, last_flush = [], None, now
        except Exception as exc:   # the engine turns its own failures into Done('error'); this is a bug
            events.close()
            done = engine.Done("error", text=reply_text_fallback(self.chat, pending),
                               error=f"{type(exc).__name__}: {exc}")
        if done is None:           # the generator ended without Done: should not happen
            done = engine.Done("error", text=reply_text_fallback(self.chat, pending),
                               error="the answer ended without a final event")
        # The last batch must be drawn before the final full render replaces it.
        deadline = time.monotonic() + 5
        while self._ui_busy.is_set() and time.monotonic() < deadline and self.is_running:
            time.sleep(0.005)
        self._to_ui(self._end_answer, reply, stats, done)

    class Progress(Message):
        """A batch of answer text and the latest stats, posted by the generation thread."""

        def __init__(self, reply: AssistantMessage, text: str, stats: engine.Stats | None) -> None:
            super().__init__()
            self.reply, self.text, self.stats = reply, text, stats

    async def on_chat_app_progress(self, message: "ChatApp.Progress") -> None:
        try:
            await self._show_progress(message.reply, message.text, message.stats)
        finally:
            self._ui_busy.clear()

    def _to_ui(self, callback, *args) -> bool:
        """Run `callback` on the UI thread and wait for it (the wait is the back-pressure
        that keeps a fast model from outrunning the screen). False if it could not run:
        the app has stopped, or is tearing its widgets down."""
        try:
            self.call_from_thread(callback, *args)
            return True
        except Exception:
            if self.chat is not None:
                self.chat.cancel()
            return False

    async def _show_progress(self, reply: AssistantMessage, text: str,
                             stats: engine.Stats | None) -> None:
        if stats is not None:
            self.status_bar.stats = stats
        if text:
            await reply.write(text)

    async def _end_answer(self, reply: AssistantMessage, stats: engine.Stats | None,
                          done: engine.Done) -> None:
        if stats is not None:
            self.status_bar.stats = stats
        await reply.finish(done.text, done.reason, done.error)
        self._reply = None
        self.status_bar.activity = ""
        if self._clear_when_done:
            self._clear_when_done = False
            await self._clear()

    # -- actions

    def action_stop(self) -> None:
        if self.generating and self.chat is not None:
            self.chat.cancel()

    async def action_clear(self) -> None:
        if self.generating:
            # Clearing under a running answer would race the engine's bookkeeping:
            # stop it, and clear when its Done arrives.
            self._clear_when_done = True
            self.chat.cancel()
            return
        await self._clear()

    async def _clear(self) -> None:
        await self.conversation.clear()
        if self.chat is not None:
            self.chat.clear()


def reply_text_fallback(chat: engine.Chat | None, pending: list[str]) -> str:
    """The partial answer after an unexpected failure: what the engine kept in the
    conversation, else what had arrived."""
    if chat is not None and chat.messages and chat.messages[-1]["role"] == "assistant":
        return chat.messages[-1]["content"]
    return "".join(pending)


def run_tui(load_engine: Callable[[], engine.Engine], settings: Settings) -> int:
    """Run the chat app in the terminal until the user quits; the process exit code."""
    app = ChatApp(load_engine, settings)
    app.run()
    return app.return_code or 0
