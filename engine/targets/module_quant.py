"""Quantized weights for models the Llama-family forward does not run (the hybrids: Qwen3.5
and Qwen3-Next's gated delta-net layers, and other architectures transformers knows):
transformers' own modules run over our cache (models/hf_forward.py), with every decoder
`nn.Linear` and every mixture-of-experts expert matrix replaced by a packed int8/int4
weight (qweights.py, the same kernels and cache as targets/quantized.py).

Why modules rather than a functional forward here: a hybrid layer's cost is its matrix
products (measured on a 169 M Qwen3.5 in float32: `aten::mm` is 85% of a decode step), so
a hand-written forward would win little, while the modules keep the model's own
arithmetic for every part that is not a weight (the conv window, the delta rule, the
gated norms, the router). What stays exact: the conv, the recurrent state and every norm,
in the dtypes the model computes them in.

A first load streams: one decoder layer at a time is read from the safetensors files,
quantized and written to the disk cache, so peak host memory is one layer; then the model,
built on `meta`, is packed from the cache as every later load packs it."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import TensorEntry, check_finite, stored_name, tensor_index
from ..errors import BadRequest, CheckpointError, UnsupportedModel
from ..kernels.dispatch import Pass
from . import qweights
from .qcache import QuantCache


def _kind(passes) -> Pass:
    """The kind of the pass a packed product is part of (see PackedLinear.row_passes)."""
    return Pass.STEP if passes is None else passes.pass_kind


class PackedLinear(nn.Module):
    """nn.Linear's forward over a packed weight (any leading shape, as nn.Linear takes)."""
    # The forward whose pass's kind this product is multiplied by (models/rows.KernelPasses;
    # set by models/hf_forward.py): a step's and a verify pass's rows are lone rows, a
    # prefill's take a GEMM past a few rows (kernels/dispatch.py). None: always a step.
    row_passes = None

    def __init__(self, weight, bias: torch.Tensor | None):
        super().__init__()
        self.w = weight
        self.out_features, self.in_features = weight.shape
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        for i, t in enumerate(weight.tensors()):     # counted by weight_tensors(), moved with the model
            self.register_buffer(f"packed{i}", t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.w.mm(x2, self.bias, _kind(self.row_passes))
        return y.view(*x.shape[:-1], self.out_features)


class PackedEmbedding(nn.Module):
    """An embedding lookup from a packed table (`embeddings=True`; a tied head shares it)."""

    def __init__(self, weight):
        super().__init__()
        self.w = weight
        for i, t in enumerate(weight.tensors()):
            self.register_buffer(f"packed{i}", t, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.rows(ids.reshape(-1)).view(*ids.shape, -1)


class PackedExperts(nn.Module):
    """A mixture-of-experts block's expert matrices (transformers keeps them as 3-D
    parameters, [experts, out, in]), one packed weight per expert, with the forward of
    transformers' experts modules (Qwen2-MoE style: gate and up fused, the router's
    weights applied after the down projection, summed with index_add_). Where no experts
    kernel takes them (models/moe.py)."""
    row_passes = None            # as PackedLinear's

    def __init__(self, module: nn.Module, gate_up: list, down: list):
        super().__init__()
        self.num_experts = len(gate_up)
        self.act_fn = module.act_fn
        self.gate_up, self.down = gate_up, down
        for e in range(self.num_experts):
            self._register(e)

    def _register(self, e: int) -> None:
        for i, t in enumerate(self.gate_up[e].tensors() + self.down[e].tensors()):
            self.register_buffer(f"e{e}_{i}", t, persistent=False)

    def keep_in_memory(self, e: int) -> None:
        """Copy expert e's tensors out of a memory mapping (routing.keep_in_memory), before
        a kernel takes their addresses."""
        for w in (self.gate_up[e], self.down[e]):
            for name, t in list(vars(w).items()):
                if isinstance(t, torch.Tensor):
                    setattr(w, name, t.clone())
        self._register(e)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        kind = _kind(self.row_passes)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, rows = torch.where(mask[e])
            gate, up = self.gate_up[e].mm(hidden_states[rows], None, kind).chunk(2, dim=-1)
            h = self.down[e].mm((self.act_fn(gate) * up).contiguous(), None, kind)
            out.index_add_(0, rows, (h * top_k_weights[rows, pos, None]).to(out.dtype))
        return out


class ModuleSource:
    """The checkpoint's tensors by the names the text-only model gives them, read a row
    range at a time. Each read opens the file, copies the rows out and closes it, so the
    pages it touched leave the process: a reader of a model larger than RAM holds what it
    is working on and nothing more."""

    def __init__(self, path: Path):
        self.path = path
        self.index: dict[str, TensorEntry] = tensor_index(path)

    def name(self, model_name: str) -> str | None:
        return stored_name(self.index, model_name)

    def has(self, model_name: str) -> bool:
        return self.name(model_name) is not None

    def entry(self, model_name: str) -> TensorEntry:
        got = self.name(model_name)
        if got is None:
            raise CheckpointError(f"{self.path}: tensor {model_name} is missing from the safetensors files; "
                                  "re-download the model")
        return self.index[got]

    def rows(self, model_name: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        from safetensors import safe_open
        e = self.entry(model_name)
        try:
            with safe_open(e.file, framework="pt") as fh:
                t = fh.get_tensor(e.name).clone() if a is None else fh.get_slice(e.name)[a:b]
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{e.file}: cannot read {e.name} ({exc}); re-download the model") from None
        check_finite([(e.name, t)], e.file, "" if a is None else f"{a}-{b}")   # all a loader or the quantizer reads
        return t

    def quantized(self, model_name: str, fmt: str, group: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Quantize one [N, K] checkpoint matrix, chunk by chunk of rows."""
        N, K = self.entry(model_name).shape
        step = max(16, (qweights._CHUNK // K) // 16 * 16)
        return qweights.concat([qweights.quantize(self.rows(model_name, a, min(N, a + step)), fmt, group, dtype)
                                for a in range(0, N, step)])


def skeleton(path: Path, cfg):
    from transformers import AutoModelForCausalLM
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg)


def _experts(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of a layer that hold experts as 3-D gate_up_proj / down_proj parameters."""
    return [(n, m) for n, m in layer.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and getattr(m, "gate_up_proj").dim() == 3]


def _tied(model, src: ModuleSource) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) or not src.has("lm_head.weight")


# ---------------------------------------------------------------- canonical form (the disk cache)

def quantize_layer(layer: nn.Module, prefix: str, src: ModuleSource, fmt: str, group: int,
                   act_dtype) -> dict[str, torch.Tensor]:
    """One decoder layer as flat names: `q|<module>|<part>` for a quantized matrix,
    `x|<module>|<expert>|<gate_up or down>|<part>` for an expert's, `p|<parameter>` for
    the rest (float32: a lossless carrier of any float dtype's values)."""
    out: dict[str, torch.Tensor] = {}
    # A matrix the int4 kernel cannot take (a router or a gate of a few output rows: a
    # negligible share of the bytes) stays in the activation dtype, as nn.Linear.
    linear = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)
              and (fmt != "int4" or qweights.int4_problem(m.out_features, m.in_features, group) is None)}
    experts = dict(_experts(layer))
    for n in sorted(linear):
        out.update({f"q|{n}|{k}": v for k, v in src.quantized(f"{prefix}{n}.weight", fmt, group, act_dtype).items()})
    for n, m in experts.items():
        for e in range(m.gate_up_proj.shape[0]):
            base = f"{prefix}{n}.{e}."
            if not src.has(base + "gate_proj.weight"):
                raise UnsupportedModel(f"{src.path}: the experts of {prefix}{n} are not stored one matrix per "
                                       "expert; the quantized profile cannot read them (use resident-exact)")
            if fmt == "int4" and (why := qweights.int4_problem(*src.entry(base + "down_proj.weight").shape, group)):
                raise BadRequest(f"--group-size {group}: {why} of {base}down_proj.weight; use --weights int8")
            gu = qweights.concat([src.quantized(base + w, fmt, group, act_dtype)
                                  for w in ("gate_proj.weight", "up_proj.weight")])
            out.update({f"x|{n}|{e}|gate_up|{k}": v for k, v in gu.items()})
            out.update({f"x|{n}|{e}|down|{k}": v
                        for k, v in src.quantized(base + "down_proj.weight", fmt, group, act_dtype).items()})
    for pname, _ in layer.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        if (owner in linear and pname.endswith(".weight")) or owner in experts:
            continue
        out[f"p|{pname}"] = src.rows(prefix + pname).float()
    return out


def quantize_rest(model: nn.Module, src: ModuleSource, fmt: str, group: int, act_dtype,
                  embeddings: bool, head: str) -> dict[str, torch.Tensor]:
    # the final norm (LFM2: model.embedding_norm) and anything else outside the layers
    out = {f"p|{n}": src.rows(n).float() for n, _ in model.named_parameters()
           if not n.startswith("model.layers.") and n not in ("model.embed_tokens.weight", "lm_head.weight")}
    tables = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    for field, held in qweights.table_formats(fmt, embeddings, head, _tied(model, src)).items():
        if held:
            out.update({f"q|{field}|{k}": v for k, v in src.quantized(tables[field], held, group, act_dtype).items()})
        else:
            out[f"p|{field}"] = src.rows(tables[field])
    return out


def _groups(flat: dict[str, torch.Tensor], tag: str) -> dict[tuple, dict[str, torch.Tensor]]:
    out: dict[tuple, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        parts = k.split("|")
        if parts[0] == tag:
            out.setdefault(tuple(parts[1:-1]), {})[parts[-1]] = v
    return out


def _set(root: nn.Module, dotted: str, value: nn.Module | torch.Tensor) -> None:
    owner, _, leaf = dotted.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    if isinstance(value, nn.Module):
        setattr(mod, leaf, value)
    else:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def pack_layer(layer: nn.Module, flat: dict[str, torch.Tensor], device, act_dtype, group: int | None) -> None:
    """Fill a meta decoder layer from its canonical form: packed linears and experts, the
    other parameters on the device in the activation dtype."""
    for (name,), c in _groups(flat, "q").items():
        _set(layer, name, PackedLinear(qweights.packed(c, device, act_dtype, group), None))
    experts: dict[str, dict[int, dict]] = {}
    for (name, e, which), c in _groups(flat, "x").items():
        experts.setdefault(name, {}).setdefault(int(e), {})[which] = qweights.packed(c, device, act_dtype, group)
    for name, by_e in experts.items():
        order = [by_e[e] for e in sorted(by_e)]
        _set(layer, name, PackedExperts(layer.get_submodule(name), [w["gate_up"] for w in order],
                                        [w["down"] for w in order]))
    for k, v in flat.items():
        if k.startswith("p|"):                       # a packed linear's bias lands on the PackedLinear
            _set(layer, k[2:], v.to(device, act_dtype))


def pack_rest(model: nn.Module, flat: dict[str, torch.Tensor], device, act_dtype, group: int | None) -> None:
    for k, v in flat.items():
        if k.startswith("p|") and k not in ("p|embed", "p|head"):
            _set(model, k[2:], v.to(device, act_dtype))
    q = _groups(flat, "q")
    if ("embed",) in q:
        embed = qweights.packed(q[("embed",)], device, act_dtype, group)
        model.model.embed_tokens = PackedEmbedding(embed)
    else:
        embed = flat["p|embed"].to(device, act_dtype)
        _set(model, "model.embed_tokens.weight", embed)
    if ("head",) in q:
        model.lm_head = PackedLinear(qweights.packed(q[("head",)], device, act_dtype, group), None)
    elif "p|head" in flat:
        _set(model, "lm_head.weight", flat["p|head"].to(device, act_dtype))
    elif isinstance(embed, torch.Tensor):            # tied, kept dense: one table for both
        model.lm_head.weight = model.model.embed_tokens.weight
    else:                                            # tied and quantized: the packed table serves both
        model.lm_head = PackedLinear(embed, None)


def finish(model: nn.Module, cfg, device) -> None:
    """Rebuild what `meta` left without values (the rotary tables), and refuse a model that
    still holds a tensor the checkpoint did not fill."""
    inner = model.model
    if hasattr(inner, "rotary_emb"):
        inner.rotary_emb = type(inner.rotary_emb)(config=getattr(cfg, "text_config", None) or cfg).to(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise UnsupportedModel(f"{model.config.model_type}: {left[0]} has no value in the checkpoint; "
                               "the quantized profile cannot run this model (use resident-exact)")
    model.eval()


def _read_layer(cache: QuantCache, name: str, manifest: dict, mapped: bool) -> dict | None:
    """A cached layer; with `mapped`, its experts' tensors stay memory-mapped from the file
    and everything else (what every token reads) is copied into memory."""
    if not mapped:
        return cache.read(name, manifest)
    flat = cache.read_mapped(name, manifest)
    return None if flat is None else {k: v if k.startswith("x|") else v.clone() for k, v in flat.items()}


def load(path: Path, cfg, device: torch.device, fmt: str, group: int, act_dtype: torch.dtype,
         cache: QuantCache, embeddings: bool, head: str, progress,
         mapped_experts: bool = False) -> tuple[nn.Module, bool]:
    """The quantized model (modules filled, on the device) and whether the cache served it.
    A first load quantizes into the cache, one layer in memory at a time, then packs the model
    from what it wrote (checked as any later load checks it). `mapped_experts` (a mixture whose
    experts do not all fit in RAM, on a CPU): the experts' tensors stay memory-mapped from the
    cache's files, read on demand."""
    mapped = mapped_experts and device.type == "cpu"
    manifest = cache.manifest()
    model = _from_cache(path, cfg, device, group, act_dtype, cache, manifest, mapped, progress) \
        if manifest is not None else None
    if model is not None:
        return model, True
    _quantize_into(cache, skeleton(path, cfg), path, fmt, group, act_dtype, embeddings, head, progress)
    manifest = cache.manifest()
    model = _from_cache(path, cfg, device, group, act_dtype, cache, manifest, mapped, progress) \
        if manifest is not None else None
    if model is None:
        raise CheckpointError(f"{cache.dir}: the quantized weights just written cannot be read back; "
                              "check the disk (LOCALCHAT_CACHE_DIR moves the cache)")
    return model, False


def _from_cache(path: Path, cfg, device, group: int, act_dtype, cache: QuantCache, manifest: dict,
                mapped: bool, progress) -> nn.Module | None:
    """The model packed from the cache; None where a file is missing, truncated or corrupt."""
    model = skeleton(path, cfg)
    layers = model.model.layers
    n = len(layers)
    for i in range(n):
        flat = _read_layer(cache, f"layer-{i:04d}", manifest, mapped)
        if flat is None:
            return None
        pack_layer(layers[i], flat, device, act_dtype, group)
        progress("load", i + 1, n + 1)
    rest = cache.read("rest", manifest)
    if rest is None:
        return None
    pack_rest(model, rest, device, act_dtype, group)
    progress("load", n + 1, n + 1)
    finish(model, cfg, device)
    return model


def _quantize_into(cache: QuantCache, model: nn.Module, path: Path, fmt: str, group: int, act_dtype,
                   embeddings: bool, head: str, progress) -> None:
    """Quantize the checkpoint into the cache, one layer in memory at a time."""
    src = ModuleSource(path)
    layers = model.model.layers
    n = len(layers)
    writer = cache.writer()
    try:
        for i in range(n):
            writer.write(f"layer-{i:04d}", quantize_layer(layers[i], f"model.layers.{i}.", src, fmt, group, act_dtype))
            progress("quantize", i + 1, n + 1)
        writer.write("rest", quantize_rest(model, src, fmt, group, act_dtype, embeddings, head))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
