"""The one-token decode step compiled by inductor, built in the background (issue 7).

An eager decode step of the fast forward is ~450 small operator calls; on a CPU their
overhead is as large as the weight reads. `torch.compile(fullgraph=True)` in
max-autotune mode with inductor *freezing* fuses the elementwise work and folds the weights
into the graph as constants, so each GEMM is prepacked and autotuned for one row
(benchmarks/compile_probe.py: 27.6 ms against 38.3 ms eager on the demo model in float32).

A cold compile takes one to two minutes on a small CPU, so nobody waits for it: a thread
compiles the step against a scratch KV cache (same shapes, same weights) while the chat
decodes eagerly, and the target uses the compiled step from the next token on once it is
ready. Two graphs are built: one at a first position, then the one with the position
symbolic (dynamo's automatic dynamic shapes), which serves every later position. The
cache's capacity and the rotary table are marked dynamic, so a conversation that
outgrows them does not recompile.

Inductor's caches go to a directory per model, dtype, weight format, torch version and
device under the user cache dir, so the next start finds what can be reused (autotuning
results, and dynamo's record of which sizes are dynamic). After the switch the
step runs with the compiler's `fail_on_recompile` stance: a call whose guards would fail
(something unforeseen changed) falls back to the eager step for good instead of
compiling on the user's time. Verify passes (several positions) stay eager.
"""
from __future__ import annotations

import copy
import gc
import hashlib
import os
import queue
import threading
import time
import types
from dataclasses import fields
from pathlib import Path

import torch

from .cache import KVCache

MODE = "max-autotune-no-cudagraphs"
STATES = ("off", "compiling", "ready", "failed")
# A TORCHINDUCTOR_CACHE_DIR the user set wins; otherwise each model gets its own directory.
_USER_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR" in os.environ

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
# drafter's): two compiles at once would only share the same cores.
_queue: "queue.Queue[CompiledStep]" = queue.Queue()
_worker: threading.Thread | None = None
_pending = 0


def pause() -> None:
    global _answering
    with _lock:
        _answering += 1
        _go.clear()


def resume() -> None:
    global _answering
    with _lock:
        _answering = max(0, _answering - 1)
        if _answering == 0:
            _go.set()


def _yield_to_answers(phase: str, info: dict) -> None:
    if phase == "stop" and not _go.is_set() and _worker is not None and threading.get_ident() == _worker.ident:
        _go.wait()                   # releases the GIL until the answers are done


def busy() -> bool:
    """Whether a compile is queued or running. A process that ends then should leave with
    os._exit after flushing its output: interpreter teardown under a thread that is inside
    the compiler can abort the process."""
    return _pending > 0


def _work() -> None:
    global _pending
    while True:
        step = _queue.get()
        try:
            step._compile()
        finally:
            with _lock:
                _pending -= 1
            step._done.set()


def _submit(step: "CompiledStep") -> None:
    global _worker, _pending
    with _lock:
        _pending += 1
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="localchat-compile", daemon=True)
            if _yield_to_answers not in gc.callbacks:
                gc.callbacks.append(_yield_to_answers)
            _worker.start()
    _queue.put(step)


def cache_key(name: str, dtype: torch.dtype, weights: str, device: torch.device) -> str:
    """The directory name inductor's caches are kept under: a compiled graph is only valid
    for the model, dtype, weight format, torch build and device it was made for."""
    raw = f"{name}|{dtype}|{weights}|{torch.__version__}|{device.type}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _as_parameters(impl) -> None:
    """Freezing folds parameters into the graph (plain tensors reached through Python
    objects would stay graph inputs, and their GEMMs unpacked). The data is shared."""
    def p(t):
        if t is None or isinstance(t, torch.nn.Parameter):
            return t
        if not isinstance(t, torch.Tensor):
            # A packed int8/int4 weight (target/qweights.py): its tensors become
            # parameters, so its kernel's weight is a constant of the graph too.
            for name, v in vars(t).items():
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    setattr(t, name, torch.nn.Parameter(v, requires_grad=False))
            return t
        return torch.nn.Parameter(t, requires_grad=False)
    for w in impl.layers:
        for f in fields(w):
            setattr(w, f.name, p(getattr(w, f.name)))
    impl.embed, impl.norm, impl.head = p(impl.embed), p(impl.norm), p(impl.head)


