"""Where a compiled step's weights live (engine/compile/pages.py), demo model: the resident
bytes of the package library's own copy of the weights before and after they are given
back; and the compiled step on 4 KiB pages against the same package with its weights
moved onto transparent huge pages (MADV_COLLAPSE, Linux 6.1+; tried, inside the noise,
not done by the engine), interleaved in one process (two loads of one package), median
of --runs rounds of --steps steps at position 200. Writes JSON.

    python benchmarks/step_pages.py [--dtypes float32,bfloat16] [--runs 8] [--steps 40]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402
from engine import hardware  # noqa: E402
from engine.compile import exported, pages  # noqa: E402


HUGE = 2 << 20


def anonymous() -> set[tuple[int, int]]:
    return {(m.start, m.end) for m in pages.mappings() if m.path == "" and m.perms.startswith("rw")}


def load_on_huge_pages(path: Path) -> tuple[exported.Package, int]:
    """The package loaded, with the new fully resident anonymous ranges of its load (the
    blob its weights were copied into) collapsed onto huge pages; the bytes moved."""
    before = anonymous()
    package = exported.Package(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    moved = 0
    for m in pages.mappings():
        if m.path == "" and m.perms.startswith("rw") and (m.start, m.end) not in before \
                and m.size >= path.stat().st_size // 4 and m.fields.get("Rss", 0) >= 0.95 * m.size:
            a, b = -(-m.start // HUGE) * HUGE, m.end // HUGE * HUGE
            if libc.madvise(a, b - a, 14) == 0 and libc.madvise(a, b - a, 25) == 0:   # HUGEPAGE, COLLAPSE
                moved += b - a
    return package, moved


def library_rss(package: exported.Package) -> int:
    """Resident bytes of the read-only mappings of the package's unpacked library."""
    prefix = str(package._unpacked)
    return sum(m.fields.get("Rss", 0) for m in pages.mappings()
               if m.path.startswith(prefix) and m.perms.startswith("r--"))


def step_ms(package, target, ids, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        t = time.perf_counter()
        package(target.impl, ids, 200)
        times.append(time.perf_counter() - t)
    return median(times[2:]) * 1e3


def row(dtype: str, args) -> dict:
    eng = engine.open(dtype=dtype, drafter="none", compile="on")   # builds the package if it is not cached
    step = eng.target.compiled
    assert step.wait(1800) and step.state == "ready", (step.state, step.error)
    path, target = step.package, eng.target
    before = hardware.host_rss()
    small = exported.Package(path)
    held = library_rss(small)
    small.release_files()
    given_back = held - library_rss(small)
    huge, moved = load_on_huge_pages(path)
    huge.release_files()
    ms = {"4k": [], "huge": []}
    with torch.inference_mode():
        target.cache.rollback(0)
        target.forward(list(range(1, 201)))
        ids = torch.tensor([7])
        for _ in range(args.runs):
            ms["4k"].append(step_ms(small, target, ids, args.steps))
            ms["huge"].append(step_ms(huge, target, ids, args.steps))
    out = {"dtype": dtype, "package_bytes": path.stat().st_size, "library_resident_bytes_at_load": held,
           "library_bytes_given_back": given_back, "rss_growth_of_two_loads": hardware.host_rss() - before,
           "huge_page_bytes": moved,
           "step_ms_4k": median(ms["4k"]), "step_ms_huge": median(ms["huge"]),
           "speedup_huge_vs_4k": median(ms["4k"]) / median(ms["huge"]), "samples_ms": ms}
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_pages.json"))
    args = ap.parse_args()
    rows = [row(d, args) for d in args.dtypes.split(",") if d]
    print("wrote", write_json(args.out, {"benchmark": "step_pages", "model": "SmolLM2-135M-Instruct (demo)",
                                         "machine": machine(), "runs": args.runs, "steps": args.steps,
                                         "rows": rows}))


if __name__ == "__main__":
    main()
