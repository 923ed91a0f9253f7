"""A prefill's bfloat16 products (more rows than a verify pass): torch's bf16 GEMM where the
CPU has bfloat16 instructions, and elsewhere the same product in float32, the weight widened
block by block into a reused buffer and the result rounded to bf16 once, as a bf16 GEMM
rounds its float32 sums. Without bf16 instructions, oneDNN's bf16 GEMM of 44 rows by the
demo model's shapes took 2.0-2.2 ms where widening and float32's took 0.48-0.52 (2-core Xeon,
torch held to AVX2 by ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS).

Which one runs follows the row kernels' instruction set (row_kernel.choose): their AVX-512
build needs AVX512-BF16, so `LOCALCHAT_ISA=avx2` gives the float32 products as well. Only
where the bf16 row kernel runs: then every pass whose rows are compared with a one-token
step's runs that kernel, and a prefill's products may round as they like (without it,
models/rows.py's probe vouches for torch's bf16 products, and those are kept)."""
from __future__ import annotations

import functools
import threading

import torch

from . import row_kernel

BLOCK = 1 << 20          # weight elements widened at once: 4 MB, in cache while the GEMM reads it
_buf = threading.local()


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether bf16 products run as torch's bf16 GEMM here."""
    return row_kernel.isa(torch.bfloat16) != "avx2"


def widens(x: torch.Tensor) -> bool:
    """Whether a prefill's product with these bf16 activations runs in float32 here."""
    return x.dtype == torch.bfloat16 and x.is_cpu and not native_bf16() and not torch.compiler.is_compiling()


def mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w_t (+ bias), as torch.mm / torch.addmm compute it, for any x [M, K] and w_t [K, N]."""
    if w_t.dtype != torch.bfloat16 or not widens(x):
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
        buf = _buf.t = torch.empty(step * K, dtype=torch.float32)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        wb = buf[:(n1 - n0) * K].view(n1 - n0, K)
        fill(n0, n1, wb)
        yb = torch.mm(xf, wb.t()) if bias is None else torch.addmm(bias[n0:n1].float(), xf, wb.t())
        y[:, n0:n1] = yb
    return y
