"""Streaming for models the Llama-family forward does not run (the hybrids: Qwen3.5 and
Qwen3-Next, whose layers are of two kinds): transformers' own decoder layers, built on
`meta`, get their parameters bound to a prefetch slot just before each runs and handed
back just after (forward hooks), so the model's arithmetic is unchanged while its weights
visit the device one layer at a time. The embedding rows, the final norm, the head chunks,
the placement tiers and the reader thread are the Llama path's own (streamed.py).

A unit's layout is per layer here (a linear-attention layer holds other tensors than an
attention one): every parameter of the layer at a 64-byte-aligned offset of the slot, in
the shape the module declares. Mixture-of-experts weights, stored one matrix per expert,
are placed expert after expert so the slot holds the [experts, out, in] tensor
transformers builds from them (gate rows then up rows per expert, as its loader
concatenates them).

On a CPU the routed experts need not be streamed at all (`mapped_experts`): a sparse layer's
unit then holds everything but its experts, and the experts kernel reads the experts a pass
routes to straight from the checkpoint's files, memory-mapped (expert_views): a token reads
its top-k experts of each layer, not all of them, and the page cache keeps the ones in use."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint import stored_name, tensor_index
from ..errors import UnsupportedModel
from ..models import hf_forward
from . import layer_index
from .layer_index import Piece, StreamIndex, Unit, _align, _dtype, _numel


@dataclass
class ModuleIndex(StreamIndex):
    # unit name -> {parameter path inside the layer: (element offset, shape)}
    layer_fields: dict = None
    rest: Unit = None            # the parameters outside the layers but the embeddings and head
    rest_fields: dict = None     # {parameter path in the model: (element offset, shape)}
    # with mapped experts: {layer: (gate, up, down)}, each a list of (tensor entry, first
    # row, rows), one an expert (rows of a fused tensor where the files hold one)
    experts: dict = None

    def norm_unit(self) -> Unit:
        return self.rest


def _place(index: dict, prefix: str, params, name: str, kind: str, i: int, path) -> tuple[Unit, dict]:
    """A unit holding `params` ((path, parameter) pairs, found in the files under `prefix`
    + path) at 64-byte-aligned offsets, and its field layout."""
    pieces, lay, start, stage = [], {}, 0, 0
    for pname, p in params:
        src = _sources(index, prefix, pname, tuple(p.shape))
        if src is None:
            raise UnsupportedModel(f"{path}: tensor {prefix}{pname} is not in the safetensors files; "
                                   "re-download the model")
        if sum(_numel(e.shape) for e in src) != p.numel():
            raise UnsupportedModel(f"{src[0].file}: {prefix}{pname} has {sum(_numel(e.shape) for e in src)} "
                                   f"values, config.json makes it {p.numel()}; re-download the model")
        lay[pname] = (start, tuple(p.shape))
        at = start
        for e in src:
            n = _numel(e.shape)
            pieces.append(Piece(e.file, e.offset, e.nbytes, _dtype(e), at, n, stage))
            at += n
            stage += e.nbytes
        start = _align(start + p.numel())
    return Unit(name, kind, i, tuple(pieces), start), lay


def _sources(index: dict, prefix: str, pname: str, shape) -> list | None:
    """The checkpoint tensors that make up one parameter, in slot order."""
    got = stored_name(index, prefix + pname)
    if got is not None:
        return [index[got]]
    base, _, leaf = pname.rpartition(".")
    if len(shape) == 3 and leaf in ("gate_up_proj", "down_proj"):
        parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        out = []
        for e in range(shape[0]):
            for part in parts:
                got = stored_name(index, f"{prefix}{base}.{e}.{part}.weight")
                if got is None:
                    return None
                out.append(index[got])
        return out
    return None


EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _expert_entries(index: dict, prefix: str, layer: nn.Module, path) -> tuple[list, list, list]:
    """(gate, up, down) of one sparse layer's experts as the files hold them."""
    E, two_i = layer.mlp.experts.gate_up_proj.shape[:2]
    fused = [stored_name(index, prefix + n) for n in EXPERT_PARAMS]
    if all(fused):
        gu, down = index[fused[0]], index[fused[1]]
        return ([(gu, e * two_i, two_i // 2) for e in range(E)],
                [(gu, e * two_i + two_i // 2, two_i // 2) for e in range(E)],
                [(down, e * down.shape[1], down.shape[1]) for e in range(E)])
    out = ([], [], [])
    for e in range(E):
        for part, into in zip(("gate_proj", "up_proj", "down_proj"), out):
            got = stored_name(index, f"{prefix}mlp.experts.{e}.{part}.weight")
            if got is None:
                raise UnsupportedModel(f"{path}: tensor {prefix}mlp.experts.{e}.{part}.weight is not in the "
                                       "safetensors files; re-download the model")
            into.append((index[got], 0, index[got].shape[0]))
    return out


def experts_dtype(path, model: nn.Module) -> torch.dtype | None:
    """The dtype the files hold the routed experts in (None: a dense model)."""
    index = tensor_index(path)
    for i, layer in enumerate(model.model.layers):
        if hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj"):
            return _dtype(_expert_entries(index, f"model.layers.{i}.", layer, path)[0][0][0])
    return None


def build(path, model: nn.Module, slot_numel: int | None = None, mapped_experts: bool = False) -> ModuleIndex:
    """Index a checkpoint for streaming transformers' layers of `model` (built on meta);
    with `mapped_experts`, the routed experts stay out of the units."""
    index = tensor_index(path)
    units, fields, experts = [], {}, {}
    for i, layer in enumerate(model.model.layers):
        if any(True for _ in layer.buffers()):
            raise UnsupportedModel(f"{path}: decoder layer {i} holds buffers; the streamed profile cannot run "
                                   "this model (use a resident profile)")
        params = layer.named_parameters()
        if mapped_experts and hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj"):
            experts[i] = _expert_entries(index, f"model.layers.{i}.", layer, path)
            params = [(n, p) for n, p in layer.named_parameters() if n not in EXPERT_PARAMS]
        unit, lay = _place(index, f"model.layers.{i}.", params, f"layer {i}", "layer", i, path)
        units.append(unit)
        fields[unit.name] = lay
    get = {n: index[s] for n in ("model.embed_tokens.weight", "lm_head.weight")
           if (s := stored_name(index, n)) is not None}
    if "model.embed_tokens.weight" not in get:
        raise UnsupportedModel(f"{path}: the checkpoint holds no embeddings; re-download it")
    embed = get["model.embed_tokens.weight"]
    head = get.get("lm_head.weight", embed)
    others = [(n, p) for n, p in model.named_parameters()
              if not n.startswith("model.layers.") and n not in ("model.embed_tokens.weight", "lm_head.weight")]
    rest, rest_fields = _place(index, "", others, "norm", "norm", 0, path)
    units += layer_index.head_units(head, slot_numel or max(u.numel for u in units), slot_numel is not None)
    files = sorted({p.file for u in units + [rest] for p in u.pieces} | {embed.file})
    first = rest.pieces[0] if rest.pieces else None
    return ModuleIndex(None, units, first, embed, head, embed.shape[1], max(u.numel for u in units), files,
                       layer_fields=fields, rest=rest, rest_fields=rest_fields, experts=experts)


def expert_views(idx: ModuleIndex) -> dict[int, tuple[list, list, list]]:
    """{sparse block (in model order): (gate, up, down) matrices}, views of the files mapped
    read-only and private (nothing is copied or written: a page is read from the disk or the
    page cache when an expert it holds is routed to, and dropped under memory pressure)."""
    maps: dict = {}

    def view(entry) -> torch.Tensor:
        e, row, rows = entry
        if e.file not in maps:
            maps[e.file] = torch.from_file(str(e.file), shared=False, size=e.file.stat().st_size,
                                           dtype=torch.uint8)
        dt = _dtype(e)
        cols = _numel(e.shape[1:])
        start = e.offset + row * cols * dt.itemsize
        return maps[e.file][start:start + rows * cols * dt.itemsize].view(dt).view(rows, cols)
    return {b: tuple([view(x) for x in part] for part in idx.experts[i])
            for b, i in enumerate(sorted(idx.experts))}


def bind(layer: nn.Module, fields: dict, flat: torch.Tensor) -> None:
    """Point each parameter of `layer` (or of the model) at its place in `flat` (no copy)."""
    for pname, (start, shape) in fields.items():
        owner, _, leaf = pname.rpartition(".")
        mod = layer.get_submodule(owner) if owner else layer
        mod._parameters[leaf] = flat[start:start + _numel(shape)].view(shape)


class StreamedModulesForward(hf_forward.HFForward):
    """HFForward over a model whose decoder layers are bound to slots as they run."""

    weights_fixed = False          # a layer's tensors are a slot's views, new on every pass

    def __init__(self, target, model: nn.Module, mapped_experts: dict | None = None):
        super().__init__(model, target.cache, mapped_experts)
        self.t = target
        self._slot = None
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(self._take(i))
            layer.register_forward_hook(self._give)

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def _take(self, i: int):
        def hook(layer, args):
            t = self.t
            unit = t.index.layer_units[i]
            flat = t.resident.get(unit.name)
            if flat is None:
                self._slot = t.prefetcher.take(unit)
                flat = self._slot.flat
            bind(layer, t.index.layer_fields[unit.name], flat)
        return hook

    def _give(self, layer, args, out):
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self.t.prefetcher.give(slot)

    def __call__(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        T = ids.shape[-1]
        self._begin_pass(T, all_logits)
        self._pos = pos
        position_ids = torch.arange(pos, pos + T, device=ids.device).unsqueeze(0)
        embeds = self.t.embed_rows(ids.view(T)).view(1, T, -1)
        try:
            with self.delta_net:
                out = self.model.model(inputs_embeds=embeds, position_ids=position_ids, cache=self.hf_cache,
                                       use_cache=True)
        finally:
            if self._slot is not None:       # a layer raised mid-pass: the slot goes back to the ring
                self._give(None, None, None)
        h = out.last_hidden_state[0]
        if not all_logits:
            h = h[-1:]
        return self.t.head(h, self.dense[self.pass_kind].pick(h.shape[0])).float()
