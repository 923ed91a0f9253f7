"""The model's answer: streamed as Markdown while it is written, rendered once in full at the end.

Streaming goes through Textual's `MarkdownStream`, which merges fragments that arrive
faster than the widget can render them. Appending parses only the tail of the document,
so a construct that spans fragments (a fenced code block) can render half-formed while
it streams; `finish` therefore replaces the document with the full text once.

A thinking model's reasoning goes in a collapsible block above the answer, dimmed: open
while the model thinks ("Thinking… 4 s"), folded once the answer starts ("Thought for
12.3 s · 180 tokens"); a click on its title opens or folds it.

Copying: a click on a code block copies that block, a double click anywhere else copies
the whole answer (through `App.copy_to_clipboard`, which writes OSC 52 so it works over
SSH and where no system clipboard exists)."""
from __future__ import annotations

import re
import time

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
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
    AssistantMessage > Collapsible.reasoning {
        display: none;
        border-top: none;
        padding-bottom: 0;
        margin-bottom: 1;
        background: transparent;
    }
    AssistantMessage > Collapsible.reasoning.-shown {
        display: block;
    }
    AssistantMessage > Collapsible.reasoning Static {
        color: $text-muted;
        text-style: italic;
    }
    AssistantMessage > .note.-shown {
        display: block;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._stream: MarkdownStream | None = None
        self.reason: str | None = None        # Done.reason once the answer has ended
        self.reasoning = ""                   # the reasoning shown so far
        self._thinking_since: float | None = None
        self._thought_seconds: float | None = None

    def compose(self) -> ComposeResult:
        with Collapsible(title="Thinking…", collapsed=False, classes="reasoning"):
            yield Static("", markup=False, classes="thought")
        yield Markdown(classes="body")
        yield Static("", classes="note", markup=False)

    @property
    def reasoning_block(self) -> Collapsible:
        return self.query_one(Collapsible)

    def think(self, fragment: str) -> None:
        """More reasoning, shown open in the block above the answer while it comes."""
        if not fragment:
            return
        block = self.reasoning_block
        if self._thinking_since is None:
            self._thinking_since = time.monotonic()
            block.add_class("-shown")
        self.reasoning += fragment
        self.query_one(".thought", Static).update(self.reasoning.strip())
        block.title = f"Thinking… {time.monotonic() - self._thinking_since:.0f} s"

    def _fold(self, tokens: int = 0) -> None:
        """The reasoning ended (the answer began, or the turn ended): fold it under a summary."""
        if not self.reasoning:
            return
        if self._thought_seconds is None and self._thinking_since is not None:
            self._thought_seconds = time.monotonic() - self._thinking_since
        block = self.reasoning_block
        seconds = f"Thought for {self._thought_seconds:.1f} s" if self._thought_seconds is not None else "Reasoning"
        block.title = seconds + (f" · {tokens} tokens" if tokens else "")
        block.collapsed = True

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
        if self.reasoning and self._thought_seconds is None and fragment.strip():
            self._fold()
        if self._stream is not None:
            await self._stream.write(fragment)

    async def finish(self, text: str, reason: str, error: str = "", reasoning: str = "",
                     reasoning_tokens: int = 0) -> None:
        """End the answer: stop the stream, render the full text once, add the note.
        `reasoning`: the whole reasoning (a saved answer shows it folded)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.remove_class("-streaming")
        self.reason = reason
        if reasoning and reasoning.strip() != self.reasoning.strip():
            # the whole of it (the last batch may not have been drawn); a saved answer's,
            # shown without seconds
            self.reasoning = reasoning
            self.query_one(".thought", Static).update(reasoning.strip())
            self.reasoning_block.add_class("-shown")
        self._fold(reasoning_tokens)
        await self.markdown.update(text)
        # an error, or why an answer stopped short (the context full): said under it
        note = error if reason == "error" or (reason == "length" and error) else _NOTES.get(reason, "")
        if note:
            label = self.query_one(".note", Static)
            label.update(note)
            label.add_class("-shown")
            label.set_class(reason == "error", "-error")
