"""The directories compiled packages are kept in (`<cache>/inductor/<key>/`, one per
model, weight files, dtype, format, torch build, device and CPU: cache_key), what is in
them (cached_steps), marked when used and removed once stale.

A key changes whenever what a package was built from changes: the model re-downloaded,
torch upgraded, packages built another way (exported.FORMAT). The new key gets a new
package, and the old directory would stay on disk for good, a copy of the model's weights
each time (656 MB for the demo model in float32, ~15 GB for an 8B model in bf16). So each
time a directory's package is used, the directory is marked (`meta.json`: what it is
for; its modification time: when it was last used), and the other directories are
looked at:

- one for the same model, dtype, weight format and device (its lineage) that no start
  has used for SUPERSEDED_DAYS was superseded: removed. Not at once, because two
  installs with different torch builds may share a cache dir and use it in turn;
- any directory no start has used for UNUSED_DAYS is removed, whatever it is for
  (directories made before they were marked have no meta.json: theirs is the newest
  modification time of anything in them).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch

from . import exported

SUPERSEDED_DAYS = 7
UNUSED_DAYS = 30
META = "meta.json"


def cache_key(name: str, dtype: torch.dtype, weights: str, device: torch.device, stamp: str = "") -> str:
    """The directory name a compiled step is kept under: it is only valid for the model
    (and the very weights, `stamp`: a package holds a copy of them), dtype, weight format,
    torch build, device and the CPU's instruction set it was made for."""
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else ""
    raw = f"{name}|{stamp}|{dtype}|{weights}|{torch.__version__}|{device.type}|{isa}|{exported.FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def weights_stamp(path: Path) -> str:
    """Names, sizes and modification times of a checkpoint's files: a re-downloaded or
    re-converted model gets a new key instead of an old package's weights."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def folder_of(root: Path, key: str = "") -> Path:
    """Where the packages under the cache dir `root` live; with `key`, that key's directory."""
    return Path(root) / "inductor" / key if key else Path(root) / "inductor"


def cached_steps(root: Path) -> list[tuple[Path, int]]:
    """The packages built under the cache dir `root`, with their sizes (each holds a copy
    of its model's weights: `localchat doctor` shows where the disk went)."""
    folder = folder_of(root)
    if not folder.is_dir():
        return []
    return [(p, p.stat().st_size) for p in sorted([*folder.glob("*/*.pt2"), *folder.glob("*/*.so")])
            if not p.name.startswith(".")]


def lineage(name: str, dtype, weights: str, device) -> str:
    """What a package is a version of: its keys differ by what it was built from."""
    return f"{name}|{str(dtype).replace('torch.', '')}|{weights}|{getattr(device, 'type', device)}"


def mark_used(folder: Path, of: str) -> None:
    """Record that the package directory `folder`, of lineage `of`, was used now."""
    (Path(folder) / META).write_text(json.dumps({"lineage": of}) + "\n")


def last_used(folder: Path) -> float:
    """When a package directory was last used or written: the newest modification time of
    the directory and what is in it (the marker is rewritten at each use)."""
    folder = Path(folder)
    return max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])


def lineage_of(folder: Path) -> str | None:
    try:
        return json.loads((Path(folder) / META).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None


def sweep_stale(own: Path, now: float | None = None) -> list[Path]:
    """Remove the stale siblings of the package directory `own` (see the module's note);
    the directories removed. Never raises: another process may be sweeping too."""
    own = Path(own)
    now = time.time() if now is None else now
    mine = lineage_of(own)
    removed = []
    try:
        siblings = [p for p in own.parent.iterdir() if p.is_dir() and p != own]
    except OSError:
        return removed
    for folder in siblings:
        try:
            idle_days = (now - last_used(folder)) / 86400
            same = bool(mine) and lineage_of(folder) == mine
            if idle_days > UNUSED_DAYS or (same and idle_days > SUPERSEDED_DAYS):
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError:
            continue
    return removed
