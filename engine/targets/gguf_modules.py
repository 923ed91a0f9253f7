"""A Qwen3.5, Qwen3.5-MoE, Qwen3-Next or Qwen3-MoE GGUF file run from its own blocks: transformers' modules
(models/hf_forward.py, as module_quant.py runs a hybrid's packed weights: PackedLinear,
PackedEmbedding, PackedExperts) with every matrix a GGUFWeight, read
where it lies in the file's memory map, activations in float32 (rounded to 16 bits inside
the block products). One-token steps and verify passes run the hybrid layers in C over the
blocks (models/hybrid_layers.py); a longer prefill runs the GEMM over weights decoded a few rows
at a time. Qwen3-MoE (no delta-net layers, plain norms) runs the same modules, its experts in
the experts kernel.

llama.cpp's converter changes a Qwen3.5 checkpoint in four ways (its conversion/qwen.py;
transformers' integrations/gguf/gguf_conversion_mapping.py undoes the same), each undone
here without decoding a block:
- the zero-centred norms are stored as w + 1 (the gated delta-net's own norm is not);
- `ssm_a` holds -exp(A_log);
- the conv1d kernel is squeezed to [channels, width];
- the value heads are stored tiled (value head i of every key head, then i + 1) where the
  model groups them by key head. The small matrices and the per-head vectors that produce
  a value axis (a, b, A_log, dt_bias, the conv's value channels) have their rows put back
  in the model's order; the large in-projections (qkv, z) keep the file's blocks as they
  lie and their outputs are put in order (TiledRows). The out projection, which consumes
  the axis, would need its columns moved across blocks: its input is put in the file's
  order instead (OutTiled). The C layer does both as it goes: the in-projections' outputs
  moved into order, each head's normed output written to its tiled place.
Qwen3-Next's value heads are grouped, but the converter split its fused in-projections
(SplitQKVZ, SplitBA put their outputs back together)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..gguf_file import GGUFWeight, dense
from ..kernels import gguf_kernel
from ..models import hf_forward
from . import module_quant
from .quantized import _skeleton
from .resident import ResidentTarget

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next", "qwen3moe")


def tiled_to_grouped(key_heads: int, per_key: int, head_dim: int = 1) -> torch.Tensor:
    """The index that takes value-axis rows from the file's tiled order to the model's
    grouped one: grouped[g] = tiled[index[g]]."""
    grouped_of_tiled = torch.arange(key_heads * per_key * head_dim).view(key_heads, per_key, head_dim)
    return grouped_of_tiled.transpose(0, 1).reshape(-1).argsort()


class TiledRows(nn.Module):
    """A delta-net in-projection whose output rows are in the file's tiled order of value
    heads (qkv's value rows, z): the product as stored, its outputs put in the model's
    order. `order` is that index (grouped[g] = tiled[order[g]]), `tiled = (key heads, value
    heads per key head, head size)`; the C layer puts the outputs in order itself."""

    def __init__(self, inner: nn.Module, order: torch.Tensor, key_heads: int, per_key: int, head_dim: int):
        super().__init__()
        self.inner = inner
        self.tiled = (key_heads, per_key, head_dim)
        self.register_buffer("order", order, persistent=False)
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).index_select(-1, self.order)


class OutTiled(module_quant.PackedLinear):
    """The delta-net out projection, its input columns in the file's tiled order of value
    heads: the input is put in that order before the product. `tiled = (key heads, value
    heads per key head, head size)` tells the C layer the same (hybrid_layers.py)."""

    def __init__(self, weight: GGUFWeight, key_heads: int, per_key: int, head_dim: int):
        super().__init__(weight, None)
        self.tiled = (key_heads, per_key, head_dim)
        self.register_buffer("order", tiled_to_grouped(key_heads, per_key, head_dim).argsort(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.order))


class SplitQKVZ(nn.Module):
    """Qwen3-Next's in_proj_qkvz from the file's two matrices: llama.cpp's converter split it
    into q/k/v (all heads' q, all k, all v: the conv's channel order) and z; the module wants
    them fused per key head ([q, k, v, z] of head 0, then head 1). The outputs are put in
    that order (activations, not weights, move). The C layer reads `qkv` and `z` apart."""

    def __init__(self, qkv: nn.Module, z: nn.Module, key_heads: int, key_dim: int, value_width: int):
        super().__init__()
        self.qkv, self.z = qkv, z
        self.heads, self.dk, self.vw = key_heads, key_dim, value_width
        self.in_features = qkv.in_features
        self.out_features = qkv.out_features + z.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, dk, vw = self.heads, self.dk, self.vw
        qkv, z = self.qkv(x), self.z(x)
        lead = x.shape[:-1]
        q, k, v = qkv.split([H * dk, H * dk, H * vw], -1)
        parts = [q.reshape(*lead, H, dk), k.reshape(*lead, H, dk), v.reshape(*lead, H, vw), z.reshape(*lead, H, vw)]
        return torch.cat(parts, -1).reshape(*lead, -1)


class SplitBA(nn.Module):
    """Qwen3-Next's in_proj_ba ([b, a] per key head) held as its b rows and its a rows (the
    C layer reads them apart); the forward gives the module's fused order back."""

    def __init__(self, b: nn.Module, a: nn.Module, key_heads: int):
        super().__init__()
        self.b, self.a, self.heads = b, a, key_heads
        self.in_features, self.out_features = b.in_features, 2 * b.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        b, a = self.b(x).reshape(*lead, self.heads, -1), self.a(x).reshape(*lead, self.heads, -1)
        return torch.cat([b, a], -1).reshape(*lead, -1)


