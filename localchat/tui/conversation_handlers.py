"""Saved conversations in the chat UI: resuming one at start (--continue, --cid), opening
one from the sidebar, renaming and deleting. Mixed into ChatApp: these methods use its
store, chat and widgets, and run on the UI thread."""
from __future__ import annotations

from .widgets import Sidebar


class ConversationHandlers:
    async def _resume(self, which: int | str) -> None:
        cid = self.store.last_id() if which == "last" else int(which)
        if cid is None:
            note = ("--continue: no saved conversation yet; this is a new one" if self.store.saving
                    else "--continue: conversations are not being saved, so there is none to continue")
            await self.conversation.add_notice(note)
            return
        if not await self.open_conversation(cid):
            await self.conversation.add_notice(f"--cid {cid}: no such conversation (see `localchat history`); "
                                               "this is a new one", error=True)

    async def open_conversation(self, cid: int) -> bool:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return False
        conv = self.store.open(cid)
        await self.report_store_problem()
        if conv is None:
            return False
        self.end_editing()
        self.system = conv.system
        await self.conversation.clear()
        for m in conv.messages:
            if m.role == "user":
                await self.conversation.add_user(m.content)
            elif m.role == "assistant":
                await self.conversation.add_finished(m.content, m.finish_reason, m.error, m.reasoning)
        self.conversation.scroll_end(animate=False)
        messages = conv.engine_messages()
        if self.chat is not None:
            self.chat.restore(messages)
        else:
            self._carry = messages    # the model is still loading: the chat takes them when it exists
        self.sidebar.current = cid
        return True

    async def on_sidebar_open(self, message: Sidebar.Open) -> None:
        if await self.open_conversation(message.cid):
            await self.sidebar.reload()
            self.prompt_input.focus()

    async def on_sidebar_new(self, message: Sidebar.New) -> None:
        await self.action_new()

    def on_sidebar_rename(self, message: Sidebar.Rename) -> None:
        from .screens import TextPromptScreen

        async def renamed(title: str | None) -> None:
            if title is not None and title.strip():
                self.store.rename(message.cid, title.strip())
                await self.report_store_problem()
                await self.sidebar.reload()
        self.push_screen(TextPromptScreen("New title:", self.store.title(message.cid)), renamed)

    def on_sidebar_delete(self, message: Sidebar.Delete) -> None:
        from .screens import ConfirmScreen
        title = self.store.title(message.cid) or "this conversation"

        async def answered(yes: bool | None) -> None:
            if not yes:
                return
            if message.cid == self.store.cid and self.generating:
                self.notify("Stop the answer first (Esc).", severity="warning")
                return
            current = message.cid == self.store.cid
            if self.store.delete(message.cid) and current:
                await self._clear()
            await self.report_store_problem()
            await self.sidebar.reload()
        self.push_screen(ConfirmScreen(f"Delete “{title}”? Its messages are removed from the history; "
                                       "this cannot be undone."), answered)
