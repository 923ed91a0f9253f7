"""What each slash command does (the table of commands is in commands.py). Mixed into
ChatApp: these methods use its chat, engine, store and widgets, and run on the UI thread
(a drafter that has to load goes to the engine thread)."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import engine

from .commands import BY_NAME, help_text

KEYS = """Enter send · Shift+Enter or Ctrl+J new line · ↑/↓ earlier prompts · Esc stop the answer
Ctrl+R retry the last answer · Ctrl+E edit and resend the last prompt · Ctrl+Y copy the last answer
click a code block: copy it · double-click an answer: copy it
Ctrl+B conversations (Enter open, n new, r rename, d delete) · Ctrl+N new chat · Ctrl+L clear
Ctrl+G engine gauges · F2 settings · Ctrl+P command palette · Ctrl+Q quit"""


class CommandHandlers:
    """`run_command(name, argument)` dispatches to `command_<name>`."""

    async def run_command(self, name: str, argument: str = "") -> None:
        if name not in BY_NAME:
            self.notify(f"/{name}: unknown command; /help lists them", severity="error")
            return
        await getattr(self, f"command_{name}")(argument)

    def _idle_or_say(self) -> bool:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return False
        return True

    async def command_new(self, argument: str) -> None:
        await self.action_new()

    async def command_clear(self, argument: str) -> None:
        await self.action_clear()

    async def command_retry(self, argument: str) -> None:
        await self.action_retry()

    async def command_edit(self, argument: str) -> None:
        self.action_edit()

    async def command_quit(self, argument: str) -> None:
        self.exit()

    async def command_settings(self, argument: str) -> None:
        self.action_settings()

    async def command_help(self, argument: str) -> None:
        await self.conversation.add_notice(f"{KEYS}\n\n{help_text()}")

    async def command_think(self, argument: str) -> None:
        choice = {"on": True, "off": False, "": None}.get(argument.lower())
        if choice is None and argument:
            self.notify(f"/think {argument}: on, off, or nothing for the model's default", severity="error")
            return
        self.thinking = choice
        if self.chat is not None and hasattr(self.chat, "thinking"):
            self.chat.thinking = choice          # from the next answer on
        if self.engine is not None and not _thinks(self.engine):
            self.notify("This model's template has no reasoning blocks: /think changes nothing", severity="warning")
            return
        self.notify({True: "Thinking on: the model reasons first", False: "Thinking off: the model answers at once",
                     None: "Thinking: the model's default"}[choice], timeout=3)

    async def command_system(self, argument: str) -> None:
        if not self._idle_or_say():
            return
        self.system = argument or None
        if self.chat is not None:     # else the chat takes self.system when the model has loaded
            self.chat.set_system(self.system)
        self.store.set_system(self.system)
        self.notify(f"System message: {argument}" if argument else "System message removed", timeout=3)

    async def command_temperature(self, argument: str) -> None:
        if argument.strip().lower() in ("model", "default"):
            self.settings = replace(self.settings, temperature=None)
            self.notify(f"Temperature as the model recommends for the next answers: {_temperature_text(self.engine)}",
                        timeout=4)
            return
        try:
            t = float(argument)
            if not (t >= 0 and math.isfinite(t)):
                raise ValueError
        except ValueError:
            self.notify(f"/temperature {argument}: a number, 0 (greedy) or more, or 'model' for the model's "
                        "recommendation", severity="error")
            return
        self.settings = replace(self.settings, temperature=t)
        self.notify(f"Temperature {t:g} for the next answers", timeout=3)

    def _can_reload(self) -> bool:
        if self.engine is None and self.load_error is None:
            # One load at a time: a second would only queue behind the first.
            self.notify("A model is still loading; wait for it first.", severity="warning")
            return False
        return self._idle_or_say()

    async def command_model(self, argument: str) -> None:
        if self._can_reload():
            self.reload_engine(replace(self.settings, model=argument))

    async def command_profile(self, argument: str) -> None:
        if self._can_reload():
            self.reload_engine(replace(self.settings, profile=argument))

    async def command_drafter(self, argument: str) -> None:
        if not self._idle_or_say():
            return
        if self.engine is None:
            self.notify("No model loaded yet.", severity="warning")
            return
        self.on_engine_thread(self._set_drafter, argument)

    def _set_drafter(self, kind: str) -> None:
        # On the engine thread: a model drafter loads weights.
        try:
            self.engine.set_drafter(kind, self.settings.draft_model)
        except engine.EngineError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error")
            return
        self.settings = replace(self.settings, drafter=kind)
        self.chat.controller = self.engine.new_controller()   # acceptance measured anew for this drafter
        self.call_from_thread(self._drafter_set)

    def _drafter_set(self) -> None:
        self.gauges.set_engine(self.engine.describe(), self.engine.plan, self.gauges.host_total)
        self.notify(f"Drafter: {self.engine.describe()['drafter']}", timeout=3)

    async def command_stats(self, argument: str) -> None:
        from ..oneshot import format_stats
        stats = self.chat.last_stats if self.chat is not None else None
        await self.conversation.add_notice(format_stats(stats) if stats else "No answer yet.")

    async def command_copy(self, argument: str) -> None:
        from .widgets import AssistantMessage
        answers = self.query(AssistantMessage)
        if not argument:
            self.action_copy_answer()
            return
        blocks = answers.last().code_blocks if answers else []
        try:
            code = blocks[int(argument) - 1]
            if int(argument) < 1:
                raise IndexError
        except (ValueError, IndexError):
            have = f"1 to {len(blocks)}" if blocks else "none in the last answer"
            self.notify(f"/copy {argument}: no such code block (have {have})", severity="error")
            return
        self.copy_to_clipboard(code)
        self.notify(f"Copied code block {argument}", timeout=2)

    async def command_export(self, argument: str) -> None:
        from ..history import Conversation, Message, to_markdown
        conv = self.store.open(self.store.cid) if self.store.cid is not None else None
        if conv is None:
            # Not saved (no database, or nothing sent yet): export what is in memory.
            messages = [m for m in (self.chat.messages if self.chat else []) if m["role"] != "system"]
            if not messages:
                self.notify("Nothing to export yet.", severity="warning")
                return
            conv = Conversation(0, "", 0.0, 0.0, self.engine.name if self.engine else None, self.system, "chat",
                                [Message(i, m["role"], m["content"], 0.0) for i, m in enumerate(messages)])
        path = Path(argument).expanduser() if argument else Path.cwd() / f"localchat-{conv.id or 'chat'}.md"
        try:
            path.write_text(to_markdown(conv), encoding="utf-8")
        except OSError as exc:
            self.notify(f"/export {path}: cannot write ({exc.strerror or exc})", severity="error")
            return
        self.notify(f"Exported to {path}", timeout=4)

    def action_settings(self) -> None:
        from .screens import SettingsScreen
        from .screens.settings import SAVED_KEYS

        def saved(settings) -> None:
            if settings is None:
                return
            theme_changed = settings.theme != self.theme
            self.settings = settings
            if theme_changed:
                self.theme = settings.theme
            self.persist_settings(SAVED_KEYS)
            self.notify("Settings saved", timeout=2)
        model = getattr(self.engine, "sampling", None)      # None: loading, or a backend's model
        self.push_screen(SettingsScreen(self.settings, sorted(self.available_themes),
                                        None if model is None else model.temperature), saved)


def _temperature_text(eng) -> str:
    """The temperature the loaded model recommends, in words."""
    model = getattr(eng, "sampling", None)
    if model is None:
        return "the server's own" if eng is not None else "known once the model has loaded"
    return "0 (greedy)" if model.greedy else f"{model.temperature:g}"


def _thinks(eng) -> bool:
    from engine.reasoning import thinks
    tok = getattr(eng, "tokenizer", None)
    return tok is None or thinks(tok)          # a backend's model: the server decides
