"""engine.open(): resolve the model, plan its memory before a weight is read, load the
target the plan chose (resident exact, quantized, or streamed), the tokenizer and the
drafter."""
from __future__ import annotations

from pathlib import Path

import torch

from . import bandwidth, fidelity, hardware, kernels, planner, profiles
from . import checkpoint as _checkpoint
from .engine import Engine, _check_drafter, _load_tokenizer, _pick_dtype
from .errors import BadRequest
from .targets import routing
from .targets.gguf_target import gguf_why_not, load_gguf
from .targets.quantized import load_quantized
from .targets.resident import load_resident
from .targets.streamed import load_streamed

# The profiles this engine has targets for; the planner shows the others for what they need.
RUNNABLE = ("resident-gguf", "resident-exact", "resident-int8", "resident-int4", "streamed-exact")
RUNNABLE_KINDS = {("resident", "gguf"), ("resident", "exact"), ("resident", "int8"), ("resident", "int4"),
                  ("streamed", "exact")}


def runnable(profile_list, shape: planner.ModelShape | None = None, gguf_why: str = "") -> tuple[str, ...]:
    """Names of the profiles (built-in or a user's) this engine has a target for, for this
    model if `shape` is given (every profile runs hybrids too: transformers' own layers
    over our cache, over packed weights, or bound to streamed slots). resident-gguf runs a
    .gguf model whose blocks run here (`gguf_why` empty)."""
    return tuple(p.name for p in profile_list if (p.placement, p.weights) in RUNNABLE_KINDS
                 and (p.weights != "gguf" or shape is not None and shape.gguf_linear_bytes and not gguf_why))


