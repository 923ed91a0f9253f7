"""Mixture-of-experts blocks (Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE, Qwen2-MoE) run as
mixtures through the kernels: the router's logits through the row kernel (a verify pass's
rows are one-token steps), its softmax and top-k as transformers computes them (ties
broken as torch.topk breaks them), and the routed experts in one call of C
(kernels/moe_kernel.py) that reads each hit expert once for every row routed to it. The
shared expert and its gate run in the hybrid layers' C call where those layers are in C
(models/hybrid_layers.py); elsewhere they are nn.Linear modules under the row kernel.

A block this does not know keeps transformers' forward; `describe()` says which ran."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import moe_kernel, row_kernel


def _dense_experts(m: nn.Module) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == down.dim() == 3


def _packed_experts(m: nn.Module) -> bool:
    return isinstance(getattr(m, "gate_up", None), list) and isinstance(getattr(m, "down", None), list)


def _packed_why(weights: list, dtype: torch.dtype) -> str:
    """'' when the kernel reads these packed experts' weights with `dtype` activations:
    per-channel int8 that q8.c reads (scales in the activations' dtype), or int4 in q4.c's
    canonical form (bf16 activations only)."""
    for w in weights:
        if getattr(w, "gguf_blocks", False):          # a GGUF file's blocks (targets/gguf_modules.py)
            if dtype != torch.float32:
                return "GGUF experts with activations other than float32"
        elif getattr(w, "canonical", False):
            if dtype != torch.bfloat16:
                return "int4 experts with float32 activations"
        elif getattr(w, "own_kernel", False):
            if w.scale.dtype != dtype:
                return f"int8 scales in {w.scale.dtype}"
        else:
            return f"{type(w).__name__} experts that no kernel here reads"
    return ""


def blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(router, experts) of every sparse block: a module with a `gate` that routes (top_k,
    num_experts, a weight [E, hidden]) and `experts` held as 3-D matrices or packed ones."""
    out = []
    for m in model.modules():
        gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
        if (gate is not None and experts is not None and hasattr(gate, "top_k") and hasattr(gate, "weight")
                and (_dense_experts(experts) or _packed_experts(experts))):
            out.append((gate, experts))
    return out


def _normalizes(gate: nn.Module) -> bool | None:
    """Whether the router rescales its top-k weights to sum to one: Qwen3-Next, Qwen3-MoE and
    Qwen2-MoE say so in norm_topk_prob; Qwen3.5-MoE's router always does; None: unknown."""
    if hasattr(gate, "norm_topk_prob"):
        return bool(gate.norm_topk_prob)
    if type(gate).__name__ == "Qwen3_5MoeTopKRouter":
        return True
    return None


def _router_forward(gate: nn.Module, normalize: bool, fwd):
    def forward(hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, gate.hidden_dim)
        w_t = gate.weight.t()
        if fwd._row_kernel(x.shape[0]) and row_kernel.fits(x, w_t, None):
            logits = row_kernel.linear(x, w_t)
        else:
            logits = nn.functional.linear(x, gate.weight)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, gate.top_k, dim=-1)
        if normalize:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index
    return forward


def _experts_forward(m: nn.Module, kernel: moe_kernel.Experts, dtype: torch.dtype, dense: bool):
    plain = m.forward

    def forward(hidden_states, top_k_index, top_k_weights):
        if hidden_states.dtype != dtype:
            return plain(hidden_states, top_k_index, top_k_weights)
        if not dense:
            return kernel(hidden_states, top_k_index, top_k_weights)
        gu, down = m.gate_up_proj, m.down_proj        # a streamed slot's current binding
        if not (gu.dtype == down.dtype == dtype and gu.is_cpu and gu.is_contiguous() and down.is_contiguous()):
            return plain(hidden_states, top_k_index, top_k_weights)
        return kernel(hidden_states, top_k_index, top_k_weights, dense=(gu, down))
    return forward


def why_not(model: nn.Module, dtype: torch.dtype) -> str:
    """'' when every sparse block of `model` can run through the experts kernel in `dtype`
    (what reading only the routed experts of a memory mapping needs), else why not."""
    cfg = getattr(model.config, "text_config", model.config)
    why = moe_kernel.why_not(dtype)
    if not why and getattr(cfg, "hidden_act", "silu") != "silu":
        why = f"activation {cfg.hidden_act!r}"
    for gate, _ in blocks(model):
        if not why and _normalizes(gate) is None:
            why = f"a router of {type(gate).__name__}"
    return why


def install(model: nn.Module, fwd, dtype: torch.dtype, mapped: dict | None = None) -> str:
    """Run the model's sparse blocks through the kernels where they can; returns a note for
    describe() ('' for a dense model). `mapped`: {block (in model order): (gate, up, down)},
    the per-expert matrices of blocks whose experts are not the module's own parameters (a
    streamed target's views of the checkpoint's memory mapping; why_not() said yes)."""
    found = blocks(model)
    if not found:
        return ""
    why = why_not(model, dtype)
    if why:
        return f"the {len(found)} sparse blocks run transformers' experts loop ({why})"
    skipped = []
    for b, (gate, experts) in enumerate(found):
        normalize = _normalizes(gate)
        dense = _dense_experts(experts)
        E, hid = gate.weight.shape
        if normalize is None:
            skipped.append(f"a router of {type(gate).__name__}")
            continue
        if mapped and b in mapped:
            gates, ups, downs = mapped[b]
            kernel = moe_kernel.Experts(dtype, E, hid, downs[0].shape[1], split=(gates, ups, downs))
            dense = False
        elif dense:
            kernel = moe_kernel.Experts(dtype, E, hid, experts.down_proj.shape[-1])
        else:
            gu, down = experts.gate_up, experts.down
            why = _packed_why(gu + down, dtype) if len(gu) == E else f"{len(gu)} packed experts of {E}"
            if why:
                skipped.append(why)
                continue
            kernel = moe_kernel.Experts(dtype, E, hid, down[0].shape[1], packed=(gu, down))
        gate.forward = _router_forward(gate, normalize, fwd)
        experts.forward = _experts_forward(experts, kernel, dtype, dense)
        experts.kernel = kernel
    if not skipped:
        return f"the experts of {len(found)} sparse blocks run in one C call a pass, each hit expert read once"
    return f"{len(skipped)} of {len(found)} sparse blocks run transformers' experts loop ({skipped[0]})"
