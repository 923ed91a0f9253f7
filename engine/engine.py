"""The Engine: one loaded model (a target and a tokenizer), who drafts for it, the pass
costs every chat measures, and the background-compiled step. `loading.open()` makes one
from a plan; `Engine.chat()` starts a conversation (session.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from . import checkpoint as _checkpoint
from . import hardware, planner
from .compile import exported, package_dirs
from .compile import step as compiled
from .drafters import ModelDrafter, NgramDrafter, NoDrafter, check_compatible
from .cache import RecurrentCache
from .errors import BadRequest, CheckpointError
from .session import Chat
from .speculative import DraftController, PassCosts
from .targets.quantized import load_quantized
from .targets.resident import ResidentTarget, checkpoint_dtype, load_resident

DRAFTERS = ("auto", "ngram", "model", "none")
DRAFTER_WEIGHTS = ("auto", "exact", "int8", "int4")

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
        self.drafter = drafter or (NgramDrafter() if _can_draft(target) else NoDrafter())
        self.max_draft = max_draft
        if isinstance(target.cache, RecurrentCache):
            # a verify pass records up to max_draft + 1 positions per recurrent layer (replay.py)
            target.cache.replay_capacity = max_draft + 1
        self.draft_tokens = draft_tokens       # a fixed k; None = adaptive
        self.costs = PassCosts()               # measured by every chat, shared by all
        self.compile_note = ""
        self.drafter_note = ""                 # why the drafter is not the one asked for
        self._compile_args: tuple[Path, bool] | None = None    # (cache root, build) once compiling is on

    def set_drafter(self, kind: str = "auto", draft_model: str | None = None, *, dtype: str | None = None,
                    cache_dir: Path | None = None, fast: bool = True, weights: str = "auto") -> None:
        """Choose who drafts: auto (model if `draft_model` is given, else ngram) | ngram | model | none.
        A model drafter is loaded here and checked against the target's tokenizer.
        draft_model "self": a quantized copy of the target drafts for it (when no small model
        shares its tokenizer). weights: exact | int8 | int4 | auto (int4 for self, else exact)."""
        _check_drafter(kind, draft_model, weights)
        self.drafter_note = ""
        if kind != "none" and not _can_draft(self.target):
            self.drafter_note = ("this model's recurrent layers are of a kind speculation cannot roll back "
                                 "(engine/models/replay.py knows gated delta-nets and short convs)")
            kind = "none"
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
            if isinstance(dtarget.cache, RecurrentCache):
                if not _can_draft(dtarget):
                    self.drafter_note = (f"{name}: its recurrent layers are of a kind replay does not know; "
                                         "drafting with n-grams instead")
                    self.drafter = NgramDrafter()
                    self.costs.new_drafter()
                    return
                # A hybrid drafter records its own steps (replayed on its cache as the
                # target's are): up to max_draft of them and the two a round starts with.
                dtarget.cache.replay_capacity = self.max_draft + 2
            self.drafter = ModelDrafter(dtarget, name, self.target.vocab_size, dckpt.path)
        self.costs.new_drafter()
        step = getattr(self.target, "compiled", None)
        if step is not None:
            # Compiling is on: the new drafter's step, and the verify buckets it fills.
            step.want_rows(self._verify_rows())
            self._compile_drafter(*self._compile_args)

    def start_compile(self, cache_dir: Path | None = None, build: bool = True, late: bool = False) -> bool:
        """Compile the decode step of the target, then of a model drafter, in the
        background (engine/compile/step.py). Resident targets with the fast forward can, exact
        or quantized; streamed targets decode eagerly (`compile_note` says why).
        build=False only loads steps an earlier start left in the cache; late=True loads them
        once the first answer's first token is out (engine/compile/worker.py)."""
        t = self.target
        if not _compilable(t):
            self.compile_note = (f"the {_weights_label(t)} target runs transformers' own layers (a hybrid or another "
                                 "architecture) and decodes eagerly: the compiled step traces the Llama-family forward"
                                 if t.kind == "transformers" else
                                 f"the {_weights_label(t)} target decodes eagerly: its int4 weights are in the form "
                                 "localchat's own int4 kernel reads, which a compiled step cannot call"
                                 if _own_int4(t) else
                                 f"the {_weights_label(t)} {t.kind} target decodes eagerly")
            return False
        root = cache_dir or _checkpoint.default_cache_dir()
        self._compile_args = (root, build, late)
        if t.compiled is None:
            short, rows = _no_room_to_compile(t), self._verify_rows()
            if short:
                # Verify passes run on the forward's own weights: they need no room.
                self.compile_note = f"the target decodes eagerly: {short}"
                if not rows:
                    return False
            t.compiled = _compiled_step(t, self.name, self.dtype, self.checkpoint.path, root, self.device,
                                        build=build, rows=rows, step=not short, late=late)
            t.compiled.start()
        self._compile_drafter(root, build, late)
        return True

    def _verify_rows(self) -> tuple[int, ...]:
        """The verify-pass buckets worth compiling for this drafter: those a draft of up
        to max_draft tokens fills (a wider bucket would mostly verify padding)."""
        if self.drafter.kind == "none":
            return ()
        widest = (self.draft_tokens if self.draft_tokens is not None else self.max_draft) + 1
        return tuple(r for r in exported.VERIFY_ROWS if r <= widest)

    def _compile_drafter(self, root: Path, build: bool, late: bool = False) -> None:
        d = self.drafter
        if d.kind == "model" and _compilable(d.target) and d.target.compiled is None \
                and not _no_room_to_compile(d.target):
            d.target.compiled = _compiled_step(d.target, d.name, d.target.dtype, d.path, root, self.device,
                                               build=build, late=late)
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
                "weights": _weights_label(t), "drafter_note": self.drafter_note,
                # whether a verify pass's rows are, bit for bit, one-token steps (models/rows.py)
                "verify_rows": getattr(getattr(t, "impl", None), "rows", None) and t.impl.rows.reason,
                # why one-token steps do not run the layer kernel ("" when they do)
                "layer_kernel": getattr(getattr(t, "impl", None), "layer_kernel_note", "not this forward"),
                # a mixture of experts: whether its routed experts run in the kernel (models/moe.py)
                **({"experts": note} if (note := _experts_note(self)) else {}),
                # a hybrid: whether its gated delta-net layers step in C (models/delta_net.py)
                **({"delta_net": note} if (note := getattr(getattr(t, "impl", None), "delta_net_note", ""))
                   else {}),
                **({"streaming": t.describe()} if hasattr(t, "stream_stats") else {})}


