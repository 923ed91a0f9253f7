"""Products of a few bfloat16 rows with a group-wise int4 weight in its canonical form
(engine/targets/qweights.py), through q4.c: the one-token steps and verify passes of an
int4 model on a CPU with AVX512-BF16.

Why a kernel of our own: aten's CPU int4 kernel reads a layout of its own, so a decode
step could only call it through torch, one operation per product, with everything between
the products in torch too; the demo model in int4 decoded slower than in bf16 that way
(45 against 61 tok/s), its per-operation overhead larger than its reads. This kernel reads
the canonical nibbles, so engine/kernels/layer.c can run a whole int4 layer in one call,
and it computes every row as a lone row, whatever the row or thread count (q4.c says how),
so an int4 model's verify passes are its one-token steps bit for bit.

`LOCALCHAT_KERNELS=off` turns it off with the other kernels, `LOCALCHAT_INT4_KERNEL=off`
alone (aten's int4 kernel then)."""
from __future__ import annotations

import ctypes
import threading

import torch

from . import row_kernel

SOURCE = "q4"
GROUPS = (32, 64, 128, 256)

_lib: list = []
_state: list[str] = []
_scratch = threading.local()          # a buffer per thread: engines on two threads never share one


def why_not() -> str:
    """'' when the int4 row kernel runs here (bf16 activations), else why it does not."""
    if not _state:
        _state.append(_load())
    return _state[0]


def available() -> bool:
    return why_not() == ""


def _load() -> str:
    lib, why = row_kernel.library_like(SOURCE, torch.bfloat16, "LOCALCHAT_INT4_KERNEL")
    if lib is None:
        return why
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.linear_q4_bf16.restype = None
    lib.linear_q4_bf16.argtypes = [P, I64, P, P, P, I, P, P, I64, I, I, I, P, I]
    lib.q4_scratch_bytes.restype = I64
    lib.q4_scratch_bytes.argtypes = [I, I, I]
    lib.dequant_q4_bf16.restype = None
    lib.dequant_q4_bf16.argtypes = [P, P, P, I, P, I, I, I]
    lib.dequant_q4_f32.restype = None
    lib.dequant_q4_f32.argtypes = [P, P, P, I, P, I, I, I]
    _lib.append(lib)
    # As the row kernel does: its products against float64's before first use.
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 192), generator=g, dtype=torch.uint8)
    scale = (torch.rand(48, 6, generator=g) * 0.01).to(torch.bfloat16)
    zero = (torch.randn(48, 6, generator=g) * 0.01).to(torch.bfloat16)
    w = ((codes.double() - 8).view(48, 6, 32) * scale.double()[..., None] + zero.double()[..., None]).view(48, 192)
    x = torch.randn(5, 192, generator=g).to(torch.bfloat16)
    want = x.double() @ w.t()
    got = linear(x, codes[:, 0::2] | (codes[:, 1::2] << 4), scale, zero, 32).double()
    if not (got - want).abs().max() <= 1e-2 * want.abs().max():
        _lib.clear()
        return "its self-test products were wrong"
    return ""


def shape_fits(N: int, K: int, group: int) -> bool:
    """Whether an [N, K] weight in groups of `group` takes this kernel."""
    return group in GROUPS and K % 64 == 0 and K % group == 0


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The [N, K] bf16 weights of canonical int4 (its definition in float32, rounded once),
    into `out` (contiguous [N, K] bf16) when given."""
    N, K = q.shape[0], 2 * q.shape[1]
    w = torch.empty(N, K, dtype=torch.bfloat16) if out is None else out
    _lib[0].dequant_q4_bf16(q.data_ptr(), scale.data_ptr(), zero.data_ptr(), group, w.data_ptr(), N, K,
                            torch.get_num_threads())
    return w


def dequantize_f32(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                   out: torch.Tensor) -> torch.Tensor:
    """The same weights in float32, not rounded, into `out` (contiguous [N, K] float32);
    q, scale and zero contiguous rows (a block of a weight's rows is)."""
    N, K = q.shape[0], 2 * q.shape[1]
    _lib[0].dequant_q4_f32(q.data_ptr(), scale.data_ptr(), zero.data_ptr(), group, out.data_ptr(), N, K,
                           torch.get_num_threads())
    return out


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 (unit column stride) @ w.T (+ bias) for w in canonical int4 form."""
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    need = _lib[0].q4_scratch_bytes(M, K, group)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(max(need, 1 << 16), dtype=torch.uint8)
    _lib[0].linear_q4_bf16(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), zero.data_ptr(), group,
                           bias.data_ptr() if bias is not None else None, y.data_ptr(), N, M, N, K,
                           buf.data_ptr(), torch.get_num_threads())
    return y
