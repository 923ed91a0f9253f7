"""Where each piece of a Llama-family checkpoint lives on disk, and how a streamed unit
is laid out in memory.

A *unit* is what the streamer moves as one: a decoder layer, or a chunk of the output
head. Every unit fills the same kind of flat buffer (a *slot*), so slots are allocated
once and reused for any unit. Inside a layer's buffer the tensors sit where the fast
forward wants them: q, k and v stacked into one matrix, gate and up into another, so a
streamed layer runs the very same matmuls as a resident one (and rounds the same).

Nothing here reads a weight: sizes and offsets come from the safetensors headers."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import TensorEntry, tensor_index
from ..errors import UnsupportedModel
from ..models.llama_family import LayerWeights

FILE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Head chunks are whole multiples of this many vocabulary rows: the CPU GEMM then blocks
# each chunk as it blocks the full matrix, so chunked logits equal the resident ones
# bit for bit (checked in tests/test_streamed.py).
HEAD_ROW_QUANTUM = 1024
# Field starts aligned to 32 elements: a multiple of 64 bytes in every compute dtype, as the
# resident forward's weights are (llama_family.ALIGN_BYTES: kernels may round by alignment).
_ALIGN = 32

# suffix after "layers.N." -> (field of LayerWeights, position inside the fused field)
_FIELDS = {
    "input_layernorm.weight": ("ln1", 0),
    "self_attn.q_proj.weight": ("qkv", 0), "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0), "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o", 0), "self_attn.o_proj.bias": ("o_bias", 0),
    "post_attention_layernorm.weight": ("ln2", 0),
    "mlp.gate_proj.weight": ("gate_up", 0), "mlp.up_proj.weight": ("gate_up", 1),
    "mlp.down_proj.weight": ("down", 0),
    "self_attn.q_norm.weight": ("q_norm", 0), "self_attn.k_norm.weight": ("k_norm", 0),
}
_MATRICES = {"qkv", "o", "gate_up", "down"}   # kept as transposed views, as the resident forward does
_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes (or a row range of one) and where they go in a unit's buffer."""
    file: Path
    offset: int          # byte offset in the file
    nbytes: int
    dtype: torch.dtype   # as stored in the file
    start: int           # element offset in the unit's flat buffer (compute dtype)
    numel: int
    stage: int = 0       # byte offset in a staging buffer (pieces packed one after another)


@dataclass(frozen=True)
class Unit:
    name: str            # "layer 3", "head 0"
    kind: str            # "layer" | "head"
    index: int
    pieces: tuple[Piece, ...]
    numel: int           # elements of the unit's buffer, alignment gaps included
    row0: int = 0        # head chunk: vocabulary rows [row0, row0 + rows)
    rows: int = 0

    @property
    def file_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass
class LayerLayout:
    """Field name -> (element offset, shape) inside a layer's flat buffer."""
    fields: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    numel: int = 0

    def weights(self, flat: torch.Tensor) -> LayerWeights:
        """LayerWeights viewing a flat buffer laid out as this layout says."""
        views = {}
        for name, (start, shape) in self.fields.items():
            n = 1
            for d in shape:
                n *= d
            v = flat[start:start + n].view(shape)
            views[name] = v.t() if name in _MATRICES else v
        views.setdefault("qkv_bias", None)
        views.setdefault("o_bias", None)
        return LayerWeights(**views)


@dataclass
class StreamIndex:
    layout: LayerLayout
    units: list[Unit]            # layers in order, then head chunks
    norm: Piece
    embed: TensorEntry           # [vocab, hidden]: rows are read on demand
    head: TensorEntry            # the embedding itself when tied
    hidden: int
    slot_numel: int              # elements a slot must hold: the largest unit
    files: list[Path]

    @property
    def layer_units(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "layer"]

    @property
    def head_units(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "head"]

    def norm_unit(self) -> Unit:
        """What stays resident besides the layers, embeddings and head: the final norm."""
        return Unit("norm", "norm", 0, (self.norm,), self.norm.numel)

    def total_file_bytes(self) -> int:
        tied = self.head.name == self.embed.name
        return sum(u.file_bytes for u in self.units) + self.norm_unit().file_bytes + (0 if tied else self.embed.nbytes)


