"""The chat UI before a turn would not fit the model's context (a tiny model holding 256
tokens), through Pilot: it asks; "drop" leaves out the oldest turns, "summarise" puts a
summary the model writes in their place, each said in the conversation, and the turn is
sent; the history and the screen keep every turn; Esc sends nothing and keeps the prompt
in the box. The context's limit is the model's own unless the plan bounds it."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

import engine  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.history import History  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.screens import ContextFullScreen  # noqa: E402
from localchat.tui.store import ChatStore  # noqa: E402
from localchat.tui.widgets import Notice, UserMessage  # noqa: E402
from tiny import build_model  # noqa: E402
from tui_helpers import SIZE, loaded, loader, record_notifications, submit, wait_for  # noqa: E402

TURN = "The quick brown fox jumps over the lazy dog. Why is the sky blue? " * 2


@pytest.fixture(scope="module")
def short(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("short"), "llama", max_positions=256, tokenizer=tokenizer,
                       endless=True)


async def _fill(pilot, app, n: int = 20) -> int:
    """Send turns until one would not fit: the question is up. The turns sent before it."""
    for i in range(n):
        await submit(pilot, f"{i}: {TURN}")
        await wait_for(pilot, lambda: isinstance(app.screen, ContextFullScreen) or not app.generating,
                       what="an answer or the question")
        if isinstance(app.screen, ContextFullScreen):
            return i
        await wait_for(pilot, lambda: not app.generating, what="the answer")
    raise AssertionError("the context never filled")


def test_a_turn_that_would_not_fit_asks_then_drops_or_summarises_the_oldest(short, tmp_path):
    eng = engine.open(str(short), drafter="none")
    assert eng.describe()["context_max"] == 256 and eng.describe()["context_note"] == "the model's own"
    db = History.open(tmp_path / "history.db")

    async def main():
        app = ChatApp(loader(eng), Settings(max_tokens=16), ChatStore(db), save_settings=False)
        told = record_notifications(app)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            sent = await _fill(pilot, app)
            assert sent >= 2 and "context holds 256" in app.screen.question

            await pilot.press("escape")                      # cancel: nothing sent, the prompt kept
            await pilot.pause()
            assert not isinstance(app.screen, ContextFullScreen) and not app.generating
            assert app.prompt_input.text.startswith(f"{sent}: ")
            assert len([m for m in app.chat.messages if m["role"] == "user"]) == sent

            await pilot.press("enter")                       # asked again: drop them
            await wait_for(pilot, lambda: isinstance(app.screen, ContextFullScreen), what="the question")
            await pilot.press("d")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating
                           and app.chat.messages[-2]["content"].startswith(f"{sent}: "), what="the answer")
            notes = [n.text for n in app.query(Notice)]
            assert any(n.startswith("Dropped the") for n in notes), notes
            assert not app.chat.messages[0]["content"].startswith("0: ")         # the model no longer sees it
            assert len(app.query(UserMessage)) == sent + 1                         # the screen keeps every turn
            assert app.prompt_input.text == ""

            more = await _fill(pilot, app)                   # fill it again: summarise this time
            await pilot.press("s")
            await wait_for(pilot, lambda: told or any(n.text.startswith("Summarised the") for n in app.query(Notice))
                           and not app.generating and app.chat.last_done is not None
                           and app.chat.messages[-2]["content"].startswith(f"{more}: "), what="the summary")
            assert not told
            system = app.chat.messages[0]
            assert system["role"] == "system" and "Earlier in this conversation (summarised): " in system["content"]
            return sent, more

    sent, more = asyncio.run(main())
    users = [m for m in db.get(db.last_id()).messages if m.role == "user"]
    assert len(users) == sent + more + 2            # the history keeps every turn
    db.close()


def test_the_context_is_bounded_by_what_the_plan_fits(tmp_path, tokenizer):
    """A model whose own context is larger than the memory left for its KV cache gets what
    fits; --context sets it; describe() says which."""
    path = build_model(tmp_path / "long", "llama", max_positions=1 << 20, tokenizer=tokenizer)
    eng = engine.open(str(path), drafter="none", memory_budget="64MB")
    d = eng.describe()
    row = eng.plan.row(eng.plan.chosen)
    assert d["context_max"] == row.max_context < 1 << 20 and "what fits in memory" in d["context_note"]
    eng = engine.open(str(path), drafter="none", context=300)
    assert eng.describe()["context_max"] == 300 and eng.describe()["context_note"] == "--context 300"
