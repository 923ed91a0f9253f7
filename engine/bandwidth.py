"""How fast this machine reads memory: the figure every predicted "tok/s ≤" rests on.

A decode step at batch 1 reads every weight once, so its speed is bounded by the bytes
read over the memory's read rate. The planner used a fixed 20 GB/s for a CPU; this VM
measures 20 to 80 GB/s, so a fixed figure predicts a bound the kernels beat. Here the
rate is measured instead: a torch `sum` over a
tensor far larger than the caches, on the threads torch uses (what a decode step's
GEMVs see), median of a few runs. About half a second, once per machine: the figure is
kept in the cache folder under a key naming the CPU, the thread count and torch, and
`localchat doctor --measure` measures again.

A probe run while other processes keep the cores busy (a build, a second model) reads a
fraction of the real rate: the probe's threads wait for the slowest one. Beside a
compiler it read 8 GB/s where the idle machine reads 20-22, and that figure, kept, set every
bound and `setup`'s recommendation. So the probe also counts the CPU time other processes
took while it ran with no core idle; a figure taken among more than BUSY_CORES of theirs is
marked busy and measured again once RETRY_S has passed, keeping the higher figure, until a
quiet one replaces it.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

FILE = "bandwidth.json"
BUSY_CORES = 0.25       # other processes' CPU during the probe, in cores, above which it is busy
IDLE_CORES = 0.5        # ... unless this much stayed idle meanwhile
RETRY_S = 600           # how long a busy figure stands before it is measured again


def _cpu_marks() -> tuple[float, float, float] | None:
    """(seconds the CPUs were busy, seconds they were idle, this process's CPU seconds) so
    far; None where psutil cannot say."""
    try:
        import psutil
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        # guest time is counted in user time too
        busy = sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        return busy, idle, sum(psutil.Process().cpu_times()[:2])
    except Exception:
        return None


def _competing_cores(before, after, wall: float) -> float:
    """Cores' worth of CPU that other processes (and the hypervisor: steal) took between two
    marks while no core was left idle. Work beside idle cores took nothing from the probe's
    threads (a container's host busy with others' work, say), so it does not count."""
    busy, idle, own = (a - b for a, b in zip(after, before))
    if wall <= 0 or idle / wall >= IDLE_CORES:
        return 0.0
    return max(0.0, busy - own) / wall


def probe(device: torch.device, nbytes: int = 512 << 20, reps: int = 5) -> tuple[float, float | None]:
    """(read bytes/s of `device`'s memory: the median time to sum `nbytes` of float32, other
    processes' CPU meanwhile in cores, None where it cannot be told)."""
    before, t0 = _cpu_marks(), time.perf_counter()
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
    after = _cpu_marks()
    others = _competing_cores(before, after, time.perf_counter() - t0) if before and after else None
    return nbytes / statistics.median(times), others


def machine_key(device: torch.device) -> str:
    from .hardware import _cpu_name
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return f"{device.type}|{name}|{os.cpu_count()} cores|{torch.get_num_threads()} threads|torch {torch.__version__}"


def measured(cache_dir: Path, device: torch.device, refresh: bool = False) -> dict:
    """{"cpu" or the device kind: bytes/s, "measured_at": unix time, and "busy": other
    processes' cores where they disturbed the probe}, from the cache file, or measured now
    (and kept) when absent, busy and RETRY_S old, or `refresh`. A busy figure that a busy
    probe does not beat stays. A probe that cannot run (no room for its buffer) returns {}
    and the planner keeps its defaults."""
    path = Path(cache_dir) / FILE
    key = machine_key(device)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    hit = known.get(key)
    if not isinstance(hit, dict):
        hit = None
    if hit and not refresh and not (hit.get("busy") and time.time() - hit.get("measured_at", 0) > RETRY_S):
        return hit
    try:
        import psutil
        room = psutil.virtual_memory().available // 8
    except Exception:
        room = 512 << 20
    try:
        rate, others = probe(device, nbytes=max(64 << 20, min(512 << 20, room)))
    except (RuntimeError, MemoryError):
        return hit or {}
    known[key] = entry = merged(hit, device, rate, others, refresh)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass                          # a read-only cache: measured again next time
    return entry


def merged(hit: dict | None, device: torch.device, rate: float, others: float | None, refresh: bool = False,
           now: float | None = None) -> dict:
    """The entry to keep after a probe read `rate` while other processes took `others` cores:
    a quiet figure, or an asked-for one, replaces what was kept; a busy one replaces only a
    lower busy figure (a busy figure kept is retried RETRY_S after this probe)."""
    kinds = ("cuda", "rocm") if device.type == "cuda" else (device.type,)   # torch calls a ROCm GPU cuda
    entry = {**{k: rate for k in kinds}, "measured_at": time.time() if now is None else now}
    if device.type != "cpu" or others is None or others <= BUSY_CORES:
        return entry
    entry["busy"] = round(others, 2)
    if hit and hit.get("busy") and not refresh and hit.get(kinds[0], 0) >= rate:
        return {**hit, "measured_at": entry["measured_at"]}
    return entry


def rates(entry: dict) -> dict:
    """The bandwidth entries of a measurement, as make_plan takes them."""
    return {k: v for k, v in entry.items() if k not in ("measured_at", "busy")}
