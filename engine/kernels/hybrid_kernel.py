"""Qwen3.5's decoder layers in C for one-token steps and verify passes (layer.c's
hybrid_body.h): a gated attention layer in one call; a gated delta-net layer in three, its
projections, then its conv and recurrence (gdn.c's gdn_step: the functions the replay of
accepted updates calls, so the bits are theirs), then its gated norm and out-projection. The
dense MLP runs in the same call as the layer's second half; a sparse block's norm and shared
expert in one more (its routed experts are the experts kernel's).

Why: through transformers' modules a Qwen3.5-2B-shaped one-token step spent a quarter of
its time between the products (some 40 torch operations a layer); the products already ran
at the memory's read rate. models/hybrid_layers.py says when this runs."""
from __future__ import annotations

import ctypes

import torch

from . import gdn_kernel, layer_kernel

_Mat = layer_kernel._Mat
VECTORS = ("ln1", "ln2", "q_norm", "k_norm", "norm", "dt_bias", "a_neg")
MATRICES = ("q", "k", "v", "o", "qkv", "z", "b", "a", "out", "gate", "up", "down", "qkvz", "ba",
            "se_gate", "se_up", "se_down", "se_score")


class Weights(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in VECTORS] + [(name, _Mat) for name in MATRICES]
                + [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("in_tiled", ctypes.c_int), ("out_tiled", ctypes.c_int)])


class Shape(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int) for name in ("hidden", "inter", "shared_inter", "heads", "kv_heads",
                                                     "head_dim", "rot", "Hk", "Hv", "Dk", "Dv")]
                + [("capacity", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)])


def why_not(dtype: torch.dtype) -> str:
    """'' when the hybrid layers run in C here in `dtype`, else why not."""
    return layer_kernel.why_not(dtype) or gdn_kernel.why_not()


class Library:
    """The C functions for one dtype (why_not(dtype) must be '')."""

    def __init__(self, dtype: torch.dtype):
        lib, sfx = layer_kernel._libs[dtype], layer_kernel.SUFFIX[dtype]
        P, I = ctypes.c_void_p, ctypes.c_int
        self.attn = getattr(lib, f"hyb_attn_{sfx}")
        self.attn.argtypes = [P, P, P, I, I, P, P, P, I]
        self.gdn_in = getattr(lib, f"hyb_gdn_in_{sfx}")
        self.gdn_in.argtypes = [P, P, P, I, P, P, P, P, P, I]
        self.gdn_out = getattr(lib, f"hyb_gdn_out_{sfx}")
        self.gdn_out.argtypes = [P, P, P, I, P, P, P, I]
        self.moe_in = getattr(lib, f"hyb_moe_in_{sfx}")
        self.moe_in.argtypes = [P, P, P, I, P, P, P, I]
        for fn in (self.attn, self.gdn_in, self.gdn_out, self.moe_in):
            fn.restype = None
        self.scratch_bytes = getattr(lib, f"hybrid_scratch_bytes_{sfx}")
        self.scratch_bytes.restype = ctypes.c_int64
        self.scratch_bytes.argtypes = [P, I, I, I]
        self.step = gdn_kernel._lib[0].gdn_step


def mat(t) -> _Mat:
    """A weight matrix [N, K] as layer.c reads it: dense, or int8/int4 (qweights)."""
    if t is None:
        return _Mat(None, None, None, 0)
    if isinstance(t, torch.Tensor):
        return _Mat(t.data_ptr(), None, None, 0)
    return layer_kernel._mat(t)
