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

Kernels: which one multiplies a weight in a given pass is the kernel policy's choice
(engine/kernels/dispatch.py): localchat's own for one-token steps and verify passes where
they build (engine/kernels/q8.c for int8, q4.c for int4 with bf16 activations: they read
the canonical form, and layer.c runs whole quantized layers in one call); elsewhere
PyTorch's own `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu` (CUDA:
`_weight_int4pack_mm`; engine/kernels/aten.py), preferred over torchao's weight-only
configs, which call the same kernels behind a tensor subclass, or dequantize per call when
run eagerly. Each kernel agrees with its format's definition to the rounding of its bf16 output (checked in tests/test_quantized.py)."""
from __future__ import annotations

import math
import threading

import torch

from ..kernels import aten, dispatch, gemm, q4_kernel, q8_kernel
from ..kernels.dispatch import Pass

INT4_GROUPS = (32, 64, 128, 256)   # what the aten int4 kernels accept
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
    """x @ w.T for a per-channel int8 weight: `_linear` in llama_family calls .mm with the
    pass's kind, and the kernel policy (kernels/dispatch.py) picks the product: on a CPU
    where it builds, localchat's own kernel (engine/kernels/q8.c, which also lets
    engine/kernels/layer.c run whole int8 layers), else aten's."""

    def __init__(self, c: dict[str, torch.Tensor], device: torch.device, act_dtype: torch.dtype):
        self.q = c["q"].to(device).contiguous()
        self.scale = c["scale"].to(device, act_dtype).contiguous()
        self.shape = tuple(self.q.shape)
        self.format = "int8"
        self.routes = dispatch.routes(self.format, device, act_dtype)
        self.own_kernel = self.routes[Pass.STEP].product == "q8"
        self.kernel = aten.runs(device, act_dtype, "int8")

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, kind: Pass = Pass.STEP) -> torch.Tensor:
        product = self.routes[kind].pick(x.shape[0])
        if product == "widened":
            scale = self.scale.float()
            return gemm.blocks(x, self.shape[0], lambda n0, n1, out: out.copy_(self.q[n0:n1]).mul_(scale[n0:n1, None]),
                               bias)
        if product == "decoded":
            if self.own_kernel and x.dtype == self.scale.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
                w = q8_kernel.dequantize(self.q, self.scale, _reused(*self.shape, torch.bfloat16, x.device))
            else:
                w = self._dense_reused(x.dtype)
            return torch.mm(x, w.t()) if bias is None else torch.addmm(bias.to(x.dtype), x, w.t())
        if product == "q8" and x.dtype == self.scale.dtype and not torch.compiler.is_compiling():
            b = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
            return q8_kernel.linear(x.contiguous(), self.q, self.scale, b)
        if self.kernel:
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
    kernel takes it (format "int4": a CPU where q4.c builds, bf16 activations; it also lets
    engine/kernels/layer.c run whole int4 layers), else in the device kernel's packed layout
    (format "int4 packed", aten's). The kernel policy (kernels/dispatch.py) picks the product."""

    def __init__(self, c: dict[str, torch.Tensor], device: torch.device, act_dtype: torch.dtype, group: int):
        N, half = c["q"].shape
        self.shape = (N, 2 * half)
        self.group = group
        self.format = dispatch.int4_layout(N, 2 * half, group, device, act_dtype)
        self.routes = dispatch.routes(self.format, device, act_dtype)
        self.canonical = self.format == "int4"
        if self.canonical:
            self.q = c["q"].contiguous()
            self.scale = c["scale"].to(act_dtype).contiguous()
            self.zero = c["zero"].to(act_dtype).contiguous()
            self.kernel = True
            return
        codes = int4_codes(c["q"])
        # [K/group, N, 2]: the kernels' scales-and-zeros layout.
        self.sz = torch.stack([c["scale"], c["zero"]], -1).transpose(0, 1).contiguous().to(device, act_dtype)
        self.kernel = aten.runs(device, act_dtype, "int4")
        if self.kernel:
            self.packed = aten.pack_int4(codes.to(device))
            self._reader = _rows_reader(self.shape, device)
            self._reader.check(self.packed, codes)
        else:
            # No int4 kernel here (e.g. CUDA without bf16): keep the nibbles, dequantize per call.
            self.packed = c["q"].to(device)
            self._reader = None

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, kind: Pass = Pass.STEP) -> torch.Tensor:
        x = x.contiguous()
        product = self.routes[kind].pick(x.shape[0])
        if self.canonical and x.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
            if product == "q4":
                return q4_kernel.linear(x, self.q, self.scale, self.zero, self.group, bias)
            if product == "widened":
                return gemm.blocks(x, self.shape[0], lambda n0, n1, out: q4_kernel.dequantize_f32(
                    self.q[n0:n1], self.scale[n0:n1], self.zero[n0:n1], self.group, out), bias)
            w = q4_kernel.dequantize(self.q, self.scale, self.zero, self.group,
                                     out=_reused(*self.shape, torch.bfloat16, x.device))
            return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
        if product != "aten" or not self.kernel:
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
            packed = aten.pack_int4(((index >> (4 * d)) & 0xF).to(torch.uint8).to(device))
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
