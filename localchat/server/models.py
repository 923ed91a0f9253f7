"""The models `localchat serve` answers for: the one it was started with, and every model
`localchat models` finds here (hub cache repos, GGUF imports), each loaded on its first
request. As many stay loaded as the memory plan fits: before a model loads, it is planned
as if it were alone on the machine, and the least recently used loaded models are unloaded
until its plan fits beside the rest. `--keep-alive` unloads a model idle that long.

Everything here runs on the engine thread (runner.Runner) except the read-only listing."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import config_dir


@dataclass
class Slot:
    name: str
    source: str | None               # what --model would say: a folder, a .gguf, a repo id; None: the demo
    checkpoint: Path | None = None   # its folder with config.json, where known before loading
    engine: object = None
    chat: object = None
    state: str = "unloaded"          # unloaded | loading | ready | failed
    error: str = ""
    last_used: float = 0.0
    footprint: int = 0               # bytes its plan counted (weights, caches), less the device's margin

    def config(self) -> dict:
        """Its config.json (a multimodal one's text part), or {} where it cannot be read."""
        try:
            cfg = json.loads((self.checkpoint / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            return {}
        return cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}

    def context_length(self) -> int | None:
        if self.engine is not None:
            return self.engine.target.max_positions
        return int(self.config().get("max_position_embeddings") or 0) or None


class Models:
    def __init__(self, name: str, settings, aliases: tuple[str, ...] = (), keep_alive: float | None = None,
                 discover: bool = True):
        self.settings = settings
        self.default = Slot(name, settings.model)
        self.slots: dict[str, Slot] = {name: self.default}
        self.aliases = {a: name for a in aliases if a and a != name}
        self.keep_alive = keep_alive
        if discover:
            self._discover()

    def _discover(self) -> None:
        from ..models_cli import find_models
        try:
            found = find_models(None)
        except Exception:            # noqa: BLE001 — an unreadable cache: serve what was asked for
            return
        for m in found:
            if m.checkpoint is None or m.name in self.slots or m.name in self.aliases:
                continue
            source = m.name if m.where == "hf cache" else str(m.checkpoint)
            self.slots[m.name] = Slot(m.name, source, m.checkpoint)

    def resolve(self, name: str | None) -> Slot | None:
        return self.slots.get(self.aliases.get(name, name)) if name else None

    def listing(self) -> list[dict]:
        return [{"id": s.name, "object": "model", "created": 0, "owned_by": "localchat",
                 "context_length": s.context_length(), "loaded": s.state == "ready", "state": s.state}
                for s in self.slots.values()]

    # -- the engine thread
    def load(self, slot: Slot, open_engine) -> None:
        """Load `slot`'s model, unloading the least recently used others while its plan
        would not fit beside them. Raises what opening the engine raises."""
        slot.state, slot.error = "loading", ""
        settings = self.settings if slot is self.default else replace(self.settings, model=slot.source)
        loaded = [s for s in self.slots.values() if s.engine is not None and s is not slot]
        budget = self._budget_for(slot, settings, loaded)
        if budget is not None:
            need, room = budget
            for old in sorted(loaded, key=lambda s: s.last_used):
                if room >= need:
                    break
                room += old.footprint
                self.unload(old)
            # the room counted, not what the allocator has handed back yet
            settings = replace(settings, vram=str(room))
        try:
            slot.engine = open_engine(settings)
        except Exception as exc:
            slot.state, slot.error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise
        slot.chat = slot.engine.chat()
        plan = getattr(slot.engine, "plan", None)
        row = plan.row(plan.chosen) if plan is not None and plan.chosen else None
        # the safety margin is the device's, counted once: in the plan of the model loading
        slot.footprint = row.total - row.margin if row is not None else 0
        slot.state, slot.last_used = "ready", time.monotonic()

    def _budget_for(self, slot: Slot, settings, loaded: list[Slot]) -> tuple[int, int] | None:
        """(bytes its plan needs alone on the machine, bytes free beside the loaded models),
        or None where it cannot be planned ahead (a hub model not downloaded)."""
        if not loaded:
            return None
        import engine
        from engine import checkpoint, hardware
        held = sum(s.footprint for s in loaded)
        try:
            if settings.vram:
                room = hardware.parse_size(settings.vram, "--vram") - held
            else:         # what is free now already excludes what the loaded models hold
                room = hardware.detect(checkpoint.default_cache_dir(), ram=settings.ram,
                                       device=None if settings.device == "auto" else settings.device).budget_bytes
            plan = engine.plan_model(str(slot.checkpoint) if slot.checkpoint else settings.model,
                                     device=settings.device, dtype=settings.dtype, memory_budget=room + held,
                                     host_memory=settings.ram, profile=settings.profile, context=settings.context,
                                     profile_dir=config_dir() / "profiles")
        except engine.EngineError:
            return None
        return plan.row(plan.chosen).total, room

    def unload(self, slot: Slot) -> None:
        if slot.chat is not None:
            slot.chat.keep()            # its last conversation resumes warm when it loads again
        engine, slot.engine, slot.chat = slot.engine, None, None
        slot.state, slot.footprint = "unloaded", 0
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        del engine
        gc.collect()

    def expire(self) -> None:
        """Unload models idle longer than --keep-alive (never the one loading)."""
        if not self.keep_alive:
            return
        now = time.monotonic()
        for s in self.slots.values():
            if s.engine is not None and now - s.last_used > self.keep_alive:
                self.unload(s)
