"""Gated delta-net layers (Qwen3.5, Qwen3-Next) with their per-token conv and recurrence in
C (kernels/gdn_kernel.py), and a prefill's causal conv in float32 where the weights are bf16.

A layer's forward calls the conv update and the recurrence (and in a prefill the chunked
rule) by their names in its modeling module, so the C versions take those names while one
of our passes runs, and only then: a model of the same class outside the engine (a test's
reference) keeps transformers' functions. The swap counts the passes in flight (an
engine's worker thread and another's) and puts the names back when the last one ends. The
replay of accepted updates reads the same functions from the layer (replay._fns), so a
one-token step, a verify pass and a replay run the same code."""
from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import gdn_kernel

CONV, RULE = "causal_conv1d_update", "torch_recurrent_gated_delta_rule"
# A prefill's rule: transformers' chunked form, in torch. gdn.c's recurrence over the same
# tokens takes its name: the same updates, token by token, each as a one-token step makes
# it (prefill need not match the steps' bits; this does), and at half the time or less
# (Qwen3.5-2B's delta-net heads, bf16, in one call: 44 tokens 1.2 against 2.4 ms, 480
# tokens 13.1 against 27.6; 2-core Xeon).
CHUNK = "torch_chunk_gated_delta_rule"
# A prefill's causal conv: transformers' in the weight's dtype, which for bf16 on a CPU runs
# aten's depthwise conv one channel at a time (most of a bf16 hybrid's prefill); the same
# conv in float32, rounded once to bf16 as aten's bf16 conv rounds its float sums, is one call.
CONV_FN = "causal_conv1d_fn"
NAMES = (CONV, RULE, CHUNK, CONV_FN)
_lock = threading.Lock()
_active: dict[str, int] = {}          # modeling module -> passes in flight
_saved: dict[str, tuple] = {}         # modeling module -> transformers' own functions, by NAMES


class Scope:
    """A context manager: while it is entered, the modeling modules it names call gdn.c."""

    def __init__(self, modules: dict[str, tuple]):
        self.modules = modules            # name -> the replacements, by NAMES (None: keep)

    def __enter__(self):
        with _lock:
            for name, fns in self.modules.items():
                if not _active.get(name):
                    mod = sys.modules[name]
                    for attr, fn in zip(NAMES, fns):
                        if fn is not None:
                            setattr(mod, attr, fn)
                _active[name] = _active.get(name, 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            for name in self.modules:
                _active[name] -= 1
                if not _active[name]:
                    mod = sys.modules[name]
                    for attr, fn in zip(NAMES, _saved[name]):
                        if fn is not None:
                            setattr(mod, attr, fn)


def _float_conv(fn):
    """transformers' causal_conv1d_fn with a bf16 weight computed in float32 (CONV_FN)."""
    from transformers.activations import ACT2FN

    def conv_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if weight.dtype != torch.bfloat16 or not hidden_states.is_cpu:
            return fn(hidden_states, weight, bias=bias, activation=activation, **kwargs)
        _, channels, T = hidden_states.shape
        out = F.conv1d(hidden_states.to(weight.dtype).float(), weight.float().unsqueeze(1),
                       None if bias is None else bias.float(), padding=weight.shape[-1] - 1, groups=channels)
        out = out[:, :, :T].to(weight.dtype)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)
    return conv_fn


def install(model: nn.Module) -> tuple[Scope, str]:
    """The scope to run `model`'s passes in, and a note for describe() ('' without delta-net layers)."""
    layers = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "conv1d")]
    names = {type(m).__module__ for m in layers}
    usable = {n for n in names if hasattr(sys.modules[n], CONV) and hasattr(sys.modules[n], RULE)}
    if not layers:
        return Scope({}), ""
    why = gdn_kernel.why_not() or ("" if usable == names else "a layer of a kind gdn.c does not know")
    if why:
        return Scope({}), f"the {len(layers)} gated delta-net layers step in transformers' torch code ({why})"
    modules = {}
    with _lock:
        for n in usable:
            mod = sys.modules[n]
            if n not in _saved:
                _saved[n] = tuple(getattr(mod, attr, None) for attr in NAMES)
            conv, rule, chunk, conv_fn = _saved[n]
            modules[n] = (gdn_kernel.conv_update(conv), gdn_kernel.delta_rule(rule),
                          gdn_kernel.delta_rule(chunk) if chunk is not None else None,
                          _float_conv(conv_fn) if conv_fn is not None else None)
    for m in layers:
        m._localchat_fns = modules[type(m).__module__][:2]
    return Scope(modules), (f"the {len(layers)} gated delta-net layers step their conv and recurrence in C, "
                            "a prefill's too")
