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
from . import bandwidth, hardware, planner, profiles
from .errors import (BadRequest, CheckpointError, ContextFull, EngineError, ModelNotFound,
                     UnsupportedModel)
from .events import Done, Stats, TextDelta
from .drafters import ModelDrafter, NgramDrafter, NoDrafter, check_compatible
from .sampling import SamplingParams
from .session import Chat
from .speculative import DraftController, PassCosts
from . import compiled, exported, package_dirs
from .target.resident import ResidentTarget, checkpoint_dtype, load_resident
from .target.quantized import load_quantized
from .target.streamed import load_streamed

DRAFTERS = ("auto", "ngram", "model", "none")
# The profiles this engine has targets for; the planner shows the others for what they need.
RUNNABLE = ("resident-exact", "resident-int8", "resident-int4", "streamed-exact")
RUNNABLE_KINDS = {("resident", "exact"), ("resident", "int8"), ("resident", "int4"), ("streamed", "exact")}


def runnable(profile_list) -> tuple[str, ...]:
    """Names of the profiles (built-in or a user's) this engine has a target for."""
    return tuple(p.name for p in profile_list if (p.placement, p.weights) in RUNNABLE_KINDS)
DRAFTER_WEIGHTS = ("auto", "exact", "int8", "int4")

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
        self.costs = PassCosts()               # measured by every chat, shared by all
        self.compile_note = ""
        self._compile_args: tuple[Path, bool] | None = None    # (cache root, build) once compiling is on

    def set_drafter(self, kind: str = "auto", draft_model: str | None = None, *, dtype: str | None = None,
                    cache_dir: Path | None = None, fast: bool = True, weights: str = "auto") -> None:
        """Choose who drafts: auto (model if `draft_model` is given, else ngram) | ngram | model | none.
        A model drafter is loaded here and checked against the target's tokenizer.
        draft_model "self": a quantized copy of the target drafts for it (when no small model
        shares its tokenizer). weights: exact | int8 | int4 | auto (int4 for self, else exact)."""
        _check_drafter(kind, draft_model, weights)
        if kind == "none":
            self.drafter = NoDrafter()
        elif kind == "ngram" or (kind == "auto" and not draft_model):
            self.drafter = NgramDrafter()
        else:
            self_draft = draft_model == "self"
            dckpt = self.checkpoint if self_draft else _checkpoint.resolve(draft_model, cache_dir)
            if weights == "auto":
                weights = "int4" if self_draft else "exact"
            if self_draft and weights == "exact":
                raise BadRequest("--draft-model self with --drafter-weights exact drafts with the target itself "
                                 "(as slow as plain decoding); use --drafter-weights int4 or int8")
            dtok = self.tokenizer if self_draft else _load_tokenizer(dckpt.path)
            check_compatible(self.tokenizer, dtok, self.name, dckpt.name)
            if weights == "exact":
                dtarget = load_resident(dckpt.path, self.device, _pick_dtype(dtype, self.device, dckpt.path),
                                        fast=fast)
            else:
                # The drafter's activations need not match the target's: the target checks every
                # token. bf16 where the device has it is what the int8/int4 kernels are fast at.
                dtarget = load_quantized(dckpt.path, self.device, weights, cache_dir=cache_dir)
            name = dckpt.name + ("" if weights == "exact" else f" ({weights})")
            self.drafter = ModelDrafter(dtarget, name, self.target.vocab_size, dckpt.path)
        self.costs.new_drafter()
        step = getattr(self.target, "compiled", None)
        if step is not None:
            # Compiling is on: the new drafter's step, and the verify buckets it fills.
            step.want_rows(self._verify_rows())
            self._compile_drafter(*self._compile_args)

    def start_compile(self, cache_dir: Path | None = None, build: bool = True) -> bool:
        """Compile the decode step of the target, then of a model drafter, in the
        background (engine/compiled.py). Resident targets with the fast forward can, exact
        or quantized; streamed targets decode eagerly (`compile_note` says why).
        build=False only loads steps an earlier start left in the cache."""
        t = self.target
        if not _compilable(t):
            self.compile_note = f"the {_weights_label(t)} {t.kind} target decodes eagerly"
            return False
        root = cache_dir or _checkpoint.default_cache_dir()
        self._compile_args = (root, build)
        if t.compiled is None:
            short, rows = _no_room_to_compile(t), self._verify_rows()
            if short:
                # Verify passes run on the forward's own weights: they need no room.
                self.compile_note = f"the target decodes eagerly: {short}"
                if not rows:
                    return False
            t.compiled = _compiled_step(t, self.name, self.dtype, self.checkpoint.path, root, self.device,
                                        build=build, rows=rows, step=not short)
            t.compiled.start()
        self._compile_drafter(root, build)
        return True

    def _verify_rows(self) -> tuple[int, ...]:
        """The verify-pass buckets worth compiling for this drafter: those a draft of up
        to max_draft tokens fills (a wider bucket would mostly verify padding)."""
        if self.drafter.kind == "none":
            return ()
        widest = (self.draft_tokens if self.draft_tokens is not None else self.max_draft) + 1
        return tuple(r for r in exported.VERIFY_ROWS if r <= widest)

    def _compile_drafter(self, root: Path, build: bool) -> None:
        d = self.drafter
        if d.kind == "model" and _compilable(d.target) and d.target.compiled is None \
                and not _no_room_to_compile(d.target):
            d.target.compiled = _compiled_step(d.target, d.name, d.target.dtype, d.path, root, self.device,
                                               build=build)
            d.target.compiled.start()

    def new_controller(self) -> DraftController:
        if self.drafter.kind == "none":
            return DraftController(max_draft=0, fixed=0)
        prior = self.costs.acceptance if self.costs.acceptance is not None else 0.5
        return DraftController(max_draft=self.max_draft, fixed=self.draft_tokens, costs=self.costs,
                               prior_acceptance=prior)

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
                "draft_tokens": self.draft_tokens if self.draft_tokens is not None else "adaptive",
                "profile": self.plan.chosen if self.plan else None,
                "weights": _weights_label(t),
                **({"streaming": t.describe()} if hasattr(t, "stream_stats") else {})}