def _dtype(e: TensorEntry) -> torch.dtype:
    try:
        return FILE_DTYPES[e.dtype]
    except KeyError:
        raise UnsupportedModel(f"{e.file}: tensor {e.name} is stored as {e.dtype}; streaming reads "
                               "float32, bfloat16 or float16 checkpoints") from None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def build(path: Path, num_layers: int, tie_word_embeddings: bool, slot_numel: int | None = None) -> StreamIndex:
    """Index a checkpoint for streaming. `slot_numel` forces a smaller head chunk (tests)."""
    index = tensor_index(path)
    per_layer: dict[int, dict[str, list[tuple[int, TensorEntry]]]] = {}
    embed = head = norm = None
    for name, e in index.items():
        m = _LAYER.match(name)
        if m:
            suffix = m.group(2)
            if suffix.endswith("rotary_emb.inv_freq"):
                continue        # a buffer old checkpoints saved; the rotary table is rebuilt
            if suffix not in _FIELDS:
                raise UnsupportedModel(f"{e.file}: layer tensor {name!r} is not part of a Llama-family "
                                       "layer; the streamed profile cannot run this model")
            fname, part = _FIELDS[suffix]
            per_layer.setdefault(int(m.group(1)), {}).setdefault(fname, []).append((part, e))
        elif name.endswith("embed_tokens.weight"):
            embed = e
        elif name.endswith("norm.weight") and "layers." not in name:
            norm = e
        elif name == "lm_head.weight":
            head = e
    if embed is None or norm is None or sorted(per_layer) != list(range(num_layers)):
        raise UnsupportedModel(f"{path}: the checkpoint does not hold the embeddings, final norm and "
                               f"{num_layers} decoder layers its config names; re-download it")
    if head is None:
        if not tie_word_embeddings:
            raise UnsupportedModel(f"{path}: no lm_head.weight and the config does not tie it to the "
                                   "embeddings; re-download the model")
        head = embed

    layout = _layout(per_layer[0])
    units = []
    for i in range(num_layers):
        if _layout(per_layer[i]).fields != layout.fields:
            raise UnsupportedModel(f"{path}: layer {i} differs in shape from layer 0; streaming needs "
                                   "uniform layers")
        pieces, stage = [], 0
        for fname, parts in sorted(per_layer[i].items(), key=lambda kv: layout.fields[kv[0]][0]):
            start = layout.fields[fname][0]
            for _, e in sorted(parts, key=lambda pe: pe[0]):
                n = _numel(e.shape)
                pieces.append(Piece(e.file, e.offset, e.nbytes, _dtype(e), start, n, stage))
                start += n
                stage += e.nbytes
        units.append(Unit(f"layer {i}", "layer", i, tuple(pieces), layout.numel))

    units += head_units(head, slot_numel or layout.numel, slot_numel is not None)
    hidden = head.shape[1]
    norm_piece = Piece(norm.file, norm.offset, norm.nbytes, _dtype(norm), 0, _numel(norm.shape))
    slot = max(u.numel for u in units)
    files = sorted({p.file for u in units for p in u.pieces} | {norm.file, embed.file})
    return StreamIndex(layout, units, norm_piece, embed, head, hidden, slot, files)


def head_units(head: TensorEntry, want: int, forced: bool = False) -> list[Unit]:
    """The output head in chunks of about `want` elements (whole HEAD_ROW_QUANTUMs of rows,
    unless `forced`: a test's smaller slot)."""
    vocab, hidden = head.shape
    rows = max(HEAD_ROW_QUANTUM, want // hidden // HEAD_ROW_QUANTUM * HEAD_ROW_QUANTUM)
    if forced:
        rows = max(1, want // hidden)
    rows = min(rows, vocab)
    esize = head.nbytes // max(1, vocab * hidden)
    units = []
    for c, row0 in enumerate(range(0, vocab, rows)):
        r = min(rows, vocab - row0)
        piece = Piece(head.file, head.offset + row0 * hidden * esize, r * hidden * esize, _dtype(head),
                      0, r * hidden, 0)
        units.append(Unit(f"head {c}", "head", c, (piece,), r * hidden, row0, r))
    return units


def _layout(fields: dict[str, list[tuple[int, TensorEntry]]]) -> LayerLayout:
    layout = LayerLayout()
    start = 0
    for fname in ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up", "down", "q_norm", "k_norm"):
        parts = sorted(fields.get(fname, []), key=lambda pe: pe[0])
        if not parts:
            continue
        shapes = [e.shape for _, e in parts]
        if len(shapes[0]) == 2:
            shape = (sum(s[0] for s in shapes), shapes[0][1])
        else:
            shape = (sum(s[0] for s in shapes),)
        layout.fields[fname] = (start, shape)
        start = _align(start + _numel(shape))
    if not {"ln1", "qkv", "o", "ln2", "gate_up", "down"} <= set(layout.fields):
        raise UnsupportedModel("a decoder layer lacks attention or MLP weights the Llama family has; "
                               "the streamed profile cannot run this model")
    layout.numel = start
    return layout
