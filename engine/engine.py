"""The Engine: one loaded model (a target and a tokenizer), who drafts for it, and the pass
costs every chat measures. `loading.open()` makes one from a plan; `Engine.chat()` starts
a conversation (session.py)."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from . import checkpoint as _checkpoint
from . import kernels, planner
from .kernels import dispatch
from .drafters import ModelDrafter, MtpDrafter, NgramDrafter, NoDrafter, check_compatible
from .cache import RecurrentCache
from .errors import BadRequest, CheckpointError
from .sampling import model_defaults
from .session import Chat
from .speculative import DraftController, PassCosts
from .targets.qcache import source_identity
from .targets.gguf_target import gguf_why_not, load_gguf
from .targets.quantized import load_quantized
from .targets.resident import checkpoint_dtype, load_resident

DRAFTERS = ("auto", "ngram", "model", "mtp", "none")
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
        # what an answer samples with where the app or the request does not say (send()'s
        # own defaults stay greedy): the model's recommendation, and where it came from
        self.sampling, self.sampling_note = model_defaults(ckpt.path)
        self.cache_owner: Chat | None = None
        self.plan: planner.Plan | None = None   # the memory plan the model was loaded under
        self.drafter = drafter or (NgramDrafter() if _can_draft(target) else NoDrafter())
        self.max_draft = max_draft
        if isinstance(target.cache, RecurrentCache):
            # a verify pass records up to max_draft + 1 positions per recurrent layer (replay.py)
            target.cache.replay_capacity = max_draft + 1
        # on a GPU, steps and verify passes as one compiled graph as wide as the widest verify pass
        use_graph = getattr(getattr(target, "impl", None), "use_graph_step", None)
        if use_graph is not None:
            use_graph(max_draft + 1)
        self.draft_tokens = draft_tokens       # a fixed k; None = adaptive
        self.costs = PassCosts()               # measured by every chat, shared by all
        self.drafter_note = ""                 # why the drafter is not the one asked for
        self._mtp_layer = None                 # the checkpoint's MTP layer, once --drafter mtp loaded it
        # where chats keep their caches when they switch away, and find them again
        # (engine.resume.ResumeStore); None: conversations resume by prefilling
        self.resume = None
        self._resume_key: tuple[str, str] | None = None
        self.context_note = "the model's own"    # why the context is as long as it is (loading._bound_context)

    def set_drafter(self, kind: str = "auto", draft_model: str | None = None, *, dtype: str | None = None,
                    cache_dir: Path | None = None, fast: bool = True, weights: str = "auto") -> None:
        """Choose who drafts: auto (model if `draft_model` is given, else ngram) | ngram | model |
        mtp (the checkpoint's own multi-token-prediction layer) | none.
        A model drafter is loaded here and checked against the target's tokenizer.
        draft_model "self": a quantized copy of the target drafts for it (when no small model
        shares its tokenizer). weights: exact | int8 | int4 | auto (int4 for self, else exact)."""
        _check_drafter(kind, draft_model, weights)
        old = getattr(self, "drafter", None)
        try:
            self._set_drafter(kind, draft_model, dtype, cache_dir, fast, weights)
        finally:
            if old is not None and old is not self.drafter and hasattr(old, "close"):
                old.close()                     # an MTP drafter's hook on the target

    def _set_drafter(self, kind, draft_model, dtype, cache_dir, fast, weights) -> None:
        self.drafter_note = ""
        if kind != "none" and not _can_draft(self.target):
            self.drafter_note = ("this model's recurrent layers are of a kind speculation cannot roll back "
                                 "(engine/models/replay.py knows gated delta-nets and short convs)")
            kind = "none"
        if kind == "none":
            self.drafter = NoDrafter()
        elif kind == "ngram" or (kind == "auto" and not draft_model):
            self.drafter = NgramDrafter()
        elif kind == "mtp":
            self.drafter = MtpDrafter(self.target, _load_mtp(self), self.name)
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
            if weights == "exact" and dckpt.gguf is not None and not gguf_why_not(dckpt.gguf) \
                    and dtype in (None, "auto", "float32", "fp32"):
                dtarget = load_gguf(dckpt.gguf, dckpt.path)        # a .gguf drafter runs its own blocks
            elif weights == "exact":
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
            self.drafter = ModelDrafter(dtarget, name, self.target.vocab_size)
        self.costs.new_drafter()

    def has_mtp(self) -> bool:
        """Whether the checkpoint carries a multi-token-prediction layer `--drafter mtp` runs."""
        from .models import mtp
        return not mtp.why_not_at(self.checkpoint.path)

    def new_controller(self) -> DraftController:
        if self.drafter.kind == "none":
            return DraftController(max_draft=0, fixed=0)
        prior = self.costs.acceptance if self.costs.acceptance is not None else 0.5
        return DraftController(max_draft=self.max_draft, fixed=self.draft_tokens, costs=self.costs,
                               prior_acceptance=prior)

    def chat(self, system: str | None = None) -> Chat:
        return Chat(self, system)

    def resume_key(self) -> tuple[str, str]:
        """What a kept cache must match to be used (engine/resume.py): the weights' identity,
        and how this engine computes its cache."""
        if self._resume_key is None:
            c, t = self.target.cache, self.target
            k = self.kernels
            how = [self.plan.chosen if self.plan else None, _weights_label(t), t.kind, str(self.dtype),
                   str(self.device), k.build, {f: {p.value: d for p, d in by.items()} for f, by in k.products.items()},
                   _graph_note(self), type(c).__name__, c.layers, c.kv_heads, c.head_dim, str(c.dtype)]
            self._resume_key = (source_identity(self.checkpoint.path)[:16],
                                hashlib.sha256(json.dumps(how).encode()).hexdigest()[:8])
        return self._resume_key

    @property
    def kernels(self) -> dispatch.Kernels:
        """The kernel policy as this engine runs it (kernels/dispatch.py): the product of each
        of its weight formats in each kind of pass, whether a verify pass's rows are
        one-token steps, and what runs whole layers or passes. What describe(), `doctor` and
        the tests read."""
        impl = getattr(self.target, "impl", None)
        whole = {"layer_kernel": getattr(impl, "layer_kernel_note", "not this forward")}  # '' when it runs
        for key, note in (("graph_step", _graph_note(self)), ("experts", _experts_note(self)),
                          ("delta_net", getattr(impl, "delta_net_note", "")),
                          ("hybrid_layers", getattr(impl, "hybrid_note", ""))):
            if note:
                whole[key] = note
        rows = getattr(impl, "rows", None)
        return dispatch.Kernels.of(_weight_formats(self.target), self.device, self.dtype,
                                   rows.reason if rows is not None else "", whole)

    def claim_cache(self, chat: Chat) -> None:
        """One KV cache per engine: a chat that did not fill it last starts from empty (the
        one that did keeps its cache in the resume store, where there is one)."""
        if self.cache_owner is not chat:
            if self.cache_owner is not None:
                self.cache_owner.keep()
            self.target.cache.rollback(0)
            chat.cached_ids = []
            self.cache_owner = chat

    def describe(self) -> dict:
        t = self.target
        return {"model": self.name, "path": str(self.checkpoint.path), "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "forward": t.kind,
                "weights_bytes": t.weight_bytes(), "context_max": t.max_positions, "context_note": self.context_note,
                "drafter": (self.drafter.kind if self.drafter.kind not in ("model", "mtp")
                            else f"{self.drafter.kind}:{self.drafter.name}"),
                "draft_tokens": self.draft_tokens if self.draft_tokens is not None else "adaptive",
                "profile": self.plan.chosen if self.plan else None,
                "weights": _weights_label(t), "drafter_note": self.drafter_note,
                # how every product and pass runs here: kernels/dispatch.py's policy
                **self.kernels.as_dict(),
                **({"streaming": t.describe()} if hasattr(t, "stream_stats") else {})}


def _graph_note(eng) -> str:
    """'' off a GPU; there, whether steps and verify passes run as one compiled graph."""
    impl = getattr(eng.target, "impl", None)
    graph = getattr(impl, "_graph", None)
    return f"compiled, {graph.width} rows a pass" if graph is not None else getattr(impl, "graph_note", "")


def _weight_formats(target) -> list[str]:
    """The formats of the matrices the target's forward multiplies (kernels/dispatch.py's
    names: a dense dtype, int8, int4, a GGUF block type), the most frequent first."""
    found: Counter = Counter()
    impl = getattr(target, "impl", None)

    def add(w) -> None:
        fmt = getattr(w, "format", None)
        if isinstance(fmt, str):
            found.update(fmt.split("+"))
        elif isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point():
            found[str(w.dtype).removeprefix("torch.")] += 1

    for layer in getattr(impl, "layers", None) or []:
        for w in vars(layer).values():
            add(w)
    add(getattr(impl, "head", None))
    model = getattr(impl, "model", None)
    for m in model.modules() if isinstance(model, torch.nn.Module) else []:
        if isinstance(m, torch.nn.Linear):
            add(m.weight)
        add(getattr(m, "w", None))                        # a packed linear (targets/module_quant.py)
        for experts in (getattr(m, "gate_up", None), getattr(m, "down", None)):
            for w in experts if isinstance(experts, list) else []:
                add(w)
    formats = [f for f, _ in found.most_common() if f in dispatch.DENSE or f in dispatch.QUANTIZED]
    return formats or [str(target.dtype).removeprefix("torch.")]


def _experts_note(eng) -> str:
    """Where a mixture's routed experts run, and how many of their bytes the plan left on disk."""
    note = getattr(getattr(eng.target, "impl", None), "experts_note", "")
    row = eng.plan.row(eng.plan.chosen) if eng.plan and eng.plan.chosen else None
    if note and getattr(eng.target, "mapped_experts", False):
        return note + "; streamed: only the experts a pass routes to are read, from the checkpoint's files"
    if note and row is not None and row.mapped_experts:
        placed = getattr(eng.target, "experts_placement", "")
        note += (f"; {placed}, {planner.gb(row.mapped_experts)} from the quantized cache on disk" if placed else
                 f"; {planner.gb(row.mapped_experts)} of them memory-mapped from the quantized cache on disk")
    return note