def open(model: str | None = None, *, device: str = "auto", dtype: str | None = None,
         cache_dir: str | Path | None = None, fast: bool = True, drafter: str = "auto",
         draft_model: str | None = None, max_draft: int | None = None, draft_tokens: int | None = None,
         memory_budget: str | int | None = None, host_memory: str | int | None = None,
         profile: str | None = None, context: int | None = None, progress=None,
         drafter_weights: str = "auto", profile_dir: str | Path | None = None, compile: str = "off") -> Engine:
    """Load a model: None for the demo model, a local directory, a .gguf file or a hub repo id.

    drafter: auto (a model drafter if `draft_model` is given, else n-gram) | ngram | model | none.
    draft_model: a checkpoint sharing the target's tokenizer, or "self" (a quantized copy of
    the target); drafter_weights: exact | int8 | int4 | auto (int4 for self, else exact).
    draft_tokens: a fixed number of drafted tokens per round; None adapts it as the chat runs.
    memory_budget: what the engine may use on the device ("8GiB"); default: detected free memory.
    host_memory: what it may hold in host RAM for streamed layers ("32GiB"); default: available RAM.
    profile: None/"auto" picks the best that fits (resident-exact > resident-int8 >
    resident-int4 > streamed-exact), or a profile's name forces it. context: the longest conversation to plan memory for.
    The memory plan is made before any weight is read (`eng.plan`); a model that fits no
    profile is refused with the figures, instead of exhausting memory.
    compile: off | on | auto | cached — build the compiled decode step in the background
    (engine/compiled.py) and switch to it when ready; auto and on do so for a resident target
    with the fast forward (the others decode eagerly), on also says why not in
    `eng.compile_note`; cached only loads a step an earlier start built, never builds one."""
    if compile not in ("off", "on", "auto", "cached"):
        raise BadRequest(f"--compile {compile}: choose auto, on or off")
    _check_drafter(drafter, draft_model, drafter_weights)      # before loading anything: fail fast
    if draft_tokens is not None and not 0 <= draft_tokens <= 64:
        raise BadRequest(f"--draft-tokens {draft_tokens}: must be between 0 and 64")
    if max_draft is not None and not 0 <= max_draft <= 64:
        raise BadRequest(f"max_draft {max_draft}: must be between 0 and 64")
    cache_dir = Path(cache_dir) if cache_dir else None
    ckpt = _checkpoint.resolve(model, cache_dir)
    dev = hardware.pick_device(device)
    dt = _pick_dtype(dtype, dev, ckpt.path)
    if context is not None and context < 16:
        raise BadRequest(f"--context {context}: must be at least 16 tokens")
    drafter_shape = None
    if drafter in ("auto", "model") and draft_model:
        dweights = drafter_weights if drafter_weights != "auto" else ("int4" if draft_model == "self" else "exact")
        local = ckpt.path if draft_model == "self" else Path(draft_model).expanduser()
        if local.is_dir() and (local / "config.json").is_file():
            # The drafter's weights and KV cache count in the plan (a hub drafter is counted
            # once downloaded: `localchat doctor --draft-model`).
            drafter_shape = (planner.ModelShape.from_checkpoint(local, draft_model), dweights)
    plan_profiles = profiles.load_all(Path(profile_dir) if profile_dir else None)
    plan, host_room = _plan(ckpt, dev, dt, memory_budget, host_memory, cache_dir, profile, context, drafter_shape,
                            plan_profiles, dtype_given=dtype not in (None, "auto"))
    tokenizer = _load_tokenizer(ckpt.path)
    prof = profiles.find(plan_profiles, plan.chosen)
    if prof.placement == "streamed":
        row = plan.row(plan.chosen)
        target = load_streamed(ckpt.path, dev, dt, weight_budget=row.budget - (row.total - row.weights),
                               host_budget=host_room, context=row.context,
                               bandwidth=plan.bandwidth, progress=progress)
    elif prof.weights in ("int8", "int4"):
        target = load_quantized(ckpt.path, dev, prof.weights, group_size=prof.group_size, embeddings=prof.embeddings,
                                act_dtype=None if dtype in (None, "auto") else dt, cache_dir=cache_dir,
                                progress=progress)
    else:
        target = load_resident(ckpt.path, dev, dt, fast=fast, progress=progress)
    # The profile says how deep drafting may go (a streamed pass pays for depth: 16).
    eng = Engine(ckpt, tokenizer, target, max_draft=max_draft if max_draft is not None else prof.max_draft,
                 draft_tokens=draft_tokens)
    eng.plan = plan
    eng.set_drafter(drafter, draft_model, dtype=dtype, cache_dir=cache_dir, fast=fast, weights=drafter_weights)
    if compile != "off":
        eng.start_compile(cache_dir, build=compile != "cached")
    return eng


