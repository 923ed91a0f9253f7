"""The one-token decode step compiled by inductor, built in the background (issue 7).

An eager decode step of the fast forward is ~450 small operator calls; on a CPU their
overhead is as large as the weight reads. Inductor in max-autotune mode with *freezing*
fuses the elementwise work and folds the weights into the code as constants, so each
GEMM is prepacked and autotuned for one row (1.3-1.4x the eager step on the demo model).

A cold compile takes minutes on a small CPU, so nobody waits for it: a thread builds the
step against a scratch KV cache (same shapes, same weights) while the chat decodes
eagerly, and the target uses the compiled step from the next token on once it is ready.

It is built ahead of time (engine/compile/exported.py: torch.export, then an AOTInductor package)
and kept under the user cache dir in a directory per model and weight files, dtype,
weight format, torch version, device and CPU instruction set, so a later start loads it
in seconds instead of compiling again. Before a step goes live it must compute the
model's step (one step on a scratch cache against the eager forward): a stale or corrupt
package is deleted and built again. When no package can be built, `torch.compile` over
the same function is the fallback (its prepacked graphs cannot be cached: it compiles in
full at every start); it runs with the compiler's `fail_on_recompile` stance, so a call
whose guards would fail falls back to the eager step for good instead of compiling on the
user's time.

Verify passes of a speculative round are compiled too, after the step, in buckets of
positions (exported.VERIFY_ROWS: a pass of n runs in the smallest bucket that holds it,
padded). They are packages built without weights that run on the forward's own tensors,
so they cost no memory beyond the forward's; a chat uses each bucket as it goes live.
"""
from __future__ import annotations

import os
import threading
import time
import types
from pathlib import Path

import torch

from .. import hardware
from . import builder, exported, package_dirs, proof, quiet, race
from . import worker
from .proving import Proving, why as _why

MODE = "max-autotune-unfused"            # engine/compile/exported.py MODES; torch.compile runs "default"
# A verify bucket goes live only if it beats the eager pass by this much (measured when it is
# built or loaded). On a small CPU a verify pass's GEMMs are the same BLAS calls either way
# and the rows amortise the eager overhead, so the two can be even: then eager is kept.
PASS_GAIN = 0.97
STATES = ("off", "compiling", "ready", "failed")
# Packages are built in a child process where one can (engine/compile/builder.py); False builds in
# this process, as a target without a recipe (one not made by the loaders) always does.
CHILD_BUILDS = True
# A TORCHINDUCTOR_CACHE_DIR the user set wins; otherwise each model gets its own directory.
_USER_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR" in os.environ

def _step(impl, ids: torch.Tensor, pos: int) -> torch.Tensor:
    return impl(ids, pos, False)


def _own_step():
    """`_step` with a code object of its own. Dynamo keeps its compiled graphs, and counts
    recompiles against its limit of 8, per code object: were every step compiled from
    `_step` itself, each target and drafter a process compiles (two graphs each) would add
    to one list, checked on every call, until a later compile failed on the limit."""
    return types.FunctionType(_step.__code__.replace(), _step.__globals__, "_step")


