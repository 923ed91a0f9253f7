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

import torch

from .gguf_reader import Tensor
from .kernels import dispatch, gguf_kernel
from .kernels.dispatch import Pass


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
