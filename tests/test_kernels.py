"""The row kernels (engine/kernels, bf16 and float32): built with the machine's C compiler
into the cache, right against float64, and every row of a pass computed as a lone row is, whatever the row
count, the thread count or the input's row stride: properties it has by construction (each
output is one fixed sequence of instructions, owned by one thread), so they are asserted
bit for bit. Where the CPU lacks AVX-512 (or AVX512-BF16) a kernel is off and its tests
skip; the engine then runs torch's kernels (test_verify_rows covers both)."""
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import build, gemm, q4_kernel, q8_kernel, row_kernel
from engine.kernels.dispatch import Pass
from engine.models import rows

DTYPES = [torch.bfloat16, torch.float32]
BF16_FLAGS = row_kernel.BUILDS["avx2"][torch.bfloat16][0]     # builds with any x86 compiler


def needs(dtype):
    if not row_kernel.available(dtype):
        pytest.skip(f"{dtype} row kernel: {row_kernel.why_not(dtype)}")
ROOT = Path(__file__).resolve().parent.parent


def _operands(M, K, N, seed=0, bias=False, dtype=torch.bfloat16):
    needs(dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 576, 1536), (3, 100, 7), (6, 2048, 64), (7, 33, 9), (17, 1536, 257),
                                   (65, 64, 12)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_float64(M, K, N, bias, dtype):
    x, w, b = _operands(M, K, N, bias=bias, dtype=dtype)
    assert row_kernel.fits(x, w.t(), b)
    got = row_kernel.linear(x, w.t(), b)
    assert got.dtype == dtype
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    # bf16 output keeps 8 bits of mantissa; float32 accumulation adds far less than that
    rel = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= rel * want.abs() + 1e-3 * want.abs().max()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", [(576, 960), (1536, 576), (2048 + 7, 61)])
def test_every_row_of_a_pass_is_a_lone_row(K, N, dtype):
    x, w, b = _operands(65, K, N, seed=1, bias=True, dtype=dtype)
    lone = [row_kernel.linear(x[r:r + 1], w.t(), b)[0] for r in range(65)]
    for M in rows.WIDTHS:
        out = row_kernel.linear(x[:M], w.t(), b)
        assert all(torch.equal(out[r], lone[r]) for r in range(M)), M


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_and_row_stride_change_no_bit(dtype):
    x, w, _ = _operands(9, 1536, 300, seed=2, dtype=dtype)
    wide = torch.zeros(9, 2000, dtype=dtype)
    wide[:, :1536] = x
    strided = wide[:, :1536]                 # rows 2000 apart, as a slice of a wider buffer
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_kernel.linear(x, w.t())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(row_kernel.linear(x, w.t()), one)
    assert torch.equal(row_kernel.linear(strided, w.t()), one)


def test_fits_only_what_it_computes():
    x, w, b = _operands(4, 64, 32, bias=True)
    assert row_kernel.fits(x, w.t(), b)
    assert not row_kernel.fits(x.half(), w.half().t(), None)             # float16: torch's
    assert not row_kernel.fits(x, w.float().t(), None)                   # mixed dtypes
    assert not row_kernel.fits(x, w, None)                               # not a transposed [N, K] weight
    assert not row_kernel.fits(x.t().contiguous().t(), w.t(), None)      # columns not contiguous
    big = torch.zeros(row_kernel.MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert not row_kernel.fits(big, w.t(), None)                         # a prefill: torch's
    assert not row_kernel.fits(x, w.t(), b.float())


def test_built_once_into_the_cache_then_reused(tmp_path, monkeypatch):
    if build.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path))
    first = build._build(row_kernel.SOURCE, BF16_FLAGS)
    assert first.parent == tmp_path / "kernels" and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert build._build(row_kernel.SOURCE, BF16_FLAGS) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]     # no half-written leftovers
    # other flags are another library, never the cached one
    assert build._build(row_kernel.SOURCE, BF16_FLAGS + ["-DPREFETCH_UNUSED"]) != first
    assert ctypes.CDLL(str(first)).linear_bf16 is not None       # the library it names is the kernel


def test_a_failing_compiler_leaves_torchs_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_why", {})
    assert build.library(row_kernel.SOURCE, BF16_FLAGS) is None
    assert "could not build rows.c" in build.why(row_kernel.SOURCE, BF16_FLAGS)
    assert not list((tmp_path / "kernels").iterdir())
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(build, "_loaded", {})
    assert build.library(row_kernel.SOURCE, BF16_FLAGS) is None
    assert "no C compiler" in build.why(row_kernel.SOURCE, BF16_FLAGS)


