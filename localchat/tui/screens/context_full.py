"""The question asked before a turn would not fit in the model's context: drop the oldest
turns, replace them with a summary the model writes, send anyway (the answer stops where
the context is full), or cancel. Dismissed with "drop", "summarise", "send" or None."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ContextFullScreen(ModalScreen[str | None]):
    DEFAULT_CSS = """
    ContextFullScreen {
        align: center middle;
    }
    ContextFullScreen > Vertical {
        width: 76;
        height: auto;
        padding: 1 2;
        border: thick $warning 60%;
        background: $surface;
    }
    ContextFullScreen Horizontal {
        height: auto;
        align-horizontal: right;
        margin-top: 1;
    }
    ContextFullScreen Button {
        margin-left: 1;
    }
    """
    BINDINGS = [Binding("escape", "choose(None)", "Cancel"), Binding("d", "choose('drop')", "Drop"),
                Binding("s", "choose('summarise')", "Summarise"), Binding("a", "choose('send')", "Send anyway")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, markup=False)
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Send anyway", id="send")
                yield Button("Summarise them", id="summarise")
                yield Button("Drop them", id="drop", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#drop", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)
