"""Snapshot tests of the chat UI (pytest-textual-snapshot): the picture of each screen,
compared with the SVG under tests/__snapshots__/. The app runs on the real engine with
a tiny random Llama; what would vary between runs (speeds, memory, dates, the plan's
budget, which depends on this machine's free memory) is set to fixed figures, so the
picture only changes when the UI does. After an intended change of the look:
`pytest tests/test_tui_snapshots.py --snapshot-update`, then look at the SVGs."""
from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

import engine  # noqa: E402
from engine.planner import PlanRow  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.history import History  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.store import ChatStore  # noqa: E402

from tui_helpers import loader, wait_for  # noqa: E402

SIZE = (110, 34)
NOON = 1735819200.0        # 2025-01-02 12:00 UTC: the same date in every time zone a CI runs in
GB = 10**9


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama))


def stats(generated: int, seconds: float, **extra) -> engine.Stats:
    return engine.Stats(prompt_tokens=42, prefill_tokens=42, prefill_seconds=0.1, prefill_tps=420.0,
                        generated_tokens=generated, decode_seconds=seconds, decode_tps=generated / seconds,
                        forward_passes=int(generated / 1.4), tokens_per_pass=1.4, drafted_tokens=60,
                        accepted_tokens=29, acceptance=29 / 60, draft_k=3, predicted_tokens_per_pass=1.35,
                        context_tokens=42 + generated, context_max=4096, device_bytes=int(0.63 * GB),
                        host_bytes=int(1.1 * GB), **extra)


PLAN_ROW = PlanRow(profile="resident-exact", summary="", weights=int(0.54 * GB), kv=int(0.19 * GB), drafter=0,
                   activations=int(0.02 * GB), runtime=int(0.6 * GB), margin=int(0.5 * GB), total=int(1.85 * GB),
                   budget=8 * GB, fits=True, context=4096, max_context=4096, resident_layers=30, host_layers=0,
                   disk_layers=0, streamed_bytes_per_pass=0, tps_bound=40.0)


class FixedPlan:
    chosen = "resident-exact"

    def row(self, name):
        return PLAN_ROW


ANSWER = """Use a list comprehension:

```python
squares = [n * n for n in range(10)]
print(squares)
```

It builds the list in **one pass**."""


def saved_db(tmp_path) -> tuple[History, int]:
    db = History.open(tmp_path / "history.db")
    for i, title in enumerate(["Why is the sky blue?", "Rust lifetimes, explained", "A haiku about tea"]):
        cid = db.new_conversation(title, model="tiny")
        db.add_message(cid, "user", title)
        db.add_message(cid, "assistant", "…", finish_reason="stop")
    cid = db.new_conversation("Squares in Python", model="tiny")
    db.add_message(cid, "user", "How do I make a list of squares in Python?")
    db.add_message(cid, "assistant", ANSWER, finish_reason="stop")
    db.add_message(cid, "user", "And only the even ones?")
    db.add_message(cid, "assistant", "Add a condition: `[n * n for n in range(10) if n % 2 == 0]`",
                   finish_reason="cancelled")
    # Fixed dates: the sidebar shows them.
    db._conn.execute("UPDATE conversations SET created_at = ? + id * 3600, updated_at = ? + id * 3600", (NOON, NOON))
    return db, cid


def app_for(tiny_engine, tmp_path) -> ChatApp:
    db, cid = saved_db(tmp_path)
    return ChatApp(loader(tiny_engine), Settings(), ChatStore(db), resume=cid, save_settings=False)


async def settle(pilot) -> None:
    """The model loaded, figures fixed, nothing left to draw."""
    app = pilot.app
    await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
    app.status_bar.model = "SmolLM2-135M-Instruct"
    app.status_bar.stats = stats(120, 3.2)
    app.gauges.set_engine({"context_max": 4096, "profile": "resident-exact", "device": "cpu",
                           "dtype": "float32", "drafter": "ngram"}, FixedPlan(), 32 * GB)
    app.gauges.start_answer()
    seconds = 0.0
    for step in range(1, 41):
        # A speed that rises and dips, as a real answer's does: 30-45 tok/s.
        seconds += 8 / (30 + 15 * abs((step % 12) - 6) / 6)
        app.gauges.update(stats(8 * step, seconds))
    app.prompt_input.blur()                 # no blinking cursor in the picture
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()


def test_chat_screen(snap_compare, tiny_engine, tmp_path):
    """A resumed conversation: two user turns (tinted, accent bar), the first answer as
    Markdown with a highlighted Python code block and bold text, the second answer
    marked 'stopped'; the empty message box with its placeholder; the status bar with
    the model, prefill and decode tok/s, 1.40 tok/pass · accept 48% · k 3, ctx 162/4096
    and memory."""
    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=settle)


def test_gauges_panel(snap_compare, tiny_engine, tmp_path):
    """Ctrl+G: the gauges panel above the message box: speed (prefill 420, decode 37.1
    tok/s), a sparkline of decode speed (a saw-tooth between 30 and 45 tok/s) over the answer, speculation (1.40 tok/pass,
    accept 48%, k 3, predicted 1.35), a context bar at 362/4096, memory (device 630 MB
    of 8.0 GB, host 1.1 GB of 32 GB), the plan line (resident-exact on cpu, float32,
    ngram) and the memory-plan bar: weights, KV, act, runtime and a long free part,
    with a legend of their sizes."""
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("ctrl+g")
        await pilot.pause()
    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_sidebar(snap_compare, tiny_engine, tmp_path):
    """Ctrl+B: the conversations sidebar on the left: the 'Conversations' title, a search
    box, four saved conversations newest first ('Squares in Python' highlighted, as it
    is the open one, with the focus on the list), each with its date and message count, and the key hint at the
    bottom; the chat stays on the right."""
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("ctrl+b")
        await pilot.pause()
    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=run_before)
