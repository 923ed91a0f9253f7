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
import hashlib
import os
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import torch

from .cache import KVCache

MODE = "max-autotune-no-cudagraphs"
STATES = ("off", "compiling", "ready", "failed")
_threads: list[threading.Thread] = []
# A TORCHINDUCTOR_CACHE_DIR the user set wins; otherwise each model gets its own directory.
_USER_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR" in os.environ


def busy() -> bool:
    """Whether a compile is still running. A process that ends then should leave with
    os._exit after flushing its output: interpreter teardown under a thread that is inside
    the compiler can abort the process."""
    return any(t.is_alive() for t in _threads)


def cache_key(name: str, dtype: torch.dtype, weights: str, device: torch.device) -> str:
    """The directory name inductor's caches are kept under: a compiled graph is only valid
    for the model, dtype, weight format, torch build and device it was made for."""
    raw = f"{name}|{dtype}|{weights}|{torch.__version__}|{device.type}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _as_parameters(impl) -> None:
    """Freezing folds parameters into the graph (plain tensors reached through Python
    objects would stay graph inputs, and their GEMMs unpacked). The data is shared."""
    def p(t):
        if t is None or isinstance(t, torch.nn.Parameter) or not isinstance(t, torch.Tensor):
            return t
        return torch.nn.Parameter(t, requires_grad=False)
    for w in impl.layers:
        for f in fields(w):
            setattr(w, f.name, p(getattr(w, f.name)))
    impl.embed, impl.norm, impl.head = p(impl.embed), p(impl.norm), p(impl.head)


def _step(impl, ids: torch.Tensor, pos: int) -> torch.Tensor:
    return impl(ids, pos, False)


class CompiledStep:
    """Owns the background compile of one target's decode step and, once it is ready,
    runs it. `state` is one of STATES; `error` says why it failed."""

    def __init__(self, target, cache_dir: Path | None, key: str, mode: str = MODE):
        self.target = target
        self.mode = mode
        self.state = "compiling"
        self.error = ""
        self.seconds = 0.0               # how long the compile took
        self.cache_dir = Path(cache_dir) / "inductor" / key if cache_dir else None
        self._fn = None
        self._thread: threading.Thread | None = None
        self._go = threading.Event()     # cleared while an answer is being generated
        self._go.set()

    # Compiling is pure Python most of the time and holds the GIL; an eager step needs the
    # GIL back after each of its ~450 operator calls and waits up to the switch interval
    # (5 ms) each time. Measured: decoding fell from ~30 to 0.7 tok/s while a compile ran.
    # So the compile pauses while an answer is generated (engine/session.py calls pause and
    # resume) and runs while the user reads and types.
    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def _yield_to_answers(self, frame, event, arg) -> None:
        if not self._go.is_set():
            self._go.wait()              # releases the GIL until the answer is done

    def start(self) -> None:
        impl = self.target.impl
        _as_parameters(impl)
        # The rotary table the real step will read: built now, shared with the scratch copy.
        impl._rope(0, self.target.cache.capacity, impl.embed)
        self._thread = threading.Thread(target=self._compile, name="localchat-compile", daemon=True)
        _threads.append(self._thread)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ends (tests and benchmarks); True when it is ready."""
        if self._thread is not None:
            self._thread.join(timeout)
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
        sys.setprofile(self._yield_to_answers)      # this thread only
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
        finally:
            sys.setprofile(None)

    def _build(self, mode: str):
        fn = torch.compile(_step, mode=mode, fullgraph=True)
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
