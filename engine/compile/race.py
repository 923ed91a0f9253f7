"""Racing passes against each other: the eager forward, compiled packages, and a read of
memory (the bandwidth bound, timed in the same minute), interleaved on scratch KV caches.

Where a race runs matters on a CPU. Every thread that runs a parallel torch operation keeps
an OpenMP team, and with two teams in a process (the chat's thread that decodes, and a
thread that races) libgomp stops spin-waiting between parallel regions: the compiled demo
step raced that way took 19.6 ms a step while it decoded at 8-12 ms in the chat's own
thread, and eager lost far less (36 against 35 ms), so the race said "barely faster than
eager" of a step 3x faster. So a step is raced in the build's child process, right after it
is built, on that process's main thread (engine/compile/builder.py), where it is the only
team; the chat records what the child measured (engine/compile/proof.py).
"""
from __future__ import annotations

import copy
import time

import torch

from ..cache import KVCache
from . import exported, quiet


class Later(Exception):
    """The race was interrupted (an answer started) or disturbed: run it again later."""


def scratch(impl, dynamic: bool = False):
    """A shallow copy of the forward `impl` with a KV cache of its own: a race or a check
    runs real steps, and they must not write into the conversation's cache."""
    cache = impl.cache
    s = copy.copy(impl)
    s.cache = KVCache(cache.layers, cache.kv_heads, cache.head_dim, cache.dtype, cache.device,
                      capacity=cache.capacity, max_positions=cache.max_positions)
    if dynamic:
        for t in s.cache.k + s.cache.v:
            torch._dynamo.mark_dynamic(t, 2)
        for t in (s._cos, s._sin):
            torch._dynamo.mark_dynamic(t, 0)
    return s


def times(impl, fns: list, rows: int, reps: int = 5, budget_s: float = 0.0, interrupted=None) -> list[float]:
    """Median milliseconds of each pass of `rows` positions at position MIN_POS: None is
    the eager forward, a callable a compiled pass (called as fn(impl, ids, pos)), a number
    of bytes a read of that much memory. `budget_s`: stop after that long once each has 3
    timings. `interrupted()` True raises Later."""
    dev = impl.cache.device
    ids = torch.arange(1, rows + 1, dtype=torch.long, device=dev)
    runs = []
    for f in fns:
        if f is None:
            s = scratch(impl)
            runs.append(lambda s=s: s(ids, exported.MIN_POS, rows > 1))
        elif isinstance(f, int):
            runs.append(torch.ones(f // 4, device=dev).sum)
        else:
            s = scratch(impl)
            runs.append(lambda f=f, s=s: f(s, ids, exported.MIN_POS))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: list[list[float]] = [[] for _ in runs]
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(reps + 1):
            for run, t in zip(runs, out):
                if interrupted is not None and interrupted():
                    raise Later
                t0 = time.perf_counter()
                run()
                sync()
                if i:                        # the first of each warms up
                    t.append(time.perf_counter() - t0)
            if budget_s and i >= 3 and time.perf_counter() - start > budget_s:
                break
    return [sorted(t)[len(t) // 2] * 1e3 for t in out]


def read_bytes(weight_bytes: int) -> int:
    """How much memory the bound's read covers: the weights, 64-256 MB (past the caches)."""
    return max(64 << 20, min(int(weight_bytes), 256 << 20))


def quietly(impl, fns: list, weight_bytes: int, exclude: tuple[int, ...] = (), tries: int = 10,
            wait_s: float = 10.0) -> dict | None:
    """A race of `fns` and a memory read on a quiet machine that nothing disturbed (others
    under quiet.QUIET_BELOW, no stop of this process): {"ms": [...], "bandwidth": bytes/s};
    None when no try of `tries` was left alone."""
    nbytes = read_bytes(weight_bytes)
    for _ in range(tries):
        quiet.wait_quiet(wait_s, exclude)
        w = quiet.Window(exclude)
        ms = times(impl, [*fns, nbytes], 1, 7, 3.0)
        if not w.disturbed():
            return {"ms": ms[:-1], "bandwidth": nbytes / (ms[-1] / 1e3)}
    return None
