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
from . import hardware, planner, profiles
from .errors import (BadRequest, CheckpointError, ContextFull, EngineError, ModelNotFound,
                     UnsupportedModel)
from .events import Done, Stats, TextDelta
from .drafters import ModelDrafter, NgramDrafter, NoDrafter, check_compatible
from .sampling import SamplingParams
from .session import Chat
from .speculative import DraftController
from .target.resident import checkpoint_dtype, load_resident

DRAFTERS = ("auto", "ngram", "model", "none")

__all__ = ["open", "Engine", "Chat", "TextDelta", "Stats", "Done", "SamplingParams", "EngineError",
           "BadRequest", "CheckpointError", "ContextFull", "ModelNotFound", "UnsupportedModel"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    def __init__(self, ckpt: _checkpoint.Checkpoint, tokenizer, target, drafter=None,
                 max_draft: int = 8, draft_tokens: int | None = None):
        self.checkpoint = ckpt
        self.name = ckpt.name
        self.tokenizer = tokenizer
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        self.stop_ids = _stop_ids(ckpt.path, tokenizer)
        self.cache_owner: Chat | None = None
        self.plan: planner.Plan | None = None   # the memory plan the model was loaded under
        self.drafter = drafter or NgramDrafter()
        self.max_draft = max_draft
        self.draft_tokens = draft_tokens       # a fixed k; None = adaptive

    def set_drafter(self, kind: str = "auto", draft_model: str | None = None, *, dtype: str | None = None,
                    cache_dir: Path | None = None, fast: bool = True) -> None:
        """Choose who drafts: auto (model if `draft_model` is given, else ngram) | ngram | model | none.
        A model drafter is loaded here and checked against the target's tokenizer."""
        _check_drafter(kind, draft_model)
        if kind == "none":
            self.drafter = NoDrafter()
        elif kind == "ngram" or (kind == "auto" and not draft_model):
            self.drafter = NgramDrafter()
        else:
            dckpt = _checkpoint.resolve(draft_model, cache_dir)
            dtok = _load_tokenizer(dckpt.path)
            check_compatible(self.tokenizer, dtok, self.name, dckpt.name)
            dtarget = load_resident(dckpt.path, self.device, _pick_dtype(dtype, self.device, dckpt.path), fast=fast)
            self.drafter = ModelDrafter(dtarget, dckpt.name, self.target.vocab_size)

    def new_controller(self) -> DraftController:
        if self.drafter.kind == "none":
            return DraftController(max_draft=0, fixed=0)
        return DraftController(max_draft=self.max_draft, fixed=self.draft_tokens)

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
                "weights_bytes": t.weight_bytes(), "context_max": t.max_positions,
                "drafter": self.drafter.kind if self.drafter.kind != "model" else f"model:{self.drafter.name}",
                "draft_tokens": self.draft_tokens if self.draft_tokens is not None else "adaptive"}


def open(model: str | None = None, *, device: str = "auto", dtype: str | None = None,
         cache_dir: str | Path | None = None, fast: bool = True, drafter: str = "auto",
         draft_model: str | None = None, max_draft: int = 8, draft_tokens: int | None = None,
         memory_budget: str | int | None = None) -> Engine:
    """Load a model: None for the demo model, a local directory, a .gguf file or a hub repo id.

    drafter: auto (a model drafter if `draft_model` is given, else n-gram) | ngram | model | none.
    draft_tokens: a fixed number of drafted tokens per round; None adapts it as the chat runs.
    memory_budget: what the engine may use on the device ("8GiB"); default: detected free memory.
    The memory plan is made before any weight is read (`eng.plan`); a model whose weights
    cannot stay on the device is refused with the figures, instead of exhausting memory."""
    _check_drafter(drafter, draft_model)      # before loading anything: fail fast
    if draft_tokens is not None and not 0 <= draft_tokens <= 64:
        raise BadRequest(f"--draft-tokens {draft_tokens}: must be between 0 and 64")
    if not 0 <= max_draft <= 64:
        raise BadRequest(f"max_draft {max_draft}: must be between 0 and 64")
    cache_dir = Path(cache_dir) if cache_dir else None
    ckpt = _checkpoint.resolve(model, cache_dir)
    dev = hardware.pick_device(device)
    dt = _pick_dtype(dtype, dev, ckpt.path)
    plan = _plan_resident(ckpt, dev, dt, memory_budget, cache_dir)
    tokenizer = _load_tokenizer(ckpt.path)
    target = load_resident(ckpt.path, dev, dt, fast=fast)
    eng = Engine(ckpt, tokenizer, target, max_draft=max_draft, draft_tokens=draft_tokens)
    eng.plan = plan
    eng.set_drafter(drafter, draft_model, dtype=dtype, cache_dir=cache_dir, fast=fast)
    return eng


def _plan_resident(ckpt, dev, dt, memory_budget, cache_dir) -> "planner.Plan":
    """Plan before loading. This version runs the target resident in its exact weights,
    so that row must fit with room for a useful context (2048 tokens, or the model's own
    limit if smaller); the other profiles are shown in the plan for what they would need."""
    import json as _json
    from dataclasses import replace as _replace
    cfg = _json.loads((ckpt.path / "config.json").read_text())
    max_pos = int(cfg.get("max_position_embeddings") or 8192)
    shape = _replace(planner.ModelShape.from_checkpoint(ckpt.path, ckpt.name),
                     dtype_bytes=torch.finfo(dt).bits // 8)
    hw = hardware.detect(cache_dir, vram=memory_budget, device=str(dev))
    plan = planner.make_plan(shape, hw, profiles.builtin(), context=min(8192, max_pos))
    row = plan.row("resident-exact")
    need = min(2048, max_pos)
    if row.max_context < need:
        other = f"; {plan.chosen} would fit, once this engine has that target" if plan.chosen else ""
        raise BadRequest(
            f"{ckpt.name} needs {planner.gb(row.weights)} of weights plus KV cache and runtime on {hw.device}, "
            f"more than its {planner.gb(hw.budget_bytes)} budget allows with {need} tokens of context{other}; "
            "pick a smaller model (`localchat setup`), or set the budget with --vram")
    return plan


def _check_drafter(kind: str, draft_model: str | None) -> None:
    if kind not in DRAFTERS:
        raise BadRequest(f"--drafter {kind}: use one of {', '.join(DRAFTERS)}")
    if kind == "model" and not draft_model:
        raise BadRequest("--drafter model needs --draft-model PATH_OR_REPO")


def _pick_dtype(dtype: str | None, dev, path: Path):
    if dtype in (None, "auto"):
        return hardware.default_dtype(dev, checkpoint_dtype(path))
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise BadRequest(f"--dtype {dtype}: use float32, bfloat16 or float16")


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
