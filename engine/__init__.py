"""localchat's embedded inference engine. No terminal, no UI: it returns values and
yields events.

    import engine
    eng = engine.open()                       # the demo model, or a path / repo id / .gguf
    chat = eng.chat(system="You are terse.")
    for event in chat.send("Why is the sky blue?", max_new_tokens=256):
        ...                                   # TextDelta | Stats | Done
    chat.cancel()                             # from another thread
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import checkpoint as _checkpoint
from . import hardware
from .errors import (BadRequest, CheckpointError, ContextFull, EngineError, ModelNotFound,
                     UnsupportedModel)
from .events import Done, Stats, TextDelta
from .sampling import SamplingParams
from .session import Chat

__all__ = ["open", "Engine", "Chat", "TextDelta", "Stats", "Done", "SamplingParams", "EngineError",
           "BadRequest", "CheckpointError", "ContextFull", "ModelNotFound", "UnsupportedModel"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    def __init__(self, ckpt: _checkpoint.Checkpoint, tokenizer, target):
        self.checkpoint = ckpt
        self.name = ckpt.name
        self.tokenizer = tokenizer
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        self.stop_ids = _stop_ids(ckpt.path, tokenizer)
        self.cache_owner: Chat | None = None

    def chat(self, system: str | None = None) -> Chat:
        return Chat(self, system)

    def claim_cache(self, chat: Chat) -> None:
        """One KV cache per engine: a chat that did not fill it last starts from empty."""
        if self.cache_owner is not chat:
            self.target.cache.rollback(0)
            chat.cached_ids = []
            self.cache_owner = chat

    def describe(self) -> dict:
        t = self.target
        return {"model": self.name, "path": str(self.checkpoint.path), "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "forward": t.kind,
                "weights_bytes": t.weight_bytes(), "context_max": t.max_positions}


def open(model: str | None = None, *, device: str = "auto", dtype: str | None = None,
         cache_dir: str | Path | None = None, fast: bool = True) -> Engine:
    """Load a model: None for the demo model, a local directory, a .gguf file or a hub repo id."""
    ckpt = _checkpoint.resolve(model, Path(cache_dir) if cache_dir else None)
    dev = hardware.pick_device(device)
    from .target.resident import checkpoint_dtype, load_resident
    if dtype in (None, "auto"):
        dt = hardware.default_dtype(dev, checkpoint_dtype(ckpt.path))
    elif dtype in _DTYPES:
        dt = _DTYPES[dtype]
    else:
        raise BadRequest(f"--dtype {dtype}: use float32, bfloat16 or float16")
    tokenizer = _load_tokenizer(ckpt.path)
    target = load_resident(ckpt.path, dev, dt, fast=fast)
    return Engine(ckpt, tokenizer, target)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None


def _stop_ids(path: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except Exception:
        pass   # no generation_config.json: the tokenizer's EOS is enough
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
