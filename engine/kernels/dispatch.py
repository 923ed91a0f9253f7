"""The kernel policy: which product multiplies a weight of a given format in a given kind of
pass, on this machine. Model code says what to compute (x @ w.T); each weight says its
format; each pass says its kind; `route()` is the one table that says how (llama.cpp's split
between the graph and the type traits).

Pass kinds:
- STEP: one token. VERIFY: the k+1 rows of a verify pass. Every row of both must be computed
  as a lone row is, whatever the rows beside it: that is what keeps speculation exactly plain
  decoding, so their products are lone-row kernels (matrix-vector ones, whose rows share
  nothing).
- PREFILL: a prompt's rows, which need not be lone rows: a GEMM wherever it is faster.

Formats: the dense dtypes (float32, bfloat16, float16), our int8 and int4 (in the layout our
kernels read; "int4 packed" is torch's own layout, taken where q4.c does not run), and each
GGUF block type (Q4_K, IQ4_XS, ...). The instruction set enters through the kernels that run
here (each library builds for the best of AVX-512 and AVX2 this CPU has, or not at all): a
route names what runs on this CPU, and `Kernels` reports it.

A Route is resolved once, when a weight is made or a forward loaded, and its `pick(rows)` is
all a product asks at run time. `Kernels` is the one report of the policy for a loaded model:
Engine.describe(), `doctor` and the tests read it."""
from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

import torch

from . import aten, gemm, gguf_kernel, q4_kernel, q8_kernel, row_kernel


class Pass(enum.Enum):
    PREFILL = "prefill"
    STEP = "step"
    VERIFY = "verify"


def pass_of(T: int, all_logits: bool) -> Pass:
    """The kind of a forward pass over T positions, all of whose logits are wanted or only the last."""
    if T == 1:
        return Pass.STEP
    return Pass.VERIFY if all_logits and T <= row_kernel.MAX_ROWS else Pass.PREFILL


# What each product is, in the words describe() and doctor use.
PRODUCTS = {
    "rows": "localchat's row kernel (rows.c)",
    "torch": "torch's",
    "gemm": "localchat's GEMM (gemm.c)",
    "widened": "widened to float32 a block at a time, then the float32 GEMM",
    "q8": "localchat's int8 kernel (q8.c)",
    "q4": "localchat's int4 kernel (q4.c)",
    "aten": "torch's packed kernel (aten)",
    "decoded": "decoded, then torch's GEMM",
    "blocks": "localchat's block products (gguf.c)",
    "blocks-gemm": "the GEMM over rows decoded a few at a time (gguf_gemm.c)",
}
ANY = sys.maxsize
DENSE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = ("int8", "int4", "int4 packed", *gguf_kernel.TYPES)
# Passes of more rows than this take the decoded weight and a GEMM even when they are steps or
# verify passes (none is this wide: max_draft <= 64): the int8/int4 kernels are
# matrix-vector kernels, one pass over the weight per row.
GEMM_ROWS = 80
# A prefill's products of more rows than this run a GEMM rather than the lone-row kernels.
# int4 on Qwen3-1.7B's matrices and int8 on Qwen3.5-35B-A3B's: the dequantized weight and
# torch's GEMM win from about 8-16 rows.
QUANT_PREFILL_ROWS = 12
# The GGUF block kernel passes over the weight once per four rows, so its crossover is lower,
# and it depends on the build: past 8 rows in the AVX2 one, past 16 in the AVX-512 one
# (benchmarks/results/gguf_kernels.json, an AVX2 EPYC; gguf_kernels-zen4.json, a Zen 4 EPYC).
GGUF_PREFILL_ROWS = {"avx512": 16, "avx2": 8}


@dataclass(frozen=True)
class Route:
    """A product per number of rows: (up to so many rows, product) in order, the last for any."""
    steps: tuple[tuple[int, str], ...]

    @classmethod
    def of(cls, *spec) -> "Route":
        """Route.of("q8", 1, "aten", 12, "decoded"): q8 for one row, aten up to 12, else decoded."""
        products, bounds = spec[0::2], spec[1::2] + (ANY,)
        return cls(tuple(zip(bounds, products)))

    @property
    def product(self) -> str:
        """The product of a single row."""
        return self.pick(1)

    def pick(self, rows: int) -> str:
        for up_to, product in self.steps:
            if rows <= up_to:
                return product
        return self.steps[-1][1]

    def describe(self, rows: int = ANY) -> str:
        """The products of passes of up to `rows` rows, in words."""
        steps, low = [], 1
        for up_to, product in self.steps:
            if low <= rows:
                steps.append((up_to, product))
            low = up_to + 1
        if len(steps) == 1:
            return PRODUCTS[steps[0][1]]
        parts, low = [], 1
        for up_to, product in steps[:-1]:
            rows = "one row" if up_to == 1 else f"up to {up_to} rows" if low == 1 else f"{low}-{up_to} rows"
            parts.append(f"{PRODUCTS[product]} for {rows}")
            low = up_to + 1
        return ", ".join(parts) + f", else {PRODUCTS[steps[-1][1]]}"


