"""The chat TUI: conversations, an input box and live engine gauges, on top of the engine.

Threads. Textual widgets belong to the UI thread (the asyncio loop). The engine blocks
(loading a model takes seconds to minutes, every decoding step a few milliseconds), so
it runs on one thread of its own, the engine thread, one job at a time:

- `_load` (loading.py) calls `load_engine(settings, progress)` (at start, and for /model
  and /profile), so the window opens at once and shows the loading progress;
- `_generate` (answer_stream.py) iterates `Chat.send(...)` and posts what it got to the UI thread as
  `Progress` messages, at most every `FLUSH_SECONDS` and never more than one in flight,
  without waiting for them to be drawn, so decoding and drawing overlap and a fast model
  does not flood the event loop with one repaint per token. When the answer ends it
  commits it to the history itself, before telling the UI: quitting mid-answer still
  saves the partial answer.

`Chat.cancel()` is the one engine call made from the UI thread while the engine works
(Esc, Ctrl+L, quitting): it is a thread-safe flag the decode loop checks between steps.

The engine thread is one thread for the app's life (engine_thread.py says why one, and
why a daemon), and no torch work ever runs on the UI thread.

What is saved when (see `store.py` and `localchat/history.py`): a prompt is committed
before its answer starts; an answer when it ends, is stopped or fails.

Layout (ids are what app.tcss styles and the tests query):

    #body (Horizontal)
      Sidebar #sidebar              saved conversations (Ctrl+B), docked left
      #chat (Vertical)
        Conversation #conversation
        GaugesPanel #gauges         the engine gauges (Ctrl+G)
        PromptInput #prompt
    StatusBar #status               docked at the bottom
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message

import engine
from localchat import config
from localchat.common import sampling
from localchat.config import Settings

from .answer_stream import AnswerStreaming
from .command_handlers import CommandHandlers
from .commands import SlashCommandProvider, parse
from .context_room import ContextRoom
from .conversation_handlers import ConversationHandlers
from .engine_thread import EngineThread
from .loading import EngineLoading
from .store import ChatStore
from .widgets import AssistantMessage, Conversation, GaugesPanel, PromptInput, Sidebar, StatusBar, UserMessage

GENERATING = "generating"
EDITING = "editing your last prompt · Enter resends · Esc cancels"

# load_engine(settings, progress) -> Engine; progress(what, done, total) may be called
# from the loading thread.
LoadEngine = Callable[[Settings, Callable[[str, int, int], None]], engine.Engine]


class ChatApp(CommandHandlers, ConversationHandlers, EngineLoading, ContextRoom, AnswerStreaming, App):
    """Chat with a local model. `load_engine` runs on the engine thread; it may raise
    `engine.EngineError`, which is shown and leaves the app open. `store` saves the
    conversations (a store without a database chats in memory); `resume` is a
    conversation id, or "last", to open at start."""

    # Absolute, so a subclass defined elsewhere (a test, a later screen) finds it too.
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "localchat"
    AUTO_FOCUS = "#prompt"
    COMMANDS = App.COMMANDS | {SlashCommandProvider}
    BINDINGS = [
        Binding("escape", "stop", "Stop answer"),
        Binding("ctrl+r", "retry", "Retry"),
        # Priority: the message box would take these keys as "end of line" and "redo".
        Binding("ctrl+e", "edit", "Edit last prompt", priority=True),
        Binding("ctrl+y", "copy_answer", "Copy answer", priority=True),
        Binding("ctrl+b", "toggle_sidebar", "Conversations"),
        Binding("ctrl+g", "toggle_gauges", "Gauges"),
        Binding("ctrl+n", "new", "New chat"),
        Binding("ctrl+l", "clear", "Clear conversation"),
        Binding("f2", "settings", "Settings"),
    ]

    def __init__(self, load_engine: LoadEngine, settings: Settings, store: ChatStore | None = None,
                 resume: int | str | None = None, save_settings: bool = True, thinking: bool | None = None) -> None:
        super().__init__()
        self.thinking = thinking                        # --think / --no-think, then /think: enable_thinking
        self._load_engine = load_engine
        self.settings = settings
        self.store = store or ChatStore(None)
        self.resume = resume
        self.save_settings = save_settings
        self.engine: engine.Engine | None = None
        self.chat: engine.Chat | None = None
        self.load_error: str | None = None
        self.editing = False                            # the box holds the last prompt, to resend in its place
        self.system = settings.system                   # this conversation's system message
        self._carry: list[dict] | None = None           # messages for the chat the next load creates
        self._reply: AssistantMessage | None = None     # the answer being written, if any
        self._clear_when_done = False
        self._ui_busy = threading.Event()               # a Progress batch is being drawn
        self._idle = threading.Event()                  # no generation thread running
        self._idle.set()
        self._loading: dict = {}                        # what the load thread reports, read by a timer
        self._engine_thread = EngineThread()             # where every engine call that blocks runs
        self._quitting = threading.Event()              # the app is closing: stop the answer

    # -- layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield Sidebar(self.store.conversations if self.store.saving else None, id="sidebar")
            with Vertical(id="chat"):
                yield Conversation(id="conversation")
                yield GaugesPanel(id="gauges")
                yield PromptInput(self.store.prompts(), id="prompt",
                                  placeholder="Message · Enter send · Shift+Enter/Ctrl+J newline · "
                                              "↑ history · /help · Ctrl+P commands")
        yield StatusBar(id="status")

    @property
    def conversation(self) -> Conversation:
        return self.query_one("#conversation", Conversation)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one("#status", StatusBar)

    @property
    def gauges(self) -> GaugesPanel:
        return self.query_one("#gauges", GaugesPanel)

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one("#sidebar", Sidebar)

    @property
    def prompt_input(self) -> PromptInput:
        return self.query_one("#prompt", PromptInput)

    @property
    def generating(self) -> bool:
        return self._reply is not None

    async def on_mount(self) -> None:
        if self.settings.theme and self.settings.theme != self.theme:
            if self.settings.theme in self.available_themes:
                self.theme = self.settings.theme
            else:
                self.notify(f"theme {self.settings.theme!r} is unknown; using {self.theme}",
                            severity="warning")
        await self.report_store_problem()
        if self.resume is not None:
            await self._resume(self.resume)
        self._start_loading()

    def exit(self, *args, **kwargs) -> None:
        self._quitting.set()
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
        # Quitting mid-answer: let the generation end at its next step (it saves the
        # partial answer as it ends). Queued jobs are dropped; the running one finishes.
        self._quitting.set()
        if self.chat is not None:
            self.chat.cancel()
        self._engine_thread.close()

    def on_engine_thread(self, job: Callable, *args) -> None:
        """Run job(*args) on the engine thread. A job reports to the UI itself
        (call_from_thread, post_message); an exception that escapes it is a bug, shown
        as one line rather than lost in a future nobody reads."""
        def run() -> None:
            try:
                job(*args)
            except Exception as exc:
                self._to_ui(self.notify, f"{type(exc).__name__}: {exc}", severity="error")
        self._engine_thread.submit(run)     # refused once the app is closing

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # The priority keys belong to the chat screen; over a dialog they do what the
        # dialog's widgets do with them.
        if action in ("edit", "copy_answer") and self.screen is not self.screen_stack[0]:
            return False
        return True

    def wait_for_generation(self, timeout: float) -> bool:
        """Block until no answer is being generated (its partial text is saved by then)."""
        return self._idle.wait(timeout)

    def keep_conversation(self) -> None:
        """Once the app has closed and no answer runs: keep the conversation's cache, so
        reopening it (--continue, the conversations list) resumes without prefilling it."""
        if self.chat is not None and self._idle.is_set():
            self.chat.keep()

    def watch_theme(self, theme: str) -> None:
        # A theme picked anywhere (settings, the palette's "Change theme") is kept.
        if self.is_mounted and theme != self.settings.theme:
            self.settings = replace(self.settings, theme=theme)
            self.persist_settings(("theme",))

    def persist_settings(self, keys: tuple[str, ...]) -> None:
        if not self.save_settings:
            return
        try:
            config.save(self.settings, keys=keys)
        except config.ConfigError as exc:
            self.notify(str(exc), severity="error")

    async def report_store_problem(self) -> None:
        """Show a history failure once, as a line in the conversation (the chat goes on)."""
        problem = self.store.take_problem()
        if problem:
            await self.conversation.add_notice(problem, error=True)
            self.notify(problem, title="Conversations", severity="warning", timeout=8)

    # -- loading the model

    # -- sending

    def put_in_prompt(self, text: str) -> None:
        box = self.prompt_input
        box.load_text(text)
        box.move_cursor(box.document.end)
        box.focus()

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        command = parse(text)
        if command is not None:
            event.prompt_input.remember(text)
            event.prompt_input.clear()
            await self.run_command(*command)
            return
        if text.startswith("//"):     # "//" sends a prompt that starts with "/"
            text = text[1:]
        mode = "edit" if self.editing else "new"
        if await self.start_answer(text, mode):
            event.prompt_input.remember(text)
            event.prompt_input.clear()

    def _can_send(self) -> bool:
        if self.chat is None:
            if self.load_error:
                self.notify(f"No model loaded: {self.load_error}", severity="error")
            else:
                self.notify("The model is still loading…", severity="warning")
            return False
        if self.generating or self._making_room:
            self.notify("An answer is still being written: wait, or press Esc to stop it.",
                        severity="warning")
            return False
        return True

    def last_exchange(self) -> tuple[str, str] | None:
        """(prompt, answer) of the last turn, if the conversation ends with one."""
        m = self.chat.messages if self.chat else []
        if len(m) >= 2 and m[-2]["role"] == "user" and m[-1]["role"] == "assistant":
            return m[-2]["content"], m[-1]["content"]
        return None

    async def start_answer(self, prompt: str, mode: str = "new") -> bool:
        """Send `prompt` and stream its answer. mode: "new" (a new turn), "retry" (answer
        the last prompt again, replacing its answer), "edit" (replace the last prompt and
        its answer). False if it could not start (said why)."""
        if not self._can_send():
            return False
        before = self.chat.messages
        if mode != "new":
            if self.last_exchange() is None:
                self.notify("There is no answered prompt to replace.", severity="warning")
                self.end_editing()
                return False
            self.chat.restore(before[:-2])
        if not self.turn_fits(prompt, mode, before):
            return False                 # asked what to do (context_room.py): it sends when decided
        s = self.settings
        try:
            # send() checks its arguments before it changes the conversation: a bad
            # setting is refused here, with nothing on screen to undo.
            events = self.chat.send(prompt, max_new_tokens=s.max_tokens, seed=s.seed, **sampling(s, self.engine))
        except engine.EngineError as exc:
            self.chat.restore(before)
            self.notify(str(exc), severity="error")
            return False
        if mode == "retry":
            await self.conversation.remove_last(AssistantMessage)
        elif mode == "edit":
            await self.conversation.remove_last(AssistantMessage, UserMessage)
        if mode != "retry":
            await self.conversation.add_user(prompt)
            # Committed before the first token is generated (the events are lazy: nothing
            # has run yet).
            self.store.save_prompt(prompt, self.engine.name, self.system, replace_last=mode == "edit")
        self.end_editing()
        reply = await self.conversation.add_assistant()
        reply.start()
        self._reply = reply
        self._idle.clear()
        self.gauges.start_answer()
        self.status_bar.activity = GENERATING
        self.on_engine_thread(self._generate, events, reply, mode == "retry")
        await self.report_store_problem()
        return True

    class Progress(Message):
        """A batch of answer text and the latest stats, posted by the generation thread."""

        def __init__(self, reply: AssistantMessage, text: str, stats: engine.Stats | None,
                     reasoning: str = "") -> None:
            super().__init__()
            self.reply, self.text, self.stats, self.reasoning = reply, text, stats, reasoning

    async def on_chat_app_progress(self, message: "ChatApp.Progress") -> None:
        try:
            if message.stats is not None:
                self.status_bar.stats = message.stats
                self.gauges.update(message.stats)
            if message.reasoning:
                message.reply.think(message.reasoning)
            if message.text:
                await message.reply.write(message.text)
        finally:
            self._ui_busy.clear()

    def _to_ui(self, callback, *args, **kwargs) -> bool:
        """Run `callback` on the UI thread and wait for it. False if it could not run:
        the app has stopped, or is tearing its widgets down."""
        try:
            self.call_from_thread(callback, *args, **kwargs)
            return True
        except Exception:
            if self.chat is not None:
                self.chat.cancel()
            return False

    async def _end_answer(self, reply: AssistantMessage, stats: engine.Stats | None,
                          done: engine.Done) -> None:
        if stats is not None:
            self.status_bar.stats = stats
            self.gauges.update(stats)
        await reply.finish(done.text, done.reason, done.error, done.reasoning, done.reasoning_tokens)
        self._reply = None
        self.status_bar.activity = ""
        await self.report_store_problem()
        await self.sidebar.reload()
        if self._clear_when_done:
            self._clear_when_done = False
            await self._clear()

    # -- actions

    def end_editing(self) -> None:
        self.editing = False
        box = self.prompt_input
        box.remove_class("-editing")
        box.border_title = None
        if self.status_bar.activity == EDITING:
            self.status_bar.activity = ""

    def action_stop(self) -> None:
        if (self.generating or self._making_room) and self.chat is not None:
            self.chat.cancel()
        elif self.editing:
            self.end_editing()
            self.prompt_input.clear()

    async def action_retry(self) -> None:
        if not self._can_send():
            return
        exchange = self.last_exchange()
        if exchange is None:
            self.notify("There is no answer to retry yet.", severity="warning")
            return
        await self.start_answer(exchange[0], "retry")

    def action_edit(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        exchange = self.last_exchange()
        if exchange is None:
            self.notify("There is no prompt to edit yet.", severity="warning")
            return
        self.editing = True
        self.put_in_prompt(exchange[0])
        box = self.prompt_input
        box.add_class("-editing")
        box.border_title = "editing the last prompt"
        self.status_bar.activity = EDITING

    def action_copy_answer(self) -> None:
        answers = self.query(AssistantMessage)
        if not answers or not answers.last().text:
            self.notify("There is no answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(answers.last().text)
        self.notify("Copied the answer", timeout=2)

    async def action_toggle_sidebar(self) -> None:
        sidebar = self.sidebar
        sidebar.toggle_class("-show")
        if sidebar.has_class("-show"):
            sidebar.current = self.store.cid
            await sidebar.reload()
            await self.report_store_problem()
            sidebar.query_one("#conversation-list").focus()
        else:
            self.prompt_input.focus()

    def action_toggle_gauges(self) -> None:
        self.gauges.toggle_class("-show")

    async def action_new(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.system = self.settings.system
        await self._clear()
        self.prompt_input.focus()

    async def action_clear(self) -> None:
        if self.generating:
            # Clearing under a running answer would race the engine's bookkeeping:
            # stop it, and clear when its Done arrives.
            self._clear_when_done = True
            self.chat.cancel()
            return
        await self._clear()

    async def _clear(self) -> None:
        """Empty the screen and the model's context; the next prompt starts a new saved
        conversation (the old one stays in the history)."""
        self.end_editing()
        await self.conversation.clear()
        self.store.start_new()
        if self.chat is not None:
            self.chat.restore([{"role": "system", "content": self.system}] if self.system else [])
        self.sidebar.current = None
        await self.sidebar.reload()


def run_tui(load_engine: LoadEngine, settings: Settings, data_dir: str | None = None,
            resume: int | str | None = None, save: bool = True, thinking: bool | None = None) -> int:
    """Run the chat app in the terminal until the user quits; the process exit code.
    save=False (--no-log): the database is not even opened; the chat lives in memory."""
    from localchat import history
    db, problem = None, None
    if save:
        try:
            db = history.History.open(history.default_path(data_dir))
        except history.HistoryError as exc:
            problem = str(exc)               # chat in memory; the app shows why
    from .hangup import HangupGuard
    app = ChatApp(load_engine, settings, ChatStore(db, problem), resume=resume, thinking=thinking)
    guard = HangupGuard(app).install()   # a closed terminal or SIGHUP/SIGTERM ends the app
    try:
        app.run()
        if app.wait_for_generation(10):      # a stopped answer is saved by its own thread
            app.keep_conversation()
        if db is not None:
            db.close()
    finally:
        guard.uninstall()
    return app.return_code or 0
