"""A prefill's products (more rows than a verify pass, rows that need not be lone rows).

float32: gemm.c's kernel on CPUs other than Intel's, where it builds (the row kernels'
instruction set), else torch's (MKL). MKL's float32 GEMM takes a slower path off Intel: on the
2-core AMD EPYC, at 44 rows, the demo model's products ran at 126-148 GFLOP/s through it and
at 154-192 through gemm.c, Qwen3-1.7B's at 86-121 against 164-191 (medians, one run); the
demo's float32 prefill went from 444 to 620 tok/s. On Intel MKL takes its fast path, and
stays: on the 2-core Xeon, gemm.c against MKL in total over the demo's products was 0.97x at
44 rows and 0.90x at 200, over Qwen3-1.7B's 1.45x and 0.72x; held to AVX2, 0.69x / 0.88x
and 1.12x / 0.85x (medians, one run each) — a prefill chunk is usually far wider than 44
rows. `LOCALCHAT_GEMM_KERNEL=on` uses gemm.c on any CPU it builds for (the tests do), `=off`
nowhere.

bfloat16: torch's bf16 GEMM where the CPU has bfloat16 instructions, and elsewhere the same
product in float32 (the float32 GEMM above), the weight widened block by block into a reused
buffer and the result rounded to bf16 once, as a bf16 GEMM rounds its float32 sums. Without
bf16 instructions, oneDNN's bf16 GEMM of 44 rows by the demo model's shapes took 2.0-2.2 ms
where widening and float32's took 0.48-0.52 (2-core Xeon, torch held to AVX2 by
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS). On the EPYC held to AVX2
that way, gemm.c took the demo's int8 prefill from 408 to 572 tok/s and int4's from 351 to
383.

Which one runs follows the row kernels' instruction set (row_kernel.choose): their AVX-512
build needs AVX512-BF16, so `LOCALCHAT_ISA=avx2` gives the float32 products as well. Only
where the bf16 row kernel runs: then every pass whose rows are compared with a one-token
step's runs that kernel, and a prefill's products may round as they like (without it,
models/rows.py's probe vouches for torch's bf16 products, and those are kept)."""
from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch

from .. import hardware
from . import row_kernel

SOURCE = "gemm"

BLOCK = 1 << 20          # weight elements widened at once: 4 MB, in cache while the GEMM reads it
_buf = threading.local()


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether bf16 products run as torch's bf16 GEMM here."""
    return row_kernel.isa(torch.bfloat16) != "avx2"


def widens(x: torch.Tensor) -> bool:
    """Whether a prefill's product with these bf16 activations runs in float32 here."""
    return x.dtype == torch.bfloat16 and x.is_cpu and not native_bf16() and not torch.compiler.is_compiling()


_lib: list = []                # [the library or None, why not]
_scratch = threading.local()


def why_not() -> str:
    """'' when gemm.c's float32 GEMM runs here, else why not."""
    if not _lib:
        lib, why = row_kernel.library_like(SOURCE, torch.float32, "LOCALCHAT_GEMM_KERNEL")
        if lib is not None:
            P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.gemm_scratch_bytes.restype, lib.gemm_scratch_bytes.argtypes = I64, [I, I]
            lib.gemm_f32.restype = None
            lib.gemm_f32.argtypes = [P, I64, P, I64, P, P, I64, I, I, I, P, I]
        _lib[:] = [lib, why]
        if lib is not None:
            # As the row kernels do: its products against float64's before first use.
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*shape, generator=g) for shape in ((53, 100), (19, 100), (19,)))
            want = x.double() @ w.double().t() + b.double()
            got = f32(x, w.t(), b).double()
            if not (got - want).abs().max() <= 1e-4 * want.abs().max():
                _lib[:] = [None, "its self-test products were wrong"]
    return _lib[1]


@functools.lru_cache(maxsize=None)
def own_f32() -> bool:
    """Whether a prefill's float32 products run gemm.c's kernel here (the module doc)."""
    forced = os.environ.get("LOCALCHAT_GEMM_KERNEL", "").strip().lower() in ("on", "1", "yes", "true")
    return (forced or hardware.cpu_vendor() != "GenuineIntel") and why_not() == ""


def fits(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether mm() takes these to f32(): float32 on the CPU, x with unit column stride, w_t
    a transposed view of an [N, K] weight with unit column stride, bias contiguous, where
    own_f32()."""
    return (x.dtype == w_t.dtype == torch.float32 and x.dim() == 2 and w_t.dim() == 2 and x.is_cpu
            and x.stride(1) == 1 and w_t.stride(0) == 1 and x.shape[1] == w_t.shape[0]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and not torch.compiler.is_compiling() and own_f32())


def f32(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w_t (+ bias) through gemm.c, for x [M, K] (unit column stride) and w_t [K, N] a
    transposed view of an [N, K] weight with unit column stride, where why_not() is ''."""
    lib = _lib[0]
    M, K = x.shape
    N = w_t.shape[1]
    y = torch.empty(M, N, dtype=torch.float32)
    lib.gemm_f32(x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.stride(1),
                 bias.data_ptr() if bias is not None else None, y.data_ptr(), N, M, N, K,
                 scratch(lib.gemm_scratch_bytes(M, K)), torch.get_num_threads())
    return y


def scratch(nbytes: int) -> int:
    """The address of this thread's reused buffer of at least nbytes, 64-byte aligned: where
    gemm.c packs a pass's rows (its callers here and in gguf_kernel.py)."""
    need = nbytes // 4 + 16
    buf = getattr(_scratch, "t", None)
    if buf is None or buf.numel() < need:
        with torch.inference_mode(False):          # a normal tensor, made in or out of inference mode
            buf = _scratch.t = torch.empty(need, dtype=torch.float32)
    return buf.data_ptr() + (-buf.data_ptr()) % 64


def mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w_t (+ bias), as torch.mm / torch.addmm compute it, for any x [M, K] and w_t [K, N]."""
    if w_t.dtype != torch.bfloat16 or not widens(x):
        if fits(x, w_t, bias):
            return f32(x, w_t, bias)
        return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
    w = w_t.t()                                   # [N, K]
    return blocks(x, w.shape[0], lambda n0, n1, out: out.copy_(w[n0:n1]), bias)


def blocks(x: torch.Tensor, N: int, fill, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) in float32, rounded to bf16 once, for a weight w [N, K] that
    fill(n0, n1, out) writes rows n0..n1-1 of, in float32, into out [n1 - n0, K] (a
    quantized weight dequantizes itself there, block by block)."""
    K = x.shape[1]
    xf = x.float()
    y = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    step = max(1, BLOCK // max(K, 1))
    buf = getattr(_buf, "t", None)
    if buf is None or buf.numel() < step * K:
        with torch.inference_mode(False):     # a normal tensor: filled in place inside inference mode or out of it
            buf = _buf.t = torch.empty(step * K, dtype=torch.float32)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        wb = buf[:(n1 - n0) * K].view(n1 - n0, K)
        fill(n0, n1, wb)
        yb = mm(xf, wb.t(), None if bias is None else bias[n0:n1].float())
        y[:, n0:n1] = yb
    return y
