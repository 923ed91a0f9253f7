"""Weight-only quantized linear weights: the two formats, their definitions, their kernels.

A format has a *canonical* form, device- and CPU-independent, which is what the disk cache
stores, and a *packed* form, the layout the device's kernel reads:

- int8, per output channel (symmetric): w[n, k] ~= q[n, k] * scale[n], q in [-128, 127].
  Canonical and packed are the same tensors ([N, K] int8, [N] scales).
- int4, group-wise along the input (asymmetric, the "tinygemm" convention):
  w[n, k] ~= (q[n, k] - 8) * scale[n, g] + zero[n, g], q in [0, 15], g = k // group.
  Canonical: q as nibbles [N, K/2] uint8 (even k in the low nibble), scales and zeros
  [N, K/group]. Packed: whatever `_convert_weight_to_int4pack*` makes on this device (its
  CPU layout depends on the CPU's vector width), plus scales-and-zeros [K/group, N, 2].

Scales and zeros are rounded to the activation dtype *before* q is computed, so q is the
best code for the parameters the kernel actually reads.

Kernels: on a CPU with AVX-512, localchat's own for one-token steps and verify passes
(engine/kernels/q8.c for int8, q4.c for int4 with bf16 activations: they read the
canonical form, and layer.c runs whole quantized layers in one call); elsewhere PyTorch's
own `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` (CUDA:
`_weight_int4pack_mm`). Measured on the development CPU (2 threads, bf16, one
decode-step matrix-vector product of SmolLM2-135M's shapes): aten int8 17-46 us per
matrix against 112-337 us for torchao 0.18 `Int8WeightOnlyConfig` run eagerly (its tensor
subclass dequantizes, then multiplies: its fast path exists only under torch.compile), and
aten int4 17-45 us against 29-62 us for torchao's `PrototypeInt4WeightOnlyConfig`, which
calls the same aten kernel behind a tensor-subclass dispatch. Same arithmetic, less
overhead, no dependency: aten it is. Each kernel agrees with its format's definition to
the rounding of its bf16 output (checked in tests/test_quantized.py)."""
from __future__ import annotations

import math
import threading

import torch

from ..kernels import gemm, q4_kernel, q8_kernel

INT4_GROUPS = (32, 64, 128, 256)   # what the aten int4 kernels accept
# Passes of more rows than this (a prompt's prefill) dequantize the weight and run the
# device's dense GEMM: the int8/int4 kernels are matrix-vector kernels, one pass over the
# weight per row, and a 256-row prefill through them is ~10x slower than dequantize +
# GEMM. Decode steps and verify passes (at most 65 rows: max_draft <= 64) stay on the
# kernel, so each row of a verify pass gets exactly what a one-token step gives it.
GEMM_ROWS = 80
# An int4 or int8 prefill (whose rows need not be lone rows) of more rows than this
# dequantizes in C and runs torch's GEMM. int4 on Qwen3-1.7B's matrices: 2.5 against q4.c's
# 3.1 ms at 16 rows, 3.1 against 7.3 at 44 (and 7.8 against 35 ms at 200 rows for the
# dequantization in torch it replaced); q4.c wins up to about 8. int8: Int8Weight.mm.
PREFILL_KERNEL_ROWS = 12
_dense_buf = threading.local()       # _reused's buffer, one per thread
_CHUNK = 1 << 20                   # elements quantized at once: bounds the float32 temporaries


# ---------------------------------------------------------------- definitions (canonical form)

