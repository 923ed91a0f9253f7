"""The decode step compiled ahead of time (AOTInductor) and kept on disk (issue 7).

`torch.compile` with freezing prepacks every GEMM weight for the CPU's kernels, and its
graph cache cannot store prepacked (mkldnn) constants, so a compiled step was rebuilt
from scratch on every start: about three minutes on a small CPU before decoding reached
its compiled speed. An AOTInductor package is the same inductor code (same freezing,
same autotuned kernels) built into a shared library, with the repacked weights as its
constants: it is compiled once per machine and model, and a later start loads it in
about two seconds.

What is exported is `_StepModule`: one token at a position `pos >= 2` over the
conversation's own KV cache. The position travels as the length of a `marker` view
(export treats Python ints as constants, sizes can be symbolic), and the cache tensors
and the rotary tables are inputs whose length is symbolic, so one package serves every
position and a cache that has grown. The cache is written in place, as the eager step
writes it.

The package holds a copy of the weights (repacked, so they cannot be the checkpoint's
own): on disk it is about the size of the resident weights.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import torch

MIN_POS = 2                      # export specialises sizes 0 and 1; position 1 runs eagerly
# Inductor settings per build mode. Autotuned GEMM templates without epilogue fusion are
# the first choice: with it, max-autotune trips an inductor assertion on the bf16 graph
# ("AssertionError: buf17", torch 2.13), and in float32, same run, the fused step was
# slower (31.4 ms against 27.9; eager 49.7) and took longer to build (103 s against 87).
# Without it the bf16 demo step runs in 17 ms against 50 eager (the default mode: 1.07x).
MODES = {
    "max-autotune-unfused": {"max_autotune": True, "epilogue_fusion": False},
    "max-autotune": {"max_autotune": True},
    "default": {"max_autotune": False},
}
_MAX = 1 << 24


def _tensors_of(obj) -> dict[str, torch.Tensor]:
    """The tensors a packed weight object (target/qweights.py) holds, one level down
    included (an int4 weight's row reader)."""
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            out[k] = v
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            out.update({f"{k}__{kk}": vv for kk, vv in _tensors_of(v).items()})
    return out


def _rebind(obj, name: str, get):
    """A copy of `obj` (a tensor or a packed weight) whose tensors are the module's
    attributes named after `name`: what export traces must be the module's own."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return get(name)
    c = copy.copy(obj)
    for k, v in vars(obj).items():
        if isinstance(v, torch.Tensor):
            setattr(c, k, get(f"{name}__{k}"))
        elif hasattr(v, "__dict__") and not isinstance(v, type) and _tensors_of(v):
            setattr(c, k, _rebind(v, f"{name}__{k}", get))
    return c


class _StepModule(torch.nn.Module):
    """The fast forward's one-token step as a module: every weight tensor registered
    (so export sees parameters, and freezing folds them), the cache and rotary tables
    passed in."""

    def __init__(self, impl):
        super().__init__()
        self.__dict__["impl"] = impl           # a plain attribute, not a submodule
        self._slots: list[tuple[int, str, str]] = []   # (layer, field, name)
        for i, w in enumerate(impl.layers):
            for f in dataclasses.fields(w):
                if getattr(w, f.name) is not None:
                    self._register(f"l{i}_{f.name}", getattr(w, f.name))
                    self._slots.append((i, f.name, f"l{i}_{f.name}"))
        for a in ("embed", "norm", "head"):
            self._register(a, getattr(impl, a))

    def _register(self, name: str, v) -> None:
        items = {name: v} if isinstance(v, torch.Tensor) else {f"{name}__{k}": t for k, t in _tensors_of(v).items()}
        for n, t in items.items():
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(n, t)
            else:
                self.register_buffer(n, t)

    def forward(self, ids, marker, cos, sin, *kv):
        pos = marker.shape[0]
        torch._check(pos < kv[0].shape[2])
        torch._check(pos < cos.shape[0])
        get = lambda n: getattr(self, n)   # noqa: E731
        impl = copy.copy(self.impl)
        impl.layers = [dataclasses.replace(w) for w in impl.layers]
        for i, f, name in self._slots:
            setattr(impl.layers[i], f, _rebind(getattr(self.impl.layers[i], f), name, get))
        impl.embed, impl.norm, impl.head = (_rebind(getattr(self.impl, a), a, get) for a in ("embed", "norm", "head"))
        impl._cos, impl._sin = cos, sin
        impl._scalar_cache = {}                # constants made while tracing stay in the trace
        impl.cache = copy.copy(impl.cache)
        n = len(kv) // 2
        impl.cache.k, impl.cache.v = list(kv[:n]), list(kv[n:])
        return impl(ids, pos, False)


def _marker(pos: int, device) -> torch.Tensor:
    # A zero-stride view: its size carries the position, it reads and allocates nothing.
    return torch.empty(1, device=device).expand(pos)


def build(impl, kv: list[torch.Tensor], path: Path, mode: str) -> None:
    """Export the step over the scratch cache `kv` and compile it into the package at
    `path` (written under a temporary name first: a crash leaves no half package)."""
    from torch.export import Dim, export

    cap, rope, pos = Dim("capacity", min=MIN_POS + 1, max=_MAX), Dim("rope", min=MIN_POS + 1, max=_MAX), \
        Dim("pos", min=MIN_POS, max=_MAX - 1)
    ids = torch.zeros(1, dtype=torch.long, device=kv[0].device)
    args = (ids, torch.empty(MIN_POS, device=ids.device), impl._cos, impl._sin, *kv)
    shapes = {"ids": None, "marker": {0: pos}, "cos": {0: rope}, "sin": {0: rope}, "kv": tuple({2: cap} for _ in kv)}
    ep = export(_StepModule(impl), args, dynamic_shapes=shapes, strict=False)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs={
            "freezing": True, "cpp.weight_prepack": True, **MODES[mode]})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Package:
    """A loaded package, run as the step over `impl`'s cache: `package(impl, ids, pos)` -> logits."""

    def __init__(self, path: Path):
        self.path = path
        self._run = torch._inductor.aoti_load_package(str(path))

    def __call__(self, impl, ids: torch.Tensor, pos: int) -> torch.Tensor:
        impl._rope(pos, 1, impl.norm)       # the table must reach pos (it grows, rarely)
        return self._run(ids, _marker(pos, ids.device), impl._cos, impl._sin, *impl.cache.k, *impl.cache.v)