def route(fmt: str, kind: Pass, device: torch.device, act: torch.dtype) -> Route:
    """The product for a weight of format `fmt` in a pass of `kind`, activations in `act`."""
    cpu = device.type == "cpu"
    lone = kind is not Pass.PREFILL
    if fmt in DENSE:
        dtype = DENSE[fmt]
        rows = cpu and row_kernel.available(dtype)
        if lone:
            return Route.of("rows" if rows else "torch")
        wide = ("gemm" if dtype == torch.float32 and cpu and gemm.own_f32() else
                "widened" if dtype == torch.bfloat16 and cpu and not gemm.native_bf16() else "torch")
        return Route.of("rows", 1, wide) if rows else Route.of(wide)
    if fmt == "int8":
        own = cpu and act in q8_kernel.SUFFIX and q8_kernel.available()
        fast = aten.runs(device, act, "int8")
        one = "q8" if own else "aten" if fast else "decoded"
        if lone:
            return Route.of(one, GEMM_ROWS, "decoded")
        if cpu and act == torch.bfloat16 and not gemm.native_bf16():
            return Route.of(one, 1, "widened")
        # a few rows: torch's packed kernel where it runs (it shares the weight's reads among them)
        return Route.of(one, 1, "aten" if fast else one, QUANT_PREFILL_ROWS, "decoded")
    if fmt == "int4":                 # our layout: only where q4.c runs (Int4Weight)
        if lone:
            return Route.of("q4", GEMM_ROWS, "decoded")
        return Route.of("q4", QUANT_PREFILL_ROWS, "widened" if cpu and not gemm.native_bf16() else "decoded")
    if fmt == "int4 packed":
        return Route.of("aten", GEMM_ROWS, "decoded") if aten.runs(device, act, "int4") else Route.of("decoded")
    if fmt in gguf_kernel.TYPES:
        rows = GGUF_PREFILL_ROWS.get(row_kernel.isa(torch.float32), GGUF_PREFILL_ROWS["avx2"])
        return Route.of("blocks") if lone else Route.of("blocks", rows, "blocks-gemm")
    raise ValueError(f"no kernel policy for weights of format {fmt!r}")


def routes(fmt: str, device: torch.device, act: torch.dtype) -> dict[Pass, Route]:
    return {kind: route(fmt, kind, device, act) for kind in Pass}


def int4_layout(N: int, K: int, group: int, device: torch.device, act: torch.dtype) -> str:
    """'int4' (our layout, q4.c's) where q4.c takes this weight, else 'int4 packed' (torch's)."""
    ours = (device.type == "cpu" and act == torch.bfloat16 and q4_kernel.shape_fits(N, K, group)
            and q4_kernel.available())
    return "int4" if ours else "int4 packed"


def dense_mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, product: str,
             pad: bool = False) -> torch.Tensor:
    """x @ w_t (+ bias) for a dense weight by the product its route picked. `pad`: a one-row
    product through torch's kernels runs as two identical rows (models/rows.py: where that
    makes a one-token step's products a verify pass's rows)."""
    if product == "rows" and row_kernel.fits(x, w_t, bias):
        return row_kernel.linear(x, w_t, bias)
    if product in ("gemm", "widened"):
        return gemm.mm(x, w_t, bias)
    if pad and x.shape[0] == 1:
        x = torch.cat([x, x])
        return (torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t))[:1]
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


@dataclass
class Kernels:
    """The policy as a loaded model runs it: which build of the C kernels runs here (or why
    none does), the product of each of its weight formats in each kind of pass, whether a
    verify pass's rows are one-token steps bit for bit, and what runs whole layers or passes
    (a name -> one line: '' where that path runs)."""
    device: str
    build: str
    products: dict[str, dict[Pass, str]] = field(default_factory=dict)
    verify_rows: str = ""
    whole: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, formats: list[str], device: torch.device, act: torch.dtype, verify_rows: str = "",
           whole: dict[str, str] | None = None) -> "Kernels":
        from . import note
        build = note(act) if device.type == "cpu" else "not on this device"
        # (a step or a verify pass is at most row_kernel.MAX_ROWS rows: pass_of)
        products = {f: {k: r.describe(ANY if k is Pass.PREFILL else row_kernel.MAX_ROWS)
                        for k, r in routes(f, device, act).items()} for f in formats}
        return cls(str(device), build, products, verify_rows, dict(whole or {}))

    def lines(self) -> list[str]:
        """One line per group of weight formats that take the same products: theirs in steps
        and verify passes, and in a prefill."""
        groups: dict[tuple[str, str], list[str]] = {}
        for fmt, by_kind in self.products.items():
            groups.setdefault((by_kind[Pass.STEP], by_kind[Pass.PREFILL]), []).append(fmt)
        return [f"{', '.join(fmts)}: " + (f"steps and verify passes: {step}; a prefill: {prefill}"
                                          if step != prefill else step)
                for (step, prefill), fmts in groups.items()]

    def as_dict(self) -> dict:
        return {"kernels": self.build, "verify_rows": self.verify_rows,
                "products": {f: {k.value: v for k, v in by.items()} for f, by in self.products.items()},
                **self.whole}