def _can_draft(target) -> bool:
    """Whether speculation can take back rejected drafts on this target: any KV cache; a
    recurrent one when every recurrent layer has a replay (engine/models/replay.py)."""
    cache = target.cache
    return not isinstance(cache, RecurrentCache) or len(cache.replays) == len(cache.states) > 0


def _weights_label(target) -> str:
    formats = getattr(target, "formats", None)           # a GGUF file's blocks, as stored
    if formats:
        odd = getattr(target, "converted", None)
        return "GGUF " + ", ".join(k for k, _ in formats.most_common()) + (
            f" ({', '.join(odd)} converted at load)" if odd else "")
    quant = getattr(target, "quant", None)
    if quant is None:
        return "exact"
    return (quant.weights + (f" g{quant.group_size}" if quant.group_size else "")
            + (f", head {quant.head}" if quant.head != quant.weights else ""))


def _load_mtp(eng):
    """The target checkpoint's multi-token-prediction layer, or a one-line refusal."""
    from .models import mtp
    from .targets.module_exact import load_mtp
    model = getattr(getattr(eng.target, "impl", None), "model", None)
    cfg = getattr(getattr(model, "config", None), "text_config", None) or getattr(model, "config", None)
    why = mtp.why_not_at(eng.checkpoint.path)
    if not why and not hasattr(getattr(model, "model", None), "norm"):
        why = "the target's forward does not expose its hidden states"
    if why:
        raise BadRequest(f"--drafter mtp: {why}; use --drafter ngram or --draft-model")
    if eng._mtp_layer is None:                # kept: switching drafters back and forth loads it once
        quant = getattr(eng.target, "quant", None)     # a quantized target: the layer in its format
        eng._mtp_layer = load_mtp(eng.checkpoint.path, model.model, cfg, eng.target.device, eng.target.cache.dtype,
                                  quant.weights if quant else "exact", (quant.group_size if quant else None) or 32)
    return eng._mtp_layer


def _check_drafter(kind: str, draft_model: str | None, weights: str = "auto") -> None:
    if kind not in DRAFTERS:
        raise BadRequest(f"--drafter {kind}: use one of {', '.join(DRAFTERS)}")
    if weights not in DRAFTER_WEIGHTS:
        raise BadRequest(f"--drafter-weights {weights}: use one of {', '.join(DRAFTER_WEIGHTS)}")
    if kind == "model" and not draft_model:
        raise BadRequest("--drafter model needs --draft-model PATH_OR_REPO")


def _pick_dtype(dtype: str | None, dev, path: Path):
    if dtype in (None, "auto"):
        return kernels.default_dtype(dev, checkpoint_dtype(path))
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
