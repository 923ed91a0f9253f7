"""A one-line note from the app in the conversation (a load failure, a refused request)."""
from __future__ import annotations

from textual.widgets import Static


class Notice(Static):
    """A line from the app, not from either side of the conversation.
    With `error=True` it gets the `-error` class (styled in app.tcss)."""

    DEFAULT_CSS = """
    Notice {
        height: auto;
    }
    """

    def __init__(self, text: str, error: bool = False, **kwargs) -> None:
        super().__init__(text, markup=False, **kwargs)
        self.text = text
        self.set_class(error, "-error")
