"""The instruction set the C kernels are built for: AVX-512 where the CPU has it (bf16 with
AVX512-BF16), else AVX2 with FMA, per dtype, from the CPU's flags; `LOCALCHAT_ISA` forces
one. The AVX2 build is the one most laptops run, so on an AVX-512 machine the kernel tests
run again under `LOCALCHAT_ISA=avx2`: the same assertions (right against float64, every
row of a pass a lone row at 1 and 2 threads, greedy equal to plain greedy) on its code."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import hardware
from engine.kernels import row_kernel

ROOT = Path(__file__).resolve().parent.parent
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "avx512_bf16", "avx2", "f16c"})
LAPTOP = frozenset({"avx2", "fma", "f16c", "sse4_2"})


def _cpu(monkeypatch, flags):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)


def test_the_best_build_the_cpu_reports_is_chosen_per_dtype(monkeypatch):
    monkeypatch.delenv("LOCALCHAT_ISA", raising=False)
    _cpu(monkeypatch, AVX512)
    assert [row_kernel.choose(d)[0] for d in (torch.bfloat16, torch.float32)] == ["avx512", "avx512"]
    _cpu(monkeypatch, AVX512 - {"avx512_bf16"})      # Skylake-X: AVX-512 without its bf16 dot product
    assert [row_kernel.choose(d)[0] for d in (torch.bfloat16, torch.float32)] == ["avx2", "avx512"]
    _cpu(monkeypatch, LAPTOP)
    isa, flags, why = row_kernel.choose(torch.bfloat16)
    assert (isa, why) == ("avx2", "") and "-mavx2" in flags and not any("512" in f for f in flags)
    _cpu(monkeypatch, frozenset({"sse4_2"}))
    assert row_kernel.choose(torch.float32) == ("", [], "this CPU lacks avx2, fma, f16c")
    # VNNI's 16-bit multiply-add where the CPU has it (Ice Lake, Zen 4, Sapphire Rapids), not on Skylake-X
    _cpu(monkeypatch, AVX512 | {"avx512_vnni"})
    assert "-mavx512vnni" in row_kernel.choose(torch.float32)[1]
    _cpu(monkeypatch, AVX512)
    assert "-mavx512vnni" not in row_kernel.choose(torch.float32)[1]
    monkeypatch.setenv("LOCALCHAT_ISA", "avx2")
    _cpu(monkeypatch, AVX512 | {"avx512_vnni"})
    assert "-mavx512vnni" not in row_kernel.choose(torch.float32)[1]


def test_forced_by_the_environment(monkeypatch):
    _cpu(monkeypatch, AVX512)
    monkeypatch.setenv("LOCALCHAT_ISA", "AVX2")
    assert row_kernel.choose(torch.bfloat16)[0] == "avx2"
    _cpu(monkeypatch, LAPTOP)
    monkeypatch.setenv("LOCALCHAT_ISA", "avx512")
    assert row_kernel.choose(torch.float32)[2] == "this CPU lacks avx512f, avx512bw, avx512vl (LOCALCHAT_ISA=avx512)"
    monkeypatch.setenv("LOCALCHAT_ISA", "neon")
    assert row_kernel.choose(torch.float32)[2] == "LOCALCHAT_ISA=neon is not one of avx512, avx2"


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= hardware.cpu_flags(), reason="this CPU lacks AVX2")
def test_the_avx2_build_passes_the_kernel_tests():
    env = {**os.environ, "LOCALCHAT_ISA": "avx2"}
    check = subprocess.run([sys.executable, "-c", "from engine import kernels; print(kernels.instruction_sets())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == "{'bfloat16': 'avx2', 'float32': 'avx2'}", check.stderr
    tests = ["tests/test_kernels.py", "tests/test_layer_kernel.py", "tests/test_moe.py", "tests/test_gemm.py",
             "tests/test_gguf_kernel.py", "-k", "kernel and not vnni"]      # VNNI is an AVX-512 instruction
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr
    assert out.returncode == 0, out.stdout[-3000:]
    assert "skipped" not in tail, tail                  # every kernel runs in the AVX2 build


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= hardware.cpu_flags(), reason="this CPU lacks AVX2")
def test_doctor_and_describe_name_the_build_that_runs(tiny_llama):
    env = {**os.environ, "LOCALCHAT_ISA": "avx2", "HF_HUB_OFFLINE": "1"}
    doctor = subprocess.run([sys.executable, "-m", "localchat", "doctor", "--model", str(tiny_llama)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 0, doctor.stderr
    assert "Row kernels (bfloat16 AVX2, float32 AVX2)" in doctor.stdout, doctor.stdout
    assert "float32: steps and verify passes: localchat's row kernel (rows.c)" in doctor.stdout, doctor.stdout
    # the AVX2 build has no bf16 instructions: a prefill's bf16 products widen to float32
    code = ("import engine, sys, torch; from engine.kernels import dispatch; "
            "e = engine.open(sys.argv[1], dtype='float32', drafter='none'); "
            "print(dispatch.route('bfloat16', dispatch.Pass.PREFILL, torch.device('cpu'), torch.bfloat16).pick(44)); "
            "print(e.describe()['kernels'])")
    desc = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert desc.returncode == 0 and desc.stdout.strip().splitlines()[-2:] == ["widened", "the avx2 build"], desc.stderr


def test_a_bf16_checkpoint_computes_in_bf16_wherever_the_bf16_kernels_run(monkeypatch):
    # a CPU without bf16 instructions (an AVX2 laptop): torch's bf16 is slow there, ours is not
    from engine import kernels
    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "fast_bf16", lambda device: False)
    if row_kernel.available(torch.bfloat16):
        assert kernels.default_dtype(cpu, torch.bfloat16) == torch.bfloat16
    assert kernels.default_dtype(cpu, torch.float32) == torch.float32      # exact stays exact
    monkeypatch.setattr(row_kernel, "_state", {torch.bfloat16: "turned off (test)"})
    assert kernels.default_dtype(cpu, torch.bfloat16) == torch.float32     # torch's kernels: float32


def test_the_stream_prefetch_is_built_for_intel_only(monkeypatch):
    monkeypatch.delenv("LOCALCHAT_ISA", raising=False)
    _cpu(monkeypatch, AVX512)
    for vendor, off in (("GenuineIntel", False), ("AuthenticAMD", True), ("", True)):
        monkeypatch.setattr(hardware, "cpu_vendor", lambda v=vendor: v)
        for d in (torch.bfloat16, torch.float32):
            assert ("-DSTREAM_PREFETCH=0" in row_kernel.choose(d)[1]) is off


@pytest.mark.skipif(not row_kernel.available(torch.bfloat16), reason="no bf16 row kernel here")
def test_a_build_with_or_without_the_prefetch_gives_the_same_bits():
    """The prefetch is a hint: the two builds' one-row products are equal bit for bit."""
    from engine.kernels import build
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 6144, generator=g).bfloat16(), torch.randn(300, 6144, generator=g).bfloat16()
    flags = [f for f in row_kernel.choose(torch.bfloat16)[1] if not f.startswith("-DSTREAM_PREFETCH")]
    outs = []
    for extra in ([], ["-DSTREAM_PREFETCH=0"]):
        fn = build.library("rows", flags + extra).linear_bf16
        fn.argtypes, fn.restype = row_kernel.ARGTYPES, None
        y = torch.empty(1, 300, dtype=torch.bfloat16)
        fn(x.data_ptr(), 6144, w.data_ptr(), 6144, None, y.data_ptr(), 300, 1, 300, 6144, 2)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0].float(), (x.float() @ w.float().t()), rtol=0.02, atol=0.5)


def test_hidden_cpu_flags_take_the_paths_of_a_cpu_without_them():
    # LOCALCHAT_HIDE_CPU_FLAGS: an AVX-512 bf16 or AMX machine runs what a CPU without bf16
    # instructions runs (an Ice Lake Xeon): bf16 kernels in their AVX2 build, bf16 prefill
    # products widened to float32, float32 the default compute dtype of bf16 checkpoints where
    # no bf16 kernel runs
    env = {**os.environ, "LOCALCHAT_HIDE_CPU_FLAGS": "avx512_bf16, AMX_BF16"}
    code = ("import torch; from engine import hardware, kernels; from engine.kernels import gemm; "
            "print(sorted(hardware.cpu_flags() & {'avx512_bf16', 'amx_bf16'}), hardware.fast_bf16(torch.device('cpu')), "
            "kernels.instruction_sets().get('bfloat16'), gemm.native_bf16())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    bf16_kernel = "avx2" if {"avx2", "fma", "f16c"} <= hardware.cpu_flags() else "None"
    assert out.stdout.split() == ["[]", "False", bf16_kernel, str(bf16_kernel != "avx2")], out.stdout
