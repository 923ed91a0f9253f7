"""Matrix products of a few rows (a decode step, a verify pass) through the C kernels in
rows.c, in bfloat16 and float32, and the one place that says which instruction set every
kernel here is built for: AVX-512 with F16C (bf16 with AVX512-BF16), else AVX2 with FMA and F16C
(most laptops and older servers), chosen per dtype from what the CPU reports.
`LOCALCHAT_ISA=avx2` (or `avx512`) forces one, so an AVX-512 machine tests the other build.

Why kernels of our own: at batch 1 a decode step is matrix-vector products, bound by
reading the weights. torch's bf16 product (oneDNN) read a Qwen3-1.7B-shaped layer's
weights at 27 GB/s on the development EPYC where a `sum` reads at ~43; this kernel at
40.5 (1.50x, interleaved in one run: one sequential stream per thread, rows.c). And it computes every row of a pass as it computes
a single row, whatever the row count or thread count, so a one-token step's products are
a verify pass's rows by construction: no two-row padding, no probe (models/rows.py), and
float32 speculation becomes exact where torch's kernels round rows apart.

It is slower than torch's once a pass is compute-bound (bf16, against torch's product of
the same rows: 1.38x at 1 row, 1.0x at 4, 0.94x at 8, 0.82x at 17, 0.37x at 65), so a forward uses it only for the passes whose rows must equal a one-token step's:
one-token steps and verify passes of up to MAX_ROWS rows. Prefill keeps torch's kernels.

`LOCALCHAT_KERNELS=off` turns it off (torch's kernels everywhere), for comparisons."""
from __future__ import annotations

import ctypes
import os

import torch

from .. import hardware
from . import build

SOURCE = "rows"
_AVX512 = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"], ("avx512f", "avx512bw", "avx512vl", "fma", "f16c"))
_AVX2 = (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c"))
# instruction set: {dtype: (compiler flags, CPU flags it needs)}, best first
BUILDS = {
    "avx512": {torch.bfloat16: (_AVX512[0] + ["-mavx512bf16"], _AVX512[1] + ("avx512_bf16",)),
               torch.float32: _AVX512},
    "avx2": {torch.bfloat16: _AVX2, torch.float32: _AVX2},
}
FUNCTIONS = {torch.bfloat16: "linear_bf16", torch.float32: "linear_f32"}
# The one-row streams' software prefetch (rows.c) is for Intel: on the 2-core Xeon VM it took
# the demo's one-token products from 12.4-14.4 GB/s to 17.2-17.9; on the AMD EPYC the
# hardware prefetcher alone kept up, and the prefetch cost rows of 4-12 KB a seventh of the
# read rate whenever the memory read fast (a 2048 x 6144 bf16 product 42.1 GB/s against 49.7
# without it, a `sum` 49.5; equal when it read at ~31; medians of 15 interleaved rounds).
STREAM_PREFETCH_OFF = ["-DSTREAM_PREFETCH=0"]
# linear_bf16 / linear_f32: x, ldx, w, ldw, bias, y, ldy, M, N, K, threads
ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
MAX_ROWS = 65        # the widest verify pass models/rows.py probes (max_draft 64)

_fns: dict[torch.dtype, object] = {}
_state: dict[torch.dtype, str] = {}    # dtype -> "" ready, else why not (absent: not tried yet)


def choose(dtype: torch.dtype) -> tuple[str, list[str], str]:
    """(instruction set, compiler flags, '') of the build `dtype`'s kernels take on this CPU,
    or ('', [], why none does)."""
    forced = os.environ.get("LOCALCHAT_ISA", "").strip().lower()
    if forced and forced not in BUILDS:
        return "", [], f"LOCALCHAT_ISA={forced} is not one of {', '.join(BUILDS)}"
    missing: list[str] = []
    for isa in [forced] if forced else BUILDS:
        flags, cpu = BUILDS[isa][dtype]
        missing = [f for f in cpu if f not in hardware.cpu_flags()]
        if not missing:
            tuning = [] if hardware.cpu_vendor() == "GenuineIntel" else STREAM_PREFETCH_OFF
            # VNNI's 16-bit multiply-add into 32 bits, where the CPU has it (gguf.c's block products)
            vnni = ["-mavx512vnni"] if isa == "avx512" and "avx512_vnni" in hardware.cpu_flags() else []
            return isa, flags + vnni + tuning, ""
    return "", [], f"this CPU lacks {', '.join(missing)}" + (f" (LOCALCHAT_ISA={forced})" if forced else "")


def isa(dtype: torch.dtype) -> str:
    """The instruction set `dtype`'s kernels run in here ('' where they do not run)."""
    return choose(dtype)[0] if available(dtype) else ""


def _load(dtype: torch.dtype) -> str:
    if os.environ.get("LOCALCHAT_KERNELS", "").lower() in ("off", "0", "no", "false"):
        return "turned off (LOCALCHAT_KERNELS=off)"
    if dtype not in FUNCTIONS:
        return f"no row kernel for {dtype}"
    name = FUNCTIONS[dtype]
    _isa, flags, why = choose(dtype)
    if why:
        return why
    lib = build.library(SOURCE, flags)
    if lib is None:
        return build.why(SOURCE, flags)
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = ARGTYPES
    _fns[dtype] = fn
    # A miscompiled or misbehaving library must not decide anyone's tokens: its products
    # against float64's on random matrices (tails in both dimensions) before first use.
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 100), (7, 100), (7,)))
    want = x.double() @ w.double().t() + b.double()
    got = linear(x, w.t(), b).double()
    if not (got - want).abs().max() <= 1e-2 * want.abs().max():
        del _fns[dtype]
        return "its self-test products were wrong"
    return ""


