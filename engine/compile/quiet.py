"""Whether the machine is quiet, and autotuning timings that are taken only when it is
(issue 23).

Autotuning picks each kernel by timing the candidates, and a package keeps those choices
for good. Timed while something else ran (another compile beside the build, a browser, the
chat's own answer while the build was stopped and continued around it), the choices are
the wrong ones: measured on the development machine, two float32 packages of the same
model, same minute, decoded at 50.1 and 26.8 tok/s, the slow one built beside another
compile. So:

- `Window` measures the share of the machine's CPU time that *other* processes took over
  an interval (Linux /proc/stat and /proc/<pid>/stat; the build's own process group and
  the chat that started it are not "others": the chat's answers stop the build outright).
  A stop and continue of this process (SIGCONT) is counted too.
- `steady_timings()` wraps inductor's CPU benchmark: a candidate whose timing was
  disturbed (others above QUIET_BELOW, or the process stopped meanwhile) waits for a quiet
  moment and is timed again; a build that never got one counts its unsteady timings, and
  the engine rebuilds that package later (engine/compile/proof.py).

Elsewhere than Linux nothing can be measured: every window reads as quiet.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

# Others taking less than this share of the machine's CPU time is quiet: a single busy
# process on a two-core machine takes half of it.
QUIET_BELOW = 0.10
RETIMES = 3                      # a disturbed candidate is timed again at most this often
WAIT_BUDGET_S = 30.0             # a build waits at most this long for quiet, in all
_continued = 0                   # SIGCONTs this process has received
_tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine, all cores summed."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    n = [int(x) for x in fields[:8]]
    user, nice, system, idle, iowait, irq, softirq, steal = n + [0] * (8 - len(n))
    busy = user + nice + system + irq + softirq + steal     # steal: a neighbour on the host took it
    return busy, busy + idle + iowait


def _ticks_of(pids: set[int], groups: set[int]) -> int:
    """CPU ticks used so far by the processes `pids` and every process in the groups
    `groups` (threads included; a compiler subprocess is in the build's group)."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for name in entries:
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue                 # it ended meanwhile
        rest = text.rsplit(")", 1)[-1].split()
        # rest[0] is the state, rest[2] the process group, rest[11:15] utime, stime and the
        # same of its children that ended (a build's C++ compilers come and go within a
        # window; once they are gone, only their parent's counts still hold their time)
        if int(name) in pids or int(rest[2]) in groups:
            total += sum(int(x) for x in rest[11:15])
    return total


class Window:
    """From its start: the share of the machine's CPU time that others took (`others()`),
    and whether this process was stopped and continued meanwhile (`stopped()`).
    `exclude`: pids that are not others (besides this process's own group)."""

    def __init__(self, exclude: tuple[int, ...] = ()):
        self.pids = {os.getpid(), *exclude}
        # A build child leads a process group of its own (its compiler subprocesses are in
        # it); any other process shares its group with whatever started it, not "mine".
        self.groups = {os.getpid()} if os.getpgrp() == os.getpid() else set()
        self.t0 = time.perf_counter()
        self.m0 = _machine()
        self.s0 = _ticks_of(self.pids, self.groups) if self.m0 else 0
        self.c0 = _continued

    def others(self) -> float:
        m1 = _machine()
        if self.m0 is None or m1 is None:
            return 0.0
        mine = _ticks_of(self.pids, self.groups) - self.s0
        total = m1[1] - self.m0[1]
        if total <= 0:
            return 0.0
        return max(0.0, min(1.0, (m1[0] - self.m0[0] - mine) / total))

    def stopped(self) -> bool:
        return _continued != self.c0

    def disturbed(self) -> bool:
        return self.stopped() or self.others() >= QUIET_BELOW


def others_share(seconds: float = 0.5, exclude: tuple[int, ...] = ()) -> float:
    """The share of the machine others take now, over `seconds`."""
    w = Window(exclude)
    time.sleep(seconds)
    return w.others()


def wait_quiet(budget_s: float, exclude: tuple[int, ...] = (), window_s: float = 0.5,
               stop: threading.Event | None = None) -> bool:
    """Wait until one `window_s` finds the machine quiet; False when `budget_s` ran out
    (or `stop` was set) first."""
    end = time.monotonic() + budget_s
    while True:
        if others_share(window_s, exclude) < QUIET_BELOW:
            return True
        if time.monotonic() >= end or (stop is not None and stop.is_set()):
            return False


class Record:
    """What the timings of one build went through: `timed` candidates, `retimed` timings
    taken again after a disturbance, `unsteady` ones never taken quiet, and the share of
    the machine others took over the whole build (`others`, set when it ends)."""

    def __init__(self):
        self.timed = self.retimed = self.unsteady = 0
        self.others = 0.0
        self.waited_s = 0.0

    @property
    def quiet(self) -> bool:
        return self.unsteady == 0 and self.others < QUIET_BELOW

    def as_dict(self) -> dict:
        return {"timed": self.timed, "retimed": self.retimed, "unsteady": self.unsteady,
                "others": round(self.others, 3), "waited_s": round(self.waited_s, 1), "quiet": self.quiet}


def _on_continue(signum, frame) -> None:
    global _continued
    _continued += 1


@contextlib.contextmanager
def counting_stops():
    """Count SIGCONTs (Window.stopped) for the duration, on the main thread (where Python
    runs signal handlers; elsewhere stops go uncounted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGCONT, _on_continue)
    try:
        yield
    finally:
        signal.signal(signal.SIGCONT, old)


@contextlib.contextmanager
def steady_timings(exclude: tuple[int, ...] = ()):
    """Inductor's CPU candidate timings, taken again when disturbed (see the module's
    note), for the duration; yields the Record. The SIGCONT counter only works on the
    main thread (where Python runs signal handlers): elsewhere stops go uncounted, and
    the others' share still catches the answers that ran meanwhile in another process."""
    from torch._inductor.runtime import benchmarking
    bench = benchmarking.benchmarker
    original = bench.benchmark_cpu                # the bound method (the class's)
    record = Record()
    whole = Window(exclude)

    def benchmark_cpu(_callable, *args, **kwargs):
        record.timed += 1
        for attempt in range(RETIMES + 1):
            w = Window(exclude)
            ms = original(_callable, *args, **kwargs)
            if not w.disturbed():
                return ms
            if attempt == RETIMES:
                break
            record.retimed += 1
            left = WAIT_BUDGET_S - record.waited_s
            t0 = time.monotonic()
            if left > 0:
                wait_quiet(left, exclude)
            record.waited_s += time.monotonic() - t0
        record.unsteady += 1
        return ms

    bench.benchmark_cpu = benchmark_cpu           # an instance attribute: every caller shares `bench`
    try:
        with counting_stops():
            yield record
    finally:
        del bench.benchmark_cpu
        record.others = whole.others()
