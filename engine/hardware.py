"""What the machine has: the compute device, whether it computes bfloat16 fast, and how
much memory the process uses. (The planner's full inventory grows here.)"""
from __future__ import annotations

import functools
import os
import resource
import sys

import torch


def pick_device(requested: str = "auto") -> torch.device:
    if requested and requested != "auto":
        dev = torch.device(requested)
        if dev.type == "cuda" and not torch.cuda.is_available():
            from .errors import BadRequest
            raise BadRequest(f"--device {requested}: no CUDA device is available; use --device cpu")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bf16(device: torch.device) -> bool:
    """bfloat16 is worth computing in only where the hardware has instructions for it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "mps":
        return True
    if sys.platform == "darwin":
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def default_dtype(device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The checkpoint's own dtype where the device computes it fast, else float32.
    A float32 checkpoint (e.g. an imported GGUF) stays float32: it is exact that way."""
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        if device.type == "cpu":
            return torch.bfloat16 if fast_bf16(device) else torch.float32
        if checkpoint_dtype == torch.bfloat16 and not fast_bf16(device):
            return torch.float16
        return checkpoint_dtype
    return torch.float32


def host_rss() -> int:
    try:
        import psutil
        return psutil.Process(os.getpid()).memory_info().rss
    except Exception:
        return 0


def peak_host_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_allocated(device: torch.device) -> int | None:
    """Bytes allocated by torch on an accelerator; None on CPU (the engine counts its own tensors)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "mps":
        return torch.mps.current_allocated_memory()
    return None
