"""Compiling a kernel's C source into a shared library, once per source, compiler and flags.

The libraries are kept in `<cache>/kernels/<name>-<hash>.so`; the hash covers the source,
the flags and the compiler's version, so an edited kernel or another compiler builds anew
and never loads a stale library. Where there is no C compiler, or it fails, the caller
keeps torch's kernels and `why` says so.

The library links libgomp.so.1 by name: torch's wheels ship it under that name and load it
first, so the kernel's parallel loops run on the same OpenMP runtime and thread team as
torch's (two runtimes on two cores throttle each other's spin-waits)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..checkpoint import default_cache_dir

HERE = Path(__file__).resolve().parent
COMPILE_TIMEOUT_S = 120
_lock = threading.Lock()
_loaded: dict[tuple, ctypes.CDLL | None] = {}    # (name, flags) -> the library, None if it failed
_why: dict[tuple, str] = {}


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def library(name: str, flags: list[str]) -> ctypes.CDLL | None:
    """The loaded library of `<name>.c` (next to this file) built with `flags`, compiled on
    first use; None if it cannot be built here (why(name, flags) says why)."""
    key = (name, tuple(flags))
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = ctypes.CDLL(str(_build(name, flags)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _loaded[key] = None
                _why[key] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return _loaded[key]


def why(name: str, flags: list[str]) -> str:
    return _why.get((name, tuple(flags)), "")


def _build(name: str, flags: list[str]) -> Path:
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = HERE / f"{name}.c"
    args = ["-O3", "-fPIC", "-shared", "-fopenmp", *flags]
    # Every C source and header here goes into the hash: a kernel may include another's file.
    sources = b"".join(f.read_bytes() for f in sorted(HERE.glob("*.[ch]")))
    digest = hashlib.sha256(sources + " ".join(args).encode() + _version(cc).encode()).hexdigest()[:16]
    folder = default_cache_dir() / "kernels"
    out = folder / f"{name}-{digest}.so"
    if out.exists():
        return out
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-")
        probe.close()
    except OSError as exc:
        raise RuntimeError(f"{folder}: cannot build the kernels there ({exc.strerror or exc}); set "
                           "LOCALCHAT_CACHE_DIR to a writable directory") from None
    # Built under a name of its own, then renamed: two processes building at once each
    # load a whole library, never one half-written by the other.
    tmp = folder / f".{name}-{digest}.{os.getpid()}.{threading.get_ident()}.so"
    try:
        done = subprocess.run([cc, *args, "-o", str(tmp), str(source)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            err = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} could not build {source.name}: {err[0] if err else done.returncode}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
