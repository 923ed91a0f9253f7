"""A GGUF file's metadata and tensor table, its tensors as views of its memory map (every
part of a split file), read without building a vocabulary's strings. Nothing here knows the
kernels: engine/gguf_file.py multiplies what this reads.

A 2-D tensor of a block format is a uint8 view [rows, row_bytes]; F32 tensors are float32
views, F16 and BF16 are widened once."""
from __future__ import annotations

import threading
from pathlib import Path

import torch


class Tensor:
    """One tensor of the file: its GGUF type name, its shape as torch orders it ([rows, K]
    for a matrix), and the data (a view of the memory map)."""

    def __init__(self, name: str, kind: str, shape: tuple[int, ...], data: torch.Tensor):
        self.name, self.kind, self.shape, self.data = name, kind, shape, data


def read(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(metadata by key, tensors by name) of a GGUF file, memory-mapped; the last few files
    read are kept (planning, checking and loading a model each read its table). A metadata
    value is a number, a string, a list of numbers, or for an array of strings (a
    vocabulary, its merges) their count: walking them is all a table needs, and building
    every string of a large vocabulary took gguf-py's reader seconds a read."""
    path = Path(path).absolute()          # not resolved: a split part in the HF cache links to a blob
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _read_lock:
        got = _read_cache.get(key)
        if got is None:
            got = _read(path)
            _read_cache[key] = got
            while len(_read_cache) > 4:
                _read_cache.pop(next(iter(_read_cache)))
    return got


_read_cache: dict[tuple, tuple[dict, dict]] = {}
_read_lock = threading.Lock()

# metadata value types (gguf's GGUFValueType): the fixed-size ones by struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """Not a GGUF file this reader knows, or one cut short."""


def shards(path: Path) -> list[Path]:
    """The files of a GGUF model: the one given, or every part of a split one
    (name-00001-of-00003.gguf, llama.cpp's gguf-split), from whichever part is given."""
    import re
    m = re.search(r"-(\d{5})-of-(\d{5})\.gguf$", path.name, re.IGNORECASE)
    if m is None:
        return [path]
    stem = path.name[:m.start()]
    parts = [path.with_name(f"{stem}-{i:05d}-of-{m.group(2)}.gguf") for i in range(1, int(m.group(2)) + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"split part {missing[0]} is missing beside it")
    return parts


def _read(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """The metadata of the first part and the tensors of every part."""
    meta, tensors = {}, {}
    for i, part in enumerate(shards(path)):
        m, t = _read_one(part)
        meta = m if i == 0 else meta
        tensors.update(t)
    return meta, tensors


def _read_one(path: Path) -> tuple[dict, dict[str, Tensor]]:
    import struct
    import warnings

    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    raw = memoryview(blob)

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", raw, at)
        return bytes(raw[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n

    def value(kind: int, at: int):
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, raw, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return string(at)
        if kind != _ARRAY:
            raise GGUFError(f"metadata value of unknown type {kind}")
        item, count = struct.unpack_from("<IQ", raw, at)
        at += 12
        if item in _SCALARS:
            fmt = _SCALARS[item]
            return list(struct.unpack_from(f"<{count}{fmt[1]}", raw, at)), at + count * struct.calcsize(fmt)
        for _ in range(count):                   # strings (or nested arrays): walked, kept as their count
            _, at = value(item, at)
        return count, at

    try:
        if bytes(raw[:4]) != b"GGUF":
            raise GGUFError("it does not start with GGUF's magic bytes")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} (this reader knows 2 and 3)")
        at, meta = 24, {}
        for _ in range(n_kv):
            name, at = string(at)
            (kind,) = struct.unpack_from("<I", raw, at)
            meta[name], at = value(kind, at + 4)
        table = []
        for _ in range(n_tensors):
            name, at = string(at)
            (dims,) = struct.unpack_from("<I", raw, at)
            shape = struct.unpack_from(f"<{dims}Q", raw, at + 4)
            kind, offset = struct.unpack_from("<IQ", raw, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            table.append((name, tuple(int(n) for n in reversed(shape)), kind, offset))   # torch's order
    except struct.error:
        raise GGUFError("the file ends inside its header") from None
    align = int(meta.get("general.alignment", 32))
    start = (at + align - 1) // align * align
    tensors = {}
    for name, shape, kind, offset in table:
        try:
            kind_name = GGMLQuantizationType(kind).name
        except ValueError:
            raise GGUFError(f"tensor {name} is of an unknown ggml type {kind}") from None
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = 1
        for n in shape[:-1]:
            rows *= n
        row = shape[-1] // per_block * block_bytes
        a = start + offset
        if a + rows * row > blob.shape[0]:
            raise GGUFError(f"tensor {name} runs past the end of the file (truncated)")
        with warnings.catch_warnings():      # the map is read-only, and nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(blob[a:a + rows * row].reshape(*shape[:-1], row))
        if kind_name in ("F32", "F16", "BF16"):
            data = data.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind_name])
            if kind_name != "F32":
                data = data.float()                  # widened once, as the forward holds floats
            kind_name = "F32"
        tensors[name] = Tensor(name, kind_name, shape, data)
    return meta, tensors
