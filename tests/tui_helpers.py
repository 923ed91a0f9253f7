"""What the Pilot tests of the chat UI share: waiting by polling (never a fixed sleep),
typing, and a loader that hands the app an engine the test opened."""
from __future__ import annotations

import time

SIZE = (100, 30)
DEADLINE = 120.0    # seconds; generous for a loaded 2-core machine, reached only on failure


def throttle(eng, seconds: float = 0.001) -> None:
    """Make each target pass of `eng` sleep first. The tiny model writes 4000 tokens in
    about a second on a fast core, which can end an answer before the UI has drawn its
    start; a test that stops an answer mid-way must not race the machine's speed. The
    sleep also lets the UI thread run, as a real model's slower steps do."""
    forward = eng.target.forward
    eng.target.forward = lambda *a, **kw: (time.sleep(seconds), forward(*a, **kw))[1]


def loader(eng):
    """A load_engine for ChatApp that hands over an engine opened by the test."""
    return lambda settings, progress: eng


async def wait_for(pilot, condition, timeout: float = DEADLINE, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def record_notifications(app) -> list[str]:
    """The messages of the app's notifications from now on (app.notify still runs)."""
    seen: list[str] = []
    notify = app.notify

    def spy(message, *args, **kwargs):
        seen.append(str(message))
        return notify(message, *args, **kwargs)
    app.notify = spy
    return seen


async def type_and_send(pilot, text: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")


async def loaded(pilot, app) -> None:
    await wait_for(pilot, lambda: app.chat is not None, what="the model to load")


async def answered(pilot, app) -> None:
    """Until the answer in progress has ended and been drawn."""
    await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating, what="the answer")


async def send_and_wait(pilot, app, text: str) -> None:
    before = len(app.chat.messages)
    await submit(pilot, text)
    await wait_for(pilot, lambda: len(app.chat.messages) > before and not app.generating, what="the answer")


async def submit(pilot, text: str) -> None:
    """Put the text in the message box and press Enter (typing it key by key costs a
    pause per key; use type_and_send where the typing itself is under test)."""
    pilot.app.put_in_prompt(text)
    await pilot.press("enter")


def pace(chat, seconds: float) -> None:
    """Slow the chat's answers to one event per `seconds` at most: the tiny model is so
    fast that an answer could end (or fill its context) before a key press lands, or
    send a single Stats snapshot."""
    send = chat.send

    def paced(*args, **kwargs):
        for event in send(*args, **kwargs):
            time.sleep(seconds)
            yield event
    chat.send = paced
