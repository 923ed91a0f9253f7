"""A target whose weights are a GGUF file's own blocks, read where they lie
(engine/gguf_file.py): the Llama-family forward over GGUFWeight matrices, activations in
float32 (rounded to 16 bits inside the block products). No float copy of the weights is made:
the matrices are views of the file's memory map but for the q and k projections, whose rows
of blocks are put back in the checkpoint's order (the same bytes, moved).

Steps and verify passes multiply through the block kernels (every row a lone row, so
speculation is exact by construction); a longer prefill runs the GEMM over each weight
decoded a few rows at a time. A file of float matrices (F32, F16) holds them as plain tensors, which the C
layer kernels run. `load_gguf` (the resident-gguf profile, from engine.open) takes the file
and the config of its import (engine/checkpoint.import_gguf), and hands a hybrid's file to
gguf_modules.py. Tested on llama and qwen3 files written by llama.cpp's converter; qwen2's
biases are mapped, untested."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from .. import checkpoint as _checkpoint
from ..errors import BadWeights, UnsupportedModel
from ..gguf_file import GGUFWeight, converted, converted_kinds, dense, hf_rows, runnable
from ..gguf_reader import read
from ..kernels import gguf_kernel
from ..models import llama_family
from . import gguf_modules
from .quantized import QuantizedForward, _skeleton
from .resident import ResidentTarget

# The architectures the Llama-family forward runs, and whether the converter interleaved the
# rotary halves of their q and k rows (convert_hf_to_gguf does it for llama alone).
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def architecture(fields) -> str:
    return str(fields["general.architecture"])


def gguf_why_not(gguf: Path) -> str:
    """'' where this GGUF file runs from its blocks here, else why not (its architecture, a
    block format without a kernel, no kernel on this CPU)."""
    why = gguf_kernel.why_not()
    if why:
        return f"no GGUF kernel here ({why})"
    fields, tensors = read(gguf)
    arch = architecture(fields)
    if arch not in ARCHITECTURES and arch not in gguf_modules.ARCHITECTURES:
        return f"the {arch} architecture does not run from its blocks yet"
    odd = sorted({t.kind for t in tensors.values() if len(t.shape) >= 2 and t.kind != "F32"
                  and t.kind not in gguf_kernel.TYPES and not converted(t.kind)})
    if odd:
        return f"no kernel for its {', '.join(odd)} blocks yet"
    return ""


class GGUFTarget(ResidentTarget):
    """ResidentTarget's interface over a QuantizedForward whose matrices are GGUFWeight."""

    def __init__(self, gguf: Path, config_dir: Path, tensors: dict, cache_capacity: int = 1024):
        arch = architecture(read(gguf)[0])
        cfg, skeleton, _ = _skeleton(Path(config_dir))
        device = torch.device("cpu")
        self._setup(cfg, device, torch.float32, cache_capacity)
        H, KV = cfg.num_attention_heads, cfg.num_key_value_heads

        interleaved = ARCHITECTURES[arch]

        def matrix(*names: str):
            """The matrices stacked by rows: a GGUFWeight of their blocks, or where all are
            float (an F32/F16 file) a plain transposed tensor, as the forward holds its own."""
            parts = [tensors[n] for n in names]
            order = [hf_rows(t.shape[0], H if ".attn_q." in t.name else KV)
                     if interleaved and (".attn_q." in t.name or ".attn_k." in t.name) else None for t in parts]
            if all(t.kind == "F32" for t in parts):
                values = [dense(t) if r is None else dense(t)[r] for t, r in zip(parts, order)]
                return llama_family.aligned(torch.cat(values) if len(values) > 1 else values[0].clone()).t()
            unsupported = [f"{t.name} ({t.kind})" for t in parts if t.kind not in gguf_kernel.TYPES]
            if unsupported:
                raise UnsupportedModel(f"{gguf}: no kernel for {', '.join(unsupported)} yet")
            return GGUFWeight.of(*parts, rows=order)

        def vector(name: str) -> torch.Tensor | None:
            return dense(tensors[name]).contiguous() if name in tensors else None

        def bias(*names: str) -> torch.Tensor | None:
            found = [vector(n) for n in names]
            return torch.cat(found) if all(v is not None for v in found) else None

        layers = []
        for i in range(cfg.num_hidden_layers):
            b = f"blk.{i}."
            layers.append(llama_family.LayerWeights(
                ln1=vector(b + "attn_norm.weight"), ln2=vector(b + "ffn_norm.weight"),
                qkv=matrix(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
                qkv_bias=bias(b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"),
                o=matrix(b + "attn_output.weight"), o_bias=vector(b + "attn_output.bias"),
                gate_up=matrix(b + "ffn_gate.weight", b + "ffn_up.weight"), down=matrix(b + "ffn_down.weight"),
                q_norm=vector(b + "attn_q_norm.weight"), k_norm=vector(b + "attn_k_norm.weight")))
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        rows = layers[0].qkv.shape[0] if isinstance(layers[0].qkv, GGUFWeight) else layers[0].qkv.shape[1]
        if rows != (H + 2 * KV) * D:
            raise BadWeights(f"{gguf}: its q, k and v projections hold {rows} rows where its metadata says "
                             f"{H} + 2 x {KV} heads of {D} ({(H + 2 * KV) * D}); the file is mis-converted: "
                             "fetch it again, or another conversion of the model")
        embed = matrix("token_embd.weight")
        head = matrix("output.weight") if "output.weight" in tensors else embed      # tied
        if isinstance(embed, torch.Tensor):
            embed = embed.t()                          # the lookup table is [vocab, hidden]
        rotary = type(skeleton.model.rotary_emb)(config=cfg).to(device)
        scaling = skeleton.model.layers[0].self_attn.scaling
        self.impl = QuantizedForward(cfg, self.cache, rotary, scaling, embed, vector("output_norm.weight"), head,
                                     layers)
        self.kind = "gguf"
        self.fallback_reason = None
        self.formats = Counter(t.kind for t in tensors.values() if len(t.shape) == 2)
        self._weight_bytes = sum(t.numel() * t.element_size() for t in self.impl.weight_tensors())


# Where each block format keeps its half-float scales (bytes into a block)
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
           "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def check_finite(gguf: Path, tensors) -> None:
    """Refuse a file whose weights hold NaN or inf (a damaged download, a bad conversion):
    float tensors element by element, block formats by their half-float scales (a block's
    weights are finite codes times them). Reads each scale once, as a first pass would."""
    for t in tensors.values():
        if t.kind == "F32":
            _checkpoint.check_finite([(t.name, t.data)], gguf)
            continue
        _, nbytes = gguf_kernel.block(t.kind)
        blocks = t.data.reshape(-1, nbytes)
        for at in _HALVES[t.kind]:
            half = blocks[:, at].to(torch.int32) | (blocks[:, at + 1].to(torch.int32) << 8)
            bad = int(((half & 0x7C00) == 0x7C00).sum())
            if bad:
                raise BadWeights(f"{gguf}: tensor {t.name} holds {bad:,} non-finite scales (NaN or inf) in its "
                                 f"{t.kind} blocks; the weights are damaged: re-download or re-convert the model")


def load_gguf(gguf: Path, config_dir: Path, cache_capacity: int = 1024) -> ResidentTarget:
    """The target of a GGUF file run from its blocks: the Llama-family forward, or for a
    hybrid (Qwen3.5, Qwen3-Next) or a mixture of experts transformers' modules over the
    blocks (gguf_modules.py)."""
    gguf = Path(gguf)
    why = gguf_why_not(gguf)
    if why:
        raise UnsupportedModel(f"{gguf}: {why}")
    fields, stored = read(gguf)
    # blocks no kernel reads, converted (gguf_file.runnable): a fresh dict, the reader's is cached
    tensors = {name: runnable(t) for name, t in stored.items()}
    check_finite(gguf, tensors)
    if architecture(fields) in gguf_modules.ARCHITECTURES:
        target = gguf_modules.GGUFModulesTarget(gguf, Path(config_dir), tensors, cache_capacity)
    else:
        target = GGUFTarget(gguf, Path(config_dir), tensors, cache_capacity)
    target.converted = converted_kinds(stored)          # what the file held that runs as Q8_0
    return target

