"""`localchat setup` builds the C kernels this CPU runs (engine/kernels/) before the first
chat, so no load waits on a compiler: each is built once per machine, kernel source and
compiler version, and kept in `<cache>/kernels/`. `--no-build` skips it; the first load
builds them then."""
from __future__ import annotations

import time
from typing import Callable


def build(say: Callable[[str], None] = print) -> dict[str, str]:
    """Build (or find) every kernel library this CPU can run and say which run here and why
    the others do not; kernel name -> '' or why not. Never raises: a kernel that cannot be
    built leaves torch's kernels in its place."""
    from engine import kernels
    say("Building the C kernels for this CPU (once per machine; --no-build skips it)")
    t0 = time.monotonic()
    state = kernels.status()
    ready = [name for name, why in state.items() if not why]
    isa = sorted(set(kernels.instruction_sets().values()))
    say(f"C kernels ready in {time.monotonic() - t0:.0f} s"
        f"{' (' + ', '.join(isa) + ')' if isa else ''}: {', '.join(ready) or 'none'}")
    for name, why in state.items():
        if why:
            say(f"  {name}: not used, {why}; torch's kernels instead")
    return state
