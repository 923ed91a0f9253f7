"""A mixture-of-experts block's routed experts in one call of C (moe_body.h, built into
layer.c's library): every pass, one-token steps, verify passes and prefill alike.

Why: transformers' experts modules loop in Python over the experts a pass hits, two
products and a handful of torch operations each (8 experts a layer for every decoded token
of Qwen3.5-35B-A3B, up to all 256 in prefill), with torch's one-row bf16 product under
them. Here each hit expert's weights are read once for all the rows routed to it, by
rows.c's (or, for int4, q4.c's) products, and every row is a lone row's bits (moe_body.h
says why), so a verify pass's rows are one-token steps and greedy speculation stays plain
greedy. The router, its top-k and the shared expert stay in the model's own modules (their
products go through the row kernel like every other nn.Linear, models/hf_forward.py).

It runs where the layer kernel for the dtype runs, for experts dense in the dtype (3-D
parameters, as transformers holds them, resident or bound to a streamed slot), per-channel
int8 as q8.c reads it, or int4 in the form q4.c reads (bf16). Elsewhere (float16, another
CPU, the device's int4 layout) the module's own forward runs, and `describe()` says so."""
from __future__ import annotations

import ctypes
import threading

import torch

from . import layer_kernel

_fns: dict[torch.dtype, tuple] = {}


def why_not(dtype: torch.dtype) -> str:
    """'' when the experts kernel for `dtype` runs here, else why it does not."""
    why = layer_kernel.why_not(dtype)
    if why:
        return why
    if dtype not in _fns:
        lib = layer_kernel._libs[dtype]
        sfx = layer_kernel.SUFFIX[dtype]
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        run = getattr(lib, f"moe_{sfx}")
        run.restype = None
        run.argtypes = [P, I64, P, P, I64, I, I, I, P, I, P, P, I, P, P, I]
        size = getattr(lib, f"moe_scratch_bytes_{sfx}")
        size.restype = I64
        size.argtypes = [I, I, I, I, I, I]
        _fns[dtype] = (run, size)
    return ""


class Experts:
    """The forward of one experts module (hidden_states [T, hid], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, hid], over its expert matrices: dense 3-D tensors ([E, 2I,
    hid] and [E, hid, I]) given with each call (their current data pointers: a streamed
    slot's rebinding is followed), or per-expert packed weights fixed at construction
    (qweights.Int8Weight or Int4Weight in canonical form: layer_kernel._mat describes
    either), or per-expert dense matrices as a checkpoint stores them (`split`: gate, up
    and down lists, say views of the files' memory mapping)."""

    def __init__(self, dtype: torch.dtype, num_experts: int, hidden: int, inter: int,
                 packed: tuple[list, list] | None = None, split: tuple[list, list, list] | None = None):
        self.dtype, self.E, self.hid, self.I = dtype, num_experts, hidden, inter
        self._run, self._size = _fns[dtype]
        self._mine = threading.local()          # scratch per thread: engines on two threads never share one
        self._packed = self._up = None
        self.expert_bytes = 0                   # split: one expert's three matrices
        mats = lambda ws: (layer_kernel._Mat * num_experts)(*map(layer_kernel._mat, ws))   # noqa: E731
        if packed is not None:
            self._packed = (mats(packed[0]), mats(packed[1]))
        elif split is not None:
            self._keep = split                  # the tensors the descriptions point into
            self._packed, self._up = (mats(split[0]), mats(split[2])), mats(split[1])
            self.expert_bytes = sum(t[0].numel() * t[0].element_size() for t in split)
        self.hits = 0                           # split: the experts read so far, each once a pass

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 dense: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = hidden_states.contiguous()
        T, k = top_k_index.shape
        idx = top_k_index.to(torch.int64).contiguous()
        wts = top_k_weights.to(self.dtype).contiguous()
        out = torch.empty(T, self.hid, dtype=self.dtype)
        threads = torch.get_num_threads()
        need = self._size(T, self.hid, self.I, k, self.E, threads)
        scratch = getattr(self._mine, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._mine.scratch = torch.empty(need, dtype=torch.uint8)
        if dense is not None:
            # one description a matrix, moved by the expert stride (moe_body.h)
            gu_w, down_w = dense
            gu, down = (layer_kernel._Mat(t.data_ptr(), None, None, 0) for t in dense)
            steps = (gu_w.stride(0) * gu_w.element_size(), down_w.stride(0) * down_w.element_size())
        else:
            gu, down = self._packed
            steps = (0, 0)
        up = None
        if self._up is not None and dense is None:
            up = ctypes.addressof(self._up)
            self.hits += int(torch.unique(idx).numel())
        self._run(ctypes.addressof(gu), steps[0], up, ctypes.addressof(down), steps[1], self.E, self.hid, self.I,
                  x.data_ptr(), T, idx.data_ptr(), wts.data_ptr(), k, out.data_ptr(), scratch.data_ptr(), threads)
        return out