class GGUFModulesTarget(ResidentTarget):
    """ResidentTarget's interface over transformers' modules holding a GGUF file's blocks."""

    def __init__(self, gguf: Path, config_dir: Path, tensors: dict, cache_capacity: int = 1024):
        """`tensors`: the file's, with the blocks no kernel reads converted (gguf_target.load_gguf)."""
        cfg, _, _ = _skeleton(Path(config_dir))
        model = module_quant.skeleton(Path(config_dir), cfg)
        _fill(model, cfg, tensors, gguf)
        device = torch.device("cpu")
        module_quant.finish(model, cfg, device)
        self._setup(model.config, device, torch.float32, cache_capacity)
        self.impl = hf_forward.HFForward(model, self.cache)
        self.kind = "gguf"
        self.fallback_reason = None
        self.formats = Counter(t.kind for t in tensors.values() if len(t.shape) >= 2)      # experts are 3-D
        self._weight_bytes = sum(t.numel() * t.element_size() for t in self.impl.weight_tensors())


def _fill(model: nn.Module, cfg, tensors: dict, gguf: Path) -> None:
    """Every parameter of the meta `model` from the file's tensors, the converter's changes
    undone (the module docstring)."""
    text = getattr(cfg, "text_config", None) or cfg

    def take(name: str):
        t = tensors.get(name)
        if t is None:
            raise UnsupportedModel(f"{gguf}: tensor {name} is missing; the file is not a complete "
                                   f"{model.config.model_type} model (re-download or re-convert it)")
        return t

    def matrix(name: str, rows: torch.Tensor | None = None):
        """A GGUFWeight of the blocks, or where the file holds floats, the float32 tensor."""
        t = take(name)
        if t.kind == "F32":
            dense = t.data.view(t.shape)
            return (dense if rows is None else dense[rows]).contiguous()
        if t.kind not in gguf_kernel.TYPES:
            raise UnsupportedModel(f"{gguf}: no kernel for {name} ({t.kind}) yet")
        return GGUFWeight.of(t, rows=[rows])

    def module(name: str, rows: torch.Tensor | None = None) -> nn.Module:
        w = matrix(name, rows)
        return module_quant.PackedLinear(w, None) if isinstance(w, GGUFWeight) else _dense_linear(w)

    def linear(owner: nn.Module, leaf: str, name: str, rows: torch.Tensor | None = None) -> None:
        setattr(owner, leaf, module(name, rows))

    def vector(name: str, rows: torch.Tensor | None = None, minus_one: bool = False) -> nn.Parameter:
        v = take(name).data.view(take(name).shape).float()
        v = v if rows is None else v[rows]
        return nn.Parameter((v - 1.0 if minus_one else v).contiguous(), requires_grad=False)

    hybrid = hasattr(text, "linear_num_key_heads")   # Qwen3.5, Qwen3-Next: zero-centred norms stored w + 1
    if hybrid:
        Hk, Hv = text.linear_num_key_heads, text.linear_num_value_heads
        Dk, Dv, r = text.linear_key_head_dim, text.linear_value_head_dim, Hv // Hk
        nxt = text.model_type == "qwen3_next"         # its value heads stay grouped; q/k/v/z and b/a fused
        per_value = None if nxt else tiled_to_grouped(Hk, r, Dv)
        per_head = None if nxt else tiled_to_grouped(Hk, r)
        qk_rows = 2 * Hk * Dk
        qkv_rows = None if nxt else torch.cat([torch.arange(qk_rows), qk_rows + per_value])
    for i, layer in enumerate(model.model.layers):
        b = f"blk.{i}."
        layer.input_layernorm.weight = vector(b + "attn_norm.weight", minus_one=hybrid)
        post = b + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight")
        layer.post_attention_layernorm.weight = vector(post, minus_one=hybrid)
        mlp = layer.mlp
        if hasattr(mlp, "gate_proj"):
            for leaf, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                linear(mlp, leaf, b + name + ".weight")
        else:                                              # a sparse block: router, experts, shared expert
            mlp.gate.weight = nn.Parameter(dense(take(b + "ffn_gate_inp.weight")).contiguous(), requires_grad=False)
            mlp.experts = _experts(mlp.experts, *(take(b + f"ffn_{w}_exps.weight") for w in ("gate", "up", "down")),
                                   gguf)
            if hasattr(mlp, "shared_expert"):
                for leaf, name in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                                   ("down_proj", "ffn_down_shexp")):
                    linear(mlp.shared_expert, leaf, b + name + ".weight")
                linear(mlp, "shared_expert_gate", b + "ffn_gate_inp_shexp.weight")
        if hasattr(layer, "self_attn"):
            att = layer.self_attn
            for leaf, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                               ("o_proj", "attn_output")):
                linear(att, leaf, b + name + ".weight")
            att.q_norm.weight = vector(b + "attn_q_norm.weight", minus_one=hybrid)
            att.k_norm.weight = vector(b + "attn_k_norm.weight", minus_one=hybrid)
            continue
        gdn = layer.linear_attn
        if nxt:
            gdn.in_proj_qkvz = SplitQKVZ(module(b + "attn_qkv.weight"), module(b + "attn_gate.weight"), Hk, Dk, r * Dv)
            ba = torch.arange(2 * Hv).view(Hk, 2, r)              # per key head: its b rows, then its a rows
            gdn.in_proj_ba = SplitBA(module(b + "ssm_ba.weight", ba[:, 0].reshape(-1)),
                                     module(b + "ssm_ba.weight", ba[:, 1].reshape(-1)), Hk)
            linear(gdn, "out_proj", b + "ssm_out.weight")
        else:
            # produced in the file's order and put in the model's (no copy of the blocks)
            gdn.in_proj_qkv = TiledRows(module(b + "attn_qkv.weight"), qkv_rows, Hk, r, Dv)
            gdn.in_proj_z = TiledRows(module(b + "attn_gate.weight"), per_value, Hk, r, Dv)
            linear(gdn, "in_proj_a", b + "ssm_alpha.weight", per_head)
            linear(gdn, "in_proj_b", b + "ssm_beta.weight", per_head)
            out = matrix(b + "ssm_out.weight")
            gdn.out_proj = (OutTiled(out, Hk, r, Dv) if isinstance(out, GGUFWeight)
                            else _dense_linear(out[:, tiled_to_grouped(Hk, r, Dv)].contiguous()))
        conv = take(b + "ssm_conv1d.weight").data.view(take(b + "ssm_conv1d.weight").shape).float()
        gdn.conv1d.weight = nn.Parameter((conv if qkv_rows is None else conv[qkv_rows]).unsqueeze(1).contiguous(),
                                         requires_grad=False)
        gdn.norm.weight = vector(b + "ssm_norm.weight")
        gdn.A_log = nn.Parameter(torch.log(-vector(b + "ssm_a", per_head).data), requires_grad=False)
        gdn.dt_bias = vector(b + "ssm_dt.bias", per_head)
    model.model.norm.weight = vector("output_norm.weight", minus_one=hybrid)
    embed = matrix("token_embd.weight")
    if isinstance(embed, GGUFWeight):
        model.model.embed_tokens = module_quant.PackedEmbedding(embed)
    else:
        model.model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    if "output.weight" in tensors:
        linear(model, "lm_head", "output.weight")
    elif isinstance(embed, GGUFWeight):                    # tied: the table's blocks serve both
        model.lm_head = module_quant.PackedLinear(embed, None)
    else:
        model.lm_head = _dense_linear(embed)


