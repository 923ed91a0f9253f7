"""Moving streamed units into reusable slots ahead of the compute that needs them.

One background thread walks the streamed units in pass order, again and again: every
pass (prefill, decode step, verify pass) needs the same units in the same order, so the
reader simply stays `depth` units ahead of the compute, across the end of one pass into
the start of the next — the time between passes (sampling, drafting) is spent reading.

A unit comes from one of two tiers:
- host: a copy the engine holds in host memory (pinned on CUDA), copied into the slot;
- disk: read with pread() from the safetensors file into the slot (on a CPU whose
  compute dtype is the file's, straight into the slot; otherwise through a staging
  buffer, then converted/copied to the device).
On CUDA the copy runs on its own stream and the slot carries two events: `ready` (the
copy finished; compute waits on it without blocking the host) and `free` (the compute
that used the slot finished; the next copy into it waits on that).

Reads use pread, not mmap: the bytes the engine holds are the bytes it allocated, and a
cold read really reads the disk (mmap views would hide the cost in page faults and let
the page cache stand in for the memory budget)."""
from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import CheckpointError
from .layer_index import Piece, Unit


class Ledger:
    """Bytes of weights the engine holds, against its budget. Every weight buffer of the
    streamed target is allocated through here, so `peak` is a measurement, not a plan."""

    def __init__(self, budget: int):
        self.budget = budget
        self.held = 0
        self.peak = 0

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
        nbytes = numel * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else numel
        if self.held + nbytes > self.budget:
            raise MemoryError(f"weight buffers would hold {self.held + nbytes} bytes, over the "
                              f"{self.budget}-byte budget")
        t = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin and device.type == "cpu")
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return t

    def free(self, t: torch.Tensor) -> None:
        self.held -= t.numel() * t.element_size()


class Files:
    """Open descriptors for the checkpoint files, checked once per cycle of the ring:
    a file that vanished or shrank mid-run ends the pass with a clear error."""

    def __init__(self, files: list[Path]):
        self.paths = list(files)
        self.sizes = {p: p.stat().st_size for p in self.paths}
        self.fds: dict[Path, int] = {}
        # Drop what was read from the page cache right after reading it: every pass then
        # really reads the disk (the cold benchmark), and on a machine short of RAM the
        # kernel's cache of weights we hold anyway does not push out other memory.
        self.evict_after_read = False

    def evict(self) -> None:
        """Drop the checkpoint files from the page cache (cold start of a benchmark)."""
        if not hasattr(os, "posix_fadvise"):      # macOS, Windows: no way to ask
            return
        for p in self.paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def open(self) -> None:
        self.close()
        for p in self.paths:
            self.check(p)
            self.fds[p] = os.open(p, os.O_RDONLY)

    def check(self, p: Path) -> None:
        try:
            size = p.stat().st_size
        except OSError:
            raise CheckpointError(f"{p}: the checkpoint file disappeared while streaming; restore or "
                                  "re-download the model, then ask again") from None
        if size != self.sizes[p]:
            raise CheckpointError(f"{p}: the checkpoint file changed size while streaming ({self.sizes[p]} -> "
                                  f"{size} bytes); restore or re-download the model, then ask again")

    def check_all(self) -> None:
        for p in self.paths:
            self.check(p)

    def read(self, piece: Piece, dest) -> None:
        """pread the piece's bytes into the writable buffer `dest` (a memoryview)."""
        fd = self.fds.get(piece.file)
        if fd is None:
            raise CheckpointError(f"{piece.file}: not open for streaming")
        got = 0
        while got < piece.nbytes:
            try:
                n = os.preadv(fd, [dest[got:piece.nbytes]], piece.offset + got)
            except OSError as exc:
                raise CheckpointError(f"{piece.file}: read failed while streaming ({exc.strerror}); "
                                      "check the disk, then ask again") from None
            if n <= 0:
                raise CheckpointError(f"{piece.file}: truncated while streaming (wanted {piece.nbytes} bytes at "
                                      f"{piece.offset}); restore or re-download the model, then ask again")
            got += n
        if self.evict_after_read and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, piece.offset, piece.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (pread writes into it)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


