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

    async def add_finished(self, text: str, reason: str | None, error: str | None = None,
                           reasoning: str | None = None) -> AssistantMessage:
        """An answer that already ended (a resumed conversation)."""
        message = await self.add_assistant()
        await message.finish(text, reason or "stop", error or "", reasoning or "")
        return message

    async def remove_last(self, *kinds: type) -> None:
        """Remove the trailing messages of these kinds, newest first, one per kind given
        (`remove_last(AssistantMessage)`, `remove_last(AssistantMessage, UserMessage)`);
        notices in between go too: they were about the turn being replaced."""
        for kind in kinds:
            while self.children and isinstance(self.children[-1], Notice):
                await self.children[-1].remove()
            if self.children and isinstance(self.children[-1], kind):
                await self.children[-1].remove()

    async def add_notice(self, text: str, error: bool = False) -> Notice:
        notice = Notice(text, error=error)
        await self.mount(notice)
        self.anchor()
        return notice

    async def clear(self) -> None:
        await self.remove_children()
