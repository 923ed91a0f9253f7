"""Chat interactions through Pilot, on the real engine with a tiny random Llama: the
multi-line box and its prompt history, copying, slash commands and the command palette,
the engine gauges, the settings screen and reloading the model."""
from __future__ import annotations

import asyncio
import tomllib

import pytest

pytest.importorskip("textual")

import engine  # noqa: E402
from localchat import config  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.history import History  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.screens import SettingsScreen  # noqa: E402
from localchat.tui.store import ChatStore  # noqa: E402
from localchat.tui.widgets import Notice, UserMessage  # noqa: E402
from localchat.tui.widgets.assistant_message import code_blocks  # noqa: E402
from textual.widgets.markdown import MarkdownFence  # noqa: E402

from tui_helpers import (SIZE, loaded, loader, pace, record_notifications, send_and_wait, submit,  # noqa: E402
                         wait_for)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama))


def test_enter_sends_shift_enter_and_ctrl_j_add_lines_and_arrows_walk_the_history(tiny_engine, tmp_path):
    """Shift+Enter and Ctrl+J insert new lines, Enter sends the whole multi-line prompt;
    ↑ on the first line brings back earlier prompts (those saved in the history too,
    newest first), ↓ walks forward and finally gives back the unsent draft."""
    db = History.open(tmp_path / "h.db")
    cid = db.new_conversation("x")
    db.add_message(cid, "user", "from an earlier session")

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=4), ChatStore(db), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.click("#prompt")
            await pilot.press("a", "shift+enter", "b", "ctrl+j", "c", "enter")
            await wait_for(pilot, lambda: not app.generating and len(app.chat.messages) == 2, what="the answer")
            assert [u.text for u in app.query(UserMessage)] == ["a\nb\nc"]
            box = app.prompt_input
            assert box.text == ""
            await pilot.press(*"dra", "f", "t")
            await pilot.press("up")
            assert box.text == "a\nb\nc"
            await pilot.press("up", "up")   # the cursor is on the last line: up first moves within the text
            assert box.text == "a\nb\nc" and box.cursor_location[0] == 0
            await pilot.press("up")
            assert box.text == "from an earlier session"
            await pilot.press("down")
            assert box.text == "a\nb\nc"
            await pilot.press("down")
            assert box.text == "draft"

    asyncio.run(main())
    db.close()


def test_copy_the_answer_a_code_block_by_click_and_by_number(tiny_engine, tmp_path):
    """Ctrl+Y copies the last answer; a click on a code block copies that block; /copy 2
    copies the second block; /copy 5 says which blocks exist. (The clipboard is the app's:
    copy_to_clipboard also writes OSC 52 to the terminal.)"""
    answer = "Two ways:\n\n```python\nprint('one')\n```\n\nor\n\n```sh\necho two\n```\n"
    db = History.open(tmp_path / "h.db")
    cid = db.new_conversation("code")
    db.add_message(cid, "user", "show me code")
    db.add_message(cid, "assistant", answer, finish_reason="stop")
    assert code_blocks(answer) == ["print('one')", "echo two"]

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(), ChatStore(db), resume=cid, save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            notes = record_notifications(app)
            await pilot.press("ctrl+y")
            assert app.clipboard == answer.strip("\n") or app.clipboard == answer
            fence = app.query(MarkdownFence).first()
            await pilot.click(fence)
            assert app.clipboard == "print('one')"
            await submit(pilot, "/copy 2")
            assert app.clipboard == "echo two"
            await submit(pilot, "/copy 5")
            assert app.clipboard == "echo two" and "have 1 to 2" in notes[-1]

    asyncio.run(main())
    db.close()


def test_slash_commands(tiny_engine, tmp_path, monkeypatch):
    """/temperature changes the next answers' temperature (a bad value is refused;
    'model' returns to the model's recommendation);
    /system sets the conversation's system message (in the engine and saved); /stats
    shows the last answer's statistics; /export writes Markdown; /help lists keys and
    commands; an unknown command is refused by name; //x sends "/x" as a prompt;
    /new starts an empty conversation; /quit leaves."""
    monkeypatch.chdir(tmp_path)
    db = History.open(tmp_path / "h.db")

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=4), ChatStore(db), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            notes = record_notifications(app)
            await submit(pilot, "/temperature 0.5")
            assert app.settings.temperature == 0.5
            await submit(pilot, "/temperature hot")
            assert app.settings.temperature == 0.5 and "/temperature hot" in notes[-1]
            await submit(pilot, "/temperature model")
            assert app.settings.temperature is None and notes[-1].endswith("the next answers: 0 (greedy)")
            await send_and_wait(pilot, app, "hello")
            await submit(pilot, "/system Be terse.")
            assert app.chat.messages[0] == {"role": "system", "content": "Be terse."}
            assert db.get(app.store.cid).system == "Be terse."
            await submit(pilot, "/stats")
            assert "prompt tokens" in app.query(Notice).last().text
            await submit(pilot, "/export")
            exported = (tmp_path / f"localchat-{app.store.cid}.md").read_text()
            assert "## You\n\nhello" in exported and "**System:** Be terse." in exported
            await submit(pilot, "/help")
            assert "/temperature T" in app.query(Notice).last().text and "Ctrl+R" in app.query(Notice).last().text
            await submit(pilot, "/frobnicate")
            assert "/frobnicate: unknown command" in notes[-1]
            await send_and_wait(pilot, app, "//not a command")
            assert app.query(UserMessage).last().text == "/not a command"
            await submit(pilot, "/new")
            await pilot.pause()
            assert not app.query(UserMessage) and app.chat.messages == [] and app.store.cid is None
            await submit(pilot, "/quit")
            await pilot.pause()
        assert not app.is_running

    asyncio.run(main())
    db.close()


