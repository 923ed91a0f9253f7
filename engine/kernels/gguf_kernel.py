"""Products with weights in GGUF's block formats, as the file stores them (gguf.c): Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
(blocks of 256). A weight is a uint8 tensor [N, row_bytes], each row K / block_size blocks,
exactly the bytes of the file (a view into its memory map).

linear(): one-token steps, verify passes and short prefills, every row a lone row: the
file's weights times the activations rounded to 16 bits per block of the format (32 or 256
values; gguf.c), multiplied in integers and summed in float32.
gemm(): a prefill's products over many rows: gemm.c's GEMM over the weight decoded a few
rows at a time into a small buffer (gguf_gemm.c), never the whole weight at once.
dequantize(): rows decoded to the file's own float32 weights, bit for bit what gguf-py's
`gguf.quants.dequantize` gives.

Built with the float32 row kernel's instruction set (AVX-512 or AVX2), and with
-ffp-contract=off: the decoders round each product and sum as ggml does."""
from __future__ import annotations

import ctypes
import os

import torch

from . import build, row_kernel
from .gemm import scratch

SOURCE = "gguf_gemm"        # gguf.c with gemm.c fed decoded rows
# The formats read here, by their GGUF type ids (gguf.GGMLQuantizationType).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
NAMES = {v: k for k, v in TYPES.items()}

_lib: list = []                # [the library or None, why not]


def why_not() -> str:
    """'' when the block kernels run here, else why not."""
    if not _lib:
        _lib[:] = [None, ""]
        _lib[1] = _load()
    return _lib[1]


def available() -> bool:
    return why_not() == ""


def _load() -> str:
    if os.environ.get("LOCALCHAT_GGUF_KERNEL", "").lower() in ("off", "0", "no", "false"):
        return "turned off (LOCALCHAT_GGUF_KERNEL=off)"
    why = row_kernel.why_not(torch.float32)
    if why:
        return why
    flags = row_kernel.choose(torch.float32)[1] + ["-ffp-contract=off"]
    lib = build.library(SOURCE, flags)
    if lib is None:
        return build.why(SOURCE, flags)
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_linear_f32.restype = lib.gguf_dequant_f32.restype = I
    lib.gguf_linear_f32.argtypes = [I, P, I64, P, I64, P, I64, I, I, I, I]
    lib.gguf_dequant_f32.argtypes = [I, P, I64, P, I64, I, I, I]
    lib.gguf_gemm_f32.restype = I
    lib.gguf_gemm_f32.argtypes = [I, P, I64, P, I64, P, P, I64, I, I, I, P, I]
    lib.gemm_scratch_bytes.restype, lib.gemm_scratch_bytes.argtypes = I64, [I, I]
    lib.gguf_block.restype = I
    lib.gguf_block.argtypes = [I, ctypes.POINTER(I), ctypes.POINTER(I)]
    _lib[0] = lib
    # A miscompiled library must not decide anyone's tokens: a K-quant and a legacy block
    # decoded against gguf-py's own reading of the same bytes, before first use.
    from gguf import GGMLQuantizationType, quants
    g = torch.Generator().manual_seed(0)
    for name in ("Q4_K", "Q5_0"):
        w = random_blocks(name, 3, 512, g)
        want = torch.from_numpy(quants.dequantize(w.numpy(), GGMLQuantizationType[name]).reshape(3, 512))
        if not torch.equal(dequantize(w, name, 512), want):
            _lib[0] = None
            return f"its self-test blocks decoded wrong ({name})"
        x = torch.randn(2, 512, generator=g)
        xr = rounded_activations(x, name)
        ref = xr @ want.double().t()
        bound = 2 * 512 * 2.0 ** -24 * (xr.abs() @ want.double().abs().t())
        if not ((linear(x, w, name, 512).double() - ref).abs() <= bound).all():
            _lib[0] = None
            return f"its self-test products came out wrong ({name})"
    return ""


