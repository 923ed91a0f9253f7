"""A gated delta-net layer's one-token steps in C (gdn.c): the causal conv update and the
gated delta rule's recurrence, as drop-in replacements for transformers' reference torch
functions (`causal_conv1d_update`, `torch_recurrent_gated_delta_rule`), which a one-token
step, a verify pass and the replay of accepted updates call alike (models/replay.py).

Why: the reference recurrence is some twenty torch operations a token, each a sweep of the
whole float32 state (32 heads x 128 x 128 in Qwen3.5); with the conv it was a tenth of a
decode step of Qwen3.5-35B-A3B's shape. gdn.c reads and writes the state once a token.

Arguments these do not take (another dtype or device, a bias, an activation other than
SiLU, heads wider than 256) go to the reference function they replace."""
from __future__ import annotations

import ctypes

import torch

from .. import hardware
from . import build

SOURCE = "gdn"
MAX_DIM = 256                 # gdn.c's per-head buffers
_DTYPES = (torch.float32, torch.bfloat16)
_lib: list = []               # [library] once loaded, [None] if it cannot be built here
_why = [""]


def _flags() -> list[str]:
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= hardware.cpu_flags() else []


def why_not() -> str:
    """'' when gdn.c runs here, else why not."""
    if not _lib:
        lib = build.library(SOURCE, _flags())
        if lib is None:
            _why[0] = build.why(SOURCE, _flags()) or "gdn.c could not be built"
        else:
            P, I, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            lib.gdn_conv.restype = lib.gdn_rule.restype = None
            lib.gdn_conv.argtypes = [P, I64, P, P, P, I, I, I, I, I, I]
            lib.gdn_rule.argtypes = [P, P, P, I64, I64, I, P, P, I, P, P, P, I, I, I, I, I, I, I]
            lib.gdn_step.restype = None
            lib.gdn_step.argtypes = [P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, I, I]
        _lib.append(lib)
    return _why[0]


def conv_update(plain):
    """causal_conv1d_update(hidden_states [B, C, T], conv_state [B, C, K], weight [C, K],
    bias, activation) -> [B, C, T], the window updated in place; `plain` where gdn.c does
    not take the arguments."""
    def run(hidden_states, conv_state, weight, bias=None, activation=None):
        dt = hidden_states.dtype
        if (bias is not None or activation not in (None, "silu") or dt not in _DTYPES
                or not (conv_state.dtype == weight.dtype == dt) or not hidden_states.is_cpu
                or not conv_state.is_contiguous() or hidden_states.dim() != 3):
            return plain(hidden_states, conv_state, weight, bias, activation)
        B, C, T = hidden_states.shape
        K = conv_state.shape[-1]
        w = weight.contiguous()
        x = hidden_states.transpose(1, 2).contiguous()           # [B, T, C]
        out = torch.empty(B, T, C, dtype=dt)
        threads = torch.get_num_threads()
        for b in range(B):
            _lib[0].gdn_conv(x[b].data_ptr(), C, conv_state[b].data_ptr(), w.data_ptr(), out[b].data_ptr(),
                             T, C, K, activation == "silu", dt == torch.bfloat16, threads)
        return out.transpose(1, 2)
    return run


def delta_rule(plain):
    """torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state,
    output_final_state, use_qk_l2norm_in_kernel) -> (out [B, T, Hv, Dv], final state
    [B, Hv, Dk, Dv] float32 or None); `plain` where gdn.c does not take the arguments."""
    def run(query, key, value, g, beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, **kwargs):
        dt = query.dtype
        B, T, Hk, Dk = key.shape
        Hv, Dv = value.shape[-2:]
        if (kwargs.get("cu_seqlens") is not None or dt not in _DTYPES or not (key.dtype == value.dtype == dt)
                or beta.dtype not in _DTYPES or not query.is_cpu or Dk > MAX_DIM or Dv > MAX_DIM or Hv % Hk):
            return plain(query, key, value, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         **kwargs)
        q, k, v, bt = (t.contiguous() for t in (query, key, value, beta))
        gf = g.to(torch.float32).contiguous()
        if initial_state is None:
            s_in = torch.zeros(B, Hv, Dk, Dv)
        else:
            s_in = initial_state.to(torch.float32).contiguous()
        s_out = torch.empty(B, Hv, Dk, Dv)
        out = torch.empty(B, T, Hv, Dv, dtype=dt)
        threads = torch.get_num_threads()
        for b in range(B):
            _lib[0].gdn_rule(q[b].data_ptr(), k[b].data_ptr(), v[b].data_ptr(), Hk * Dk, Hv * Dv, dt == torch.bfloat16,
                             gf[b].data_ptr(), bt[b].data_ptr(), bt.dtype == torch.bfloat16, s_in[b].data_ptr(),
                             s_out[b].data_ptr(), out[b].data_ptr(), T, Hk, Hv, Dk, Dv,
                             bool(use_qk_l2norm_in_kernel), threads)
        return out, (s_out if output_final_state else None)
    return run
