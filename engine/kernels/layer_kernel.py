"""A resident Llama-family model's decoder layers in one call of C (layer.c) for one-token
steps and verify passes: the rows engine/kernels/row_kernel.py computes the products of,
with everything between the products done in the same call.

Why: on a small model a one-token step is mostly the dispatch of some 25 torch operations a
layer (norms, rotary, the cache writes, attention, SiLU, residuals), not their arithmetic;
the demo model (30 layers) spent more time there than reading its weights. One call per
pass removes it. Every row of a pass is computed as a lone row is (layer.c says how), so a
verify pass's rows are one-token steps bit for bit, as with the row kernel alone.

It runs where the row kernel for the dtype runs (the same compiler flags and CPU needs) and
the model is plain: dense weights resident in the dtype, head size at most 512. Elsewhere,
and while a graph is traced (the compiled step), the forward runs its torch operations.
`LOCALCHAT_KERNELS=off` turns it off with the row kernel; `LOCALCHAT_LAYER_KERNEL=off`
alone, for comparisons."""
from __future__ import annotations

import ctypes
import os

import torch

from . import build, row_kernel

SOURCE = "layer"
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_HEAD_DIM = 512           # layer.c's per-head buffers
VERSION = 1                  # layer.c's layer_version(): a compiled step's race records it

_WEIGHT_FIELDS = ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2", "gate_up", "down", "q_norm", "k_norm",
                  "k_cache", "v_cache")


class _Weights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _WEIGHT_FIELDS]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("capacity", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_libs: dict[torch.dtype, ctypes.CDLL] = {}
_state: dict[torch.dtype, str] = {}


def _off() -> bool:
    return os.environ.get("LOCALCHAT_LAYER_KERNEL", "").lower() in ("off", "0", "no", "false")


def why_not(dtype: torch.dtype) -> str:
    """'' when the layer kernel for `dtype` runs here, else why it does not."""
    if dtype not in _state:
        _state[dtype] = _load(dtype)
    return _state[dtype]


def _load(dtype: torch.dtype) -> str:
    if _off():
        return "turned off (LOCALCHAT_LAYER_KERNEL=off)"
    if dtype not in SUFFIX:
        return f"no layer kernel for {dtype}"
    why = row_kernel.why_not(dtype)          # its products, flags and CPU needs are the row kernel's
    if why:
        return why
    flags = row_kernel.KERNELS[dtype][1]
    lib = build.library(SOURCE, flags)
    if lib is None:
        return build.why(SOURCE, flags)
    sfx = SUFFIX[dtype]
    fn = getattr(lib, f"layers_{sfx}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    size = getattr(lib, f"layer_scratch_bytes_{sfx}")
    size.restype = ctypes.c_int64
    size.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    _libs[dtype] = lib
    return ""


def why_not_for(fwd, dtype: torch.dtype) -> str:
    """'' when `fwd`'s layers (llama_family.LayerWeights) can run the layer kernel."""
    why = why_not(dtype)
    if why:
        return why
    if fwd.cache.dtype != dtype or fwd.cache.device.type != "cpu":
        return "the cache is not on the CPU in the weights' dtype"
    if fwd.head_dim > MAX_HEAD_DIM or fwd.head_dim % 2 or fwd.heads % fwd.kv_heads:
        return f"head size {fwd.head_dim} with {fwd.heads}/{fwd.kv_heads} heads"
    for w in fwd.layers:
        for name, t in vars(w).items():
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_cpu:
                return f"{name} weights are not plain {str(dtype).removeprefix('torch.')} tensors"
            base = t.t() if t.dim() == 2 else t      # matrices are held as transposed views
            if not base.is_contiguous():
                return f"{name} weights are not contiguous"
    return ""


class LayerStack:
    """The C descriptions of a forward's layers, rebuilt when the KV cache is reallocated."""

    def __init__(self, fwd, dtype: torch.dtype):
        self.fwd, self.dtype = fwd, dtype
        lib = _libs[dtype]
        sfx = SUFFIX[dtype]
        self._run = getattr(lib, f"layers_{sfx}")
        self._size = getattr(lib, f"layer_scratch_bytes_{sfx}")
        cfg_inter = fwd.intermediate
        hidden = fwd.layers[0].ln1.shape[0]
        self._shape = _Shape(hidden, fwd.heads, fwd.kv_heads, fwd.head_dim, cfg_inter, 0, fwd.eps, fwd.scaling)
        self._descs = None
        self._cache_key = None
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _refresh(self) -> None:
        cache = self.fwd.cache
        key = (cache.capacity, cache.k[0].data_ptr())
        if key == self._cache_key:
            return
        descs = (_Weights * len(self.fwd.layers))()
        for d, w, kc, vc in zip(descs, self.fwd.layers, cache.k, cache.v):
            for name, t in vars(w).items():
                setattr(d, name, t.data_ptr() if t is not None else None)
            d.k_cache, d.v_cache = kc.data_ptr(), vc.data_ptr()
        self._shape.capacity = cache.capacity
        self._descs, self._cache_key = descs, key

    def __call__(self, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """All layers over h [T, hidden] (in place) at positions pos..pos+T-1; cos/sin [T, D]."""
        self._refresh()
        T = h.shape[0]
        threads = torch.get_num_threads()
        need = self._size(ctypes.addressof(self._shape), T, pos + T, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()), dtype=torch.uint8)
        self._run(ctypes.addressof(self._descs), len(self._descs), ctypes.addressof(self._shape), h.data_ptr(),
                  T, pos, cos.data_ptr(), sin.data_ptr(), self._scratch.data_ptr(), threads)
        return h