@dataclass
class Slot:
    flat: torch.Tensor                 # on the device, compute dtype
    staging: torch.Tensor | None       # host bytes (pinned on CUDA) when pieces cannot go straight in
    ready: object = None               # torch.cuda.Event
    free: object = None
    views: object = None               # LayerWeights over `flat`, built once


@dataclass
class Counters:
    disk_bytes: int = 0
    host_bytes: int = 0
    load_seconds: float = 0.0          # the reader thread busy filling slots
    wait_seconds: float = 0.0          # compute blocked waiting for a slot
    units: int = 0

    def snapshot(self) -> "Counters":
        return Counters(self.disk_bytes, self.host_bytes, self.load_seconds, self.wait_seconds, self.units)


# Reads are split into pieces of this size and issued by `readers` threads at once: one
# thread copying from the page cache reaches about half of what two do, and a disk
# answers several outstanding reads faster than one at a time.
READ_CHUNK = 4 << 20


class Filler:
    """Fills one unit into a destination buffer from its tier."""

    def __init__(self, files: Files, device: torch.device, dtype: torch.dtype, readers: int = 2):
        self.files, self.device, self.dtype = files, device, dtype
        self.cuda = device.type == "cuda"
        self.readers = readers
        self._pool = None

    def _read_all(self, jobs: list[tuple[Piece, memoryview]]) -> None:
        chunks = []
        for piece, dest in jobs:
            for a in range(0, piece.nbytes, READ_CHUNK):
                n = min(READ_CHUNK, piece.nbytes - a)
                chunks.append((replace(piece, offset=piece.offset + a, nbytes=n), dest[a:a + n]))
        if self.readers <= 1 or len(chunks) <= 1:
            for piece, dest in chunks:
                self.files.read(piece, dest)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="localchat-read")
        # list() re-raises the first read error here, in the prefetch thread.
        list(self._pool.map(lambda job: self.files.read(*job), chunks))

    def close(self) -> None:
        """End the reader pool's threads (a later read starts a new pool)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def direct(self, piece: Piece) -> bool:
        # Straight into the slot when no conversion or device copy is needed.
        return not self.cuda and self.device.type == "cpu" and piece.dtype == self.dtype

    def staging_bytes(self, unit: Unit) -> int:
        return sum(p.nbytes for p in unit.pieces if not self.direct(p))

    def read_to_host(self, unit: Unit, host: torch.Tensor) -> None:
        """The unit's file bytes, packed, into a host byte buffer (host tier, staging)."""
        mv = byte_view(host)
        self._read_all([(p, mv[p.stage:p.stage + p.nbytes]) for p in unit.pieces])

    def from_disk(self, unit: Unit, flat: torch.Tensor, staging: torch.Tensor | None) -> None:
        staged, jobs = [], []
        flat_mv = byte_view(flat)
        es = flat.element_size()
        for p in unit.pieces:
            if self.direct(p):
                jobs.append((p, flat_mv[p.start * es:(p.start + p.numel) * es]))
            else:
                jobs.append((p, byte_view(staging)[p.stage:p.stage + p.nbytes]))
                staged.append(p)
        self._read_all(jobs)
        self.copy_pieces(staged, flat, staging)

    def copy_pieces(self, pieces, flat: torch.Tensor, src: torch.Tensor) -> None:
        """Copy (and convert) packed pieces from a host byte buffer into the device buffer."""
        for p in pieces:
            part = src[p.stage:p.stage + p.nbytes].view(p.dtype)
            flat[p.start:p.start + p.numel].copy_(part, non_blocking=self.cuda)


# Readers still running when the interpreter exits would be inside torch or a read while
# Python tears down ("terminate called without an active exception"): stop them first.
_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.reset()


