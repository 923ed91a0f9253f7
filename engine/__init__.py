"""localchat's embedded inference engine. No terminal, no UI: it returns values and
yields events. This module is the public API; each part lives in a file named for it
(engine.py the Engine, loading.py open(), session.py Chat, events.py, errors.py).

    import engine
    eng = engine.open()                       # the demo model, or a path / repo id / .gguf
    chat = eng.chat(system="You are terse.")
    for event in chat.send("Why is the sky blue?", max_new_tokens=256):
        ...                                   # TextDelta | Stats | Done
    chat.cancel()                             # from another thread
"""
from __future__ import annotations

from .drafters import ModelDrafter, NgramDrafter, NoDrafter
from .engine import Engine
from .errors import (BadRequest, BadWeights, CheckpointError, ContextFull, EngineError, ModelNotFound,
                     UnsupportedModel)
from .events import Done, Stats, TextDelta
from .loading import RUNNABLE, measured_routing, open, quant_act_dtype, runnable
from .sampling import SamplingParams
from .session import Chat

__all__ = ["open", "Engine", "Chat", "TextDelta", "Stats", "Done", "SamplingParams", "EngineError",
           "BadRequest", "BadWeights", "CheckpointError", "ContextFull", "ModelNotFound", "UnsupportedModel",
           "NoDrafter", "NgramDrafter", "ModelDrafter", "RUNNABLE", "runnable", "quant_act_dtype", "measured_routing"]
