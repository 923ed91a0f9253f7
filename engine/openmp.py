"""How long an idle OpenMP thread spins before it sleeps: set before torch is imported.

torch's CPU operations and our kernels share one libgomp, whose threads spin about 300,000
times at the end of every parallel region before they sleep. On a quiet machine that saves a
wake-up per region. When another process holds a core, it turns a pass into a stall: the
thread that finished first keeps its core spinning, the other waits its turn behind the other
process, and every region waits a scheduler time slice. On 2 cores with one busy-loop beside
it, the demo model decoded at 6-10 tok/s instead of 93 (benchmarks/busy.py). The shorter
the spin, the less a busy core costs, and the more a quiet machine pays in wake-ups: on the
2-core VM, 10,000 kept quiet decode within 1% (prefill 3% slower) and doubled decode beside
a busy core; 1,000 gave 4-6x beside it but 10% slower decode and 30% slower prefill when
quiet.

libgomp reads the setting once, when it is loaded (by `import torch`), so it only takes
effect if this module runs first; `effective` says whether it did. A GOMP_SPINCOUNT or
OMP_WAIT_POLICY of the user's own is left alone.

The one other setting torch reads once: THP_MEM_ALLOC_ENABLE, which puts its CPU tensors of
2 MB and more on transparent huge pages (aligned to 2 MB and madvised; the machines here
leave huge pages to madvise). A decode pass reads every weight once through a few thousand
4 KB pages a matrix, and each page's translation is a miss; with 2 MB pages the routed
experts of Qwen3.5-35B-A3B's shape read at 31-39 GB/s against 25-27, and the whole step
gained 4% in decode and 24% in prefill (medians of 8 interleaved runs each, bf16), the demo
model's bf16 decode 7%, with the same resident memory. A value of the user's own is kept."""
from __future__ import annotations

import os
import sys

SPIN = "10000"

# a child process inherits our own value: that is not the user's
user_set = os.environ.get("GOMP_SPINCOUNT", SPIN) != SPIN or "OMP_WAIT_POLICY" in os.environ
effective = "torch" not in sys.modules
if not user_set:
    os.environ["GOMP_SPINCOUNT"] = SPIN
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def describe() -> str:
    """One sentence for `doctor`."""
    if user_set:
        mine = ", ".join(f"{k}={os.environ[k]}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ)
        return f"Idle threads: as set in the environment ({mine})"
    if not effective:
        return ("Idle threads: libgomp's default long spin (torch was imported before the engine, so "
                "GOMP_SPINCOUNT could not be set); a busy core beside it slows every pass")
    return (f"Idle threads: spin {SPIN} times, then sleep (GOMP_SPINCOUNT; libgomp's own 300,000 "
            "stalls every pass when another process keeps a core busy)")
