"""The chat TUI driven by Textual's Pilot, on the real engine with a tiny random Llama.

Each test runs its own event loop with `asyncio.run` (no pytest-asyncio needed) and
waits by polling `pilot.pause()` with a deadline, never by sleeping a fixed time."""
from __future__ import annotations

import asyncio
import re
import threading

import pytest

pytest.importorskip("textual")

import engine  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.widgets import AssistantMessage, Notice, UserMessage  # noqa: E402

from tui_helpers import DEADLINE, SIZE, loader, record_notifications, throttle, type_and_send, wait_for  # noqa: E402


@pytest.fixture
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama))


def first_answer(app) -> AssistantMessage | None:
    replies = app.query(AssistantMessage)
    return replies.first() if replies else None


def test_prompt_gets_an_answer_and_live_stats(tiny_engine):
    """Typing a prompt and pressing Enter shows the user's message, then the streamed
    answer (the same text the engine recorded), and the status bar shows decode tok/s."""
    settings = Settings(max_tokens=24)

    async def main():
        app = ChatApp(loader(tiny_engine), settings)
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
    max_tokens = 4000         # the tiny model holds 4096 positions; the prompt is ~25
    throttle(tiny_engine)
    settings = Settings(max_tokens=max_tokens)

    async def main():
        app = ChatApp(loader(tiny_engine), settings)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "Tell me a long story.")
            await wait_for(pilot, lambda: first_answer(app) and first_answer(app).text,
                           what="the answer to start")
            reply = first_answer(app)

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


def test_second_send_is_refused_while_answering(tiny_engine):
    """While an answer is being written, Enter is refused with a notification and the
    typed text stays in the box. The answer is held at its start by a gate so the
    check does not depend on how fast the model is."""
    gate = threading.Event()

    def gated(send):
        def send_after_gate(*args, **kwargs):
            events = send(*args, **kwargs)

            def held():
                gate.wait(DEADLINE)
                yield from events
            return held()
        return send_after_gate

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=8))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            app.chat.send = gated(app.chat.send)
            notes = record_notifications(app)
            await type_and_send(pilot, "first")
            assert app.generating
            await type_and_send(pilot, "second")
            assert [u.text for u in app.query(UserMessage)] == ["first"]
            assert app.query_one("#prompt").value == "second"
            assert any("still being written" in n for n in notes), notes
            gate.set()
            await wait_for(pilot, lambda: not app.generating, what="the answer")
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.query(UserMessage)) == 2, what="the second send")
            await wait_for(pilot, lambda: not app.generating, what="the second answer")
        gate.set()

    asyncio.run(main())


def test_ctrl_l_clears_the_view_and_the_conversation(tiny_engine):
    """Ctrl+L empties the conversation on screen and in the engine."""
    settings = Settings(max_tokens=8, system="Be brief.")

    async def main():
        app = ChatApp(loader(tiny_engine), settings)
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


def test_ctrl_l_mid_answer_stops_it_then_clears(tiny_engine):
    """Ctrl+L while an answer streams: the answer is stopped first, then the view and the
    engine's conversation are cleared (clearing under a running answer would race it)."""
    tiny_engine.stop_ids = frozenset()
    throttle(tiny_engine)

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=4000))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "Tell me a long story.")
            await wait_for(pilot, lambda: first_answer(app) and first_answer(app).text,
                           what="the answer to start")
            await pilot.press("ctrl+l")
            await wait_for(pilot, lambda: not app.generating and not app.conversation.children,
                           what="the answer to stop and the view to clear")
            assert app.chat.last_done.reason == "cancelled"
            assert app.chat.messages == []

    asyncio.run(main())


def test_quitting_mid_answer_ends_the_generation(tiny_engine):
    """Ctrl+Q while an answer streams: the app exits, and the generation thread stops at
    its next step (the engine records 'cancelled') instead of running to max tokens."""
    tiny_engine.stop_ids = frozenset()
    throttle(tiny_engine)
    max_tokens = 4000

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=max_tokens))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "Tell me a long story.")
            await wait_for(pilot, lambda: first_answer(app) and first_answer(app).text,
                           what="the answer to start")
            await pilot.press("ctrl+q")
        return app

    app = asyncio.run(main())
    assert app.wait_for_generation(DEADLINE)    # the engine thread has ended the answer
    assert not app.is_running
    done = app.chat.last_done
    assert done is not None and done.reason == "cancelled"
    assert len(done.token_ids) < max_tokens


def test_load_failure_is_shown_and_the_app_stays_open():
    """While the model loads, the status bar says so and the input works; when loading
    fails, its message appears as one line in the conversation and as a notification,
    and the app keeps running and refuses to send."""
    may_fail = threading.Event()

    def load(settings, progress):
        may_fail.wait(DEADLINE)
        raise engine.ModelNotFound("x: not found")

    async def main():
        app = ChatApp(load, Settings())
        notes = record_notifications(app)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            # "Loading model…" at once, then the timer's "Loading the demo model… N s …"
            # every half second: which one shows depends on how busy the machine is
            assert "Loading" in app.status_bar.text
            await type_and_send(pilot, "hi")
            assert not app.query(UserMessage)
            assert any("still loading" in n for n in notes), notes

            may_fail.set()
            await wait_for(pilot, lambda: app.load_error is not None, what="the load to fail")
            await pilot.pause()
            assert [n.text for n in app.query(Notice)] == ["x: not found"]
            assert "x: not found" in notes
            assert app.is_running and app.chat is None

            await pilot.press("enter")     # "hi" is still in the box
            assert not app.query(UserMessage)
            assert app.is_running
        may_fail.set()

    asyncio.run(main())


def test_status_bar_figures_are_short_and_readable():
    from localchat.format import human_bytes, rate
    assert [human_bytes(n) for n in (999, 585e6, 1.3e9, 999_700)] == ["999 B", "585 MB", "1.3 GB", "1.0 MB"]
    assert [rate(0.0), rate(71.67), rate(286.4)] == ["–", "71.7", "286"]




def test_a_long_prompt_shows_its_prefill_and_escape_stops_it_within_a_chunk(tiny_engine):
    """A prompt of several chunks: the status bar shows the prefill's progress, and Esc stops
    it at the end of the chunk that is running, with no answer. The second chunk is held
    until the first one's progress is on screen, so nothing depends on the machine's speed."""
    from engine import decode
    calls, shown = [], threading.Event()
    forward = tiny_engine.target.forward

    def gated(ids, *args, **kwargs):
        calls.append(len(ids))
        if len(calls) == 2:
            shown.wait(DEADLINE)
        return forward(ids, *args, **kwargs)
    tiny_engine.target.forward = gated
    prompt = " ".join(f"word{i % 97}" for i in range(420))       # about 2,900 tokens here

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=8))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            app.query_one("#prompt").text = prompt
            await pilot.press("enter")
            chunk = decode.PREFILL_CHUNK
            await wait_for(pilot, lambda: f"prefill {chunk}/" in app.status_bar.text, what="the prefill's progress")
            await pilot.press("escape")
            shown.set()
            await wait_for(pilot, lambda: not app.generating, what="the prefill to stop")
            done = app.chat.last_done
            assert done.reason == "cancelled" and done.token_ids == ()
            assert calls == [chunk, chunk]                 # the chunk shown, and the one Esc came during
            assert tiny_engine.target.cache.length == 2 * chunk
    try:
        asyncio.run(main())
    finally:
        shown.set()
