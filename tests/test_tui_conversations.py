"""The chat UI and the history database, through Pilot on the real engine with a tiny
random Llama: what is saved when, stopping, retrying and editing as the database sees
them, resuming (--continue, --cid), the sidebar, and a history that cannot be used."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

import engine  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.history import History  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.screens import ConfirmScreen, TextPromptScreen  # noqa: E402
from localchat.tui.store import ChatStore  # noqa: E402
from localchat.tui.widgets import AssistantMessage, Notice, UserMessage  # noqa: E402

from tui_helpers import SIZE, answered, loaded, loader, pace, send_and_wait, type_and_send, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama))


@pytest.fixture
def db(tmp_path):
    d = History.open(tmp_path / "history.db")
    yield d
    d.close()


def saved(db, cid=None):
    """[(role, content, finish_reason)] of a conversation (the latest by default)."""
    conv = db.get(cid if cid is not None else db.last_id())
    return [(m.role, m.content, m.finish_reason) for m in conv.messages] if conv else []


def make_app(eng, db, resume=None, **settings):
    return ChatApp(loader(eng), Settings(**{"max_tokens": 8, **settings}), ChatStore(db), resume=resume,
                   save_settings=False)


def test_prompt_is_saved_before_the_answer_and_the_answer_when_it_ends(tiny_engine, db):
    """The prompt is in the database while the answer is still being generated (held at
    its start by a gate), titled by the prompt; the answer is saved when it ends, with
    its finish reason and stats."""
    import threading
    gate = threading.Event()

    async def main():
        app = make_app(tiny_engine, db)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            send = app.chat.send

            def held(*args, **kwargs):
                events = send(*args, **kwargs)

                def wait_then():
                    gate.wait(60)
                    yield from events
                return wait_then()
            app.chat.send = held
            await type_and_send(pilot, "Why is the sky blue?")
            assert app.generating
            assert saved(db) == [("user", "Why is the sky blue?", None)]
            assert db.get(db.last_id()).title == "Why is the sky blue?"
            gate.set()
            await answered(pilot, app)
            done = app.chat.last_done
            assert saved(db) == [("user", "Why is the sky blue?", None), ("assistant", done.text, done.reason)]
            assert db.get(db.last_id()).messages[1].stats["generated_tokens"] > 0
        gate.set()

    asyncio.run(main())


def test_esc_saves_the_partial_answer_and_quitting_mid_answer_saves_it_too(tiny_engine, db):
    """Esc mid-answer: the partial text is saved as 'cancelled'. Quitting (Ctrl+Q) in the
    middle of the next answer: once the generation thread has ended, its partial answer
    is in the database too."""
    stop_ids = tiny_engine.stop_ids
    tiny_engine.stop_ids = frozenset()

    async def main():
        app = make_app(tiny_engine, db, max_tokens=2000)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            # Paced: each answer is surely still running when its key arrives (at full
            # speed the tiny model can finish 2000 tokens first on a busy machine).
            pace(app.chat, 0.005)
            await type_and_send(pilot, "Tell me a long story.")
            await wait_for(pilot, lambda: app.query(AssistantMessage) and app.query(AssistantMessage).last().text,
                           what="the answer to start")
            await pilot.press("escape")
            await answered(pilot, app)
            first = app.chat.last_done
            assert first.reason == "cancelled" and saved(db)[-1] == ("assistant", first.text, "cancelled")
            await type_and_send(pilot, "Another one.")
            await wait_for(pilot, lambda: app.query(AssistantMessage).last().text, what="the second answer")
            await pilot.press("ctrl+q")
        assert app.wait_for_generation(60)
        return app

    try:
        app = asyncio.run(main())
    finally:
        tiny_engine.stop_ids = stop_ids
    rows = saved(db)
    assert [r[0] for r in rows] == ["user", "assistant", "user", "assistant"]
    assert rows[-1][2] == "cancelled" and rows[-1][1] == app.chat.last_done.text


def test_retry_and_edit_replace_the_last_turn_on_screen_in_the_engine_and_in_the_database(tiny_engine, db):
    """Ctrl+R answers the last prompt again in place of its answer; Ctrl+E puts the last
    prompt in the box (marked as editing; Esc gives up editing), and Enter sends the
    edited text in place of the last prompt and its answer. Earlier turns stay."""

    async def main():
        app = make_app(tiny_engine, db, temperature=1.0, seed=None)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await send_and_wait(pilot, app, "first")
            await send_and_wait(pilot, app, "second")
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: not app.generating and app.chat.last_done is not None, what="the retry")
            await wait_for(pilot, lambda: len(saved(db)) == 4 and saved(db)[-1][0] == "assistant",
                           what="the retried answer to be saved")
            assert [u.text for u in app.query(UserMessage)] == ["first", "second"]
            assert len(app.query(AssistantMessage)) == 2
            assert [r[:2] for r in saved(db)][2] == ("user", "second")
            assert saved(db)[3][1] == app.chat.last_done.text

            box = app.prompt_input
            await pilot.press("ctrl+e", "escape")         # Esc leaves editing, the box empties
            assert not app.editing and box.text == "" and not box.has_class("-editing")
            await pilot.press("ctrl+e")
            assert app.editing and box.text == "second" and box.has_class("-editing")
            await pilot.press("end", "!", "enter")
            await wait_for(pilot, lambda: not app.generating and app.chat.messages[-2]["content"] == "second!",
                           what="the edited prompt's answer")
            await wait_for(pilot, lambda: saved(db)[-1][0] == "assistant", what="the answer to be saved")
            assert [u.text for u in app.query(UserMessage)] == ["first", "second!"]
            assert [m["role"] for m in app.chat.messages] == ["user", "assistant"] * 2
            assert [r[:2] for r in saved(db)][::2] == [("user", "first"), ("user", "second!")]
            assert not app.editing

    asyncio.run(main())


def test_continue_resumes_the_last_conversation_and_cid_a_given_one(tiny_engine, db):
    """resume='last' (--continue) shows the most recent conversation, with a stopped
    answer marked, and the model continues it; resume=ID (--cid) opens that one; an
    unknown id is a notice and a new conversation."""
    old = db.new_conversation("old one", system="Be brief.")
    db.add_message(old, "user", "old question")
    db.add_message(old, "assistant", "old answer")
    last = db.new_conversation("last one")
    db.add_message(last, "user", "hello")
    db.add_message(last, "assistant", "partial", finish_reason="cancelled")

    async def main(resume):
        app = make_app(tiny_engine, db, resume=resume)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            users = [u.text for u in app.query(UserMessage)]
            notes = [n.text for n in app.query(Notice)]
            answers = [(a.text, a.note) for a in app.query(AssistantMessage)]
            messages = list(app.chat.messages)
            if resume == "last":
                await send_and_wait(pilot, app, "and then?")
            return users, answers, messages, notes

    users, answers, messages, _ = asyncio.run(main("last"))
    assert users == ["hello"] and answers == [("partial", "stopped")]
    assert messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "partial"}]
    assert [r[:2] for r in saved(db, last)][2] == ("user", "and then?")
    users, _, messages, _ = asyncio.run(main(old))
    assert users == ["old question"] and messages[0] == {"role": "system", "content": "Be brief."}
    users, _, messages, notes = asyncio.run(main(999))
    assert users == [] and messages == [] and "--cid 999" in notes[0]


def test_sidebar_lists_searches_opens_renames_and_deletes_with_confirmation(tiny_engine, db):
    """Ctrl+B shows the saved conversations, newest first; typing in the search box
    filters them; Enter on one opens it; r renames it; d asks for confirmation, and only
    'yes' deletes (Esc keeps it); deleting the open conversation starts a new one."""
    for title in ("tea", "rust lifetimes", "coffee"):
        cid = db.new_conversation(title)
        db.add_message(cid, "user", f"about {title}")
        db.add_message(cid, "assistant", f"{title} is fine")

    async def main():
        app = make_app(tiny_engine, db)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press("ctrl+b")
            await pilot.pause()
            titles = lambda: [i.info.title for i in app.sidebar.items]   # noqa: E731
            assert app.sidebar.has_class("-show") and titles() == ["coffee", "rust lifetimes", "tea"]
            await pilot.click("#search")
            await pilot.press(*"RUST")
            await wait_for(pilot, lambda: titles() == ["rust lifetimes"], what="the search")
            await pilot.press("enter")         # from the search box to the list
            await pilot.press("enter")         # open the highlighted conversation
            await wait_for(pilot, lambda: [u.text for u in app.query(UserMessage)] == ["about rust lifetimes"],
                           what="the conversation to open")
            assert app.chat.messages[-1]["content"] == "rust lifetimes is fine"
            assert app.store.cid == app.sidebar.current

            app.sidebar.query_one("#conversation-list").focus()
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen), what="the rename box")
            app.screen.query_one("#answer").value = "ownership"
            await pilot.press("enter")
            # Still found by "RUST": the search reads the messages too.
            await wait_for(pilot, lambda: titles() == ["ownership"], timeout=20, what="the renamed title")
            app.sidebar.query_one("#search").value = ""
            await wait_for(pilot, lambda: len(titles()) == 3, timeout=20, what="the whole list")

            app.sidebar.query_one("#conversation-list").focus()
            app.sidebar.query_one("#conversation-list").index = titles().index("ownership")
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            await pilot.press("escape")
            await pilot.pause()
            assert "ownership" in titles()
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
            await pilot.press("y")
            await wait_for(pilot, lambda: "ownership" not in titles(), what="the deletion")
            assert not app.query(UserMessage) and app.store.cid is None and app.chat.messages == []
            await pilot.press("n")              # new chat from the sidebar
            await pilot.pause()
            assert len(db.conversations()) == 2

    asyncio.run(main())


def test_an_unusable_history_is_a_notice_and_the_chat_goes_on(tiny_engine):
    """A history that could not be opened (here: the message a corrupt file gives):
    the app says so in the conversation, chats in memory, and the sidebar says
    conversations are not being saved."""
    problem = "/x/history.db: the history database is corrupt (file is not a database); conversations are not saved"

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=6), ChatStore(None, problem), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            assert [n.text for n in app.query(Notice)] == [problem]
            await send_and_wait(pilot, app, "still works?")
            assert app.chat.messages[-2]["content"] == "still works?"
            await pilot.press("ctrl+b")
            await pilot.pause()
            assert "not being saved" in str(app.sidebar.query_one(".hint").content)

    asyncio.run(main())


def test_a_history_that_fails_mid_session_is_reported_once_and_the_chat_goes_on(tiny_engine, tmp_path):
    """The database stops working after start (here: its connection is closed under
    the app, as a vanished disk would do): the next prompt still gets its answer, and the
    failure is one notice in the conversation, not one per message."""
    db = History.open(tmp_path / "history.db")

    async def main():
        app = make_app(tiny_engine, db)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await send_and_wait(pilot, app, "saved")
            db._conn.close()
            await send_and_wait(pilot, app, "not saved")
            await send_and_wait(pilot, app, "still not saved")
            assert [m["content"] for m in app.chat.messages if m["role"] == "user"] == \
                ["saved", "not saved", "still not saved"]
            notes = [n.text for n in app.query(Notice)]
            assert len(notes) == 1 and "history.db" in notes[0], notes

    asyncio.run(main())


def test_a_conversation_reopened_after_quitting_resumes_warm(tiny_llama, db, tmp_path):
    """Quitting keeps the conversation's cache (run_tui calls keep_conversation once the app
    has closed); reopening it with --continue in a new session (a new engine) prefills only
    the new turn, and the status bar says how much came from the kept cache."""
    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)

    async def session(resume, text):
        eng = engine.open(str(tiny_llama))
        eng.resume = store
        app = make_app(eng, db, resume=resume)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await send_and_wait(pilot, app, text)
            status = app.status_bar.text
        assert app.wait_for_generation(5)
        app.keep_conversation()
        return app.chat.last_stats, status

    first, _ = asyncio.run(session(None, "The quick brown fox jumps over the lazy dog. " * 10))
    assert first.restored_tokens == 0 and len(store.entries()) == 1
    second, status = asyncio.run(session("last", "and then?"))
    assert second.restored_tokens >= first.prompt_tokens
    assert second.prefill_tokens < second.prompt_tokens - first.prompt_tokens
    assert f"{second.restored_tokens} restored" in status
