"""The list of saved conversations, docked left: a search box over a list, newest first.

It reads the history itself (`source(search) -> [ConversationInfo]`) and posts what the
user asked for (open, new, rename, delete); the app does it and calls `reload()`."""
from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView, Static

from ...history import ConversationInfo


class ConversationItem(ListItem):
    """One row: the title, and when it was last written to."""

    def __init__(self, info: ConversationInfo, current: bool) -> None:
        super().__init__(classes="-current" if current else "")
        self.info = info

    def compose(self) -> ComposeResult:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(self.info.title or "(untitled)")
        line.append("\n" + short_time(self.info.updated_at) + f" · {self.info.messages} msgs", style="dim")
        yield Label(line)


def short_time(t: float) -> str:
    now = time.time()
    if now - t < 86400 and time.localtime(t).tm_mday == time.localtime(now).tm_mday:
        return time.strftime("%H:%M", time.localtime(t))
    return time.strftime("%Y-%m-%d", time.localtime(t))


class Sidebar(Vertical):
    """`source` gives the conversations for a search text; `current` is the open one."""

    DEFAULT_CSS = """
    Sidebar {
        width: 34;
        height: 1fr;
        dock: left;
    }
    Sidebar > ListView {
        height: 1fr;
    }
    Sidebar ConversationItem {
        padding: 0 1;
        margin-bottom: 1;
    }
    Sidebar > .title, Sidebar > .hint {
        height: auto;
        padding: 0 1;
    }
    """
    BINDINGS = [
        Binding("n", "new", "New chat"),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
    ]

    class Open(Message):
        def __init__(self, cid: int) -> None:
            super().__init__()
            self.cid = cid

    class Rename(Open):
        pass

    class Delete(Open):
        pass

    class New(Message):
        pass

    def __init__(self, source: Callable[[str], list[ConversationInfo]] | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.current: int | None = None

    def compose(self) -> ComposeResult:
        yield Static("Conversations", classes="title")
        yield Input(placeholder="Search…", id="search")
        yield ListView(id="conversation-list")
        hint = ("Enter open · n new · r rename · d delete" if self.source
                else "Conversations are not being saved (see the notice).")
        yield Static(hint, classes="hint")

    @property
    def items(self) -> list[ConversationItem]:
        return list(self.query(ConversationItem))

    async def reload(self) -> None:
        """Read the list again (after a save, rename, delete or a new search); only
        while shown — showing it reloads it."""
        if self.source is None or not self.has_class("-show"):
            return
        listing = self.query_one(ListView)
        search = self.query_one("#search", Input).value
        try:
            infos = self.source(search)
        except Exception as exc:   # a history that failed mid-session: say so, keep the old list
            self.app.notify(str(exc), severity="error")
            return
        await listing.clear()
        await listing.extend(ConversationItem(i, i.id == self.current) for i in infos)
        # Highlight the open conversation, else the first: Enter always has a target.
        ids = [i.id for i in infos]
        listing.index = ids.index(self.current) if self.current in ids else (0 if ids else None)

    async def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        await self.reload()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(ListView).focus()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Open(event.item.info.id))

    def _highlighted(self) -> ConversationItem | None:
        item = self.query_one(ListView).highlighted_child
        return item if isinstance(item, ConversationItem) else None

    def action_new(self) -> None:
        self.post_message(self.New())

    def action_rename(self) -> None:
        if item := self._highlighted():
            self.post_message(self.Rename(item.info.id))

    def action_delete(self) -> None:
        if item := self._highlighted():
            self.post_message(self.Delete(item.info.id))

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Typing in the search box must type letters, not rename or delete.
        if action in ("new", "rename", "delete") and isinstance(self.app.focused, Input):
            return False
        return True