def test_command_palette_runs_slash_commands(tiny_engine):
    """Ctrl+P opens the palette; 'temperature 0.3' runs /temperature 0.3; picking a
    command that needs an argument without one puts '/model ' in the message box."""

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press("ctrl+p")
            await pilot.press(*"temperature 0.3")
            await wait_for(pilot, lambda: app.screen.query("CommandList") and
                           app.screen.query_one("CommandList").option_count > 0, what="the palette's hits")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.settings.temperature == 0.3, what="the command to run")
            await pilot.press("ctrl+p")
            await pilot.press(*"model")
            await wait_for(pilot, lambda: app.screen.query("CommandList") and
                           app.screen.query_one("CommandList").option_count > 0, what="the palette's hits")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.prompt_input.text == "/model ", what="the box to be filled")

    asyncio.run(main())


def test_model_and_profile_commands_reload_and_keep_the_conversation(tiny_engine, tiny_qwen3):
    """/model loads another model with the conversation carried over; /profile reloads
    with that profile; a model that cannot load is a notice, and the app stays open."""
    other = engine.open(str(tiny_qwen3))
    asked: list[Settings] = []

    def load(settings, progress):
        asked.append(settings)
        if settings.model == "missing":
            raise engine.ModelNotFound("missing: not found")
        return other if settings.model == "qwen" else tiny_engine

    async def main():
        app = ChatApp(load, Settings(max_tokens=4), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await send_and_wait(pilot, app, "hello")
            before = list(app.chat.messages)
            await submit(pilot, "/model qwen")
            await wait_for(pilot, lambda: app.engine is other and app.chat is not None, what="the reload")
            assert app.chat.messages == before and app.status_bar.model == other.name
            await send_and_wait(pilot, app, "and now?")
            await submit(pilot, "/profile resident-exact")
            await wait_for(pilot, lambda: len(asked) == 3 and app.chat is not None, what="the reload")
            assert asked[-1].profile == "resident-exact" and asked[-1].model == "qwen"
            await submit(pilot, "/model missing")
            await wait_for(pilot, lambda: app.load_error is not None, what="the failure")
            assert app.query(Notice).last().text == "missing: not found" and app.is_running

    asyncio.run(main())


def test_drafter_command_switches_the_drafter(tiny_llama):
    """/drafter none turns speculation off for the next answers; a bad kind is refused."""
    eng = engine.open(str(tiny_llama))

    async def main():
        app = ChatApp(loader(eng), Settings(max_tokens=4), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            notes = record_notifications(app)
            await submit(pilot, "/drafter none")
            await wait_for(pilot, lambda: eng.drafter.kind == "none", what="the drafter to change")
            await wait_for(pilot, lambda: any("Drafter: none" in n for n in notes), what="the notice")
            assert app.chat.controller.max_draft == 0
            await submit(pilot, "/drafter wizard")
            await wait_for(pilot, lambda: any("--drafter wizard" in n for n in notes), what="the refusal")

    asyncio.run(main())


def test_gauges_panel_shows_live_figures_sparkline_and_memory_plan(tiny_engine):
    """Ctrl+G shows the gauges: after an answer, decode tok/s, a sparkline with points,
    context used/max and why it is that long, device and host memory, and the memory plan bar of the chosen
    profile; Ctrl+G hides it again."""
    stop_ids = tiny_engine.stop_ids
    tiny_engine.stop_ids = frozenset()

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(max_tokens=100), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            pace(app.chat, 0.01)    # several Stats snapshots (one per 0.25 s) on any machine
            assert not app.gauges.display
            await pilot.press("ctrl+g")
            assert app.gauges.display
            await send_and_wait(pilot, app, "count")
            figures = app.gauges.figures().plain
            assert "context" in figures and "/ 4096 tokens" in figures and "device" in figures and "host" in figures
            assert f"tokens · {tiny_engine.describe()['context_note']}" in figures    # why it is that long
            assert app.gauges.speeds, "no sparkline points"
            bar = app.gauges.query_one("PlanBar")
            assert bar.row is not None and bar.row.profile == tiny_engine.plan.chosen
            legend = bar.render().plain
            assert "weights" in legend and "free" in legend
            await pilot.press("ctrl+g")
            assert not app.gauges.display

    try:
        asyncio.run(main())
    finally:
        tiny_engine.stop_ids = stop_ids


def test_settings_screen_saves_to_the_config_file(tiny_engine, tmp_path, monkeypatch):
    """F2 opens the settings; a bad temperature is refused in the dialog; Save applies
    the theme, temperature, max tokens and system prompt and writes them to the config
    file; a theme changed elsewhere (the palette) is persisted too. Its own config
    directory: a temperature left in the run's shared one would make every later answer
    sample."""
    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))

    async def main():
        app = ChatApp(loader(tiny_engine), Settings(), save_settings=True)
        async with app.run_test(size=(100, 50)) as pilot:
            await loaded(pilot, app)
            await pilot.press("f2")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
            screen = app.screen
            screen.query_one("#temperature").value = "-1"
            await pilot.click("#save")
            assert isinstance(app.screen, SettingsScreen) and "temperature" in str(screen.query_one("#problem").content)
            screen.query_one("#temperature").value = "0.8"
            screen.query_one("#max-tokens").value = "321"
            screen.query_one("#system").load_text("You are a pirate.")
            screen.query_one("#theme").value = "nord"
            screen.query_one("#save").press()    # a click within 0.2 s of the last is ignored by Button
            await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the dialog to close")
            assert (app.settings.temperature, app.settings.max_tokens, app.settings.system) == (0.8, 321, "You are a pirate.")
            assert app.theme == "nord"
            saved = tomllib.loads(config.config_path().read_text())
            assert saved | {"theme": "nord", "temperature": 0.8, "max_tokens": 321, "system": "You are a pirate."} == saved
            app.theme = "gruvbox"
            await pilot.pause()
            assert tomllib.loads(config.config_path().read_text())["theme"] == "gruvbox"
            # emptied, the temperature is the model's again, and leaves the file
            await pilot.press("f2")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="the settings")
            field = app.screen.query_one("#temperature")
            assert field.value == "0.8" and field.placeholder == "the model's: 0"
            field.value = ""
            app.screen.query_one("#save").press()
            await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the dialog to close")
            assert app.settings.temperature is None
            assert "temperature" not in tomllib.loads(config.config_path().read_text())

    asyncio.run(main())