def _step(impl, ids: torch.Tensor, pos: int) -> torch.Tensor:
    return impl(ids, pos, False)


def _own_step():
    """`_step` with a code object of its own. Dynamo keeps its compiled graphs, and counts
    recompiles against its limit of 8, per code object: were every step compiled from
    `_step` itself, each target and drafter a process compiles (two graphs each) would add
    to one list, checked on every call, until a later compile failed on the limit."""
    return types.FunctionType(_step.__code__.replace(), _step.__globals__, "_step")


class CompiledStep:
    """Owns the background compile of one target's decode step and, once it is ready,
    runs it. `state` is one of STATES; `error` says why it failed."""

    def __init__(self, target, cache_dir: Path | None, key: str, mode: str = MODE):
        self.target = target
        self.mode = mode
        self.state = "compiling"
        self.error = ""
        self.seconds = 0.0               # how long the compile took (wall time, pauses included)
        self.cache_dir = Path(cache_dir) / "inductor" / key if cache_dir else None
        self._fn = None
        self._done = threading.Event()

    def start(self) -> None:
        impl = self.target.impl
        _as_parameters(impl)
        # The rotary table the real step will read: built now, shared with the scratch copy.
        impl._rope(0, self.target.cache.capacity, impl.norm)
        _submit(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ends (tests and benchmarks); True when it is ready."""
        self._done.wait(timeout)
        return self.state == "ready"

    def _scratch(self):
        """A shallow copy of the forward with a KV cache of its own: the compile runs real
        steps, and they must not write into the conversation's cache."""
        impl, cache = self.target.impl, self.target.cache
        scratch = copy.copy(impl)
        scratch.cache = KVCache(cache.layers, cache.kv_heads, cache.head_dim, cache.dtype, cache.device,
                                capacity=cache.capacity, max_positions=cache.max_positions)
        for t in scratch.cache.k + scratch.cache.v:
            torch._dynamo.mark_dynamic(t, 2)
        for t in (scratch._cos, scratch._sin):
            torch._dynamo.mark_dynamic(t, 0)
        return scratch

    def _compile(self) -> None:
        t0 = time.perf_counter()
        try:
            import torch._inductor.config as inductor_config
            inductor_config.freezing = True
            # Prepacked weights (mkldnn) make inductor's FX graph cache skip the graph
            # ("mkldnn tensors unpickleable"), so every start compiles in full; without
            # them a warm start reuses the generated code. Measured on the demo model, same
            # run: 1.34x eager with prepacking, 1.20x without. The compile runs in the
            # background either way, so the faster steady state wins.
            inductor_config.cpp.weight_prepack = True
            if self.cache_dir is not None and not _USER_CACHE_DIR:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
            # max-autotune fails in inductor on some graphs (bf16 here: "AssertionError:
            # buf17"); the default mode still fuses the step, so it is the fallback.
            modes = [self.mode] + (["default"] if self.mode != "default" else [])
            for i, mode in enumerate(modes):
                try:
                    self._fn = self._build(mode)
                    self.mode = mode
                    break
                except Exception:
                    if i == len(modes) - 1:
                        raise
            self.seconds = time.perf_counter() - t0
            self.state = "ready"
        except Exception as exc:             # a compiler failure must never end the chat
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.state = "failed"

    def _build(self, mode: str):
        fn = torch.compile(_own_step(), mode=mode, fullgraph=True)
        scratch = self._scratch()
        with torch.inference_mode():
            # Made inside inference mode, as the target's forward makes its ids: the
            # guards check the tensor's dispatch keys.
            ids = torch.zeros(1, dtype=torch.long, device=self.target.device)
            fn(scratch, ids, 1)          # the first graph, at one position
            fn(scratch, ids, 2)          # then the one with the position symbolic
        return fn

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor | None:
        """The compiled step's logits, or None when the caller must run the eager step."""
        if self.state != "ready":
            return None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._fn(self.target.impl, ids, pos)
        except Exception as exc:
            self.error = f"would recompile ({type(exc).__name__}: {exc}); decoding eagerly"
            self.state = "failed"
            return None
