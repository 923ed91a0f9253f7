"""The message box: a multi-line TextArea where Enter sends and Shift+Enter or Ctrl+J
starts a new line, and the up/down arrows walk the prompt history (like a shell) when
the cursor is on the first/last line, so they still move within a multi-line draft."""
from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """Posts `PromptInput.Submitted` on Enter. `prompts` holds earlier prompts, oldest
    first; walking it keeps the unsent draft and gives it back past the newest entry."""

    DEFAULT_CSS = """
    PromptInput {
        height: auto;
        min-height: 3;
        max-height: 12;
    }
    """

    class Submitted(Message):
        def __init__(self, prompt_input: "PromptInput", text: str) -> None:
            super().__init__()
            self.prompt_input, self.text = prompt_input, text

        @property
        def control(self) -> "PromptInput":
            return self.prompt_input

    def __init__(self, prompts: list[str] | None = None, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompts: list[str] = list(prompts or [])
        self._position: int | None = None     # index into history while walking it
        self._draft = ""                      # what was typed before walking began

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)

    # -- prompt history

    def remember(self, text: str) -> None:
        """Add a sent prompt (an immediate repeat is kept once) and stop walking."""
        if text and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._position = None

    def action_cursor_up(self, select: bool = False) -> None:
        if select or self.cursor_location[0] > 0 or not self.prompts:
            return super().action_cursor_up(select)
        if self._position is None:
            self._draft, self._position = self.text, len(self.prompts)
        if self._position > 0:
            self._position -= 1
            self._show(self.prompts[self._position])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self._position is None or self.cursor_location[0] < last_row:
            return super().action_cursor_down(select)
        self._position += 1
        if self._position >= len(self.prompts):
            self._position = None
            self._show(self._draft)
        else:
            self._show(self.prompts[self._position])

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def clear(self) -> None:
        super().clear()
        self._position = None

    @property
    def value(self) -> str:
        """The text in the box (named like Input's, which this replaced)."""
        return self.text
