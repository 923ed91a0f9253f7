"""What the machine has: accelerators and their memory, host RAM, free disk, the CPU;
whether it computes bfloat16 fast; and how much memory the process uses.

Detection never creates a CUDA context (NVML reads the driver), and a machine without
an NVIDIA driver is simply a machine without an NVIDIA GPU. Every figure can be
overridden (`--vram`, `--ram`, `--device`), which is also how the planner's choices are
exercised on a CPU-only machine."""
from __future__ import annotations

import functools
import os
import platform
import re
import resource
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import BadRequest

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str, flag: str = "size") -> int:
    """'8GiB', '8 GB', '512MiB', '1.5g' -> bytes (decimal for GB, binary for GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise BadRequest(f"{flag} {text}: not a size; write it like 8GiB, 16GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Accelerator:
    kind: str            # cuda | rocm | mps
    index: int
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def device(self) -> str:
        return "mps" if self.kind == "mps" else f"cuda:{self.index}"


@dataclass(frozen=True)
class Hardware:
    accelerators: tuple[Accelerator, ...]
    host_total_bytes: int
    host_available_bytes: int
    disk_free_bytes: int
    disk_path: str
    cpu_name: str
    cpu_cores: int
    bf16: bool                       # the CPU has native bf16 instructions
    device: str = "cpu"              # where the engine runs: cpu | cuda:N | mps
    budget_bytes: int = 0            # memory the engine may use on that device
    overrides: tuple[str, ...] = field(default=())   # which figures the user gave

    @property
    def on_accelerator(self) -> bool:
        return self.device != "cpu"


def detect(cache_dir: Path | None = None, vram: str | int | None = None, ram: str | int | None = None,
           device: str | None = None) -> Hardware:
    """The machine's inventory and the budget of the device the engine would use."""
    accs = tuple(_nvidia() or _torch_accelerators())
    try:
        import psutil
        vm = psutil.virtual_memory()
        host_total, host_avail = vm.total, vm.available
    except Exception:
        host_total = host_avail = 0
    disk_path = Path(cache_dir) if cache_dir else Path.home()
    probe = disk_path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    disk_free = shutil.disk_usage(probe).free
    hw = Hardware(accs, host_total, host_avail, disk_free, str(disk_path), _cpu_name(), os.cpu_count() or 1,
                  bool({"avx512_bf16", "amx_bf16"} & cpu_flags()))
    overrides = []
    if ram is not None:
        hw = replace(hw, host_available_bytes=_size(ram, "--ram"))
        overrides.append("ram")
    dev = device if device and device != "auto" else (accs[0].device if accs else "cpu")
    if dev != "cpu" and not any(a.device == dev or (dev == "cuda" and a.kind in ("cuda", "rocm")) for a in accs):
        raise BadRequest(f"--device {dev}: no such device here "
                         f"(found: {', '.join(a.device for a in accs) or 'CPU only'})")
    if dev == "cuda":
        dev = accs[0].device
    acc = next((a for a in accs if a.device == dev), None)
    budget = acc.free_bytes if acc else hw.host_available_bytes
    if vram is not None:
        budget = _size(vram, "--vram")
        overrides.append("vram")
    return replace(hw, device=dev, budget_bytes=budget, overrides=tuple(overrides))


def _size(value, flag: str) -> int:
    return value if isinstance(value, int) else parse_size(value, flag)


def _nvidia() -> list[Accelerator]:
    """NVIDIA GPUs through NVML: no CUDA context, free memory as the driver sees it."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []           # no driver (NVMLError_LibraryNotFound) = no NVIDIA GPU
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(Accelerator("cuda", i, name.decode() if isinstance(name, bytes) else str(name),
                                   int(mem.total), int(mem.free)))
        return out
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _torch_accelerators() -> list[Accelerator]:
    """ROCm (and CUDA without NVML) through torch; Apple through MPS."""
    out = []
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append(Accelerator(kind, i, torch.cuda.get_device_name(i), int(total), int(free)))
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        total = int(torch.mps.recommended_max_memory())
        out.append(Accelerator("mps", 0, "Apple GPU", total, total - int(torch.mps.current_allocated_memory())))
    return out


def _cpuinfo(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo, '' where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


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
    """The CPU's feature flags (/proc/cpuinfo), less those LOCALCHAT_HIDE_CPU_FLAGS names
    (comma-separated): with `avx512_bf16,amx_bf16` a Zen 4 or Sapphire Rapids machine takes
    the code paths of a CPU without bf16 instructions (an Ice Lake Xeon, most laptops), so
    the suite can run them anywhere."""
    hidden = {f.strip().lower() for f in os.environ.get("LOCALCHAT_HIDE_CPU_FLAGS", "").split(",")}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split()) - hidden
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), '' where it says none."""
    return _cpuinfo("vendor_id")


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


def host_total() -> int:
    """Physical memory of the machine (0 if unknown)."""
    try:
        import psutil
        return psutil.virtual_memory().total
    except Exception:
        return 0


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated where `device` keeps tensors: free RAM on a CPU,
    free device memory on CUDA; None where it cannot be told."""
    try:
        if device.type == "cpu":
            import psutil
            return psutil.virtual_memory().available
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
    except Exception:
        pass
    return None


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
