"""Products of a few rows (bfloat16 or float32) with a per-channel int8 weight
(engine/targets/qweights.py), through q8.c: the one-token steps and verify passes of an
int8 model on a CPU with AVX-512.

Why a kernel of our own: aten's int8 kernel can only be called through torch, one
operation per product with everything between the products in torch too, and the demo
model in int8 decoded slower than in bf16 that way (47.7 tok/s against llama.cpp's Q8_0 at
112.9). q8.c reads the int8 codes as they are stored, so engine/kernels/layer.c runs whole
int8 layers in one call, and it computes every row as a lone row, whatever the row or
thread count, so an int8 model's verify passes are its one-token steps bit for bit.

`LOCALCHAT_KERNELS=off` turns it off with the other kernels, `LOCALCHAT_INT8_KERNEL=off`
alone (aten's int8 kernel then)."""
from __future__ import annotations

import ctypes
import threading

import torch

from . import row_kernel

SOURCE = "q8"
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}

_fns: dict = {}                   # dtype -> (linear, scratch size); "dequant" -> dequant_q8_bf16
_state: list[str] = []
_scratch = threading.local()          # a buffer per thread: engines on two threads never share one


def why_not() -> str:
    """'' when the int8 kernel runs here (bf16 or float32 activations), else why not."""
    if not _state:
        _state.append(_load())
    return _state[0]


def available() -> bool:
    return why_not() == ""


def _load() -> str:
    lib, why = row_kernel.library_like(SOURCE, torch.float32, "LOCALCHAT_INT8_KERNEL")
    if lib is None:
        return why
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    size = lib.q8_scratch_bytes
    size.restype, size.argtypes = I64, [I, I]
    for dtype, sfx in SUFFIX.items():
        fn = getattr(lib, f"linear_q8_{sfx}")
        fn.restype = None
        fn.argtypes = [P, I64, P, P, P, P, I64, I, I, I, P, I]
        _fns[dtype] = (fn, size)
    lib.dequant_q8_bf16.restype = None
    lib.dequant_q8_bf16.argtypes = [P, P, P, I, I, I]
    _fns["dequant"] = lib.dequant_q8_bf16
    # As the row kernel does: its products against float64's before first use.
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (48, 200), generator=g, dtype=torch.int8)
    for dtype in SUFFIX:
        scale = (torch.rand(48, generator=g) * 0.01).to(dtype)
        x = torch.randn(5, 200, generator=g).to(dtype)
        want = x.double() @ (q.double() * scale.double()[:, None]).t()
        got = linear(x, q, scale).double()
        if not (got - want).abs().max() <= 1e-2 * want.abs().max():
            _fns.clear()
            return "its self-test products were wrong"
    return ""


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride) @ (q * scale[:, None]).T (+ bias), in x's dtype (bf16 or
    float32; scale and bias in it too)."""
    M, K = x.shape
    N = q.shape[0]
    fn, size = _fns[x.dtype]
    y = torch.empty(M, N, dtype=x.dtype)
    need = size(M, K)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(max(need, 1 << 16), dtype=torch.uint8)
    fn(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), bias.data_ptr() if bias is not None else None,
       y.data_ptr(), N, M, N, K, buf.data_ptr(), torch.get_num_threads())
    return y


def dequantize(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The [N, K] bf16 weights of per-channel int8 (q * scale, rounded once) into `out`
    (contiguous [N, K] bf16); q and scale (bf16) contiguous."""
    N, K = q.shape
    _fns["dequant"](q.data_ptr(), scale.data_ptr(), out.data_ptr(), N, K, torch.get_num_threads())
    return out
