"""Draw assets/screenshot.svg: the chat UI answering on the demo model, with the engine
gauges open — real figures from this machine, not staged ones.

    .venv/bin/python assets/make_screenshot.py [--out assets/screenshot.svg]

The history goes to a temporary directory (nothing of the user's is read or written)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def open_in_thread():
    """The engine is opened off the main thread, as the app does (see localchat/tui/app.py)."""
    import engine
    box = []
    worker = threading.Thread(target=lambda: box.append(engine.open()))
    worker.start()
    worker.join()
    return box[0]


async def draw(out: Path) -> None:
    from localchat.config import Settings
    from localchat.history import History
    from localchat.tui.app import ChatApp
    from localchat.tui.store import ChatStore

    eng = open_in_thread()
    db = History.open(Path(os.environ["LOCALCHAT_DATA_DIR"]) / "history.db")
    app = ChatApp(lambda settings, progress: eng, Settings(max_tokens=160), ChatStore(db), save_settings=False)
    async with app.run_test(size=(120, 42)) as pilot:
        while app.chat is None:
            await pilot.pause(0.05)
        await pilot.press("ctrl+g")
        app.put_in_prompt(PROMPT)
        await pilot.press("enter")
        while app.generating or app.chat.last_done is None:
            await pilot.pause(0.05)
        app.prompt_input.blur()
        await pilot.pause(0.2)
        app.save_screenshot(filename=out.name, path=str(out.parent))
    db.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).with_name("screenshot.svg")))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as data:
        os.environ["LOCALCHAT_DATA_DIR"] = data
        asyncio.run(draw(Path(args.out).resolve()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
