"""A target whose exact weights stay on disk (or in host memory) and visit the device one
layer at a time: how a model larger than the device answers without changing a weight.

The pieces:
- layer_index.py: where every tensor is in the files, how a layer is laid out in a slot;
- planner.place_streamed: which units stay resident, which sit in host memory, which are
  read from disk on every pass (from the budget);
- prefetch.py: the reader thread that fills reusable slots `depth` units ahead.
This file runs the pass: the same Llama-family forward as the resident target, with its
layer weights taken from a resident buffer or a slot, so the logits are the resident
model's bit for bit. The KV cache stays on the device: a token costs one streamed pass,
and a verify pass of k+1 tokens costs one streamed pass too — speculation multiplies.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import planner
from ..errors import BadRequest, EngineError, UnsupportedModel
from ..kernels import dispatch, layer_kernel
from ..models import llama_family, moe
from . import layer_index, streamed_modules
from .resident import ResidentTarget
from .prefetch import Counters, Filler, Files, Ledger, Prefetcher, Slot, byte_view


@dataclass(frozen=True)
class SplitCheck:
    """How many threads one-token steps compute on (None: torch's setting, every thread)
    out of `full`, and a sentence saying why."""
    threads: int | None
    reason: str
    full: int = 0

    @property
    def short(self) -> str:
        """The choice in a few words, for a stats line."""
        if self.threads is None:
            return f"steps on all {self.full} threads (torch's kernels)"
        return f"steps on {self.threads} of {self.full} threads (same bits on any count)"


@dataclass(frozen=True)
class StreamStats:
    """Cumulative figures of a streamed target (an answer's are the difference of two)."""
    passes: int = 0
    pass_seconds: float = 0.0
    disk_bytes: int = 0
    host_bytes: int = 0
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    expert_bytes: int = 0        # a mixture's routed experts read from the files' mapping

    @property
    def streamed_bytes(self) -> int:
        return self.disk_bytes + self.host_bytes

    def minus(self, other: "StreamStats") -> "StreamStats":
        return StreamStats(*(a - b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def gbps(self) -> float:
        """Effective read rate of the streamed bytes while the reader was busy."""
        return self.streamed_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    @property
    def hidden(self) -> float:
        """Share of the transfer time that compute did not wait for."""
        if not self.load_seconds:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.wait_seconds / self.load_seconds))


class StreamedForward(llama_family.LlamaFamilyForward):
    """The Llama-family forward with its weights fetched per unit."""

    def __init__(self, target: "StreamedTarget", cfg, rotary, scaling: float):
        self._setup(cfg, target.cache, rotary, scaling)
        self.t = target
        self.norm = target.norm
        self.layers = []
        # one-token steps and verify passes: each layer in layer.c as it arrives, the bits
        # of the resident target's stack (whose weights the same checks pass per layer)
        self.layer_kernel_note = (layer_kernel.why_not_for(self, self.cache.dtype) if self._kernel
                                  else "the row kernel does not run here")
        if not self.layer_kernel_note:
            self._one = layer_kernel.LayerStack(self, self.cache.dtype, hidden=cfg.hidden_size)

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def iter_layers(self):
        t = self.t
        for unit in t.index.layer_units:
            flat = t.resident.get(unit.name)
            if flat is not None:
                yield t.resident_views[unit.name]
                continue
            slot = t.prefetcher.take(unit)
            try:
                yield slot.views
            finally:
                t.prefetcher.give(slot)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.t.embed_rows(ids)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        return self.t.head(x, self.dense[self.pass_kind].pick(x.shape[0]))

    def steps_in_kernels(self, views) -> bool:
        """Whether a one-token step runs in localchat's kernels from the first layer to the
        logits (layer.c a layer at a time, its final norm, the head through the row kernel),
        for layers laid out as `views` (a slot's: every unit shares the layout). Those
        compute every output on one thread, summing in one order, so a step's bits do not
        depend on the thread count; torch's do (its attention over one query row adds the
        threads' partial sums in their order)."""
        if self._one is not None and self._one_fits is None:
            self._one_fits = not layer_kernel.why_not_weights([views], self.cache.dtype)
        return self._one is not None and self._kernel and bool(self._one_fits)


class StreamedTarget:
    """Same interface as ResidentTarget: forward(ids, all_logits), cache, weight_bytes()."""

    def head(self, x: torch.Tensor, product: str = "torch") -> torch.Tensor:
        """The output head over normed hidden rows, chunk by chunk (resident or streamed), by
        `product`, the kernel policy's for the forward's pass (kernels/dispatch.py)."""
        t = self
        parts = []
        for unit in t.index.head_units:
            flat = t.resident.get(unit.name)
            pad = t.pad_rows             # as the resident head's product (models/rows.py)
            if flat is not None:
                parts.append(dispatch.dense_mm(x, flat[:unit.numel].view(unit.rows, -1).t(), None, product, pad))
                continue
            slot = t.prefetcher.take(unit)
            try:
                parts.append(dispatch.dense_mm(x, slot.flat[:unit.numel].view(unit.rows, -1).t(), None, product, pad))
            finally:
                t.prefetcher.give(slot)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, weight_budget: int,
                 host_budget: int = 0, depth: int = planner.PREFETCH_DEPTH, context: int | None = None,
                 bandwidth: dict | None = None, slot_numel: int | None = None, progress=None):
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        cfg._attn_implementation = "sdpa"
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                skeleton = AutoModelForCausalLM.from_config(cfg)     # shapes and module code, no memory
        except ValueError:
            raise UnsupportedModel(f"{path}: {cfg.model_type!r} is not a causal language model transformers "
                                   "can build; pick another model") from None
        # The Llama family runs the fast forward over slot views; any other model (a
        # hybrid) runs transformers' layers bound to the slots (streamed_modules.py).
        self.modules = llama_family.can_run(skeleton) is not None
        self.path = Path(path)
        self.kind = "streamed"
        self.prefill_chunk = planner.STREAMED_PREFILL_CHUNK    # the plan's, when loaded under one
        self.fallback_reason = None
        self.depth = depth
        self.bandwidth = dict(planner.DEFAULT_BANDWIDTH, **(bandwidth or {}))
        self.mapped_experts = self.modules and maps_experts(self.path, skeleton, device, dtype)
        if self.modules:
            self.index = streamed_modules.build(self.path, skeleton, slot_numel, self.mapped_experts)
            cfg = skeleton.config
        else:
            self.index = layer_index.build(self.path, cfg.num_hidden_layers,
                                           bool(getattr(cfg, "tie_word_embeddings", False)), slot_numel)
        # The KV cache is capped at the planned context: the budget was planned for it.
        model_max = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        ResidentTarget._setup(self, cfg, device, dtype, 1024, min(model_max, context) if context else model_max)
        self.weight_budget, self.host_budget = weight_budget, host_budget
        self._progress = progress or (lambda what, done, total: None)
        self._place(weight_budget, host_budget)
        rotary = type(skeleton.model.rotary_emb)(config=cfg).to(device)
        if self.modules:
            skeleton.model.rotary_emb = rotary
            streamed_modules.bind(skeleton, self.index.rest_fields, self.norm)     # the final norm and the like
            mapped = streamed_modules.expert_views(self.index) if self.mapped_experts else None
            self.impl = streamed_modules.StreamedModulesForward(self, skeleton.eval(), mapped)
        else:
            self.impl = StreamedForward(self, cfg, rotary, skeleton.model.layers[0].self_attn.scaling)
        # the experts kernels that read from the files' mapping (what stream_stats counts)
        self._mapped_kernels = ([e.kernel for _, e in moe.blocks(self.impl.model)
                                 if getattr(getattr(e, "kernel", None), "expert_bytes", 0)]
                                if self.mapped_experts else [])
        self.pad_rows = self.impl.rows.pad        # one-row products as two (models/rows.py)
        self._passes, self._pass_seconds = 0, 0.0
        self._retried_oom = False
        self.split_threads = True     # _compute_threads; benchmarks/streamed.py compares without
        self.split: SplitCheck | None = None
        self._check_split()

    # -- placement and loading
    def _place(self, weight_budget: int, host_budget: int) -> None:
        idx = self.index
        files = Files(idx.files)
        self.filler = Filler(files, self.device, self.dtype)
        self.placement = placement(idx, self.filler, weight_budget, host_budget, self.depth)
        staging = max(self.filler.staging_bytes(u) for u in idx.units)
        embed_bytes = self.placement.embed_bytes
        if not self.placement.fits:
            raise BadRequest(f"{self.path.name}: streaming needs at least {planner.gb(self.placement.min_budget)} "
                             f"for weights (the largest unit twice plus buffers), the budget leaves "
                             f"{planner.gb(weight_budget)}; raise --vram to at least "
                             f"{planner.gb(self.placement.min_budget + self.cache.bytes_per_token() * 2048)}")
        self.ledger = Ledger(weight_budget)
        self.host_ledger = Ledger(host_budget)
        files.open()
        try:
            rest = idx.norm_unit()
            self.norm = self.ledger.alloc(rest.numel, self.dtype, self.device)
            self._load_into(rest, self.norm)
            self.resident: dict[str, torch.Tensor] = {}
            self.resident_views = {}
            self.host: dict[str, torch.Tensor | None] = {}
            total = len(idx.units)
            for i, unit in enumerate(idx.units):
                if i in self.placement.resident:
                    flat = self.ledger.alloc(unit.numel, self.dtype, self.device)
                    self._load_into(unit, flat)
                    self.resident[unit.name] = flat
                    if unit.kind == "layer" and idx.layout is not None:
                        self.resident_views[unit.name] = idx.layout.weights(flat)
                elif i in self.placement.host:
                    host = self.host_ledger.alloc(unit.file_bytes, torch.uint8, torch.device("cpu"),
                                                  pin=self.device.type == "cuda")
                    self.filler.read_to_host(unit, host)
                    self.host[unit.name] = host
                self._progress(unit.name, i + 1, total)
            self.embed = None
            if self.placement.embed_resident and embed_bytes:
                e = idx.embed
                emb = layer_index.Piece(e.file, e.offset, e.nbytes, layer_index._dtype(e), 0,
                                        e.shape[0] * e.shape[1])
                self.embed = self.ledger.alloc(emb.numel, self.dtype, self.device)
                self._load_into(layer_index.Unit("embed", "embed", 0, (emb,), emb.numel), self.embed)
            streamed = [u for i, u in enumerate(idx.units) if i not in self.placement.resident]
            slots = self._allocate_slots(staging) if streamed else []
        finally:
            files.close()
        self.prefetcher = Prefetcher(streamed, {u.name: self.host.get(u.name) for u in streamed}, slots,
                                     self.filler, files)

    def _allocate_slots(self, staging: int) -> list[Slot]:
        """The prefetch slots, through the ledger: a device buffer for the largest unit and,
        when pieces need converting or copying to a GPU, a host staging buffer each."""
        slots = []
        for _ in range(self.depth):
            flat = self.ledger.alloc(self.index.slot_numel, self.dtype, self.device)
            stage = (self.ledger.alloc(staging, torch.uint8, torch.device("cpu"), pin=self.device.type == "cuda")
                     if staging else None)
            views = self.index.layout.weights(flat) if self.index.layout is not None else None
            slots.append(Slot(flat, stage, views=views))
        return slots

    def _load_into(self, unit: layer_index.Unit, flat: torch.Tensor) -> None:
        """Read a unit once at load time (resident tier), through a temporary staging buffer
        when it needs converting; the temporary is freed before the next unit."""
        need = self.filler.staging_bytes(unit)
        stage = torch.empty(need, dtype=torch.uint8) if need else None
        self.filler.from_disk(unit, flat, stage)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for these token ids: a lookup when the matrix is resident, else
        each row read from the file (a token needs hidden × dtype bytes of it)."""
        if self.embed is not None:
            return F.embedding(ids, self.embed.view(self.index.embed.shape))
        e = self.index.embed
        dtype = layer_index._dtype(e)
        hidden = e.shape[1]
        row_bytes = e.nbytes // e.shape[0]
        host = torch.empty(ids.numel(), hidden, dtype=dtype)
        mv = byte_view(host)
        files = self.prefetcher.files
        if not files.fds:
            files.open()
        for r, tok in enumerate(ids.tolist()):
            piece = layer_index.Piece(e.file, e.offset + tok * row_bytes, row_bytes, dtype, 0, hidden)
            files.read(piece, mv[r * row_bytes:(r + 1) * row_bytes])
        return host.to(device=self.device, dtype=self.dtype)

    # -- running
    def _check_split(self) -> None:
        """Decide, once, whether one-token steps may compute on fewer threads (see
        _compute_threads): only on the CPU, only when units are streamed (else no reader
        needs a core), and only where a step runs in localchat's kernels from the first
        layer to the logits (StreamedForward.steps_in_kernels)."""
        cores = torch.get_num_threads()
        if self.split is not None or self.device.type != "cpu" or cores < 2 or not self.prefetcher.slots \
                or self.modules:      # transformers' layers: torch's kernels
            return
        few = max(1, cores - self.filler.readers)
        if self.impl.steps_in_kernels(self.prefetcher.slots[0].views):
            self.split = SplitCheck(few, f"one-token steps on {few} of {cores} threads, the readers on the rest: "
                                         "localchat's kernels give the same bits on any thread count", cores)
        else:
            self.split = SplitCheck(None, f"one-token steps on all {cores} threads: they run torch's kernels here "
                                          f"({self.impl.layer_kernel_note}), whose bits may change with the thread "
                                          "count", cores)

    def _compute_threads(self, positions: int) -> int | None:
        """How many threads a pass over `positions` should compute with, or None for
        torch's setting. When the device is the CPU, compute and the prefetch readers share
        its cores, and torch's OpenMP workers spin between operators: a one-token step
        computed on every core starves the readers (benchmarks/streamed.py measures it).
        Only one-token steps, and only where they run in localchat's kernels: the logits
        must be the resident target's, and a verify pass (always on every thread) must give
        each row a one-token step's bits."""
        s = self.split
        if (positions != 1 or not self.split_threads or s is None or s.threads is None
                or torch.get_num_threads() != s.full):
            return None
        return s.threads

    @torch.inference_mode()
    def forward(self, ids, all_logits: bool = False) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
        pos = self.cache.length
        self.cache.reserve(ids.numel())
        threads, restore = self._compute_threads(ids.numel()), torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            logits = self.impl(ids, pos, all_logits)
        except torch.OutOfMemoryError:
            self.prefetcher.reset()
            logits = self._retry_after_oom(ids, pos, all_logits)
        except BaseException:
            # A pass that stopped midway (read error, Ctrl-C) leaves the ring mid-cycle:
            # restart it, so the next pass (the user's retry) begins at the first unit.
            self.prefetcher.reset()
            raise
        finally:
            if threads is not None:
                torch.set_num_threads(restore)
        self.cache.length = pos + ids.numel()
        self._passes += 1
        self._pass_seconds += time.perf_counter() - t0
        return logits

    def _retry_after_oom(self, ids, pos, all_logits):
        """Out of device memory mid-pass: give back half of the resident units (they will be
        streamed from disk), and run the pass once more; a second failure is an error."""
        if self._retried_oom:
            raise EngineError("out of device memory during a streamed pass even with fewer resident layers; "
                              "lower --vram or close what else uses the device") from None
        self._retried_oom = True
        self.demote(len(self.resident) // 2 or len(self.resident))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            return self.impl(ids, pos, all_logits)
        except torch.OutOfMemoryError:
            self.prefetcher.reset()
            raise EngineError("out of device memory during a streamed pass even with fewer resident layers; "
                              "lower --vram or close what else uses the device") from None

    def demote(self, count: int) -> int:
        """Stream `count` more units from disk instead of keeping them resident (frees their
        device memory). Returns how many were demoted."""
        self.prefetcher.reset()
        idx = self.index
        slots = self.prefetcher.slots
        slot_bytes = idx.slot_numel * torch.finfo(self.dtype).bits // 8
        staging = max(self.filler.staging_bytes(u) for u in idx.units)
        names = []
        for name in list(self.resident):
            # Everything was resident (no slots yet): free enough for the prefetch slots too.
            room_for_slots = slots or self.ledger.held + self.depth * (slot_bytes + staging) <= self.weight_budget
            if len(names) >= count and room_for_slots:
                break
            self.ledger.free(self.resident.pop(name))
            self.resident_views.pop(name, None)
            names.append(name)
        new_slots = bool(names and not slots)
        if new_slots:
            slots = self._allocate_slots(staging)
        keep = {u.name for u in self.index.units if u.name in self.resident}
        demoted = set(names)
        streamed = [u for u in self.index.units if u.name not in keep]
        tier = {u.name: (None if u.name in demoted else self.prefetcher.tier.get(u.name)) for u in streamed}
        self.prefetcher = Prefetcher(streamed, tier, slots, self.filler, self.prefetcher.files)
        resident_idx = frozenset(i for i, u in enumerate(self.index.units) if u.name in keep)
        self.placement = replace(self.placement, resident=resident_idx,
                                 host=frozenset(i for i in self.placement.host if self.index.units[i].name in tier))
        if new_slots:
            self._check_split()           # units are streamed now: readers will want a core
        return len(names)

    def close(self) -> None:
        self.prefetcher.close()

    # -- what it holds and how it did
    def weight_bytes(self) -> int:
        """Weight bytes held on the device now (resident units, slots, norm)."""
        return self.ledger.held

    def device_bytes(self) -> int:
        return self.ledger.held + self.cache.nbytes()

    def stream_stats(self) -> StreamStats:
        c: Counters = self.prefetcher.counters
        return StreamStats(self._passes, self._pass_seconds, c.disk_bytes, c.host_bytes, c.load_seconds,
                           c.wait_seconds, sum(k.hits * k.expert_bytes for k in self._mapped_kernels))

    def bound_pass_seconds(self) -> float:
        """The transfer bound of one pass: streamed bytes over their tier's bandwidth."""
        p, bw = self.placement, self.bandwidth
        return p.disk_streamed_bytes / bw["disk"] + p.host_streamed_bytes / bw["host_to_device"]

    def describe(self) -> dict:
        p = self.placement
        layers = len(self.index.layer_units)
        return {"resident_units": len(p.resident), "host_units": len(p.host), "disk_units": len(p.disk),
                "resident_layers": p.resident_layers(layers), "units": len(p.units),
                "streamed_bytes_per_pass": p.streamed_bytes, "weight_budget": self.weight_budget,
                "held_bytes": self.ledger.held, "prefetch_depth": self.depth,
                "compute_threads": self.split.reason if self.split else
                "torch's setting (transformers' layers)" if self.modules else
                "torch's setting (nothing streamed or not the CPU)"}


def placement(idx: layer_index.StreamIndex, filler: Filler, weight_budget: int, host_budget: int = 0,
              depth: int = planner.PREFETCH_DEPTH) -> planner.StreamPlacement:
    """The tiers of this checkpoint's units under a budget, from exact sizes."""
    es = torch.finfo(filler.dtype).bits // 8
    staging = max(filler.staging_bytes(u) for u in idx.units)
    tied = idx.head.name == idx.embed.name
    embed_bytes = 0 if tied else idx.embed.shape[0] * idx.embed.shape[1] * es
    return planner.place_streamed([u.numel * es for u in idx.units], idx.slot_numel * es, idx.norm_unit().numel * es,
                                  embed_bytes, weight_budget, host_budget, depth, staging,
                                  host_units=[u.file_bytes for u in idx.units])


def maps_experts(path: Path, skeleton, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a mixture streamed here reads its routed experts where they lie in the files,
    only those a pass routes to (streamed_modules.expert_views): on a CPU, where the experts
    kernel runs and the files hold the experts in the dtype computed in (the plan assumes
    so whenever the file's element size is the computed one's: planner._row)."""
    return (device.type == "cpu" and bool(moe.blocks(skeleton)) and not moe.why_not(skeleton, dtype)
            and streamed_modules.experts_dtype(path, skeleton) == dtype)


def minimum_budget(path: Path, device: torch.device, dtype: torch.dtype, depth: int = planner.PREFETCH_DEPTH,
                   slot_numel: int | None = None) -> int:
    """The fewest weight bytes a streamed target of this checkpoint can run in."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skeleton = AutoModelForCausalLM.from_config(cfg)
    if llama_family.can_run(skeleton) is not None:        # transformers' layers, as StreamedTarget runs them
        mapped = maps_experts(Path(path), skeleton, device, dtype)
        idx = streamed_modules.build(Path(path), skeleton, slot_numel, mapped)
    else:
        idx = layer_index.build(Path(path), cfg.num_hidden_layers, bool(getattr(cfg, "tie_word_embeddings", False)),
                                slot_numel)
    return placement(idx, Filler(Files([]), device, dtype), 0, 0, depth).min_budget


def load_streamed(path: Path, device: torch.device, dtype: torch.dtype, weight_budget: int,
                  host_budget: int = 0, **kwargs) -> StreamedTarget:
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise UnsupportedModel(f"{path}: a pre-quantized checkpoint cannot be streamed exactly; use the "
                               "original weights")
    return StreamedTarget(Path(path), device, dtype, weight_budget, host_budget, **kwargs)
