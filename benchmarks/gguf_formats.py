"""GGUF files of the same weights in other formats, for llama.cpp: every tensor of a GGUF
dequantized (gguf-py's own dequantize) and written back as F32, BF16 or Q8_0, metadata
copied.

Our engine loads the demo's Q4_1 GGUF through transformers, which dequantizes it with the
same gguf-py code: a float32 (bf16) run of ours and llama.cpp on the F32 (BF16) file read
exactly the same weights.

    python benchmarks/gguf_formats.py SOURCE.gguf OUT_DIR      # writes <name>-F32.gguf, -BF16, -Q8_0
"""
from __future__ import annotations

import sys
from pathlib import Path

FORMATS = ("F32", "BF16", "Q8_0")
# llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_BF16 / MOSTLY_Q4_1 / MOSTLY_Q8_0
_FILE_TYPE = {"F32": 0, "BF16": 32, "Q4_1": 3, "Q8_0": 7}


def write(source: Path, out: Path, fmt: str) -> Path:
    """Write `source` as format `fmt` at `out` (skipped when `out` is newer than `source`)."""
    import gguf
    import numpy as np
    if out.exists() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = _FILE_TYPE[fmt] if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    want = gguf.GGMLQuantizationType[fmt]
    for t in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if data.ndim == 1 or fmt == "F32":          # norms stay float32, as llama.cpp's converter keeps them
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, want), raw_dtype=want)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def write_all(source: Path, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return {fmt: write(source, folder / f"{source.stem}-{fmt}.gguf", fmt) for fmt in FORMATS}


if __name__ == "__main__":
    for fmt, path in write_all(Path(sys.argv[1]), Path(sys.argv[2])).items():
        print(fmt, path)