class CompiledStep(Proving):
    """Owns the background compile of one target's decode step and, once it is ready,
    runs it. `state` is one of STATES; `error` says why it failed; `source` says where the
    running step came from: "cache" (a package loaded from disk), "built" (compiled now
    and packaged) or "jit" (torch.compile, when no package could be made)."""

    def __init__(self, target, cache_dir: Path | None, key: str, mode: str = MODE, build: bool = True,
                 rows: tuple[int, ...] = (), step: bool = True, lineage: str = "", late: bool = False):
        self.target = target
        self.lineage = lineage           # what the package is a version of (package_dirs.lineage)
        self._marked = False
        self.step = step                 # False: verify passes only (no memory for the step's own weights)
        self.build = build               # False: only load a package an earlier start built
        self.late = late                 # load once an answer's first token is out (worker.first_token)
        self._tokens_at_start = 0
        self._unchecked = False          # a late step's package, loaded; checked by the first step that runs it
        self.mode = mode
        self.state = "compiling"
        self.error = ""
        self.source = ""
        self.seconds = 0.0               # how long the compile (or the load) took, pauses included
        self.cache_dir = package_dirs.folder_of(cache_dir, key) if cache_dir else None
        self._suffix = exported.suffix(getattr(target, "device", "cpu"))
        self.package = self.cache_dir / f"step{self._suffix}" if self.cache_dir else None
        self.notes: list[str] = []       # attempts that failed on the way (why a fallback ran)
        self.check_error = None          # the live step's relative logit error against eager (_check)
        self.built_in = ""               # where the last package was built: child | process
        self._fn = None
        self._done = threading.Event()
        # Verify passes (exported.VERIFY_ROWS buckets), built after the step: those live
        # so far, by rows. They run on the forward's own weights (no copy).
        self.rows = tuple(rows) if self.cache_dir is not None else ()
        self.passes: dict[int, exported.Package] = {}
        self.passes_error = ""
        self._passes_done = threading.Event()
        self._gave_up: set[int] = set()          # buckets that failed, lost their race, or were not cached
        self.pass_ms: dict[int, tuple[float, float]] = {}   # rows -> (eager, compiled) ms, as raced
        # The step's proof (engine/compile/proof.py): raced when idle after it goes live,
        # rebuilt when the machine is quiet if it falls short (`short` says why).
        self.proof: dict = {}
        self.short = ""
        self.rebuilt = ""                # what a quiet rebuild did: "kept new" | "kept old" | ""
        self._proven = threading.Event()
        self._built: dict = {}           # how the last step build went (proof.built)
        self._race_tries = 0
        self._next = None                # a rebuilt package waiting for its race
        self._next_built: dict = {}
        self._child_race: dict | None = None   # the build's child's race of the step it built (race.py)

    def start(self) -> None:
        impl = self.target.impl
        exported.as_parameters(impl)
        # The rotary table the real step will read: built now, shared with the scratch copy.
        impl._rope(0, self.target.cache.capacity, impl.norm)
        self._tokens_at_start = worker.first_tokens()
        if self.late:
            worker.submit(self._late, threading.Event())
        else:
            worker.submit(self._compile, self._done)

    def _late(self) -> None:
        """Load once an answer's first token is out: loading copies the weights out of the
        library, a few tenths of a second of memory traffic that would slow the prefill.
        Queued again meanwhile, so the worker's other jobs are not held up."""
        if not worker.wait_for_first_token(self._tokens_at_start, 0.5):
            worker.submit(self._late, threading.Event())
            return
        try:
            self._compile()
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ends (tests and benchmarks); True when it is ready."""
        self._done.wait(timeout)
        return self.state == "ready"

    def wait_proven(self, timeout: float | None = None) -> bool:
        """Block until the step has been raced (and rebuilt, if it fell short); True when
        that happened (False: timed out, or there was nothing to prove)."""
        return self._proven.wait(timeout) and bool(self.proof.get("race"))

    def wait_passes(self, timeout: float | None = None) -> bool:
        """Block until the verify passes are built or loaded (or given up on); True when
        every bucket is live."""
        self._passes_done.wait(timeout)
        return bool(self.rows) and all(r in self.passes for r in self.rows)

    def _scratch(self, dynamic: bool = True):
        """The forward with a KV cache of its own (race.scratch): the compile and the
        checks run real steps, and they must not write into the conversation's cache."""
        return race.scratch(self.target.impl, dynamic)

    def _attempts(self) -> list[tuple[str, str]]:
        """(backend, mode) in the order tried: an AOTInductor package first (it is kept on
        disk), autotuned, then in inductor's default mode (autotuning fails in inductor on
        some graphs, and the default mode still fuses the step); torch.compile last."""
        aot = [self.mode] + (["default"] if self.mode != "default" else [])
        return ([("aot", m) for m in aot] if self.package is not None else []) + [("jit", "default")]

    def _compile(self) -> None:
        t0 = time.perf_counter()
        try:
            if not self.step:
                self.state = "off"
            elif self._eager_wins_here():
                self.state = "off"           # its race says so; not even loaded
            elif self._load_package():
                self.source = "cache"
            elif not self.build:
                self.state = "off"           # nothing cached, and building was not asked for
            else:
                self._fn = self._first_that_builds()
            if self.state == "off":
                return
            self.seconds = time.perf_counter() - t0
            self.state = "ready"
        except Exception as exc:             # a compiler failure must never end the chat
            self.error = _why(exc)
            self.state = "failed"
        finally:
            # The verify passes queue behind whatever is queued now (a drafter's step):
            # the step gains more per second of compiling. A compiler that failed on the
            # step is not asked for more.
            if self.rows and self.state != "failed":
                worker.submit(self._compile_passes, self._passes_done)
            else:
                self._passes_done.set()
            if self.state == "ready" and self.source in ("cache", "built"):
                self._when_free(self._prove)                  # it sets _proven itself
            else:
                self._proven.set()

    def want_rows(self, rows: tuple[int, ...]) -> None:
        """Compile these verify buckets too (another drafter drafts longer, or at all)."""
        more = [r for r in rows if r not in self.rows]
        if not more or self.cache_dir is None or self.state == "failed":
            return
        self.rows = tuple(sorted({*self.rows, *more}))
        if self.state != "compiling":        # else the step's job queues the passes when it ends
            self._passes_done = threading.Event()
            worker.submit(self._compile_passes, self._passes_done)

    def _compile_passes(self) -> None:
        for rows in [r for r in self.rows if r not in self.passes and r not in self._gave_up]:
            path = self.cache_dir / f"verify-{rows}{self._suffix}"
            # Buckets load (and build) between answers: loading one during an answer
            # slowed a warm start's first answer (one-shot, demo model) from 40 to 30 tok/s
            # for the two seconds it took. (This thread holds no OpenMP team: worker.off_thread.)
            worker.wait_for_answers()
            try:
                package = self._load(path, rows, f"cached verify pass of {rows}")
                if package is None and self.build:
                    with worker.building():
                        package = self._build_aot(path, rows, "default")
                if package is None:
                    self._gave_up.add(rows)
                    continue
                eager, fast = self._race_when_idle(package, rows)
            except Exception as exc:         # the next bucket would fail the same way
                self.passes_error = f"verify pass of {rows}: {_why(exc)}"
                self._gave_up.update(self.rows)
                return
            self.pass_ms[rows] = (round(eager, 2), round(fast, 2))
            if fast < eager * PASS_GAIN:
                self.passes[rows] = package
            else:
                self._gave_up.add(rows)
                self.notes.append(f"verify pass of {rows} kept eager: {fast:.1f} ms compiled, {eager:.1f} eager")

    def _race_when_idle(self, package, rows: int) -> tuple[float, float]:
        return self._when_idle(self._race, package, rows)

    def _when_idle(self, fn, *args):
        """fn(*args), while no answer is generated (a race would slow the answer and be
        slowed by it): one that an answer interrupts waits for it to end, on this thread,
        which holds no OpenMP team (worker.off_thread), and starts again."""
        while True:
            worker.wait_for_answers()
            try:
                return worker.off_thread(fn, *args)
            except worker.Later:
                continue

    def _race(self, package, rows: int, reps: int = 5) -> tuple[float, float]:
        """Median milliseconds of the eager and the compiled pass of `rows` positions, run
        in turn on scratch caches; worker.Later if an answer starts meanwhile."""
        return tuple(self._times([None, package], rows, reps))

    def _times(self, fns: list, rows: int, reps: int = 5, budget_s: float = 0.0) -> list[float]:
        """engine/compile/race.py's times over this target's forward; worker.Later if an
        answer starts meanwhile."""
        try:
            return race.times(self.target.impl, fns, rows, reps, budget_s, interrupted=worker.answering)
        except race.Later:
            raise worker.Later from None

    def _when_free(self, job) -> None:
        """Queue `job` to run while no answer runs and the machine is quiet. Found
        answering, or the job raising worker.Later (an answer started, or the machine was
        busy), it is queued again behind whatever came meanwhile: loading a package never
        waits behind a race waiting for its moment."""
        def run():
            if worker.answering():
                worker.wait_for_answers(0.5)
                worker.submit(run, threading.Event())
                return
            try:
                job()
            except worker.Later:
                worker.submit(run, threading.Event())
            except Exception as exc:              # the step stays as it is
                self.notes.append(f"proving the step: {_why(exc)}")
                self._proven.set()
        worker.submit(run, threading.Event())

    def _load_package(self) -> bool:
        """Use the step's package a previous start left, if it is there and computes this
        model's step; a stale or unreadable one is deleted (and built again)."""
        if self.package is None:
            return False
        self._fn = self._load(self.package, 1, "cached package")
        return self._fn is not None

    def _load(self, path: Path, rows: int, what: str):
        """The package at `path` if it is there and checks out; else None, and a package
        that does not load or check out is deleted."""
        try:
            exported.migrate(path)
        except (OSError, ValueError) as exc:
            self.notes.append(f"{what}: the earlier version's archive could not be read ({_why(exc)})")
            path.with_suffix(".pt2").unlink(missing_ok=True)
        if not path.exists():
            return None
        try:
            return self._open(path, rows)
        except Exception as exc:
            self.notes.append(f"{what} unusable, {'rebuilding' if self.build else 'deleted'} ({_why(exc)})")
            path.unlink(missing_ok=True)
            return None

    def _build_aot(self, path: Path, rows: int, mode: str, against: Path | None = None):
        """Build the package of a pass of `rows` positions at `path` (in a child process
        where one can: engine/compile/builder.py), load and check it; a miscompile is deleted, not
        kept for the next start."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._child_race = None
        if self._in_child():
            self.built_in = "child"
            record = builder.build(self.target.recipe, path, mode, rows, private_cache=not _USER_CACHE_DIR,
                                   against=against)
            self._child_race = record.pop("race", None) if rows == 1 else None
            if record.get("race_error"):
                self.notes.append(f"the build's race of the step failed ({record.pop('race_error')})")
        else:
            self.built_in = "process"
            scratch = self._scratch(dynamic=False)
            with quiet.steady_timings() as timings:
                exported.build(scratch, scratch.cache.k + scratch.cache.v, path, mode,
                               private_cache=not _USER_CACHE_DIR, rows=rows)
            record = timings.as_dict()
        try:
            package = self._open(path, rows)
        except Exception:
            path.unlink(missing_ok=True)
            raise
        if rows == 1:
            self._built = proof.built(record, mode)
        return package

    def _in_child(self) -> bool:
        """Build in a child process: on a CPU (on a GPU the child would need a second copy
        of the weights on the device), for a target that says how to load it again, with
        memory for the child's own copy."""
        t = self.target
        if not CHILD_BUILDS or t.device.type != "cpu" or getattr(t, "recipe", None) is None:
            return False
        free = hardware.available_memory(t.device)
        return free is not None and free >= builder.room_needed(t.weight_bytes())

    def _open(self, path: Path, rows: int = 1):
        """The package at `path`, loaded (a verify pass given the forward's weights) and
        checked; its unpacked files are removed once the check has run it (it lives in
        memory from then on). On a thread that ends with it (worker.off_thread)."""
        package = worker.off_thread(self._open_here, path, rows)
        self._used()
        return package

    def _open_here(self, path: Path, rows: int):
        package = (exported.take_preloaded(path) if rows == 1 else None) or \
            exported.Package(path, rows, weights_of=self.target.impl if rows > 1 else None)
        try:
            if self.late and rows == 1:
                # Checked by the answer's own thread, between two tokens (__call__): run here,
                # its Python work would take the interpreter from the eager tokens decoding
                # meanwhile, each of their ~450 operator calls waiting for it.
                self._unchecked = True
            else:
                self._check(package, rows)
        except BaseException:
            package.release_files()
            raise
        if worker.answering() and package.unpacked is None:
            # A late step (a one-shot answer's) goes live first: giving back the library's
            # pages reads this process's whole memory map (tens of ms), after the answer.
            self._when_free(package.release_files)
        else:
            package.release_files()
        return package

    def _used(self) -> None:
        """A package of this directory checked out: mark the directory used, and remove
        stale ones beside it (engine/compile/package_dirs.py); once per start."""
        if self._marked:
            return
        self._marked = True
        try:
            if self.lineage:
                package_dirs.mark_used(self.cache_dir, self.lineage)
            package_dirs.sweep_stale(self.cache_dir)
        except OSError:
            pass                             # a read-only cache dir still serves its packages

    def _first_that_builds(self):
        with worker.building():
            return self._try_builds()

    def _try_builds(self):
        attempts = self._attempts()
        for i, (backend, mode) in enumerate(attempts):
            try:
                fn = self._build(backend, mode)
                self.source = "built" if backend == "aot" else "jit"
                self.mode = mode
                return fn
            except Exception as exc:
                self.notes.append(f"{backend} {mode}: {_why(exc)}")
                if i == len(attempts) - 1:
                    raise

    def _build(self, backend: str, mode: str):
        import torch._inductor.config as inductor_config
        if backend == "aot":
            return self._build_aot(self.package, 1, mode)
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        inductor_config.freezing = True
        # Prepacked weights (mkldnn) make inductor's FX graph cache skip the graph
        # ("mkldnn tensors unpickleable"), so this path compiles in full on every start;
        # the package above is what makes a second start fast.
        inductor_config.cpp.weight_prepack = True
        inductor_config.cpp.min_chunk_size = exported.SERIAL_BELOW
        if self.cache_dir is not None and not _USER_CACHE_DIR:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        fn = torch.compile(_own_step(), mode=mode, fullgraph=True)
        scratch = self._scratch()
        with torch.inference_mode():
            # Made inside inference mode, as the target's forward makes its ids: the
            # guards check the tensor's dispatch keys.
            ids = torch.zeros(1, dtype=torch.long, device=self.target.device)
            fn(scratch, ids, 1)          # the first graph, at one position
            fn(scratch, ids, 2)          # then the one with the position symbolic
        fn = _guarded(fn)
        self._check(fn)
        return fn

    def _check(self, fn, rows: int = 1) -> None:
        """The compiled step must compute this model's step: one step on a scratch cache,
        against the eager forward. A package built from other weights is off by about the
        logits' own size (relative error ~1.4); float32 kernels round apart by ~1e-5 of it.
        In bfloat16 the two part further (inductor keeps fused intermediates in float32,
        the eager step rounds each to bf16: 0.24 measured on the demo model at this probe,
        whose cache is empty), so the bound follows the activations' dtype."""
        a, b = self._scratch(dynamic=False), self._scratch(dynamic=False)
        with torch.inference_mode():
            ids = torch.arange(1, rows + 1, dtype=torch.long, device=self.target.device)
            want = a(ids, exported.MIN_POS, rows > 1)
            got = fn(b, ids, exported.MIN_POS)
        err = _relative(got, want)
        self.check_error = err
        if not err < self._bound():
            raise ValueError(f"its logits are not this model's (relative error {err:.2g})")

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor | None:
        """The compiled step's logits, or None when the caller must run the eager step."""
        if self.state != "ready" or pos < exported.MIN_POS:
            return None
        if self._unchecked:
            return self._check_late(ids, pos)
        try:
            return self._fn(self.target.impl, ids, pos)
        except Exception as exc:
            self.error = f"the compiled step stopped ({type(exc).__name__}: {exc}); decoding eagerly"
            self.state = "failed"
            return None

    def _check_late(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """The check a late step's package skipped when it loaded (_open_here), run on its
        first step: the compiled step, then the eager one over the same cache slot (it
        writes the slot again), compared; this token is the eager step's. Only a step
        that parts from eager here takes the full check on a scratch cache (_check, whose
        bound is calibrated there), and one that fails it is deleted, as at any load.
        Checking here costs one compiled step; the scratch check two steps and two caches
        (~60 ms on the demo model), in the middle of an answer."""
        self._unchecked = False
        impl = self.target.impl
        try:
            got = self._fn(impl, ids, pos)
        except Exception as exc:
            got, why = None, exc
        want = impl(ids, pos, False)
        err = _relative(got, want) if got is not None else None
        if err is not None and err < self._bound():
            self.check_error = err
            return want
        try:
            if got is None:
                raise why
            self._check(self._fn)
        except Exception as exc:
            self.notes.append(f"cached package unusable, deleted ({_why(exc)})")
            self.package.unlink(missing_ok=True)
            self._fn, self.source, self.state = None, "", "off"
        return want

    def _bound(self) -> float:
        return 1e-2 if self.target.cache.dtype == torch.float32 else 0.6

    @property
    def passes_state(self) -> str:
        """The verify passes: off (none wanted) | compiling | ready (some live) | failed."""
        if not self.rows:
            return "off"
        if not self._passes_done.is_set():
            return "compiling"
        return "ready" if self.passes else ("failed" if self.passes_error else "off")

    def pass_rows(self, n: int) -> int | None:
        """The compiled verify pass a pass of n positions runs in (its bucket), if it is
        live; None: the eager forward runs it."""
        rows = next((r for r in self.rows if r >= n), None)
        return rows if rows in self.passes else None

    def run_pass(self, ids: torch.Tensor, pos: int, rows: int) -> torch.Tensor | None:
        """Every row's logits of a verify pass at `pos` (padded to `rows`: the caller has
        made room for them in the cache), or None when the caller must run it eagerly."""
        package = self.passes.get(rows)
        if package is None or pos < exported.MIN_POS:
            return None
        try:
            return package(self.target.impl, ids, pos)[:ids.numel()]
        except Exception as exc:
            self.passes_error = f"the compiled verify pass stopped ({type(exc).__name__}: {exc}); verifying eagerly"
            self.passes = {}
            return None


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _guarded(fn):
    """A torch.compile'd step that never compiles on the user's time: a call whose guards
    fail raises (and the caller decodes eagerly for good)."""
    def step(impl, ids, pos):
        with torch.compiler.set_stance("fail_on_recompile"):
            return fn(impl, ids, pos)
    return step