def rounded_activations(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [M, K] as the products of a weight in format `name` read it, in float64: per block
    of the format (32 values, or 256 for the K-quants and IQ4_XS), s = largest |x| / 32767
    and x / s rounded to the nearest (even) integer, computed in float32 as gguf.c does."""
    c = x.float().reshape(x.shape[0], -1, block(name)[0])
    mx = c.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(32767.0) / mx, torch.zeros_like(mx))
    return ((c * inv).round().double() * (mx / 32767.0).double()).view(x.shape)


def block(name: str) -> tuple[int, int]:
    """(weights, bytes) a block of the format holds (where the kernels run here)."""
    why_not()
    bs, nbytes = ctypes.c_int(), ctypes.c_int()
    _lib[0].gguf_block(TYPES[name], ctypes.byref(bs), ctypes.byref(nbytes))
    return bs.value, nbytes.value


def row_bytes(name: str, K: int) -> int:
    bs, nbytes = block(name)
    if K % bs:
        raise ValueError(f"{name}: a row of {K} weights is not a whole number of {bs}-weight blocks")
    return K // bs * nbytes


def linear(x: torch.Tensor, w: torch.Tensor, name: str, K: int) -> torch.Tensor:
    """x [M, K] @ w.T in float32 for a weight w [N, row_bytes] in format `name`; x is
    widened to float32 first (bf16 exactly)."""
    xf = _operands(x, w, name, K)
    M, N = xf.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if _lib[0].gguf_linear_f32(TYPES[name], xf.data_ptr(), xf.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(),
                               N, M, N, K, torch.get_num_threads()) == -2:
        raise MemoryError(f"{name} product: no memory for its rounded activations")
    return y


def _operands(x: torch.Tensor, w: torch.Tensor, name: str, K: int) -> torch.Tensor:
    """x as float32 rows with unit column stride, once x and w are checked to fit K."""
    xf = x.float().contiguous() if x.dtype != torch.float32 or x.stride(1) != 1 else x
    if xf.shape[1] != K or w.dtype != torch.uint8 or w.stride(1) != 1 or w.shape[1] != row_bytes(name, K):
        raise ValueError(f"{name} product: x {tuple(x.shape)} and weight {tuple(w.shape)} do not fit K={K}")
    return xf


def gemm(x: torch.Tensor, w: torch.Tensor, name: str, K: int) -> torch.Tensor:
    """x [M, K] @ w.T in float32 for a prefill's many rows (not lone rows: a row's
    sums do not depend on the rows beside it, but they are not linear()'s)."""
    xf = _operands(x, w, name, K)
    M, N = xf.shape[0], w.shape[0]
    lib = _lib[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if lib.gguf_gemm_f32(TYPES[name], xf.data_ptr(), xf.stride(0), w.data_ptr(), w.stride(0),
                         None, y.data_ptr(), N, M, N, K,
                         scratch(lib.gemm_scratch_bytes(M, K)), torch.get_num_threads()) == -2:
        raise MemoryError(f"{name} product: no memory for its decoded rows")
    return y


def dequantize(w: torch.Tensor, name: str, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [N, K] of w [N, row_bytes] in format `name`, into `out` if given."""
    N = w.shape[0]
    if w.dtype != torch.uint8 or w.stride(1) != 1 or w.shape[1] != row_bytes(name, K):
        raise ValueError(f"{name} weight {tuple(w.shape)} does not hold rows of K={K}")
    out = torch.empty(N, K, dtype=torch.float32) if out is None else out
    _lib[0].gguf_dequant_f32(TYPES[name], w.data_ptr(), w.stride(0), out.data_ptr(), out.stride(0), N, K,
                             torch.get_num_threads())
    return out


def random_blocks(name: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """A weight [N, row_bytes] of valid random blocks: random codes and scale bytes, each
    half-float scale a finite value of a weight's size (random bytes there could be a NaN)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    bs, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = torch.randint(0, 256, (N * K // bs, nbytes), generator=g, dtype=torch.uint8)
    halves = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(name, (0,))
    for at in halves:
        d = (torch.rand(blocks.shape[0], generator=g) * 0.02 + 1e-3).to(torch.float16)
        blocks[:, at:at + 2] = d.view(torch.uint8).view(-1, 2)
    return blocks.view(N, K // bs * nbytes)
