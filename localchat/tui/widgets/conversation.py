"""The scrolling conversation: user turns, assistant turns and app notices, in order."""
from __future__ import annotations

from textual.containers import VerticalScroll

from .assistant_message import AssistantMessage
from .notice import Notice
from .user_message import UserMessage


class Conversation(VerticalScroll):
    """A transcript that keeps the newest line in view while an answer streams
    (unless the user has scrolled up to read: `anchor` releases on a manual scroll)."""

    DEFAULT_CSS = """
    Conversation {
        height: 1fr;
    }
    """

    async def add_user(self, text: str) -> UserMessage:
        message = UserMessage(text)
        await self.mount(message)
        self.anchor()
        return message

    async def add_assistant(self) -> AssistantMessage:
        message = AssistantMessage()
        await self.mount(message)
        self.anchor()
        return message

    async def add_notice(self, text: str, error: bool = False) -> Notice:
        notice = Notice(text, error=error)
        await self.mount(notice)
        self.anchor()
        return notice

    async def clear(self) -> None:
        await self.remove_children()
