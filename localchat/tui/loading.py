"""Loading the engine in the chat UI: at start, and again for /model and /profile. Mixed
into ChatApp: `_load` runs on the engine thread (opening a model takes seconds to
minutes), the rest on the UI thread, which shows the progress (elapsed time, memory, the
file or layer being read) twice a second until the engine is handed over."""
from __future__ import annotations

import time

import engine
from engine import hardware
from localchat.config import Settings
from localchat.format import human_bytes

LOADING = "Loading model…"


class EngineLoading:
    def _start_loading(self) -> None:
        self.engine = self.chat = None
        self.load_error = None
        self._loading = {"started": time.monotonic(), "rss": hardware.host_rss(), "what": ""}
        self.status_bar.model = ""
        self.status_bar.activity = LOADING
        self._load_timer = self.set_interval(0.5, self._show_loading)
        self.on_engine_thread(self._load, self.settings)

    def _show_loading(self) -> None:
        info = self._loading
        if not info:
            return
        name = self.settings.model or "the demo model"
        line = f"Loading {name}… {time.monotonic() - info['started']:.0f} s · {human_bytes(max(0, hardware.host_rss() - info['rss']))} in memory"
        if info.get("total"):
            done, total = info["done"], info["total"]
            if total > 1 << 20:      # bytes (a file being read), not layers
                done, total = human_bytes(done), human_bytes(total)
            line += f" · {info['what']} {done}/{total}"
        self.status_bar.activity = line

    def _progress(self, what: str, done: int, total: int) -> None:
        """Called by the engine from the loading thread: only note it, the timer draws it."""
        self._loading.update(what=what, done=done, total=total)

    def _load(self, settings: Settings) -> None:
        """On the engine thread: open the engine, hand it to the UI."""
        try:
            eng = self._load_engine(settings, self._progress)
        except engine.EngineError as exc:
            self._to_ui(self._load_failed, str(exc))
            return
        except Exception as exc:   # a bug or a library failure: one line, not a traceback over the UI
            self._to_ui(self._load_failed, f"{type(exc).__name__}: {exc}")
            return
        self._to_ui(self._loaded, eng)

    def _stop_loading_timer(self) -> None:
        self._loading = {}
        self._load_timer.stop()

    def _loaded(self, eng: engine.Engine) -> None:
        self._stop_loading_timer()
        chat = eng.chat(system=self.system)
        chat.thinking = self.thinking
        if self._carry:
            chat.restore(self._carry)
            chat.set_system(self.system)    # a /system typed while loading wins
        self._carry = None
        self.engine, self.chat = eng, chat
        description = eng.describe()
        status = self.status_bar
        status.model = eng.name
        status.context_max = int(description.get("context_max") or 0)
        status.activity = ""
        self.gauges.set_engine(description, eng.plan, hardware.host_total())

    async def _load_failed(self, message: str) -> None:
        self._stop_loading_timer()
        message = " ".join(message.split())      # one line, whatever the exception carried
        self.load_error = message
        self.status_bar.activity = "no model loaded"
        await self.conversation.add_notice(message, error=True)
        self.notify(message, title="Could not load the model", severity="error", timeout=10)

    def reload_engine(self, settings: Settings) -> None:
        """Load the engine again with other settings (/model, /profile); the conversation
        carries over to the new chat."""
        if self.chat is not None:
            self._carry = [dict(m) for m in self.chat.messages]
            self.on_engine_thread(self.chat.keep)      # before the engine goes: the conversation resumes warm
        self.settings = settings
        self._start_loading()

