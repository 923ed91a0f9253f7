"""engine/compile/pages.py on real mappings of this process: a mapped file's resident pages are
given back and read again unchanged, and a page that was written is never dropped."""
import ctypes
import mmap
import sys

import pytest

from engine.compile import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and madvise")
MB = 1 << 20


def address(m: mmap.mmap) -> int:
    buf = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf                  # an exported buffer would keep the mmap from closing


def mapping_at(start: int) -> pages.Mapping:
    return next(m for m in pages.mappings() if m.start <= start < m.end)


def test_a_mapped_files_pages_are_given_back_and_read_again_unchanged(tmp_path):
    folder = tmp_path / "unpacked"
    folder.mkdir()
    data = bytes(range(256)) * (16 * MB // 256)
    (folder / "weights.bin").write_bytes(data)
    (tmp_path / "other.bin").write_bytes(data)
    with open(folder / "weights.bin", "rb") as f, open(tmp_path / "other.bin", "rb") as g:
        inside = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        outside = mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert inside[:] == data and outside[:] == data          # every page read in
        start_in = next(m.start for m in pages.mappings() if m.path == str(folder / "weights.bin"))
        start_out = next(m.start for m in pages.mappings() if m.path == str(tmp_path / "other.bin"))
        assert mapping_at(start_in).fields["Rss"] >= 15 * MB

        freed = pages.drop_file_pages(folder)

        assert freed >= 15 * MB
        assert mapping_at(start_in).fields["Rss"] == 0
        assert mapping_at(start_out).fields["Rss"] >= 15 * MB    # not under the folder: kept
        assert inside[:] == data                                 # read again from the file
    finally:
        inside.close()
        outside.close()


def test_a_read_only_mapping_with_written_pages_is_never_dropped(tmp_path):
    # Relocated data in a loaded library is written once, then made read-only: its pages
    # are the only copy of those bytes, and dropping them would bring back the file's.
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / "data.bin").write_bytes(b"\0" * (4 * MB))
    with open(folder / "data.bin", "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        m[123] = 7
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = address(m)
        assert libc.mprotect(start, 4 * MB, mmap.PROT_READ) == 0
        assert mapping_at(start).perms.startswith("r--")
        assert mapping_at(start).fields["Anonymous"] > 0

        assert pages.drop_file_pages(folder) == 0

        assert m[123] == 7
    finally:
        m.close()
