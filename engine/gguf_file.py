"""A GGUF file's tensors (engine/gguf_reader.py reads them, views of the file's memory map)
multiplied where they lie: the quantized ones in their block formats, by the GGUF kernels
(engine/kernels/gguf_kernel.py), without a float copy. Where
llama.cpp's converter reordered a matrix's rows (the Llama family's q and k projections,
their rotary halves interleaved), `hf_rows` gives the checkpoint's order back: rows of blocks
move whole, so a quantized matrix is reordered without decoding it.

GGUFWeight is a weight the model code multiplies through `.mm`, as it does the int8 and int4
weights (models/llama_family._linear), with the pass's kind; the kernel policy
(kernels/dispatch.py) picks the product: one-token steps and verify passes through the block
kernels (every row a lone row), a prefill of more than a few rows through the GEMM over the
weight decoded a few rows at a time (never a float32 copy of the whole weight)."""
from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import torch

from .gguf_reader import Tensor
from .kernels import dispatch, gguf_kernel
from .kernels.dispatch import Pass


# The block format a tensor without a kernel here (IQ1-IQ3, TQ1_0/TQ2_0, MXFP4, ...) becomes
# at load: its values decoded by gguf-py and each block of 32 rounded to 8 bits with a
# half-float scale, so what runs stays within 8-bit rounding of the file (the memory grows
# to 8.5 bits a weight; `doctor` says so).
CONVERT_TO = "Q8_0"
_CHUNK = 1 << 22                     # weights decoded at once: bounds the float32 temporaries


@functools.lru_cache(maxsize=None)
def converted(kind: str) -> bool:
    """Whether tensors of this GGUF type are converted at load (no kernel reads it, gguf-py decodes it)."""
    if kind == "F32" or kind in gguf_kernel.TYPES:
        return False
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
    try:
        qtype = GGMLQuantizationType[kind]
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def converted_kinds(tensors: dict[str, Tensor]) -> Counter:
    """The GGUF types of a file's matrices that are converted at load, with their counts."""
    return Counter(t.kind for t in tensors.values() if len(t.shape) >= 2 and converted(t.kind))


def held_bytes(t: Tensor) -> int:
    """The bytes a tensor takes once loaded: as stored, or as CONVERT_TO where it is converted."""
    if converted(t.kind):
        rows = t.data.numel() // t.data.shape[-1]
        return rows * gguf_kernel.row_bytes(CONVERT_TO, t.shape[-1])
    return t.data.numel() * t.data.element_size()