class Prefetcher:
    """The reader thread and its ring of slots. `take(unit)` hands the compute the slot
    holding `unit` (waiting only if the reader is behind); `give(slot)` returns it."""

    def __init__(self, units: list[Unit], tier: dict[str, torch.Tensor | None], slots: list[Slot],
                 filler: Filler, files: Files):
        self.units = units               # the streamed units, in pass order
        self.tier = tier                 # unit name -> host copy (host tier) or None (disk tier)
        self.slots = slots
        self.filler = filler
        self.files = files
        self.cuda = filler.cuda
        self.counters = Counters()
        self._thread: threading.Thread | None = None
        _LIVE.add(self)
        if self.cuda:
            self._stream = torch.cuda.Stream(device=filler.device)
            for s in slots:
                s.ready, s.free = torch.cuda.Event(), torch.cuda.Event()

    # -- the compute side
    def take(self, unit: Unit) -> Slot:
        self._ensure_running()
        t0 = time.perf_counter()
        while True:
            try:
                got, slot, error = self._ready.get(timeout=0.5)
                break
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    raise CheckpointError("the weight reader stopped unexpectedly; ask again") from None
        self.counters.wait_seconds += time.perf_counter() - t0
        if error is not None:
            raise error
        if got is not unit:
            raise RuntimeError(f"streamed pass out of order: wanted {unit.name}, the reader had {got.name}")
        if self.cuda:
            torch.cuda.current_stream(self.filler.device).wait_event(slot.ready)
        return slot

    def give(self, slot: Slot) -> None:
        if self.cuda:
            slot.free.record(torch.cuda.current_stream(self.filler.device))
        self._free.put(slot)

    # -- lifecycle
    def _ensure_running(self) -> None:
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        self._stop = threading.Event()
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        for s in self.slots:
            self._free.put(s)
        self.files.open()
        # The reader holds the prefetcher only while it fills a slot: a target dropped without
        # close() is freed (its weights, its ring), and the finalizer wakes the reader to end.
        self._thread = threading.Thread(target=_reader, args=(weakref.ref(self), self._stop, self._free),
                                        name="localchat-prefetch", daemon=True)
        weakref.finalize(self, self._free.put, None)
        self._thread.start()

    def reset(self) -> None:
        """Stop the reader and forget what it read: after a failed or interrupted pass the
        ring restarts at the first unit (and a restored file is reopened)."""
        if self._thread is not None:
            self._stop.set()
            self._free.put(None)
            self._thread.join()
            self._thread = None
        if self.cuda:
            torch.cuda.synchronize(self.filler.device)

    def close(self) -> None:
        self.reset()
        self.filler.close()
        self.files.close()

    # -- the reader thread (_reader below)
    def _fill_next(self, i: int, slot: Slot) -> bool:
        """Fill `slot` with unit i and hand it over; False once a read failed (the compute
        thread gets the error)."""
        unit = self.units[i]
        try:
            if i == 0:
                self.files.check_all()
            self._fill(unit, slot)
        except BaseException as exc:   # noqa: BLE001 — handed to the compute thread
            self._ready.put((unit, slot, exc))
            return False
        self._ready.put((unit, slot, None))
        return True

    def _fill(self, unit: Unit, slot: Slot) -> None:
        t0 = time.perf_counter()
        host = self.tier.get(unit.name)
        f = self.filler
        if self.cuda:
            # The slot's previous copy read from staging: it must be done before we overwrite it.
            slot.ready.synchronize()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(slot.free)
                if host is None:
                    f.read_to_host(unit, slot.staging)
                    f.copy_pieces(unit.pieces, slot.flat, slot.staging)
                else:
                    f.copy_pieces(unit.pieces, slot.flat, host)
                slot.ready.record(self._stream)
            slot.ready.synchronize()       # the copy time counts as load time, not compute's
        elif host is None:
            f.from_disk(unit, slot.flat, slot.staging)
        else:
            f.copy_pieces(unit.pieces, slot.flat, host)
        c = self.counters
        if host is None:
            c.disk_bytes += unit.file_bytes
        else:
            c.host_bytes += unit.file_bytes
        c.units += 1
        c.load_seconds += time.perf_counter() - t0


def _reader(ref: "weakref.ref[Prefetcher]", stop: threading.Event, free: queue.Queue) -> None:
    """The reader thread: units in pass order into free slots, until stopped, or until the
    prefetcher is gone. It waits for a slot without holding the prefetcher."""
    i = 0
    while not stop.is_set():
        slot = free.get()
        p = ref()
        if slot is None or p is None or stop.is_set():
            return
        if not p._fill_next(i, slot):
            return
        i = (i + 1) % len(p.units)
        del p