def quantize_int8(w: torch.Tensor, param_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-output-channel symmetric int8 of a [N, K] weight, a few rows at a time."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int8)
    scale = torch.empty(N, dtype=param_dtype)
    step = max(1, _CHUNK // K)
    for a in range(0, N, step):
        rows = w[a:a + step].float()
        s = (rows.abs().amax(1) / 127).to(param_dtype)
        s = torch.where(s == 0, torch.ones_like(s), s)        # an all-zero row: any scale is exact
        q[a:a + step] = torch.round(rows / s.float()[:, None]).clamp_(-128, 127).to(torch.int8)
        scale[a:a + step] = s
    return {"q": q, "scale": scale}


def dequantize_int8(c: dict[str, torch.Tensor]) -> torch.Tensor:
    return c["q"].float() * c["scale"].float()[:, None]


def quantize_int4(w: torch.Tensor, group: int, param_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Group-wise asymmetric int4 of a [N, K] weight (K % group == 0), a few rows at a time."""
    N, K = w.shape
    G = K // group
    nibbles = torch.empty(N, K // 2, dtype=torch.uint8)
    scale = torch.empty(N, G, dtype=param_dtype)
    zero = torch.empty(N, G, dtype=param_dtype)
    step = max(1, _CHUNK // K)
    for a in range(0, N, step):
        rows = w[a:a + step].float().view(-1, G, group)
        lo, hi = rows.amin(-1), rows.amax(-1)
        s = ((hi - lo) / 15).clamp_(min=1e-8).to(param_dtype)
        z = (lo + 8 * s.float()).to(param_dtype)
        q = torch.round((rows - z.float()[..., None]) / s.float()[..., None] + 8).clamp_(0, 15)
        q = q.to(torch.uint8).view(-1, K)
        nibbles[a:a + step] = q[:, 0::2] | (q[:, 1::2] << 4)
        scale[a:a + step], zero[a:a + step] = s, z
    return {"q": nibbles, "scale": scale, "zero": zero}


def int4_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """[N, K/2] nibbles -> [N, K] codes 0..15 (uint8)."""
    return torch.stack([nibbles & 0xF, nibbles >> 4], -1).view(nibbles.shape[0], -1)


def dequantize_int4(c: dict[str, torch.Tensor]) -> torch.Tensor:
    q = int4_codes(c["q"]).float()
    N, K = q.shape
    G = c["scale"].shape[1]
    w = (q.view(N, G, K // G) - 8) * c["scale"].float()[..., None] + c["zero"].float()[..., None]
    return w.view(N, K)


def quantize(w: torch.Tensor, fmt: str, group: int, param_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return quantize_int8(w, param_dtype) if fmt == "int8" else quantize_int4(w, group, param_dtype)


def dequantize(c: dict[str, torch.Tensor]) -> torch.Tensor:
    return dequantize_int4(c) if "zero" in c else dequantize_int8(c)


def concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack quantized weights along the output dimension (q, k, v -> qkv): every format
    here quantizes rows independently, so this equals quantizing the fused matrix."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def int4_problem(N: int, K: int, group: int) -> str | None:
    """Why an [N, K] weight cannot take int4 with this group, or None."""
    if group not in INT4_GROUPS:
        return f"group size {group} is not one the int4 kernels take ({', '.join(map(str, INT4_GROUPS))})"
    if K % group:
        return f"group size {group} does not divide the input width {K}"
    if N % 16:
        return f"output width {N} is not a multiple of 16"
    return None


def table_formats(fmt: str, embeddings: bool, head: str, tied: bool) -> dict[str, str | None]:
    """The format each table outside the layers is held in (None: the activation dtype).
    With `embeddings`, both as the layers. Else the output head in `head` (int8 or exact):
    every token reads it whole, the largest matrix of many models, and int8 per channel
    keeps its logits within a fraction of a percent; a tied table goes with it (it is the
    head, and its rows serve the lookups), an untied embedding table stays exact (a token
    reads one row of it)."""
    if embeddings:
        out = {"embed": fmt, "head": fmt}
    else:
        held = None if head == "exact" else head
        out = {"embed": held if tied else None, "head": held}
    if tied:
        del out["head"]
    return out


# ---------------------------------------------------------------- packed weights (what the forward holds)

def _reused(N: int, K: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An [N, K] view of this thread's buffer for a weight dequantized for a prefill's GEMM,
    valid until the next call: a fresh tensor the size of a large matrix is new pages every
    call (glibc maps allocations over 32 MB anew), which cost a Qwen3-1.7B-shaped prefill
    more than its products."""
    buf = getattr(_dense_buf, "t", None)
    if buf is None or buf.numel() < N * K or buf.dtype != dtype or buf.device != device:
        with torch.inference_mode(False):     # a normal tensor: in place inside inference mode or out of it
            buf = _dense_buf.t = torch.empty(N * K, dtype=dtype, device=device)
    return buf[:N * K].view(N, K)


def packed(c: dict[str, torch.Tensor], device: torch.device, act_dtype: torch.dtype, group: int | None):
    """The packed weight of a canonical form, by its format (int4's carries zero points)."""
    if "zero" in c:
        return Int4Weight(c, device, act_dtype, group)
    return Int8Weight(c, device, act_dtype)


class Int8Weight:
    """x @ w.T for a per-channel int8 weight: `_linear` in llama_family calls .mm. On a CPU
    with AVX-512, localchat's own kernel (engine/kernels/q8.c, which also lets
    engine/kernels/layer.c run whole int8 layers), else aten's."""

    def __init__(self, c: dict[str, torch.Tensor], device: torch.device, act_dtype: torch.dtype):
        self.q = c["q"].to(device).contiguous()
        self.scale = c["scale"].to(device, act_dtype).contiguous()
        self.shape = tuple(self.q.shape)
        self.own_kernel = (device.type == "cpu" and act_dtype in q8_kernel.SUFFIX and q8_kernel.available())
        self.kernel = _int8_kernel_works(device, act_dtype)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, lone_rows: bool = True) -> torch.Tensor:
        """lone_rows: a step or a verify pass, whose rows must each be computed as a lone
        row is (every kernel here does that); a prefill passes False, and one of more than
        PREFILL_KERNEL_ROWS rows takes the weight dequantized in C and torch's GEMM: on the
        matrices of Qwen3.5-35B-A3B's shape that took 5.7 against aten's int8 kernel's 9.6 ms
        and q8.c's 18.7 at 44 rows (a tie at 16: q8.c is a matrix-vector kernel)."""
        if not lone_rows and gemm.widens(x):
            scale = self.scale.float()
            return gemm.blocks(x, self.shape[0], lambda n0, n1, out: out.copy_(self.q[n0:n1]).mul_(scale[n0:n1, None]),
                               bias)
        if x.shape[0] > (GEMM_ROWS if lone_rows else PREFILL_KERNEL_ROWS):
            if self.own_kernel and x.dtype == self.scale.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
                w = q8_kernel.dequantize(self.q, self.scale, _reused(*self.shape, torch.bfloat16, x.device))
            else:
                w = self._dense_reused(x.dtype)
            return torch.mm(x, w.t()) if bias is None else torch.addmm(bias.to(x.dtype), x, w.t())
        elif (self.own_kernel and (lone_rows or not self.kernel) and x.dtype == self.scale.dtype
              and not torch.compiler.is_compiling()):
            b = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
            return q8_kernel.linear(x.contiguous(), self.q, self.scale, b)
        elif self.kernel:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        else:
            # Exact to the definition too: |q| <= 128 is exact in bf16/fp16, and a
            # per-row scale can be applied after the product.
            y = torch.mm(x, self.q.t().to(x.dtype)).mul_(self.scale)
        return y if bias is None else y.add_(bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup from a tied head)."""
        return self.q[ids].to(self.scale.dtype) * self.scale[ids, None]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q.to(dtype).mul_(self.scale.to(dtype)[:, None])

    def _dense_reused(self, dtype: torch.dtype) -> torch.Tensor:
        """dense(), in this thread's reused buffer (_reused)."""
        w = _reused(*self.shape, dtype, self.q.device).copy_(self.q)
        return w.mul_(self.scale.to(dtype)[:, None])

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


class Int4Weight:
    """x @ w.T for a group-wise int4 weight: in its canonical form where localchat's own
    kernel runs (a CPU with AVX512-BF16, bf16 activations: engine/kernels/q4_kernel.py,
    which also lets engine/kernels/layer.c run whole int4 layers), else in the device
    kernel's packed layout (aten's)."""

    def __init__(self, c: dict[str, torch.Tensor], device: torch.device, act_dtype: torch.dtype, group: int):
        N, half = c["q"].shape
        self.shape = (N, 2 * half)
        self.group = group
        self.canonical = (device.type == "cpu" and act_dtype == torch.bfloat16
                          and q4_kernel.shape_fits(N, 2 * half, group) and q4_kernel.available())
        if self.canonical:
            self.q = c["q"].contiguous()
            self.scale = c["scale"].to(act_dtype).contiguous()
            self.zero = c["zero"].to(act_dtype).contiguous()
            self.kernel = True
            return
        codes = int4_codes(c["q"])
        # [K/group, N, 2]: the kernels' scales-and-zeros layout.
        self.sz = torch.stack([c["scale"], c["zero"]], -1).transpose(0, 1).contiguous().to(device, act_dtype)
        self.kernel = _int4_kernel_works(device, act_dtype)
        if self.kernel:
            self.packed = _pack_int4(codes.to(device))
            self._reader = _rows_reader(self.shape, device)
            self._reader.check(self.packed, codes)
        else:
            # No int4 kernel here (e.g. CUDA without bf16): keep the nibbles, dequantize per call.
            self.packed = c["q"].to(device)
            self._reader = None

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, lone_rows: bool = True) -> torch.Tensor:
        """lone_rows: as Int8Weight's. A prefill of more than PREFILL_KERNEL_ROWS rows
        takes the weight dequantized in C and torch's GEMM, faster there than q4.c."""
        x = x.contiguous()
        if self.canonical:
            limit = GEMM_ROWS if lone_rows else PREFILL_KERNEL_ROWS
            if x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
                if x.shape[0] <= limit:
                    return q4_kernel.linear(x, self.q, self.scale, self.zero, self.group, bias)
                if gemm.widens(x):
                    return gemm.blocks(x, self.shape[0], lambda n0, n1, out: q4_kernel.dequantize_f32(
                        self.q[n0:n1], self.scale[n0:n1], self.zero[n0:n1], self.group, out), bias)
                w = q4_kernel.dequantize(self.q, self.scale, self.zero, self.group,
                                         out=_reused(*self.shape, torch.bfloat16, x.device))
                return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
            y = torch.mm(x, self.dense(x.dtype).t())
        elif not self.kernel or x.shape[0] > GEMM_ROWS:
            y = torch.mm(x, self.dense(x.dtype).t())
        elif x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.sz)
        return y if bias is None else y.add_(bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequant_rows(ids)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.canonical and dtype == torch.bfloat16:
            return q4_kernel.dequantize(self.q, self.scale, self.zero, self.group)
        return self._dequant_rows(None).to(dtype)

    def _dequant_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        if self.canonical:
            q = int4_codes(self.q if ids is None else self.q[ids])
            scale, zero = (self.scale, self.zero) if ids is None else (self.scale[ids], self.zero[ids])
        else:
            if self._reader is None:
                q = int4_codes(self.packed if ids is None else self.packed[ids])
            elif ids is None:
                q = self._reader.all_codes(self.packed)
            else:
                q = self._reader.codes(self.packed, ids)
            sz = self.sz if ids is None else self.sz[:, ids]           # [G, n, 2]
            scale, zero = sz[..., 0].t(), sz[..., 1].t()
        n, K = q.shape
        G = scale.shape[1]
        w = (q.view(n, G, K // G).to(scale.dtype) - 8) * scale[..., None] + zero[..., None]
        return w.view(n, K)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale, self.zero] if self.canonical else [self.packed, self.sz]


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> the device kernel's packed layout."""
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # The CUDA converter takes [N, K/2] uint8 with the even k in the high nibble (as torchao
    # feeds it) and tiles K by inner_k_tiles * 16: take the largest tiling that divides K.
    K = codes.shape[1]
    tiles = next(t for t in (8, 4, 2) if K % (t * 16) == 0)
    u8 = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(u8, tiles)


class _PackedRows:
    """Reads single rows back out of a kernel-packed int4 weight, so a tied head can serve
    as the embedding table without a second copy. The packed layout is the kernel's own
    business (on a CPU it interleaves 64 rows for AVX-512, 32 for AVX2), so rather than
    hard-code it, ask the packer: pack a probe whose every code is a digit of its own
    index, and read back where each (row, k) landed. Every layout the packers make keeps
    a block of 64 rows in its own contiguous byte range, so one block (plus the tail
    block, if N is not a multiple of 64) describes the whole tensor; `check` verifies
    that against the real weight when it is packed."""
    PERIOD = 64

    def __init__(self, shape: tuple[int, int], device: torch.device):
        N, K = shape
        self.N, self.K = N, K
        self.full = N - N % self.PERIOD if N > self.PERIOD else 0
        P = N if N <= self.PERIOD else self.PERIOD + N % self.PERIOD
        index = torch.arange(P * K, dtype=torch.int64).view(P, K)
        where = torch.zeros(P * K, dtype=torch.int64)          # packed nibble slot of each index
        digits = max(1, math.ceil(math.log2(P * K) / 4))
        slots = None
        for d in range(digits):
            packed = _pack_int4(((index >> (4 * d)) & 0xF).to(torch.uint8).to(device))
            b = packed.contiguous().view(torch.uint8).reshape(-1).cpu().long()
            nib = torch.stack([b & 0xF, b >> 4], -1).reshape(-1)   # slot s = 2 * byte + high
            slots = torch.arange(nib.numel()) if slots is None else slots
            where |= nib << (4 * d)                                 # index held by each slot
        inverse = torch.empty(P * K, dtype=torch.int64)
        inverse[where] = slots
        self.slot = inverse.view(P, K).to(device)

    def codes(self, packed: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        ids = torch.arange(self.N, device=self.slot.device) if ids is None else ids
        half = self.K // 2
        if self.full:
            tail = ids >= self.full
            probe_row = torch.where(tail, self.PERIOD + ids - self.full, ids % self.PERIOD)
            base = torch.where(tail, torch.full_like(ids, self.full - self.PERIOD), ids - ids % self.PERIOD)
        else:
            probe_row, base = ids, torch.zeros_like(ids)
        s = self.slot[probe_row] + (base * half * 2)[:, None]
        b = packed.view(torch.uint8).reshape(-1)[s // 2]
        return torch.where(s % 2 == 1, b >> 4, b & 0xF)

    def all_codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Every row's codes [N, K], a block pattern at a time (no [N, K] index tensor)."""
        flat = packed.view(torch.uint8).reshape(-1)
        half, P = self.K // 2, self.PERIOD

        def region(data: torch.Tensor, slot: torch.Tensor, rows: int) -> torch.Tensor:
            s = slot.reshape(-1)
            b = data.view(-1, s.numel() // 2)[:, s // 2]          # [blocks, rows_per_block * K]
            return torch.where(s % 2 == 1, b >> 4, b & 0xF).view(rows, self.K)

        if not self.full:
            return region(flat, self.slot, self.N)
        parts = [region(flat[:self.full * half], self.slot[:P], self.full)]
        if self.N > self.full:
            parts.append(region(flat[self.full * half:], self.slot[P:] - P * self.K, self.N - self.full))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def check(self, packed: torch.Tensor, codes: torch.Tensor) -> None:
        n = codes.shape[0]
        ids = torch.tensor(sorted({0, n // 2, n - 1, max(0, n - 2)}), device=packed.device)
        if not torch.equal(self.codes(packed, ids).cpu(), codes[ids.cpu()].cpu()):
            raise RuntimeError("int4 packed layout not understood on this device; use --weights int8")


_READERS: dict[tuple, _PackedRows] = {}


def _rows_reader(shape: tuple[int, int], device: torch.device) -> _PackedRows:
    """One probe per weight shape and device (a model has four or five shapes)."""
    key = (shape, str(device))
    if key not in _READERS:
        _READERS[key] = _PackedRows(shape, device)
    return _READERS[key]


def _int8_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    return _kernel_runs(device, dtype, "int8")


def _int4_kernel_works(device: torch.device, dtype: torch.dtype) -> bool:
    return _kernel_runs(device, dtype, "int4")


_KERNEL_OK: dict[tuple, bool] = {}


def _kernel_runs(device: torch.device, dtype: torch.dtype, fmt: str) -> bool:
    """Whether this torch build has the aten kernel for this device and activation dtype:
    tried once on a small weight and compared with the definition (a kernel that runs
    but answers otherwise would be worse than none)."""
    key = (device.type, dtype, fmt)
    if key not in _KERNEL_OK:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 256, generator=g) * 0.05
        x = torch.randn(2, 256, generator=g).to(dtype)
        try:
            if fmt == "int8":
                c = quantize_int8(w, dtype)
                y = torch.ops.aten._weight_int8pack_mm(x.to(device), c["q"].to(device), c["scale"].to(device))
            else:
                c = quantize_int4(w, 32, dtype)
                sz = torch.stack([c["scale"], c["zero"]], -1).transpose(0, 1).contiguous().to(device)
                packed = _pack_int4(int4_codes(c["q"]).to(device))
                op = (torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu"
                      else torch.ops.aten._weight_int4pack_mm)
                y = op(x.to(device), packed, 32, sz)
            want = x.float() @ dequantize(c).t()
            _KERNEL_OK[key] = bool(torch.allclose(y.float().cpu(), want, rtol=0.02, atol=0.02))
        except (RuntimeError, NotImplementedError):
            _KERNEL_OK[key] = False
    return _KERNEL_OK[key]
