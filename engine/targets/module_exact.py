"""Exact weights for transformers' modules, loaded one tensor at a time: the resident
loader for mixtures of experts and hybrids (a dense Qwen3.5 too: from_pretrained held its
mapped files and the model at once, a 2.95 GB checkpoint peaking at 6.15 GB of RSS; here
3.11 GB above the imports, the weights and caches plus 5%).

Why not `from_pretrained`: a mixture's experts are stored one matrix per expert and fused on
load into 3-D tensors ([experts, 2 x width, hidden] for gate and up), so transformers holds
the mapped files and the fused copies at once; a 7.1 GB bf16 checkpoint peaked at 14.7 GB of
RSS, and a model that fits in RAM could not be loaded. Here the model is built on `meta`,
each fused tensor is allocated once and filled expert by expert, and every other tensor is
copied out of its file, which is closed after each read (module_quant.ModuleSource), so the
peak is the model plus one tensor. The values are the files' own, in the requested dtype, as
`from_pretrained(dtype=...)` gives them (float32 where the model keeps a module in float32)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from .module_quant import ModuleSource, _experts, _set, _tied, finish, pack_layer, quantize_layer, skeleton


def _fused(src: ModuleSource, name: str, like: torch.Tensor, parts: tuple[str, ...], dtype, device) -> torch.Tensor:
    """One fused experts tensor `name` ([E, rows, cols]): stored as it is, or one matrix per
    expert (`<module>.<e>.<part>.weight`, the parts stacked along the rows)."""
    owner, _, leaf = name.rpartition(".")
    if src.has(name):
        t = src.rows(name)
        if tuple(t.shape) != tuple(like.shape):
            raise CheckpointError(f"{src.entry(name).file}: tensor {name} has shape {list(t.shape)}, the model "
                                  f"expects {list(like.shape)}; re-download the model")
        return t.to(device, dtype)
    out = torch.empty(like.shape, dtype=dtype, device=device)
    for e in range(like.shape[0]):
        at = 0
        for part in parts:
            t = src.rows(f"{owner}.{e}.{part}.weight")
            if at + t.shape[0] > like.shape[1] or t.shape[1:] != like.shape[2:]:
                raise CheckpointError(f"{src.entry(f'{owner}.{e}.{part}.weight').file}: tensor "
                                      f"{owner}.{e}.{part}.weight has shape {list(t.shape)}, which does not fit "
                                      f"{leaf} {list(like.shape)}; re-download the model")
            out[e, at:at + t.shape[0]] = t
            at += t.shape[0]
    return out


def _keeps_float32(model: nn.Module, name: str) -> bool:
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return any(k in name.split(".") or name.endswith(k) for k in keep)


def load_exact(path: Path, cfg, device: torch.device, dtype: torch.dtype, progress=None) -> nn.Module:
    model = skeleton(path, cfg)
    src = ModuleSource(path)
    layers = model.model.layers
    n = len(layers)

    def value(name: str) -> torch.Tensor:
        return src.rows(name).to(device, torch.float32 if _keeps_float32(model, name) else dtype)

    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}."
        experts = dict(_experts(layer))
        for name, m in experts.items():
            _set(layer, f"{name}.gate_up_proj",
                 _fused(src, f"{prefix}{name}.gate_up_proj", m.gate_up_proj, ("gate_proj", "up_proj"), dtype, device))
            _set(layer, f"{name}.down_proj",
                 _fused(src, f"{prefix}{name}.down_proj", m.down_proj, ("down_proj",), dtype, device))
        for pname, _ in list(layer.named_parameters()):
            if pname.rpartition(".")[0] not in experts:
                _set(layer, pname, value(prefix + pname))
        if progress is not None:
            progress("load", i + 1, n + 1)
    for pname, _ in list(model.named_parameters()):
        if not pname.startswith("model.layers.") and pname != "lm_head.weight":
            _set(model, pname, value(pname))
    if _tied(model, src):
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        _set(model, "lm_head.weight", value("lm_head.weight"))
    finish(model, cfg, device)
    if progress is not None:
        progress("load", n + 1, n + 1)
    return model


def load_mtp(path: Path, text_model: nn.Module, cfg, device: torch.device, dtype: torch.dtype,
             weights: str = "exact", group: int = 32) -> nn.Module:
    """The checkpoint's multi-token-prediction layer (models/mtp.py MtpLayer), in `dtype`:
    exact, its experts fused as the target's are, or (`weights` int8 or int4: a quantized
    target's own format) its decoder layer's matrices and experts packed as a quantized
    target's layers are (Qwen3.5-35B-A3B's 256-expert layer: 1.7 GB in bf16, 0.5 GB in
    int4), quantized from the files one tensor at a time."""
    from ..models import mtp
    layer = mtp.MtpLayer(text_model, cfg)
    src = ModuleSource(path)
    block = layer.model.layers[0]
    experts = dict(_experts(block))
    if weights in ("int8", "int4"):
        pack_layer(block, quantize_layer(block, "mtp.layers.0.", src, weights, group, dtype), device, dtype, group)
        experts = {}
    for name, m in experts.items():
        at = f"mtp.layers.0.{name}"
        _set(block, f"{name}.gate_up_proj", _fused(src, f"{at}.gate_up_proj", m.gate_up_proj,
                                                   ("gate_proj", "up_proj"), dtype, device))
        _set(block, f"{name}.down_proj", _fused(src, f"{at}.down_proj", m.down_proj, ("down_proj",), dtype, device))
    for pname, t in list(layer.named_parameters()):
        inside = pname.removeprefix("model.layers.0.")
        if (inside != pname and inside.rpartition(".")[0] in experts) or not t.is_meta:
            continue                                   # filled above
        _set(layer, pname, src.rows(layer.stored_name(pname)).to(device, dtype))
    inner = layer.model
    inner.rotary_emb = type(inner.rotary_emb)(config=layer.config).to(device)
    left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"{path}: the multi-token-prediction layer has no value for {left[0]}; "
                              "use another --drafter")
    return layer.eval()