def runnable(t: Tensor) -> Tensor:
    """t where a kernel reads its format (or it is float), else t converted to CONVERT_TO."""
    if not converted(t.kind):
        return t
    from gguf import GGMLQuantizationType, quants
    qtype = GGMLQuantizationType[t.kind]
    K = t.shape[-1]
    raw = t.data.reshape(-1, t.data.shape[-1])
    out = torch.empty(raw.shape[0], gguf_kernel.row_bytes(CONVERT_TO, K), dtype=torch.uint8)
    step = max(1, _CHUNK // K)
    for a in range(0, raw.shape[0], step):
        values = torch.from_numpy(quants.dequantize(raw[a:a + step].numpy(), qtype)).float()
        out[a:a + step] = q8_0(values)
    return Tensor(t.name, CONVERT_TO, t.shape, out.view(*t.shape[:-1], -1))


def q8_0(values: torch.Tensor) -> torch.Tensor:
    """Rows of float values [n, K] as Q8_0 blocks [n, K/32 * 34], as llama.cpp's reference
    quantizer writes them (scale = largest magnitude / 127, codes rounded to nearest)."""
    n, K = values.shape
    v = values.view(n, K // 32, 32)
    d = v.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(v * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    blocks = torch.empty(n, K // 32, 34, dtype=torch.uint8)
    blocks[..., :2] = d.to(torch.float16).view(torch.uint8).view(n, K // 32, 2)
    blocks[..., 2:] = q.view(torch.uint8)
    return blocks.view(n, -1)


def dense(t: Tensor) -> torch.Tensor:
    """A tensor's float32 values (decoded where quantized)."""
    if t.kind in gguf_kernel.TYPES:
        return gguf_kernel.dequantize(t.data, t.kind, t.shape[-1]).view(t.shape)
    return t.data.float().view(t.shape)


def hf_rows(rows: int, heads: int) -> torch.Tensor:
    """The index that puts a q or k projection's rows back in the checkpoint's order: the
    converter stored each head's two rotary halves interleaved (convert_hf_to_gguf's
    LlamaModel.permute), row (h, j, s) for the checkpoint's (h, s, j)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFWeight:
    """x @ w.T for a weight [N, K] stored as row blocks of one or more formats, stacked by
    rows (a fused q/k/v may mix them: Q4_K_M keeps some v projections in Q6_K). Products are
    float32 whatever x's dtype (its values widen exactly)."""

    gguf_blocks = True            # the layer kernel reads it (layer_kernel.py)

    def __init__(self, parts: list[tuple[str, torch.Tensor]], K: int):
        for kind, data in parts:
            if kind not in gguf_kernel.TYPES:
                raise ValueError(f"no kernel for GGUF type {kind}")
            if data.shape[1] != gguf_kernel.row_bytes(kind, K):
                raise ValueError(f"a {kind} part of {data.shape[1]} bytes a row does not hold {K} weights")
        self.parts = [(kind, data.contiguous()) for kind, data in parts]
        self.shape = (sum(d.shape[0] for _, d in self.parts), K)
        self.format = "+".join(dict.fromkeys(kind for kind, _ in self.parts))
        # each part's products by the kind of pass, as the kernel policy picks them (kernels/dispatch.py)
        self.routes = [dispatch.routes(kind, torch.device("cpu"), torch.float32) for kind, _ in self.parts]

    @classmethod
    def of(cls, *tensors: Tensor, rows: list[torch.Tensor | None] | None = None) -> "GGUFWeight":
        """The weight of these matrices stacked by rows (each reordered by its `rows` index)."""
        rows = rows or [None] * len(tensors)
        return cls([(t.kind, t.data if r is None else t.data[r]) for t, r in zip(tensors, rows)], tensors[0].shape[1])

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, kind: Pass = Pass.STEP) -> torch.Tensor:
        K = self.shape[1]
        M = x.shape[0]
        y = torch.cat([(gguf_kernel.linear if routes[kind].pick(M) == "blocks" else gguf_kernel.gemm)(x, data, part, K)
                       for (part, data), routes in zip(self.parts, self.routes)], 1)
        return y if bias is None else y.add_(bias)

    def _decoded(self) -> torch.Tensor:
        """The whole weight in float32."""
        N, K = self.shape
        out, at = torch.empty(N, K, dtype=torch.float32), 0
        for kind, data in self.parts:
            gguf_kernel.dequantize(data, kind, K, out[at:at + data.shape[0]])
            at += data.shape[0]
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` decoded (an embedding lookup), float32 [len(ids), K]."""
        at = 0
        ids = ids.view(-1)
        picked = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32)
        for kind, data in self.parts:
            mine = (ids >= at) & (ids < at + data.shape[0])
            if mine.any():
                picked[mine] = gguf_kernel.dequantize(data[ids[mine] - at], kind, self.shape[1])
            at += data.shape[0]
        return picked

    def dense(self) -> torch.Tensor:
        return self._decoded()

    def tensors(self) -> list[torch.Tensor]:
        return [data for _, data in self.parts]

    def c_parts(self) -> list[tuple[int, int, int, int]]:
        """(type id, rows, bytes a row, address) of each part, as gguf.c reads them."""
        return [(gguf_kernel.TYPES[kind], data.shape[0], data.stride(0), data.data_ptr()) for kind, data in self.parts]