def test_turned_off_by_the_environment():
    code = ("from engine.kernels import row_kernel; import torch; from engine.models import rows;"
            "c = rows.check([(576, 960)], torch.bfloat16, torch.device('cpu'));"
            "print(row_kernel.why_not(torch.bfloat16)); print(c.kernel)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "LOCALCHAT_KERNELS": "off"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["turned off (LOCALCHAT_KERNELS=off)", "False"]


# ---------------------------------------------------------------- the int4 kernel (q4.c)

def _int4(N, K, group, M, seed):
    from engine.targets import qweights
    if not q4_kernel.available():
        pytest.skip(f"int4 kernel: {q4_kernel.why_not()}")
    g = torch.Generator().manual_seed(seed)
    c = qweights.quantize_int4(torch.randn(N, K, generator=g) * 0.05, group, torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    return c, x, qweights.dequantize_int4(c)


@pytest.mark.parametrize("N,K,group", [(960, 576, 32), (576, 1536, 64), (40, 256, 128), (48, 512, 256), (16, 64, 32)])
@pytest.mark.parametrize("M", [1, 3, 17, 65])
def test_int4_products_match_the_definition(N, K, group, M):
    c, x, w = _int4(N, K, group, M, seed=N + M)
    b = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = q4_kernel.linear(x, c["q"], c["scale"], c["zero"], group, b)
    want = x.double() @ w.double().t() + b.double()
    # the output keeps 8 bits of mantissa; the float32 sums (around a 128-offset code) far more
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * want.abs().max()).all()


@pytest.mark.parametrize("group", [32, 64])
def test_every_int4_row_is_a_lone_row_at_any_thread_count(group):
    c, x, _ = _int4(320, 768, group, 65, seed=9)
    lone = [q4_kernel.linear(x[r:r + 1], c["q"], c["scale"], c["zero"], group)[0] for r in range(65)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for M in rows.WIDTHS:
                out = q4_kernel.linear(x[:M], c["q"], c["scale"], c["zero"], group)
                assert all(torch.equal(out[r], lone[r]) for r in range(M)), (threads, M)
    finally:
        torch.set_num_threads(before)


def test_int4_kernel_takes_only_shapes_it_computes():
    assert q4_kernel.shape_fits(960, 576, 32) and q4_kernel.shape_fits(64, 512, 256)
    assert not q4_kernel.shape_fits(64, 96, 32)        # K not a multiple of its 64-code blocks
    assert not q4_kernel.shape_fits(64, 576, 128)      # a group that does not divide K
    assert not q4_kernel.shape_fits(64, 512, 16)


# ---------------------------------------------------------------- the int8 kernel (q8.c)

def _int8(N, K, M, seed, dtype):
    from engine.targets import qweights
    if not q8_kernel.available():
        pytest.skip(f"int8 kernel: {q8_kernel.why_not()}")
    g = torch.Generator().manual_seed(seed)
    c = qweights.quantize_int8(torch.randn(N, K, generator=g) * 0.05, dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    return c, x, qweights.dequantize_int8(c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (40, 100), (7, 33)])
@pytest.mark.parametrize("M", [1, 3, 17, 65])
def test_int8_products_match_the_definition(N, K, M, dtype):
    c, x, w = _int8(N, K, M, N + M, dtype)
    b = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = q8_kernel.linear(x, c["q"], c["scale"].to(dtype), b)
    want = x.double() @ w.double().t() + b.double()
    # float32 sums of exact products; the output rounded once to the dtype
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-5 * want.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_int8_row_is_a_lone_row_at_any_thread_count(dtype):
    c, x, _ = _int8(320, 768 + 16, 65, 9, dtype)
    scale = c["scale"].to(dtype)
    lone = [q8_kernel.linear(x[r:r + 1], c["q"], scale)[0] for r in range(65)]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for M in rows.WIDTHS:
                out = q8_kernel.linear(x[:M], c["q"], scale)
                assert all(torch.equal(out[r], lone[r]) for r in range(M)), (threads, M)
    finally:
        torch.set_num_threads(before)


def test_the_quantized_kernels_are_turned_off_each_by_its_own_variable():
    code = ("from engine.kernels import q4_kernel, q8_kernel, row_kernel; import torch;"
            "print(q8_kernel.why_not()); print(q4_kernel.why_not()); print(row_kernel.why_not(torch.float32))")
    env = {**os.environ, "LOCALCHAT_INT8_KERNEL": "off", "LOCALCHAT_INT4_KERNEL": "off"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[:2] == ["turned off (LOCALCHAT_INT8_KERNEL=off)", "turned off (LOCALCHAT_INT4_KERNEL=off)"]
    assert "LOCALCHAT" not in lines[2]                   # the row kernel is not theirs to turn off


@pytest.mark.parametrize("N,K,group", [(960, 576, 32), (576, 1536, 64), (48, 512, 256)])
def test_int4_dequantized_for_a_prefill_is_the_definition_rounded_once(N, K, group):
    c, _, w = _int4(N, K, group, 1, seed=N)
    got = q4_kernel.dequantize(c["q"], c["scale"], c["zero"], group)
    assert got.dtype == torch.bfloat16 and got.shape == (N, K)
    # float32 (q - 8) * scale + zero, as dequantize_int4 computes it, one rounding to bf16
    # (an FMA may round its float32 once less: one bf16 step apart at most)
    assert ((got.float() - w.to(torch.bfloat16).float()).abs() <= 2 ** -7 * w.abs()).all()


def test_int8_dequantized_for_a_prefill_is_torchs_bits():
    # a code times a bf16 scale is exact in float32, so one rounding to bf16 gives the very
    # bits torch's q.to(bf16) * scale gives
    c, _, _ = _int8(960, 576, 1, 9, torch.bfloat16)
    got = q8_kernel.dequantize(c["q"], c["scale"], torch.empty(960, 576, dtype=torch.bfloat16))
    assert torch.equal(got, c["q"].to(torch.bfloat16) * c["scale"][:, None])


@pytest.mark.parametrize("bias", [False, True])
def test_a_prefills_bf16_product_is_right_in_either_form(bias):
    # torch's bf16 GEMM where the CPU has bf16 instructions, else float32's over the weight
    # widened block by block (three blocks and a tail here): either is float32 sums rounded once
    g = torch.Generator().manual_seed(3)
    K, N = 2048, 3 * (gemm.BLOCK // 2048) + 100
    x = torch.randn(44, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else None
    got = gemm.mm(x, w.t(), b)
    assert got.dtype == torch.bfloat16 and got.shape == (44, N)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-4 * want.abs().max()).all()
    assert gemm.native_bf16() == (row_kernel.isa(torch.bfloat16) != "avx2")


def test_the_widened_product_runs_in_and_out_of_inference_mode_and_on_any_thread():
    # its reused block buffer is a normal tensor, whichever mode made it: a buffer made in
    # inference mode could not be filled outside it (the widened path of CPUs without bf16
    # instructions, reached here on any CPU through blocks())
    import threading
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(2 * (gemm.BLOCK // 64) + 3, 64, generator=g)
    want = (x.double() @ w.double().t()).to(torch.bfloat16)

    def product():
        return gemm.blocks(x, w.shape[0], lambda n0, n1, out: out.copy_(w[n0:n1]))
    results = []
    thread = threading.Thread(target=lambda: results.append(product()))
    with torch.inference_mode():
        results.append(product())
        thread.start()
        thread.join()
    results.append(product())
    for got in results:
        assert ((got.double() - want.double()).abs() <= 2 ** -7 * want.double().abs() + 1e-3).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("M", [20, 100])
def test_a_quantized_prefill_product_is_the_definition_in_either_form(kind, M):
    # a prefill of bf16 rows: q8.c's or q4.c's dequantization and
    # torch's bf16 GEMM where the CPU has bf16 instructions; else the weight dequantized
    # block by block in float32 (engine/kernels/gemm.py); within bf16 rounding of float64's
    from engine.targets import qweights
    N, K = 2 * (gemm.BLOCK // 1536) + 40, 1536
    if kind == "int8":
        c, x, w = _int8(N, K, M, 5, torch.bfloat16)
        weight = qweights.Int8Weight(c, torch.device("cpu"), torch.bfloat16)
    else:
        c, x, w = _int4(N, K, 32, M, seed=5)
        weight = qweights.Int4Weight(c, torch.device("cpu"), torch.bfloat16, 32)
    b = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = weight.mm(x, b, Pass.PREFILL)
    want = x.double() @ w.double().t() + b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    # the output rounded to bf16 (2^-8 relative); where the GEMM is bf16, each weight was
    # rounded to bf16 too (2^-9 relative, summed with random signs over K: about 2^-9 of a
    # typical output, a quarter of that of the largest, here allowed four times over)
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 2 ** -9 * want.abs().max()).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_dequantized_in_float32_is_the_definition(group):
    c, _, w = _int4(96, 512, group, 1, seed=4)
    out = torch.empty(96, 512)
    q4_kernel.dequantize_f32(c["q"], c["scale"], c["zero"], group, out)
    # one FMA against torch's product then sum: float32 rounding apart at most
    assert torch.allclose(out, w.float(), rtol=2 ** -22, atol=2 ** -22 * w.abs().max().item())
