"""What the user typed, shown as it was typed (no markup, no Markdown)."""
from __future__ import annotations

from textual.widgets import Static


class UserMessage(Static):
    """One user turn in the conversation."""

    DEFAULT_CSS = """
    UserMessage {
        height: auto;
    }
    """

    def __init__(self, text: str, **kwargs) -> None:
        # markup=False: a prompt like "[red]" or "a [b] c" is text, not styling.
        super().__init__(text, markup=False, **kwargs)
        self.text = text
