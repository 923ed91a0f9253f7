"""Before a turn would not fit the model's context, the chat UI asks (ContextFullScreen):
drop the oldest turns, replace them with a summary the model writes, send anyway (the
answer stops where the context is full, and says so), or cancel; then it says in the
conversation which it did, and sends. The history keeps every turn: only what the model
is shown changes. Mixed into ChatApp; the summary is written on the engine thread."""
from __future__ import annotations

import engine

from .screens import ContextFullScreen

GOAL = 0.75          # making room leaves the conversation and an answer's room within 3/4 of the context
SUMMARISING = "summarising the oldest turns…"


class ContextRoom:
    _send_as_is = False           # the user chose "send anyway" for the turn being sent
    _making_room = False          # a summary is being written

    def room_for(self, prompt: str) -> tuple[int, int, int]:
        """(tokens the conversation would be with `prompt`, the context, the room an answer
        is given: max_tokens, or a quarter of the context if that is less)."""
        room = self.engine.target.cache.max_positions
        return self.chat.prompt_tokens(prompt), room, min(self.settings.max_tokens, room // 4)

    def turn_fits(self, prompt: str, mode: str, before: list[dict]) -> bool:
        """True where the turn fits (or the user said to send it anyway); else ask what to
        do, with the conversation as it was (`before`), and False."""
        if self._send_as_is or not hasattr(self.chat, "prompt_tokens"):     # a --backend counts its own
            self._send_as_is = False
            return True
        need, room, reserve = self.room_for(prompt)
        if need + reserve <= room:
            return True
        self.chat.restore(before)
        question = (f"This turn needs {need:,} tokens and the answer up to {reserve:,} more, but the model's "
                    f"context holds {room:,}. Drop the oldest turns (the history keeps them), replace them with "
                    "a summary the model writes, or send anyway (the answer stops where the context is full)?")
        self.push_screen(ContextFullScreen(question), lambda choice: self._room_chosen(choice, prompt, mode))
        return False

    def _room_chosen(self, choice: str | None, prompt: str, mode: str) -> None:
        if choice is None:
            return
        if choice == "send":
            self._send_as_is = True
            self.call_later(self._send_again, prompt, mode)
            return
        messages = self.chat.messages
        tail = messages[-2:] if mode != "new" else []            # the turn an edit or a retry replaces
        base = messages[:len(messages) - len(tail)]
        system = [m for m in base if m["role"] == "system"]
        turns = [m for m in base if m["role"] != "system"]
        # a summary takes room of its own: up to an eighth of the context (Chat.summarise) and its heading
        extra = 0 if choice == "drop" else min(256, self.engine.target.cache.max_positions // 8) + 32
        cut = self._oldest(system, turns, prompt, extra)
        self.chat.restore(messages)
        if cut is None:
            self.notify("The prompt alone does not fit the model's context: shorten it, or start a new chat.",
                        severity="error")
            return
        dropped, kept = turns[:cut], turns[cut:]
        if choice == "drop":
            self.chat.restore(system + kept + tail)
            self.call_later(self._made_room, f"Dropped the {_turns(dropped)} to make room: the model no longer "
                                             "sees them (the history keeps them).", prompt, mode)
            return
        self._making_room = True
        self.status_bar.activity = SUMMARISING
        self.on_engine_thread(self._summarise, dropped, system, kept, tail, prompt, mode)

    def _oldest(self, system: list[dict], turns: list[dict], prompt: str, extra: int) -> int | None:
        """How many of the oldest messages to leave out (whole turns, each from a user
        message) so the turn and `extra` tokens fit within GOAL of the context; else the
        fewest that make it fit at all; None where even none of them left does not."""
        starts = [i for i, m in enumerate(turns) if m["role"] == "user"][1:] + [len(turns)]
        fitting = None
        for cut in starts:
            self.chat.restore(system + turns[cut:])
            need, room, reserve = self.room_for(prompt)
            need += extra
            if need + reserve <= GOAL * room:
                return cut
            if fitting is None and need + reserve <= room:
                fitting = cut
        return fitting

    def _summarise(self, dropped, system, kept, tail, prompt, mode) -> None:
        """On the engine thread: the summary, then the conversation it stands in."""
        try:
            summary = self.chat.summarise(dropped)
        except engine.EngineError as exc:
            summary, failed = "", str(exc)
        else:
            failed = "" if summary else "the model wrote nothing"
        self._to_ui(self._summarised, summary, failed, dropped, system, kept, tail, prompt, mode)

    async def _summarised(self, summary, failed, dropped, system, kept, tail, prompt, mode) -> None:
        self._making_room = False
        self.status_bar.activity = ""
        if failed or self.chat._cancel.is_set():
            self.notify(f"No summary ({failed or 'stopped'}); nothing was sent.", severity="warning")
            return
        text = (system[0]["content"] + "\n\n" if system else "") + f"Earlier in this conversation (summarised): {summary}"
        self.chat.restore([{"role": "system", "content": text}] + kept + tail)
        await self._made_room(f"Summarised the {_turns(dropped)}, which the model now sees as: {summary}", prompt, mode)

    async def _made_room(self, note: str, prompt: str, mode: str) -> None:
        await self.conversation.add_notice(note)
        await self._send_again(prompt, mode)     # checked again: a long summary may still not fit (then asked)

    async def _send_again(self, prompt: str, mode: str) -> None:
        if await self.start_answer(prompt, mode):
            self.prompt_input.remember(prompt)
            self.prompt_input.clear()
        self._send_as_is = False


def _turns(messages: list[dict]) -> str:
    n = sum(1 for m in messages if m["role"] == "user")
    return "oldest turn" if n == 1 else f"{n} oldest turns"
