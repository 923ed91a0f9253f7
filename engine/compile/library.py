"""A CPU package's shared library, loaded and run through its C interface (the
AOTInductorModelContainer* functions every AOTInductor library exports).

torch's own runner (torch._C._aoti.AOTIModelContainerRunnerCpu) does the same calls but
holds the interpreter lock throughout. Loading a decode step copies its weights out of
the library (0.26 s for the demo model's float32 step on two cores) and every step runs
for milliseconds: under the lock, the thread that decodes stops for all of it. Called
through ctypes, which lets go of the lock for the length of a foreign call, a one-shot
answer keeps decoding eagerly while its step loads beside it, and the chat UI's thread
draws while a compiled step runs.

Only the decode step loads this way: verify passes take the forward's own tensors as
constants, which only torch's runner can hand over.
"""
from __future__ import annotations

import _ctypes
import ctypes
from pathlib import Path

import torch

_P = ctypes.c_void_p
# torch hands tensor handles over as capsules (unnamed) of the at::Tensor pointers.
_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.argtypes, _pointer.restype = [ctypes.py_object, ctypes.c_char_p], _P
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.argtypes, _capsule.restype = [_P, ctypes.c_char_p, _P], ctypes.py_object


class Library:
    """`Library(path)(*tensors)` -> the first output; each call's inputs are the tensors
    in the order the package was exported with."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))        # (RTLD_LOCAL: two packages' symbols never meet)
        f = self._lib
        f.AOTInductorModelContainerCreateWithDevice.argtypes = [ctypes.POINTER(_P), ctypes.c_size_t,
                                                                ctypes.c_char_p, ctypes.c_char_p]
        f.AOTInductorModelContainerRun.argtypes = [_P, ctypes.POINTER(_P), ctypes.c_size_t, ctypes.POINTER(_P),
                                                   ctypes.c_size_t, _P, _P]
        f.AOTInductorModelContainerGetNumOutputs.argtypes = [_P, ctypes.POINTER(ctypes.c_size_t)]
        f.AOTInductorModelContainerDelete.argtypes = [_P]
        self._run = f.AOTInductorModelContainerRun
        handle = _P()
        _ok(f.AOTInductorModelContainerCreateWithDevice(ctypes.byref(handle), 1, b"cpu", None),
            f"{path.name}: its library did not load")
        self._handle = handle
        n = ctypes.c_size_t()
        _ok(f.AOTInductorModelContainerGetNumOutputs(handle, ctypes.byref(n)), f"{path.name}: no outputs")
        self._outputs = n.value

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        # The container takes ownership of the input handles (new references to the
        # tensors, not the tensors) and hands over its outputs'.
        ins = [_pointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))]
        out = (_P * self._outputs)()
        _ok(self._run(self._handle, (_P * len(ins))(*ins), len(ins), out, self._outputs, None, None),
            "the compiled step failed")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_capsule(out[i], None, None) for i in range(self._outputs)])[0]

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.AOTInductorModelContainerDelete(handle)
            self._handle = None
            # ctypes never unloads a library: a rebuilt step's old one would keep its file
            # (the weights' size, deleted) mapped to the end of the process.
            _ctypes.dlclose(self._lib._handle)


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(what)
