"""llama.cpp's own converter, convert_hf_to_gguf.py with its gguf-py, unpacked from
llama-cpp-python's source distribution into .venv/llama.cpp by `make` (never built): the
GGUF files of the tests are written as the files people download are."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent / ".venv" / "llama.cpp"


def convert(checkpoint: Path, out: Path, outtype: str = "q8_0", *args: str) -> Path:
    """`checkpoint` (a Hugging Face directory) written as a GGUF file of `outtype` (f32,
    f16, bf16, q8_0) by llama.cpp's converter; `args` go to it as given (--no-mtp)."""
    script = HERE / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked at {HERE}: `make setup` unpacks it")
    env = dict(os.environ, PYTHONPATH=str(HERE / "gguf-py"))
    done = subprocess.run([sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out