def test_loading_progress_is_shown(tiny_engine):
    """While the model loads, the status bar says what is loading, for how long, and the
    layer count the engine reports; /model is refused until the load ends."""
    import threading
    release = threading.Event()

    def load(settings, progress):
        progress("layer", 3, 30)
        release.wait(60)
        return tiny_engine

    async def main():
        app = ChatApp(load, Settings(), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            notes = record_notifications(app)
            await wait_for(pilot, lambda: "layer 3/30" in app.status_bar.text, what="the progress")
            assert "Loading the demo model…" in app.status_bar.text and " s · " in app.status_bar.text
            await submit(pilot, "/model other")          # one load at a time
            assert "still loading" in notes[-1] and app.settings.model is None
            release.set()
            await loaded(pilot, app)
            assert "Loading" not in app.status_bar.text
        release.set()

    asyncio.run(main())


def test_gauges_say_where_a_streamed_models_weights_live(tiny_llama):
    """A model streamed under a small budget: the gauges' plan line says how many units
    stay on the device, come from host RAM or from disk, and the bytes a pass streams."""
    from localchat.tui.widgets.gauges import where_weights_live
    eng = engine.open(str(tiny_llama), memory_budget="3MB", profile="streamed-exact", context=64)
    text = where_weights_live(eng.describe())
    assert "units stay on cpu" in text and "from disk" in text and "a pass" in text
    assert where_weights_live({"device": "cpu"}) == ""


def test_a_hybrid_model_chats_with_speculation_and_shows_its_state(tmp_path, tokenizer):
    """A Qwen3.5-style hybrid in the chat UI: answers stream with n-gram drafting on (its
    recurrent state replayed), and the memory plan shows the state segment (live state,
    turn checkpoint, replay buffer)."""
    from tiny import build_model
    path = build_model(tmp_path / "hybrid", "qwen3_5", layers=4, tokenizer=tokenizer, seed=2)
    eng = engine.open(str(path))
    assert eng.drafter.kind == "ngram"

    async def main():
        app = ChatApp(loader(eng), Settings(max_tokens=40), save_settings=False)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await send_and_wait(pilot, app, "Repeat: a b c a b c a b c")
            await send_and_wait(pilot, app, "again")
            assert len(app.chat.messages) == 4 and app.chat.messages[-1]["content"]
            await pilot.press("ctrl+g")
            bar = app.gauges.query_one("PlanBar")
            assert bar.row is not None and bar.row.state > 0 and "state" in bar.render().plain

    asyncio.run(main())
