"""The chat TUI driven by Textual's Pilot, on the real engine with a tiny random Llama.

Each test runs its own event loop with `asyncio.run` (no pytest-asyncio needed) and
waits by polling `pilot.pause()` with a deadline, never by sleeping a fixed time."""
from __future__ import annotations

import asyncio
import re
import time

import pytest

pytest.importorskip("textual")

import engine  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.widgets import AssistantMessage, Notice, UserMessage  # noqa: E402

SIZE = (100, 30)
DEADLINE = 120.0    # seconds; generous for a loaded 2-core machine, reached only on failure


@pytest.fixture
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama))


async def wait_for(pilot, condition, timeout: float = DEADLINE, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def type_and_send(pilot, text: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")


def test_prompt_gets_an_answer_and_live_stats(tiny_engine):
    """Typing a prompt and pressing Enter shows the user's message, then the streamed
    answer (the same text the engine recorded), and the status bar shows decode tok/s."""
    settings = Settings(max_tokens=24)

    async def main():
        app = ChatApp(lambda: tiny_engine, settings)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            assert app.status_bar.model == tiny_engine.name
            await type_and_send(pilot, "Why is the sky blue?")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating,
                           what="the answer")

            users = app.query(UserMessage)
            assert [u.text for u in users] == ["Why is the sky blue?"]
            replies = app.query(AssistantMessage)
            assert len(replies) == 1
            done = app.chat.last_done
            assert done.reason in ("stop", "length")
            assert replies[0].text, "the answer is empty"
            assert replies[0].text == done.text
            assert app.query_one("#prompt").value == ""

            status = app.status_bar.text
            assert re.search(r"decode \d+(\.\d+)? tok/s", status), status
            assert re.search(r"ctx \d+/4096", status), status
            assert "dev ·" in status and "host" in status, status

    asyncio.run(main())


def test_escape_stops_a_long_answer_and_keeps_the_partial_text(tiny_engine):
    """Esc shortly after the answer starts: the answer ends as 'cancelled', well before
    max tokens, with a 'stopped' note; the partial text stays on screen and in the engine."""
    tiny_engine.stop_ids = frozenset()       # no end-of-sequence: the answer runs to max tokens
    max_tokens = 3000
    settings = Settings(max_tokens=max_tokens)

    async def main():
        app = ChatApp(lambda: tiny_engine, settings)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "Tell me a long story.")
            reply = None

            def started():
                nonlocal reply
                replies = app.query(AssistantMessage)
                reply = replies.first() if replies else None
                return reply is not None and reply.text != ""
            await wait_for(pilot, started, what="the answer to start")

            # A second send while the answer is written is refused; the text stays in the box.
            await type_and_send(pilot, "again")
            assert len(app.query(UserMessage)) == 1, (app.chat.last_done and app.chat.last_done.reason, app.chat.last_done and len(app.chat.last_done.token_ids), app.generating)
            assert app.query_one("#prompt").value == "again"

            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, what="the answer to stop")

            done = app.chat.last_done
            assert done.reason == "cancelled"
            assert 0 < len(done.token_ids) < max_tokens
            assert reply.text and reply.text == done.text
            assert reply.note == "stopped"
            # The engine kept the partial answer in the conversation.
            assert app.chat.messages[-1] == {"role": "assistant", "content": done.text}

    asyncio.run(main())


def test_ctrl_l_clears_the_view_and_the_conversation(tiny_engine):
    """Ctrl+L empties the conversation on screen and in the engine."""
    settings = Settings(max_tokens=8, system="Be brief.")

    async def main():
        app = ChatApp(lambda: tiny_engine, settings)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "hello")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating,
                           what="the answer")
            assert app.query(UserMessage)
            await pilot.press("ctrl+l")
            await wait_for(pilot, lambda: not app.conversation.children, what="the view to clear")
            assert app.chat.messages == [{"role": "system", "content": "Be brief."}]

    asyncio.run(main())


def test_load_failure_is_shown_and_the_app_stays_open():
    """A model that cannot be found: its message appears as one line in the conversation
    and as a notification; the app keeps running and refuses to send."""
    def load():
        raise engine.ModelNotFound("x: not found")

    async def main():
        app = ChatApp(load, Settings())
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.load_error is not None, what="the load to fail")
            await pilot.pause()
            notices = list(app.query(Notice))
            assert [n.text for n in notices] == ["x: not found"]
            assert any(n.message == "x: not found" for n in app._notifications)
            assert app.is_running and app.chat is None

            await type_and_send(pilot, "hi")
            assert not app.query(UserMessage)
            assert app.is_running

    asyncio.run(main())
