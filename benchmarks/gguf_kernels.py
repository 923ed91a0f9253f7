"""The GGUF block kernels (engine/kernels/gguf.c) alone, on one matrix of Qwen3.5-2B's MLP
shape (6144 x 2048) of random valid blocks per format:

- one-row products (a decode step's) per format: weights a second, and the bytes a second
  as a share of the memory read rate measured interleaved in the same run (a sum over 256 MB
  of float32; torch's float32 matrix-vector product is not the baseline: its BLAS threads
  spin after each call, on the cores the block kernel then wants);
- a prefill's rows: the block kernel over M rows against the GEMM over the weight decoded a
  few rows at a time (gguf_kernel.gemm), per M, for the format most files hold (Q4_K) and two
  others; the ratio says where engine/kernels/dispatch.py's GGUF_PREFILL_ROWS should sit.

Medians of interleaved repeats, 2 threads (and 1 for the one-row products).

    python benchmarks/gguf_kernels.py [--repeats 15] [--out benchmarks/results/gguf_kernels.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch  # noqa: E402

from common import machine, write_json  # noqa: E402
from engine.kernels import gguf_kernel  # noqa: E402

N, K = 6144, 2048
ROW_COUNTS = (2, 4, 8, 12, 16, 32, 64)


def _medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, the callables interleaved repeat by repeat."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()                                      # warm: buffers, kernels built, pages touched
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gguf_kernels.json"))
    args = ap.parse_args()
    if not gguf_kernel.available():
        sys.exit(f"no GGUF kernel here: {gguf_kernel.why_not()}")
    g = torch.Generator().manual_seed(0)
    weights = {name: gguf_kernel.random_blocks(name, N, K, g) for name in gguf_kernel.TYPES}
    dense = torch.randn(64 << 20, generator=g)
    x1 = torch.randn(1, K, generator=g)
    one_row = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        fns = {"read": lambda: dense.sum()}
        fns.update({name: (lambda w=w, name=name: gguf_kernel.linear(x1, w, name, K)) for name, w in weights.items()})
        med = _medians(fns, args.repeats)
        for name in gguf_kernel.TYPES:
            read_gbps = dense.numel() * 4 / med["read"] / 1e9
            gbps = weights[name].numel() / med[name] / 1e9
            one_row.append({"format": name, "threads": threads, "gweights_per_s": round(N * K / med[name] / 1e9, 2),
                            "gbytes_per_s": round(gbps, 2), "read_gbytes_per_s": round(read_gbps, 1),
                            "of_read_rate": round(gbps / read_gbps, 3)})
            print(f"{threads} thread(s) {name:7s} {N * K / med[name] / 1e9:6.1f} Gw/s  {gbps:5.1f} GB/s, "
                  f"{gbps / read_gbps:.2f} of the read rate ({read_gbps:.0f} GB/s)")
    torch.set_num_threads(2)
    rows = []
    for name in ("Q4_K", "Q6_K", "Q8_0"):
        w = weights[name]
        for M in ROW_COUNTS:
            x = torch.randn(M, K, generator=g)
            med = _medians({"kernel": lambda: gguf_kernel.linear(x, w, name, K),
                            "gemm": lambda: gguf_kernel.gemm(x, w, name, K)}, args.repeats)
            rows.append({"format": name, "rows": M, "kernel_ms": round(med["kernel"] * 1e3, 2),
                         "gemm_ms": round(med["gemm"] * 1e3, 2), "kernel_speedup": round(med["gemm"] / med["kernel"], 2)})
            print(f"{name} {M:4d} rows: kernel {med['kernel'] * 1e3:6.1f} ms, GEMM over decoded rows "
                  f"{med['gemm'] * 1e3:6.1f} ms (the kernel {med['gemm'] / med['kernel']:.2f}x)")
    write_json(args.out, {"benchmark": "gguf_kernels", "shape": [N, K], "repeats": args.repeats,
                          "activations": "rounded to 16 bits per 32 values", "machine": machine(),
                          "one_row": one_row, "prefill_rows": rows})


if __name__ == "__main__":
    main()
