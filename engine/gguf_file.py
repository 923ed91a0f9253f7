"""A GGUF file read where it lies: its tensors as views of the file's memory map, the
quantized ones in their block formats, multiplied by the GGUF kernels
(engine/kernels/gguf_kernel.py) without a float copy.

A 2-D tensor of a block format is a uint8 view [rows, row_bytes] (gguf-py's reader gives
exactly that); F32 tensors are float32 views, F16 and BF16 are widened once. Where
llama.cpp's converter reordered a matrix's rows (the Llama family's q and k projections,
their rotary halves interleaved), `hf_rows` gives the checkpoint's order back: rows of blocks
move whole, so a quantized matrix is reordered without decoding it.

GGUFWeight is a weight the model code multiplies through `.mm`, as it does the int8 and int4
weights (models/llama_family._linear): one-token steps and verify passes through the block
kernels (every row a lone row), a prefill through the weight decoded block by block into a
reused float32 buffer and the GEMM."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .kernels import gemm, gguf_kernel

# A prefill of more rows than this decodes the weight and runs the GEMM: the block kernels
# are matrix-vector kernels, one pass over the weight per row of x (four rows a pass).
PREFILL_KERNEL_ROWS = 8
_buf = threading.local()                # the decoded weight of a prefill's product, one per thread


class Tensor:
    """One tensor of the file: its GGUF type name, its shape as torch orders it ([rows, K]
    for a matrix), and the data (a view of the memory map)."""

    def __init__(self, name: str, kind: str, shape: tuple[int, ...], data: torch.Tensor):
        self.name, self.kind, self.shape, self.data = name, kind, shape, data

    def dense(self) -> torch.Tensor:
        """The float32 values (decoded where quantized)."""
        if self.kind in gguf_kernel.TYPES:
            return gguf_kernel.dequantize(self.data, self.kind, self.shape[-1]).view(self.shape)
        return self.data.float().view(self.shape)


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


def hf_rows(rows: int, heads: int) -> torch.Tensor:
    """The index that puts a q or k projection's rows back in the checkpoint's order: the
    converter stored each head's two rotary halves interleaved (convert_hf_to_gguf's
    LlamaModel.permute), row (h, j, s) for the checkpoint's (h, s, j)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFWeight:
    """x @ w.T for a weight [N, K] stored as row blocks of one or more formats, stacked by
    rows (a fused q/k/v may mix them: Q4_K_M keeps some v projections in Q6_K). Products are
    float32 whatever x's dtype (its values widen exactly)."""

    gguf_blocks = True            # the layer kernel reads it (layer_kernel.py)

    def __init__(self, parts: list[tuple[str, torch.Tensor]], K: int):
        for kind, data in parts:
            if kind not in gguf_kernel.TYPES:
                raise ValueError(f"no kernel for GGUF type {kind}")
            if data.shape[1] != gguf_kernel.row_bytes(kind, K):
                raise ValueError(f"a {kind} part of {data.shape[1]} bytes a row does not hold {K} weights")
        self.parts = [(kind, data.contiguous()) for kind, data in parts]
        self.shape = (sum(d.shape[0] for _, d in self.parts), K)

    @classmethod
    def of(cls, *tensors: Tensor, rows: list[torch.Tensor | None] | None = None) -> "GGUFWeight":
        """The weight of these matrices stacked by rows (each reordered by its `rows` index)."""
        rows = rows or [None] * len(tensors)
        return cls([(t.kind, t.data if r is None else t.data[r]) for t, r in zip(tensors, rows)], tensors[0].shape[1])

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None, lone_rows: bool = True) -> torch.Tensor:
        K = self.shape[1]
        if lone_rows or x.shape[0] <= PREFILL_KERNEL_ROWS:
            y = torch.cat([gguf_kernel.linear(x, data, kind, K) for kind, data in self.parts], 1)
            return y if bias is None else y.add_(bias)
        w = self._decoded()
        return gemm.mm(x.float(), w.t(), None if bias is None else bias.float())

    def _decoded(self) -> torch.Tensor:
        """The whole weight in float32, in this thread's reused buffer (valid until the next call)."""
        N, K = self.shape
        buf = getattr(_buf, "t", None)
        if buf is None or buf.numel() < N * K:
            with torch.inference_mode(False):          # a normal tensor, filled in or out of inference mode
                buf = _buf.t = torch.empty(N * K, dtype=torch.float32)
        out, at = buf[:N * K].view(N, K), 0
        for kind, data in self.parts:
            gguf_kernel.dequantize(data, kind, K, out[at:at + data.shape[0]])
            at += data.shape[0]
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` decoded (an embedding lookup), float32 [len(ids), K]."""
        at = 0
        ids = ids.view(-1)
        picked = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32)
        for kind, data in self.parts:
            mine = (ids >= at) & (ids < at + data.shape[0])
            if mine.any():
                picked[mine] = gguf_kernel.dequantize(data[ids[mine] - at], kind, self.shape[1])
            at += data.shape[0]
        return picked

    def dense(self) -> torch.Tensor:
        return self._decoded().clone()

    def tensors(self) -> list[torch.Tensor]:
        return [data for _, data in self.parts]

    def c_parts(self) -> list[tuple[int, int, int, int]]:
        """(type id, rows, bytes a row, address) of each part, as gguf.c reads them."""
        return [(gguf_kernel.TYPES[kind], data.shape[0], data.stride(0), data.data_ptr()) for kind, data in self.parts]
