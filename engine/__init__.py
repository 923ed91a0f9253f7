"""localchat's embedded inference engine. No terminal, no UI: it returns values and
yields events. This module is the public API; each part lives in a file named for it
(engine.py the Engine, loading.py open(), session.py Chat, events.py, errors.py).

    import engine
    eng = engine.open()                       # the demo model, or a path / repo id / .gguf
    chat = eng.chat(system="You are terse.")
    for event in chat.send("Why is the sky blue?", max_new_tokens=256):
        ...                                   # TextDelta | Stats | Done
    chat.cancel()                             # from another thread
    eng.resume = engine.ResumeStore(folder, budget_bytes)   # conversations resume warm
    chat.keep()                               # this chat's cache kept there now

The names below are imported when first used, so that `import engine.openmp` (which must
run before torch is imported) does not import torch.
"""
from __future__ import annotations

import importlib

from . import openmp  # noqa: F401

_WHERE = {"ModelDrafter": "drafters", "NgramDrafter": "drafters", "NoDrafter": "drafters",
          "Engine": "engine",
          "BadRequest": "errors", "BadWeights": "errors", "CheckpointError": "errors", "ContextFull": "errors",
          "EngineError": "errors", "ModelNotFound": "errors", "UnsupportedModel": "errors",
          "Done": "events", "Stats": "events", "TextDelta": "events",
          "RUNNABLE": "loading", "measured_routing": "loading", "open": "loading", "plan_model": "loading",
          "quant_act_dtype": "loading", "runnable": "loading",
          "SamplingParams": "sampling", "Chat": "session", "Grammar": "constrain", "ResumeStore": "resume"}

__all__ = ["open", "Engine", "Chat", "TextDelta", "Stats", "Done", "SamplingParams", "EngineError",
           "BadRequest", "BadWeights", "CheckpointError", "ContextFull", "ModelNotFound", "UnsupportedModel",
           "NoDrafter", "NgramDrafter", "ModelDrafter", "Grammar", "ResumeStore", "RUNNABLE", "runnable", "plan_model", "quant_act_dtype", "measured_routing"]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