def open(model: str | None = None, *, device: str = "auto", dtype: str | None = None,
         cache_dir: str | Path | None = None, fast: bool = True, drafter: str = "auto",
         draft_model: str | None = None, max_draft: int | None = None, draft_tokens: int | None = None,
         memory_budget: str | int | None = None, host_memory: str | int | None = None,
         profile: str | None = None, context: int | None = None, progress=None,
         drafter_weights: str = "auto", profile_dir: str | Path | None = None) -> Engine:
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
    profile is refused with the figures, instead of exhausting memory."""
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
    drafter_shape = "mtp" if drafter == "mtp" else None      # the MTP layer's shape is the target's (_plan)
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
    if prof.weights != "gguf":
        _checkpoint.import_weights(ckpt.path)        # a GGUF model's float32 copy, on first need
    if (prof.placement, prof.weights) not in (("resident", "exact"), ("resident", "gguf")):
        # The streamed and quantized targets read tensors by name from the files; the
        # resident loader checks what transformers loaded (its load report) instead.
        _checkpoint.check_tensors(ckpt.path)
    if prof.weights == "gguf":
        target = load_gguf(ckpt.gguf, ckpt.path)
    elif prof.placement == "streamed":
        row = plan.row(plan.chosen)
        target = load_streamed(ckpt.path, dev, dt, weight_budget=row.budget - (row.total - row.weights),
                               host_budget=host_room, context=row.context,
                               bandwidth=plan.bandwidth, progress=progress)
    elif prof.weights in ("int8", "int4"):
        row = plan.row(plan.chosen)
        keep = texts = None
        if row.mapped_experts:
            # the experts that fit stay in memory, the most used first (targets/routing.py)
            keep = row.kept_experts
            texts = fidelity.held_texts(tokenizer, routing.TOKENS)
        target = load_quantized(ckpt.path, dev, prof.weights, group_size=prof.group_size, embeddings=prof.embeddings,
                                head=prof.head, act_dtype=None if dtype in (None, "auto") else dt, cache_dir=cache_dir,
                                progress=progress, experts_in_memory=keep, routing_texts=texts)
    else:
        target = load_resident(ckpt.path, dev, dt, fast=fast, progress=progress)
    # The profile says how deep drafting may go (a streamed pass pays for depth: 16).
    eng = Engine(ckpt, tokenizer, target, max_draft=max_draft if max_draft is not None else prof.max_draft,
                 draft_tokens=draft_tokens)
    eng.plan = plan
    target.prefill_chunk = plan.row(plan.chosen).prefill_chunk    # what the plan counted
    eng.context_note = _bound_context(target, plan.row(plan.chosen), context)
    eng.set_drafter(drafter, draft_model, dtype=dtype, cache_dir=cache_dir, fast=fast, weights=drafter_weights)
    return eng


def plan_model(model: str | None = None, *, device: str = "auto", dtype: str | None = None,
               memory_budget: str | int | None = None, host_memory: str | int | None = None,
               profile: str | None = None, context: int | None = None, cache_dir: str | Path | None = None,
               profile_dir: str | Path | None = None) -> "planner.Plan":
    """The memory plan open() would make for `model` with these figures, without loading
    it (a model a server is about to load: what it needs alone on the machine)."""
    cache_dir = Path(cache_dir) if cache_dir else None
    ckpt = _checkpoint.resolve(model, cache_dir)
    dev = hardware.pick_device(device)
    dt = _pick_dtype(dtype, dev, ckpt.path)
    every = profiles.load_all(Path(profile_dir) if profile_dir else None)
    return _plan(ckpt, dev, dt, memory_budget, host_memory, cache_dir, profile, context, None, every,
                 dtype_given=dtype not in (None, "auto"))[0]


def measured_routing(path: Path, shape: planner.ModelShape, cache_dir: Path | None = None):
    """A mixture's measured expert use (targets/routing.py), as make_plan takes it; None for
    a dense model, or one not measured yet (uniform routing is planned)."""
    if not shape.expert_params:
        return None
    return routing.cached(Path(cache_dir) if cache_dir else _checkpoint.default_cache_dir(), path)


def quant_act_dtype(dev, requested=None) -> torch.dtype:
    """What a quantized target computes in: the requested dtype, else bf16 where the device
    has it natively (what load_quantized picks)."""
    return requested or kernels.default_dtype(dev, torch.bfloat16)


def _bound_context(target, row, context: int | None) -> str:
    """Set how long a conversation may grow (planner.context_limit); why, for describe()."""
    limit, why = planner.context_limit(row, target.max_positions, context)
    target.max_positions = target.cache.max_positions = limit
    return why


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
    shape = _replace(planner.ModelShape.of(ckpt), dtype_bytes=torch.finfo(dt).bits // 8)
    hw = hardware.detect(cache_dir, vram=memory_budget, ram=host_memory, device=str(dev))
    every = every or profiles.builtin()
    names = [p.name for p in every]
    forced = profile if profile not in (None, "auto") else None
    if forced and forced not in names:
        raise BadRequest(f"--profile {forced}: no such profile (have: auto, {', '.join(names)})")
    # A GGUF model runs its own blocks unless another dtype is asked for (they compute in float32)
    gguf_why = gguf_why_not(ckpt.gguf) if ckpt.gguf is not None else "not a .gguf model"
    if not gguf_why and dtype_given and dt != torch.float32:
        gguf_why = f"--dtype {str(dt).removeprefix('torch.')} asks for a converted copy"
    can = runnable(every, shape, gguf_why)
    if forced and forced not in can:
        if forced == "resident-gguf":
            raise BadRequest(f"--profile resident-gguf: {gguf_why}; use one of {', '.join(can)} or auto")
        raise BadRequest(f"--profile {forced}: this version runs {', '.join(can)}; use one of those or auto")
    # tok/s bounds (and a streamed pass's compute time) from this machine's measured read rate
    bw = bandwidth.rates(bandwidth.measured(cache_dir or _checkpoint.default_cache_dir(), dev))
    if drafter == "mtp":
        from .models import mtp
        why = mtp.why_not_at(ckpt.path)
        if why:
            raise BadRequest(f"--drafter mtp: {why}; use --drafter ngram or --draft-model")
        drafter = (shape.mtp_drafter(min(context or 4096, max_pos)), "profile")
    plan = planner.make_plan(shape, hw, every, context=min(context or 4096, max_pos), force=forced,
                             runnable=can, bandwidth=bw, drafter=drafter[0] if drafter else None,
                             drafter_weights=drafter[1] if drafter else "exact",
                             quant_act_bytes=torch.finfo(quant_act_dtype(dev, dt if dtype_given else None)).bits // 8,
                             routing=measured_routing(ckpt.path, shape, cache_dir))
    if plan.chosen is None:
        raise BadRequest(f"{ckpt.name} does not fit the {planner.gb(hw.budget_bytes)} budget on {hw.device}: "
                         f"{plan.reason} Raise --vram, lower --context, or pick a smaller model (`localchat setup`)")
    host_room = 0
    if dev.type != "cpu":
        host_room = max(0, hw.host_available_bytes - plan.row(plan.chosen).margin)
    return plan, host_room
