"""How fast this machine reads memory: the figure every predicted "tok/s ≤" rests on.

A decode step at batch 1 reads every weight once, so its speed is bounded by the bytes
read over the memory's read rate. The planner used a fixed 20 GB/s for a CPU; this VM
measures 20 to 80 GB/s, so a fixed figure predicts a bound the kernels beat. Here the
rate is measured instead: a torch `sum` over a
tensor far larger than the caches, on the threads torch uses (what a decode step's
GEMVs see), median of a few runs. About half a second, once per machine: the figure is
kept in the cache folder under a key naming the CPU, the thread count and torch, and
`localchat doctor --measure` measures again.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

FILE = "bandwidth.json"


def probe(device: torch.device, nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Read bytes/s of `device`'s memory: the median time to sum `nbytes` of float32."""
    x = torch.ones(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    x.sum()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t)
    del x
    return nbytes / statistics.median(times)


def machine_key(device: torch.device) -> str:
    from .hardware import _cpu_name
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return f"{device.type}|{name}|{os.cpu_count()} cores|{torch.get_num_threads()} threads|torch {torch.__version__}"


def measured(cache_dir: Path, device: torch.device, refresh: bool = False) -> dict:
    """{"cpu" or the device kind: bytes/s, "measured_at": unix time}, from the cache file
    or measured now (and kept) when absent or `refresh`. A probe that cannot run (no room
    for its buffer) returns {} and the planner keeps its defaults."""
    path = Path(cache_dir) / FILE
    key = machine_key(device)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    hit = known.get(key)
    if hit and not refresh and isinstance(hit, dict):
        return hit
    try:
        import psutil
        room = psutil.virtual_memory().available // 8
    except Exception:
        room = 512 << 20
    try:
        rate = probe(device, nbytes=max(64 << 20, min(512 << 20, room)))
    except (RuntimeError, MemoryError):
        return {}
    kinds = ("cuda", "rocm") if device.type == "cuda" else (device.type,)   # torch calls a ROCm GPU cuda
    entry = {**{k: rate for k in kinds}, "measured_at": time.time()}
    known[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass                          # a read-only cache: measured again next time
    return entry


def rates(entry: dict) -> dict:
    """The bandwidth entries of a measurement, as make_plan takes them."""
    return {k: v for k, v in entry.items() if k != "measured_at"}
