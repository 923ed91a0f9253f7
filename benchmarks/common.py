"""Shared helpers for the benchmarks: machine description, medians, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import engine.openmp  # noqa: F401  (before torch loads libgomp: the spin localchat runs with)
import torch


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "kernel_isa": _kernel_isa(),
            "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ}}


# what makes a run emulate an older CPU: ours (LOCALCHAT_ISA) and torch's (aten, oneDNN)
ISA_ENV = ("LOCALCHAT_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _kernel_isa() -> dict:
    try:
        from engine import kernels
        return kernels.instruction_sets()
    except Exception as exc:           # a benchmark of a peer alone need not have our kernels
        return {"error": str(exc)}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def read_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Memory read bandwidth in bytes/s as a decode step sees it: the median time to sum a
    float32 tensor far larger than the caches, on the threads torch uses."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / median(times)


def demo_tokenizer():
    """The demo model's tokenizer (from its GGUF): what the random checkpoints of real shapes
    use, as no other model's tokenizer can be fetched here."""
    from transformers import AutoTokenizer

    from engine import checkpoint
    demo = checkpoint.demo_gguf_path()
    return AutoTokenizer.from_pretrained(demo.parent, gguf_file=demo.name)
