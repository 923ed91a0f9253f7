"""The pages of a loaded compiled step's library (Linux; elsewhere nothing is done).

A package built with its weights (the decode step, engine/compile/exported.py) carries them
inside its shared library. Loading it copies them into memory of the step's own (a
malloc'd blob on a CPU, the device on a GPU), and the library's copy is never read
again; but it stays mapped, and its pages stay resident, for as long as the process
lives: as much host memory again as the weights (621 MB for the demo model in float32),
counted in the chat's "host memory in use". `drop_file_pages` gives those pages back.

Demo model, float32: 651 MB given back (benchmarks/step_pages.py); a chat's process
with the compiled step live held 2572 MB before this, 1954 MB after.

Moving the blob onto transparent huge pages (MADV_COLLAPSE after the load) was measured
too: 0.997-1.015x on the float32 step and 0.99-1.003x on bf16 over two runs, inside the
noise, so the engine does not do it.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

_MADV_DONTNEED = 4
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \d+\s*(.*)$")


class Mapping:
    """One line of /proc/self/smaps: an address range, its permissions, its file ("" when
    anonymous), and the smaps fields in bytes (Rss, Anonymous, AnonHugePages...)."""

    def __init__(self, start: int, end: int, perms: str, path: str):
        self.start, self.end, self.perms, self.path = start, end, perms, path
        self.fields: dict[str, int] = {}

    @property
    def size(self) -> int:
        return self.end - self.start


def mappings() -> list[Mapping]:
    """This process's mappings; [] where there is no /proc."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    out: list[Mapping] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            out.append(Mapping(int(m.group(1), 16), int(m.group(2), 16), m.group(3), m.group(4)))
        elif out and line.endswith(" kB"):
            name, value = line.split(":", 1)
            out[-1].fields[name] = int(value.split()[0]) * 1024
    return out


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def drop_file_pages(folder: Path, only: Path | None = None, keep_cached: bool = False) -> int:
    """Give back the resident pages of this process's read-only, non-executable mappings
    of the files under `folder` (or of the file `only`, deleted or not) that hold exactly
    the file's bytes (no page of theirs was ever written: relocated data, also read-only
    once relocated, is kept), and drop the files from the page cache unless `keep_cached`
    (a file that stays on disk to be loaded again: the system reclaims its cache when it
    needs the memory, and meanwhile the next load reads it from memory). A page dropped and
    read again is read from the file, so this changes no data. Returns the bytes given back."""
    lib = _libc()
    if lib is None:
        return 0
    prefix = str(Path(folder)) + os.sep
    freed, files = 0, set()
    for m in mappings():
        path = m.path.removesuffix(" (deleted)")
        if only is not None and path != str(only):
            continue
        if not path.startswith(prefix) or m.perms[:3] != "r--" or m.fields.get("Anonymous", 1) != 0:
            continue
        rss = m.fields.get("Rss", 0)
        if rss and lib.madvise(m.start, m.size, _MADV_DONTNEED) == 0:
            freed += rss
            files.add(path)
    for path in files if not keep_cached else ():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return freed