def _experts(module: nn.Module, gate, up, down, gguf: Path) -> nn.Module:
    """A sparse block's experts from the file's [experts, rows, K] tensors: one GGUFWeight per
    expert (gate and up stacked, as transformers fuses them) read where it lies, or where the
    file holds floats, the module's own 3-D parameters."""
    kinds = {gate.kind, up.kind, down.kind}
    if kinds == {"F32"}:
        module.gate_up_proj = nn.Parameter(torch.cat([gate.data, up.data], 1).contiguous(), requires_grad=False)
        module.down_proj = nn.Parameter(down.data.contiguous(), requires_grad=False)
        return module
    odd = sorted(kinds - set(gguf_kernel.TYPES))
    if odd:
        raise UnsupportedModel(f"{gguf}: no kernel for {gate.name.rsplit('.', 2)[0]}'s {', '.join(odd)} experts yet")
    hid, inter = gate.shape[-1], down.shape[-1]
    gate_up = [GGUFWeight([(gate.kind, gate.data[e]), (up.kind, up.data[e])], hid) for e in range(gate.shape[0])]
    downs = [GGUFWeight([(down.kind, down.data[e])], inter) for e in range(down.shape[0])]
    return module_quant.PackedExperts(module, gate_up, downs)


def _dense_linear(w: torch.Tensor) -> nn.Linear:
    m = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    m.weight = nn.Parameter(w, requires_grad=False)
    return m