def quant_act_dtype(dev, requested=None) -> torch.dtype:
    """What a quantized target computes in: the requested dtype, else bf16 where the device
    has it natively (what load_quantized picks)."""
    return requested or hardware.default_dtype(dev, torch.bfloat16)


def _plan(ckpt, dev, dt, memory_budget, host_memory, cache_dir, profile, context,
          drafter=None, every=None, dtype_given: bool = False) -> tuple["planner.Plan", int]:
    """Plan before loading, and pick the target: the best runnable profile (by rank:
    resident exact > resident quantized > streamed exact) that fits with `context` tokens
    of KV cache (default 4096, or the model's own limit if smaller). Also returns the host
    RAM a streamed target may hold (none on a CPU: there the device memory is host memory
    and --vram is the whole budget)."""
    import json as _json
    from dataclasses import replace as _replace
    cfg = _json.loads((ckpt.path / "config.json").read_text())
    max_pos = int(cfg.get("max_position_embeddings") or 8192)
    shape = _replace(planner.ModelShape.from_checkpoint(ckpt.path, ckpt.name),
                     dtype_bytes=torch.finfo(dt).bits // 8)
    _checkpoint.check_tensors(ckpt.path)
    hw = hardware.detect(cache_dir, vram=memory_budget, ram=host_memory, device=str(dev))
    every = every or profiles.builtin()
    names = [p.name for p in every]
    forced = profile if profile not in (None, "auto") else None
    if forced and forced not in names:
        raise BadRequest(f"--profile {forced}: no such profile (have: auto, {', '.join(names)})")
    can = runnable(every)
    if forced and forced not in can:
        raise BadRequest(f"--profile {forced}: this version runs {', '.join(can)}; use one of those or auto")
    # tok/s bounds (and a streamed pass's compute time) from this machine's measured read rate
    bw = bandwidth.rates(bandwidth.measured(cache_dir or _checkpoint.default_cache_dir(), dev))
    plan = planner.make_plan(shape, hw, every, context=min(context or 4096, max_pos), force=forced,
                             runnable=can, bandwidth=bw, drafter=drafter[0] if drafter else None,
                             drafter_weights=drafter[1] if drafter else "exact",
                             quant_act_bytes=torch.finfo(quant_act_dtype(dev, dt if dtype_given else None)).bits // 8)
    if plan.chosen is None:
        raise BadRequest(f"{ckpt.name} does not fit the {planner.gb(hw.budget_bytes)} budget on {hw.device}: "
                         f"{plan.reason} Raise --vram, lower --context, or pick a smaller model (`localchat setup`)")
    host_room = 0
    if dev.type != "cpu":
        host_room = max(0, hw.host_available_bytes - plan.row(plan.chosen).margin)
    return plan, host_room


def _compilable(target) -> bool:
    """A resident target (exact or quantized) running the fast forward: its weights are
    fixed, so inductor can fold them into the graph."""
    return isinstance(target, ResidentTarget) and target.kind == "fast"


def _no_room_to_compile(target) -> str:
    """Why memory is too short for a compiled step ("" when it is not). The step keeps a
    copy of the weights of its own, repacked for its kernels, beside the eager forward's
    (prefill runs eagerly, verify passes on the forward's weights): about the weights' size
    again, in RAM on a CPU, on the device on a GPU."""
    need = int(target.weight_bytes() * 1.1) + (256 << 20)
    free = hardware.available_memory(target.device)
    if free is None or free >= need:
        return ""
    return (f"a compiled step needs {need / 2**30:.1f} GiB more memory (its own copy of the weights) "
            f"and {free / 2**30:.1f} GiB is free")


def _compiled_step(target, name: str, dtype, path, root: Path, device, **kw) -> compiled.CompiledStep:
    """The compiled step of `target` (model `name`, weights at `path`), kept in its
    package directory under `root` (engine/package_dirs.py)."""
    weights = _weights_label(target)
    stamp = package_dirs.weights_stamp(path) if path else ""
    return compiled.CompiledStep(target, root, package_dirs.cache_key(name, dtype, weights, device, stamp),
                                 lineage=package_dirs.lineage(name, dtype, weights, device), **kw)


def _weights_label(target) -> str:
    quant = getattr(target, "quant", None)
    if quant is None:
        return "exact"
    return quant.weights + (f" g{quant.group_size}" if quant.group_size else "")


def _check_drafter(kind: str, draft_model: str | None, weights: str = "auto") -> None:
    if kind not in DRAFTERS:
        raise BadRequest(f"--drafter {kind}: use one of {', '.join(DRAFTERS)}")
    if weights not in DRAFTER_WEIGHTS:
        raise BadRequest(f"--drafter-weights {weights}: use one of {', '.join(DRAFTER_WEIGHTS)}")
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
