"""The disk cache of quantized weights: quantize once, load directly on every later start.

One directory per (model location, format, group size, activation dtype, embeddings
quantized or not) under `<cache>/quantized/`, holding one safetensors file per decoder
layer plus `rest.safetensors` (embeddings, final norm, head) and `manifest.json`, written
last, which names the source's identity (config.json and every weight file's name, size
and mtime) and each file's size and SHA-256. A directory is used only if its manifest
matches the source as it is now and every file has its size and checksum: a re-downloaded
model, a truncated or corrupted file, an interrupted write are rebuilt, never loaded.

The files hold the canonical (device-independent) form of qweights.py, so one cache
serves any CPU and any GPU; packing into the kernel's layout happens at load.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from ..checkpoint import gguf_source, weight_files

VERSION = 1          # bump when the quantization arithmetic or the file layout changes
MANIFEST = "manifest.json"


def source_identity(path: Path) -> str:
    """A digest of what the quantized weights derive from. Names, sizes and mtimes, as the
    GGUF import does: hashing the contents would read the whole model on every start."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    gguf = gguf_source(path)                  # a GGUF import: the file it was made from
    for f in [gguf] if gguf is not None else weight_files(path):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cache_path(root: Path, model: Path, fmt: str, group: int, act_dtype: torch.dtype, embeddings: bool,
               head: str = "exact") -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.name)[:48] or "model"
    where = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:12]
    grouping = f"g{group}" if fmt == "int4" else "perchannel"
    dtype = str(act_dtype).replace("torch.", "")
    tables = "-embq" if embeddings else "-head8" if head == "int8" else ""
    return root / "quantized" / f"{name}-{where}-{fmt}-{grouping}-{dtype}{tables}"


class QuantCache:
    def __init__(self, directory: Path, settings: dict):
        self.dir = directory
        self.settings = dict(settings, version=VERSION)   # must all match for a hit

    def manifest(self) -> dict | None:
        """The manifest if it belongs to these settings and this source, else None."""
        try:
            m = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if m.get("settings") != self.settings:
            return None
        return m

    def read(self, name: str, manifest: dict) -> dict[str, torch.Tensor] | None:
        """One file's tensors, or None if it is missing, truncated or corrupt. The bytes are
        read once, checked, then parsed: what is checked is what is loaded."""
        meta = manifest["files"].get(name)
        try:
            data = (self.dir / f"{name}.safetensors").read_bytes()
        except OSError:
            return None
        if meta is None or len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return None
        return load_bytes(data)

    def read_mapped(self, name: str, manifest: dict) -> dict[str, torch.Tensor] | None:
        """As read(), with the tensors left memory-mapped from the file (clean pages the
        kernel drops under pressure and reads again when touched): a mixture's experts that
        do not fit in RAM. The file is checked by streaming it through the hash."""
        from safetensors import safe_open
        meta = manifest["files"].get(name)
        file = self.dir / f"{name}.safetensors"
        h, size = hashlib.sha256(), 0
        try:
            with open(file, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
                    size += len(chunk)
            if meta is None or size != meta["bytes"] or h.hexdigest() != meta["sha256"]:
                return None
            with safe_open(file, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, RuntimeError, ValueError):
            return None

    def writer(self) -> "CacheWriter":
        return CacheWriter(self)


class CacheWriter:
    """Writes into a fresh directory beside the cache and swaps it in on commit, so a
    reader never sees half a cache and an interrupted write leaves nothing behind."""

    def __init__(self, cache: QuantCache):
        self.cache = cache
        cache.dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=".quantize-", dir=cache.dir.parent))
        self.files: dict[str, dict] = {}

    def write(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        data = save_bytes({k: v.contiguous() for k, v in tensors.items()})
        (self.tmp / f"{name}.safetensors").write_bytes(data)
        self.files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def commit(self) -> None:
        manifest = {"settings": self.cache.settings, "files": self.files}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        target = self.cache.dir
        if target.exists():           # stale or corrupt: replace it whole
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(self.tmp, target)
        except OSError:               # another process committed first: theirs is as good
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
