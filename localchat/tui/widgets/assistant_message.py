"""The model's answer: streamed as Markdown while it is written, rendered once in full at the end.

Streaming goes through Textual's `MarkdownStream`, which merges fragments that arrive
faster than the widget can render them. Appending parses only the tail of the document,
so a construct that spans fragments (a fenced code block) can render half-formed while
it streams; `finish` therefore replaces the document with the full text once.

Copying: a click on a code block copies that block, a double click anywhere else copies
the whole answer (through `App.copy_to_clipboard`, which writes OSC 52 so it works over
SSH and where no system clipboard exists)."""
from __future__ import annotations

import re

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownFence, MarkdownStream

# A fenced block: an opening fence of 3+ backticks or tildes, the code, the same fence.
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<code>.*?)^(?P=fence)[ \t]*$", re.S | re.M)


def code_blocks(markdown: str) -> list[str]:
    """The code of each fenced block in the Markdown, in order (what the copy commands copy)."""
    return [m.group("code").removesuffix("\n") for m in _FENCE.finditer(markdown)]

# Done.reason -> the dim line under the answer ("stop" and "length" end normally: no note).
_NOTES = {"cancelled": "stopped"}


class AssistantMessage(Vertical):
    """One assistant turn: a Markdown body and, when the answer did not end normally, a note."""

    DEFAULT_CSS = """
    AssistantMessage {
        height: auto;
    }
    AssistantMessage > Markdown {
        margin: 0;
        padding: 0;
    }
    /* Blocks are spaced by a bottom margin; the last one's would leave a blank line. */
    AssistantMessage > Markdown > MarkdownBlock:last-child {
        margin-bottom: 0;
    }
    AssistantMessage > .note {
        display: none;
        height: auto;
    }
    AssistantMessage > .note.-shown {
        display: block;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._stream: MarkdownStream | None = None
        self.reason: str | None = None        # Done.reason once the answer has ended

    def compose(self) -> ComposeResult:
        yield Markdown(classes="body")
        yield Static("", classes="note", markup=False)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def text(self) -> str:
        """The Markdown source shown so far (after `finish`: the whole answer)."""
        return self.markdown.source

    @property
    def note(self) -> str:
        return str(self.query_one(".note", Static).content)

    @property
    def code_blocks(self) -> list[str]:
        return code_blocks(self.text)

    def on_click(self, event: events.Click) -> None:
        fence = next((w for w in (event.widget, *(event.widget.ancestors if event.widget else ()))
                      if isinstance(w, MarkdownFence)), None)
        if fence is not None:
            self.app.copy_to_clipboard(fence.code)
            self.app.notify("Copied the code block", timeout=2)
        elif event.chain == 2:
            self.app.copy_to_clipboard(self.text)
            self.app.notify("Copied the answer", timeout=2)
        else:
            return
        event.stop()

    def start(self) -> None:
        """Begin streaming; the widget must be mounted."""
        self.add_class("-streaming")
        self._stream = Markdown.get_stream(self.markdown)

    async def write(self, fragment: str) -> None:
        if self._stream is not None:
            await self._stream.write(fragment)

    async def finish(self, text: str, reason: str, error: str = "") -> None:
        """End the answer: stop the stream, render the full text once, add the note."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.remove_class("-streaming")
        self.reason = reason
        await self.markdown.update(text)
        note = error if reason == "error" else _NOTES.get(reason, "")
        if note:
            label = self.query_one(".note", Static)
            label.update(note)
            label.add_class("-shown")
            label.set_class(reason == "error", "-error")
