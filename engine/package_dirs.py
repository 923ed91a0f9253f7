"""The directories compiled packages are kept in (`<cache>/inductor/<key>/`, one per
model, weight files, dtype, format, torch build, device and CPU: engine/compiled.py
cache_key), marked when used and removed once stale.

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

import json
import shutil
import time
from pathlib import Path

SUPERSEDED_DAYS = 7
UNUSED_DAYS = 30
META = "meta.json"


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
