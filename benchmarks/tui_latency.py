"""Responsiveness of the chat UI while the demo model decodes (a benchmark, not a test):

- **Esc to stop**: from the Esc key entering the app to (a) the app cancelling the
  answer, (b) the engine's answer ending (the generation thread has its Done) and (c)
  the screen showing the answer stopped. Target < 200 ms.
- **Frame latency**: while an answer streams, how late the UI's event loop runs a
  callback scheduled every 10 ms (its oversleep: what a keypress or a repaint waits for
  when the decoding thread holds the interpreter), and how long each batch of streamed
  text takes to be drawn.
- **Decode speed** in the UI against the bare engine on the same prompt: what drawing
  costs the model. A bare answer runs before each of
  the UI's answers, on the app's own engine thread (the same OpenMP team: a second team on
  another thread would be throttled by the first), with the UI idle; the ratio is the
  median of each UI answer over the bare one just before it, so the memory's drifting read
  rate cancels out.

The app runs headless (Textual's run_test) at 120x40 on the real demo model, greedy,
with its end-of-turn tokens removed so each answer runs until it is stopped.

    flock /tmp/localchat-bench.lock .venv/bin/python benchmarks/tui_latency.py [--runs 5]

Writes benchmarks/results/tui_latency.json."""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402
from localchat.config import Settings  # noqa: E402
from localchat.tui import answer_stream as stream_module  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.widgets import AssistantMessage  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TICK = 0.010           # the probe's period: 100 callbacks a second
STREAM_SECONDS = 3.0   # how long each answer streams before Esc


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def until(pilot, condition, timeout: float = 120.0, step: float = 0.001) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("the app did not get there in time")
        await pilot.pause(step)


class Probe:
    """Oversleep of a 10 ms sleep on the UI's event loop, while `active`."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self.active = False
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(TICK)
            if self.active:
                self.late.append(time.perf_counter() - t - TICK)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()


class TimedApp(ChatApp):
    """The chat app, recording when Esc cancels, when the engine's answer ends (in the
    generation thread) and when the stopped answer is on screen, and how long each
    streamed batch takes to draw."""

    draw_seconds: list[float] = []
    cancelled_at = done_at = shown_at = 0.0

    def action_stop(self) -> None:
        self.cancelled_at = time.perf_counter()
        super().action_stop()

    def _drain(self, events, reply):
        result = super()._drain(events, reply)
        self.done_at = time.perf_counter()
        return result

    async def _end_answer(self, *args) -> None:
        await super()._end_answer(*args)
        self.shown_at = time.perf_counter()

    async def on_chat_app_progress(self, message) -> None:
        t = time.perf_counter()
        await super().on_chat_app_progress(message)
        self.draw_seconds.append(time.perf_counter() - t)


async def on_engine_thread(app, pilot, fn, *args):
    """fn(*args) on the app's engine thread, awaited without blocking the UI."""
    box = []
    app.on_engine_thread(lambda: box.append(fn(*args)))
    await until(pilot, lambda: box, timeout=600, step=0.01)
    return box[0]


async def measure(eng, runs: int, max_tokens: int, bare_tokens: int) -> dict:
    app = TimedApp(lambda settings, progress: eng, Settings(max_tokens=max_tokens), save_settings=False)
    reacted, stops, shown, probe = [], [], [], Probe()
    ui_tps: list[float] = []
    bare: list[float] = []
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.chat is not None)
        await on_engine_thread(app, pilot, bare_decode_tps, eng, bare_tokens, 1)    # warm-up
        probe.start()
        for _ in range(runs):
            bare += await on_engine_thread(app, pilot, bare_decode_tps, eng, bare_tokens, 1)
            await app.action_clear()
            app.put_in_prompt(PROMPT)
            await pilot.press("enter")
            await until(pilot, lambda: app.query(AssistantMessage) and app.query(AssistantMessage).last().text)
            probe.active = True
            await asyncio.sleep(STREAM_SECONDS)
            probe.active = False
            t0 = time.perf_counter()
            await pilot.press("escape")
            await until(pilot, lambda: not app.generating)
            reacted.append(app.cancelled_at - t0)
            stops.append(app.done_at - t0)
            shown.append(app.shown_at - t0)
            assert app.chat.last_done.reason == "cancelled", app.chat.last_done
            ui_tps.append(app.chat.last_stats.decode_tps)
        probe.stop()
    return {"esc_to_cancel_ms": [round(s * 1e3, 1) for s in reacted],
            "esc_to_engine_stop_ms": [round(s * 1e3, 1) for s in stops],
            "esc_to_screen_ms": [round(s * 1e3, 1) for s in shown],
            "loop_late_ms": probe.late, "draw_ms": app.draw_seconds, "ui_decode_tps": ui_tps, "bare_tps": bare}