def _experts_note(eng) -> str:
    """Where a mixture's routed experts run, and how many of their bytes the plan left on disk."""
    note = getattr(getattr(eng.target, "impl", None), "experts_note", "")
    row = eng.plan.row(eng.plan.chosen) if eng.plan and eng.plan.chosen else None
    if note and row is not None and row.mapped_experts:
        note += f"; {row.mapped_experts / 1e9:.2f} GB of them memory-mapped from the quantized cache on disk"
    return note


def _can_draft(target) -> bool:
    """Whether speculation can take back rejected drafts on this target: any KV cache; a
    recurrent one when every recurrent layer has a replay (engine/models/replay.py)."""
    cache = target.cache
    return not isinstance(cache, RecurrentCache) or len(cache.replays) == len(cache.states) > 0


def _compilable(target) -> bool:
    """A resident target (exact or quantized) running the fast forward: its weights are
    fixed, so inductor can fold them into the graph. Not int4 weights in the canonical
    form engine/kernels/q4.c reads: a traced step would dequantize them (a bf16 step at
    four times the reads), while the eager step runs whole layers in one call."""
    return isinstance(target, ResidentTarget) and target.kind == "fast" and not _own_int4(target)


def _own_int4(target) -> bool:
    """Whether the target's int4 weights are in localchat's own kernel's form (qweights.Int4Weight)."""
    layers = getattr(getattr(target, "impl", None), "layers", None) or []
    return any(getattr(m, "canonical", False) for w in layers[:1] for m in vars(w).values())


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
    package directory under `root` (engine/compile/package_dirs.py)."""
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
