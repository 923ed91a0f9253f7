"""What localchat derives from a model and keeps in its cache directory: quantized copies
(`quantized/`), routing counts of a mixture (`routing/`), fidelity figures (`fidelity/`).
GGUF imports (`imports/`) are models of their own. Kernel builds and the measured read rate
belong to the machine, not to a model.

`localchat models` lists these beside each model and removes them with it; `prune` removes
the ones whose model is gone."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .checkpoint import default_cache_dir
from .targets.qcache import source_identity


def disk_bytes(path: Path) -> int:
    """Bytes a file or folder takes on disk, as `du` counts them (allocated blocks, each
    inode once, symbolic links not followed)."""
    seen, total = set(), 0
    paths = [path] if not path.is_dir() or path.is_symlink() else [path, *path.rglob("*")]
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_blocks * 512
    return total


def identity(model: Path) -> str | None:
    """qcache.source_identity, or None where the model's files cannot be read."""
    try:
        return source_identity(model)
    except OSError:
        return None


def derived(model: Path, cache_dir: Path | None = None, resume_dir: Path | None = None) -> list[Path]:
    """The caches derived from the checkpoint folder `model` (with `resume_dir`, the
    conversations' caches a resume store keeps of it too)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    where = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:12]
    out = sorted((root / "quantized").glob(f"*-{where}-*"))
    ident = identity(model)
    if ident:
        out += sorted((root / "fidelity").glob(f"{ident[:32]}-*.json"))
        routing = root / "routing" / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"
        if routing.is_file():
            out.append(routing)
        if resume_dir is not None:
            out += sorted(Path(resume_dir).glob(f"{ident[:16]}-*.safetensors"))
    return out


def orphans(models: list[Path], cache_dir: Path | None = None, resume_dir: Path | None = None) -> list[Path]:
    """Derived caches none of these checkpoint folders owns any more (a model removed,
    re-downloaded or edited since): quantized copies, routing counts and fidelity figures,
    and conversations' caches in `resume_dir`."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    owned = {p for m in models for p in derived(m, root)}
    idents = {i for m in models if (i := identity(m))}
    out = []
    if resume_dir is not None:
        out += sorted(f for f in Path(resume_dir).glob("*.safetensors")
                      if not any(f.name.startswith(i[:16] + "-") for i in idents))
    for q in sorted((root / "quantized").glob("*")):
        if q.is_dir() and q not in owned:
            out.append(q)
    for f in sorted((root / "fidelity").glob("*.json")):
        if f not in owned and not any(f.name.startswith(i[:32]) for i in idents):
            out.append(f)
    for f in sorted((root / "routing").glob("*.json")):
        if f in owned:
            continue
        try:
            source = json.loads(f.read_text()).get("source")
        except (OSError, ValueError):
            source = None
        if source not in idents:
            out.append(f)
    return out


def imports(cache_dir: Path | None = None) -> list[tuple[Path, str]]:
    """GGUF files imported into safetensors: (folder, the GGUF it came from)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = []
    for d in sorted((root / "imports").glob("*")):
        done = d / ".complete"
        if d.is_dir() and done.is_file():
            try:
                out.append((d, done.read_text().strip()))
            except OSError:
                continue
    return out


def last_used(path: Path) -> float:
    """When a model's files were last read or changed (the newest access time of its files)."""
    newest = 0.0
    for p in ([path] if path.is_file() else path.rglob("*")):
        try:
            st = os.stat(p)
        except OSError:
            continue
        newest = max(newest, st.st_atime, st.st_mtime)
    return newest