def in_thread(fn, *args):
    """Run fn in a thread of its own and return its result. The main thread must never
    run torch work here: once it has run a parallel (OpenMP) op, its thread team lives
    as long as the process, and libgomp throttles the spin-wait of every other thread's
    team on a machine with few cores, which makes the small matmuls of a decode step
    about 3x slower in the app's generation thread. The app keeps torch off its UI
    thread for that reason; so does this benchmark, for the bare engine too."""
    box = []
    worker = threading.Thread(target=lambda: box.append(fn(*args)))
    worker.start()
    worker.join()
    return box[0]


def bare_decode_tps(eng, tokens: int, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        chat = eng.chat()
        list(chat.send(PROMPT, max_new_tokens=tokens))
        out.append(chat.last_stats.decode_tps)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--model", default=None, help="default: the demo model")
    p.add_argument("--flush", type=float, default=None,
                   help="seconds between UI updates while streaming (default: the app's FLUSH_SECONDS)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "tui_latency.json"))
    args = p.parse_args()
    if args.flush is not None:
        stream_module.FLUSH_SECONDS = args.flush
    eng = in_thread(lambda: engine.open(args.model))
    eng.stop_ids = frozenset()       # answers run until Esc
    raw = asyncio.run(measure(eng, args.runs, max_tokens=2000, bare_tokens=96))
    bare = raw["bare_tps"]
    ratios = [u / b for u, b in zip(raw["ui_decode_tps"], bare)]
    late = [x * 1e3 for x in raw["loop_late_ms"]]
    draw = [x * 1e3 for x in raw["draw_ms"]]
    result = {
        "machine": machine(), "model": eng.name, "runs": args.runs, "terminal": "120x40 headless",
        "esc_to_cancel_ms": {"median": median(raw["esc_to_cancel_ms"]), "max": max(raw["esc_to_cancel_ms"]),
                             "each": raw["esc_to_cancel_ms"]},
        "esc_to_engine_stop_ms": {"median": median(raw["esc_to_engine_stop_ms"]),
                                  "max": max(raw["esc_to_engine_stop_ms"]), "each": raw["esc_to_engine_stop_ms"]},
        "esc_to_screen_ms": {"median": median(raw["esc_to_screen_ms"]), "max": max(raw["esc_to_screen_ms"]),
                             "each": raw["esc_to_screen_ms"]},
        "event_loop_late_ms": {"p50": round(percentile(late, 0.5), 2), "p95": round(percentile(late, 0.95), 2),
                               "p99": round(percentile(late, 0.99), 2), "max": round(max(late), 2),
                               "samples": len(late), "tick_ms": TICK * 1e3},
        "draw_batch_ms": {"p50": round(percentile(draw, 0.5), 2), "p95": round(percentile(draw, 0.95), 2),
                          "max": round(max(draw), 2), "batches": len(draw)},
        "decode_tps": {"bare_engine": round(median(bare), 1), "in_ui": round(median(raw["ui_decode_tps"]), 1),
                       "ratio": round(median(ratios), 3), "ratio_each": [round(r, 3) for r in ratios],
                       "bare_each": [round(x, 1) for x in bare], "ui_each": [round(x, 1) for x in raw["ui_decode_tps"]]},
        "flush_seconds": stream_module.FLUSH_SECONDS,
        "target_esc_to_stop_ms": 200,
    }
    path = write_json(args.out, result)
    print(f"Esc to stop: UI reacts {result['esc_to_cancel_ms']['median']:.0f} ms, engine {result['esc_to_engine_stop_ms']['median']:.0f} ms, screen "
          f"{result['esc_to_screen_ms']['median']:.0f} ms (max {result['esc_to_screen_ms']['max']:.0f}); "
          f"event loop late p50 {result['event_loop_late_ms']['p50']} ms, p95 {result['event_loop_late_ms']['p95']} ms; "
          f"draw p50 {result['draw_batch_ms']['p50']} ms; decode {result['decode_tps']['in_ui']} tok/s in the UI "
          f"vs {result['decode_tps']['bare_engine']} bare -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
