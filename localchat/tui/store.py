"""The chat UI's link to the history database: which conversation is open, and the ids
of its last prompt and answer (what a retry or an edit replaces).

Saving never stops the chat. With no database (it could not be opened) every call is a
no-op; a write that fails mid-session (disk full, locked) is remembered in `problem`
for the UI to show once, and the conversation goes on in memory. Thread-safe through
History's lock: the generation thread saves the answer the moment it ends, so quitting
mid-answer still saves what was written."""
from __future__ import annotations

import threading

from ..history import Conversation, ConversationInfo, History, HistoryError, title_from


class ChatStore:
    def __init__(self, db: History | None, problem: str | None = None) -> None:
        self.db = db
        self.problem = problem              # a message not yet shown to the user
        self.cid: int | None = None         # the open conversation (None until its first prompt)
        self.last_user: int | None = None   # message ids in the open conversation
        self.last_answer: int | None = None
        self._lock = threading.Lock()
        self._reported: set[str] = set()    # each distinct problem is shown once

    @property
    def saving(self) -> bool:
        return self.db is not None

    def _do(self, fn, default=None):
        if self.db is None:
            return default
        try:
            return fn(self.db)
        except HistoryError as exc:
            with self._lock:
                self.problem = str(exc)
            return default

    def take_problem(self) -> str | None:
        """The latest problem if it has not been shown yet (a dead disk fails every
        write the same way: one notice is enough)."""
        with self._lock:
            problem, self.problem = self.problem, None
            if problem in self._reported:
                return None
            if problem:
                self._reported.add(problem)
        return problem

    # -- the open conversation

    def start_new(self) -> None:
        self.cid = self.last_user = self.last_answer = None

    def open(self, cid: int) -> Conversation | None:
        conv = self._do(lambda db: db.get(cid))
        if conv is not None:
            self.cid = conv.id
            users = [m.id for m in conv.messages if m.role == "user"]
            answers = [m.id for m in conv.messages if m.role == "assistant"]
            self.last_user = users[-1] if users else None
            self.last_answer = answers[-1] if answers and (not users or answers[-1] > users[-1]) else None
        return conv

    def save_prompt(self, text: str, model: str | None, system: str | None, replace_last: bool = False) -> None:
        """Commit the prompt before its answer is generated; `replace_last` (an edited
        prompt) replaces the last prompt and its answer in the same transaction."""
        if self.cid is None:
            self.cid = self._do(lambda db: db.new_conversation(title_from(text), model=model, system=system))
            if self.cid is None:
                return
        replaces = self.last_user if replace_last else None
        self.last_user = self._do(lambda db: db.add_message(self.cid, "user", text, replaces=replaces))
        self.last_answer = None

    def save_answer(self, text: str, reason: str, error: str = "", stats: dict | None = None,
                    replace_last: bool = False, reasoning: str = "") -> None:
        """Commit an answer that ended (stop, length, cancelled, error); `replace_last`
        (a retry) replaces the previous answer in the same transaction."""
        if self.cid is None:
            return
        replaces = self.last_answer if replace_last else None
        self.last_answer = self._do(lambda db: db.add_message(self.cid, "assistant", text, finish_reason=reason,
                                                              error=error, stats=stats, replaces=replaces,
                                                              reasoning=reasoning))

    def set_system(self, system: str | None) -> None:
        if self.cid is not None:
            self._do(lambda db: db.set_system(self.cid, system))

    # -- the list

    def conversations(self, search: str = "") -> list[ConversationInfo]:
        return self._do(lambda db: db.conversations(search), []) or []

    def title(self, cid: int) -> str:
        conv = self._do(lambda db: db.get(cid))
        return conv.title if conv else ""

    def rename(self, cid: int, title: str) -> None:
        self._do(lambda db: db.rename(cid, title))

    def delete(self, cid: int) -> bool:
        deleted = self._do(lambda db: db.delete(cid), False)
        if deleted and cid == self.cid:
            self.start_new()
        return deleted

    def last_id(self) -> int | None:
        return self._do(lambda db: db.last_id())

    def prompts(self) -> list[str]:
        return self._do(lambda db: db.prompts(), []) or []
