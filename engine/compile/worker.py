"""The thread that compiles in the background (engine/compile/step.py's jobs, one after
another), and how it keeps out of the way of the answers: it pauses while any answer is
generated (engine/session.py calls pause and resume), stops a child's build outright
(engine/compile/builder.py), and never holds an OpenMP team while it waits (off_thread)."""
from __future__ import annotations

import contextlib
import gc
import queue
import threading

from . import builder

# Compiling is pure Python most of the time and holds the GIL; an eager step needs the
# GIL back after each of its ~450 operator calls and waits up to the switch interval
# (5 ms) each time. Measured: decoding fell from ~30 to 0.7 tok/s while a compile ran.
# So compiling pauses, process-wide, while any answer is generated (engine/session.py
# calls pause and resume), and runs while the user reads and types.
#
# Where it pauses: at the compile thread's next garbage collection. The compiler builds
# graphs, nodes and code as Python objects all the time (collections count objects kept,
# not freed), so collections come every fraction of a millisecond of its work, and a gc
# callback costs one call per collection. (A
# sys.setprofile hook, the obvious tool, runs on every function call and return of
# the compiler: it made compiles 1.4x slower on the tiny model and several times
# slower on the demo model.) While the thread waits inside the callback no other
# thread collects, which an answer does not miss.
_go = threading.Event()
_go.set()
_answering = 0
_lock = threading.Lock()
# Steps are compiled one after another by one worker thread (a target's step, then its
# drafter's): two compiles at once would only share the same cores. The worker ends when
# its queue is empty (the next job starts a new one): a thread that has run a parallel
# torch op keeps an OpenMP team for as long as it lives, and with a second team in the
# process (the one decoding) libgomp stops spin-waiting between parallel regions once its
# threads outnumber the cores. Measured on the demo model, two cores, float32: the
# compiled step 36 ms with an idle worker alive, 21 ms once it had ended; eager GEMVs
# over the same weights 33 against 22 ms.
_queue: "queue.Queue[tuple]" = queue.Queue()        # (job, its done event)
_worker: threading.Thread | None = None
_pending = 0
# Only building parks: loading a package from disk takes a second or two, mostly outside
# the interpreter, and a warm start should decode its first answer with it.
_building = False


def pause() -> None:
    global _answering
    with _lock:
        _answering += 1
        _go.clear()
        builder.stop()               # a build in a child process stops outright


def resume() -> None:
    global _answering
    with _lock:
        _answering = max(0, _answering - 1)
        if _answering == 0:
            _go.set()
            builder.go_on()


def _yield_to_answers(phase: str, info: dict) -> None:
    if phase == "stop" and _building and not _go.is_set() and _worker is not None \
            and threading.get_ident() == _worker.ident:
        _go.wait()                   # releases the GIL until the answers are done


def busy() -> bool:
    """Whether a compile is queued or running. A process that ends then should leave with
    os._exit after flushing its output: interpreter teardown under a thread that is inside
    the compiler can abort the process."""
    return _pending > 0


def _work() -> None:
    global _pending, _worker
    while True:
        with _lock:              # taken and found empty under the lock submit puts under
            if _queue.empty():
                _worker = None
                return           # the thread ends, and its OpenMP team with it
            job, done = _queue.get_nowait()
        try:
            job()
        finally:
            with _lock:
                _pending -= 1
            done.set()


def submit(job, done: threading.Event) -> None:
    """Queue `job` for the worker; `done` is set when it has run."""
    global _worker, _pending
    with _lock:
        _pending += 1
        _queue.put((job, done))
        if _worker is None or not _worker.is_alive():      # (not alive: a job raised past its own guard)
            _worker = threading.Thread(target=_work, name="localchat-compile", daemon=True)
            if _yield_to_answers not in gc.callbacks:
                gc.callbacks.append(_yield_to_answers)
            _worker.start()


@contextlib.contextmanager
def building():
    """Mark the worker as building (it parks while answers run, see _yield_to_answers)."""
    global _building
    _building = True
    try:
        yield
    finally:
        _building = False

def wait_for_answers(timeout: float | None = None) -> bool:
    """Block until no answer is being generated (at once when none is), or `timeout`
    seconds; True when none is."""
    return _go.wait(timeout)


def answering() -> bool:
    return not _go.is_set()


# How many answers have handed out their first token (engine/session.py): a step that
# loads late (a one-shot answer's) waits for the next one.
_first_tokens = 0
_token_out = threading.Condition()


def first_token() -> None:
    global _first_tokens
    with _token_out:
        _first_tokens += 1
        _token_out.notify_all()


def first_tokens() -> int:
    return _first_tokens


def wait_for_first_token(after: int, timeout: float | None = None) -> bool:
    """Block until an answer's first token is out, counting from `after` (first_tokens()),
    or `timeout` seconds; True when one is."""
    with _token_out:
        return _token_out.wait_for(lambda: _first_tokens > after, timeout)


class Later(Exception):
    """A race found an answer running: it is run again once the answers are done."""


def off_thread(fn, *args):
    """fn(*args) on a thread of its own that ends with it; its result, or its exception.

    A thread that runs a parallel torch operation keeps an OpenMP team for as long as it
    lives, and a second team in the process makes libgomp sleep between the parallel
    regions of the thread that decodes (see _worker above). The compile worker waits a long time
    (on a child's build, for answers to end), so its torch work (loading and checking a
    package, racing it) runs here and takes its team with it. Measured on the demo model,
    a one-shot warm start with the n-gram drafter: its answer decoded at 22 tok/s with the
    compiled step live, against 39 without the drafter, while the worker that had checked
    the step waited with its team to race the verify buckets."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:         # handed to the caller's thread
            out["error"] = exc
    t = threading.Thread(target=run, name="localchat-compile-work", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