def library_like(source: str, dtype: torch.dtype, env: str):
    """(the library of `source` built with the flags of `dtype`'s row kernel, '') where that
    kernel runs (the same CPU needs), else (None, why not); `env`=off turns it off alone."""
    if os.environ.get(env, "").lower() in ("off", "0", "no", "false"):
        return None, f"turned off ({env}=off)"
    why = why_not(dtype)
    if why:
        return None, why
    flags = choose(dtype)[1]
    lib = build.library(source, flags)
    return lib, "" if lib is not None else build.why(source, flags)


def why_not(dtype: torch.dtype) -> str:
    """'' when the row kernel for `dtype` runs here, else why it does not."""
    if dtype not in _state:
        _state[dtype] = _load(dtype)
    return _state[dtype]


def available(dtype: torch.dtype) -> bool:
    return why_not(dtype) == ""


def fits(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear() takes these: a dtype whose kernel is ready here (why_not() was
    asked; a forward asks at load, models/rows.py), on the CPU, x [M <= MAX_ROWS, K] with
    unit column stride, w_t a transposed view of a contiguous [N, K] weight (as nn.Linear
    and the Llama-family forward hold theirs), bias contiguous; not while a graph is traced.
    Called for every product of a decode step: the cheap tests first, nothing looked up."""
    return (x.dtype in _fns and x.dtype == w_t.dtype and x.dim() == 2 and w_t.dim() == 2 and x.is_cpu
            and x.stride(1) == 1 and w_t.stride(0) == 1 and w_t.stride(1) == x.shape[1] == w_t.shape[0]
            and x.shape[0] <= MAX_ROWS
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
            and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w_t (+ bias); the caller checked fits()."""
    M, K = x.shape
    N = w_t.shape[1]
    y = torch.empty(M, N, dtype=x.dtype)
    _fns[x.dtype](x.data_ptr(), x.stride(0), w_t.data_ptr(), K, bias.data_ptr() if bias is not None else None,
                  y.data_ptr(), N, M, N, K, torch.get_num_threads())
    return y
