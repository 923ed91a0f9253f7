"""A target whose decoder linear layers are kept on the device weight-only quantized, int8
per output channel or int4 group-wise (qweights.py says how, and why the aten kernels),
with activations in bfloat16 where the device computes it natively.

Quantization streams: one decoder layer is read from the safetensors files (in row
chunks, each through a short-lived mapping), quantized, written to the disk cache and
packed for the device before the next is read, so a model larger than host memory
quantizes in about one layer's worth of host memory on top of its quantized output. The
second start reads the cache (qcache.py) and skips the source weights entirely.

The forward is the Llama-family fast forward, unchanged: `_linear` hands a packed weight
its own kernel. The output head is held in int8 per channel (`head="exact"` keeps it in
the activation dtype; a tied table goes with it and serves the embedding lookups, so
nothing is stored twice); an untied embedding table stays in the activation dtype.
`embeddings=True` quantizes both like the layers (qweights.table_formats).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import kernels as lc_kernels
from ..kernels import aten
from ..cache import KVCache
from ..checkpoint import default_cache_dir
from ..errors import BadRequest, CheckpointError, UnsupportedModel
from ..models import hf_forward, llama_family, moe
from . import module_quant, qweights, routing
from .qcache import QuantCache, cache_path, source_identity
from .resident import ResidentTarget

FORMATS = ("int8", "int4")
# Each decoder linear weight of the fast forward and the checkpoint matrices it fuses.
LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "down": ("mlp.down_proj",)}
# Plain tensors of a layer: LayerWeights field -> checkpoint name (optional ones may be absent).
PLAIN = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
         "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
         "o_bias": "self_attn.o_proj.bias"}


@dataclass(frozen=True)
class QuantInfo:
    """What was loaded and how: for `localchat doctor`, the stats line and the benchmarks."""
    weights: str                 # int8 | int4
    group_size: int | None       # None for int8 (per output channel)
    embeddings: bool             # embeddings/head quantized as the layers
    head: str                    # how the output head is held: int8, int4 or exact
    act_dtype: torch.dtype
    cache_dir: Path
    cache_hit: bool
    load_seconds: float
    int8_kernel: bool            # False: the dequantize-and-multiply fallback runs
    int4_kernel: bool


class QuantizedForward(llama_family.LlamaFamilyForward):
    """The fast forward over packed weights, built from the pieces (there is no model
    with real weights to take them from)."""

    def __init__(self, cfg, cache: KVCache, rotary, scaling: float, embed, norm: torch.Tensor, head,
                 layers: list[llama_family.LayerWeights]):
        self._setup(cfg, cache, rotary, scaling)
        self.embed, self.norm, self.head = embed, norm, head
        self.layers = layers
        self._use_layer_kernel()

    def weight_tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for w in [self.embed, self.norm, self.head] + [v for lw in self.layers for v in vars(lw).values()]:
            for t in (w.tensors() if hasattr(w, "tensors") else [w] if w is not None else []):
                if t.data_ptr() not in seen:        # a tied head is counted once
                    seen.add(t.data_ptr())
                    out.append(t)
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(ids, self.embed)
        return self.embed.rows(ids)


class QuantizedTarget(ResidentTarget):
    """ResidentTarget's interface (forward, cache, weight_bytes, device_bytes) over a
    QuantizedForward; only the construction differs."""

    def __init__(self, cfg, device: torch.device, act_dtype: torch.dtype, impl_parts: dict, info: QuantInfo,
                 cache_capacity: int = 1024):
        self._setup(cfg, device, act_dtype, cache_capacity)
        self.impl = QuantizedForward(cfg, self.cache, **impl_parts)
        self.kind = "fast"
        self.fallback_reason = None
        self.quant = info
        self._weight_bytes = sum(t.numel() * t.element_size() for t in self.impl.weight_tensors())

    @classmethod
    def over_modules(cls, model, device: torch.device, act_dtype: torch.dtype, info: QuantInfo,
                     cache_capacity: int = 1024) -> "QuantizedTarget":
        """The same target over transformers' modules with packed weights (module_quant.py)."""
        self = cls.__new__(cls)
        self._setup(model.config, device, act_dtype, cache_capacity)
        self.impl = hf_forward.HFForward(model, self.cache)
        self.kind = "transformers"
        self.fallback_reason = None
        self.quant = info
        self._weight_bytes = sum(t.numel() * t.element_size() for t in self.impl.weight_tensors())
        return self


def load_quantized(path: Path, device: torch.device, weights: str, group_size: int = 32,
                   act_dtype: torch.dtype | None = None, cache_dir: Path | None = None, progress=None,
                   embeddings: bool = False, head: str = "int8", experts_in_memory: int | None = None,
                   routing_texts: list[list[int]] | None = None) -> QuantizedTarget:
    """Quantize the checkpoint at `path` (or load its cached quantized copy) onto `device`.

    weights: int8 (per output channel) | int4 (group-wise, `group_size` along the input).
    act_dtype: default bfloat16 where the device has native bf16, else float32 (CPU) or
    float16 (GPU). head: the output head in int8 (default) or "exact" (act_dtype).
    embeddings: quantize embeddings and head as the layers. progress(what, done, total) is
    called per layer. experts_in_memory (a mixture on a CPU whose experts do not all fit):
    its experts stay memory-mapped from the cache's files (module_quant.load) but for this
    many bytes of them, the most used first (routing.py: counts kept per model, measured on
    `routing_texts` where there are none)."""
    t0 = time.perf_counter()
    path = Path(path)
    if weights not in FORMATS:
        raise BadRequest(f"--weights {weights}: use one of {', '.join(FORMATS)} for a quantized target")
    if head not in ("int8", "exact"):
        raise BadRequest(f"head {head!r}: use int8 or exact")
    head = weights if embeddings else head
    device = torch.device(device)
    act_dtype = act_dtype or lc_kernels.default_dtype(device, torch.bfloat16)
    cfg, skeleton, why_not = _skeleton(path)
    group = group_size if weights == "int4" else None
    settings = {"source": source_identity(path), "weights": weights, "group": group,
                "act_dtype": str(act_dtype), "embeddings": embeddings, "head": head}
    if why_not is not None:
        settings["layout"] = "modules"          # a cache of the other layout is not this one's
    cache = QuantCache(cache_path(Path(cache_dir) if cache_dir else default_cache_dir(), path, weights,
                                  group_size, act_dtype, embeddings, head), settings)
    progress = progress or (lambda what, done, total: None)
    kernels = (aten.runs(device, act_dtype, "int8"), aten.runs(device, act_dtype, "int4"))
    info = lambda hit: QuantInfo(weights, group, embeddings, head, act_dtype, cache.dir, hit,  # noqa: E731
                                 time.perf_counter() - t0, *kernels)
    if why_not is not None:
        # Not a model the Llama-family forward runs (a hybrid, another architecture):
        # transformers' modules over packed weights (module_quant.py).
        mapped = experts_in_memory is not None and device.type == "cpu"
        model, hit = module_quant.load(path, cfg, device, weights, group_size, act_dtype, cache, embeddings,
                                       head, progress, mapped)
        placed = _keep_experts(model, path, Path(cache_dir) if cache_dir else default_cache_dir(),
                               experts_in_memory, routing_texts) if mapped else ""
        target = QuantizedTarget.over_modules(model, device, act_dtype, info(hit))
        target.experts_placement = placed
    else:
        src = _Source(path, cfg)
        _check_shapes(src, weights, group_size, head == "int4")
        parts = _load_cached(cache, cfg, device, act_dtype, group, progress)
        hit = parts is not None
        if not hit:
            parts = quantize_checkpoint(src, cache, device, act_dtype, weights, group_size, embeddings, head, progress)
        rotary = type(skeleton.model.rotary_emb)(config=cfg).to(device)
        scaling = skeleton.model.layers[0].self_attn.scaling
        target = QuantizedTarget(cfg, device, act_dtype, dict(parts, rotary=rotary, scaling=scaling), info(hit))
    return target


# ---------------------------------------------------------------- model shape, source reading

def _skeleton(path: Path):
    """The config and the model built on `meta`: its shapes and module code, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot read config.json ({exc.__class__.__name__}); "
                              "re-download the model") from None
    cfg._attn_implementation = "sdpa"
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            skeleton = AutoModelForCausalLM.from_config(cfg)
    except ValueError:
        raise UnsupportedModel(f"{path}: {cfg.model_type!r} is not a causal language model transformers can "
                               "build; pick another model") from None
    return cfg, skeleton, llama_family.can_run(skeleton)


class _Source(module_quant.ModuleSource):
    """The checkpoint's tensors by name, read a row range at a time (ModuleSource), checked
    to be a Llama-family checkpoint in the Hugging Face layout."""

    def __init__(self, path: Path, cfg):
        super().__init__(path)
        self.layers = cfg.num_hidden_layers
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False)) or "lm_head.weight" not in self.index
        for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
            if name not in self.index:
                raise CheckpointError(f"{path}: no tensor {name} in the safetensors files; "
                                      "this is not a Llama-family checkpoint in the Hugging Face layout")

    def converted(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A whole tensor in `dtype`, converted chunk by chunk (an embedding table can be
        as large as several layers)."""
        shape = self.entry(name).shape
        if len(shape) == 1:
            return self.rows(name).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        step = max(1, qweights._CHUNK // shape[1])
        for a in range(0, shape[0], step):
            out[a:a + step] = self.rows(name, a, min(shape[0], a + step))
        return out


def _check_shapes(src: _Source, fmt: str, group: int, table: bool) -> None:
    """int4 needs a group that divides every quantized matrix's input width: refuse up
    front, naming the matrix and the group sizes that would work, rather than skip one."""
    if fmt != "int4":
        return
    names = [f"model.layers.{i}.{m}.weight" for i in range(src.layers) for ms in LINEARS.values() for m in ms]
    if table:                   # the head (or the tied table) in int4 too
        names.append("model.embed_tokens.weight" if src.tied else "lm_head.weight")
    for name in names:
        N, K = src.entry(name).shape
        why = qweights.int4_problem(N, K, group)
        if why is not None:
            ok = [g for g in qweights.INT4_GROUPS
                  if all(qweights.int4_problem(*src.entry(n).shape, g) is None for n in names)]
            fix = f"use --group-size {ok[0]}" if ok else "use --weights int8"
            raise BadRequest(f"--group-size {group}: {why} of {name}; {fix}")


# ---------------------------------------------------------------- quantize (cache miss) and load (hit)

def quantize_checkpoint(src: _Source, cache: QuantCache, device: torch.device, act_dtype: torch.dtype,
                        fmt: str, group: int, embeddings: bool, head: str, progress) -> dict:
    """Layer by layer: read, quantize, write to the cache, pack for the device."""
    writer = cache.writer()
    try:
        layers = []
        for i in range(src.layers):
            canonical = _quantize_layer(src, i, fmt, group, act_dtype)
            writer.write(f"layer-{i:04d}", canonical)
            layers.append(_pack_layer(canonical, device, act_dtype, group))
            del canonical
            progress("quantize", i + 1, src.layers + 1)
        rest = _quantize_rest(src, fmt, group, act_dtype, embeddings, head)
        writer.write("rest", rest)
        out = dict(_pack_rest(rest, device, act_dtype, group), layers=layers)
        progress("quantize", src.layers + 1, src.layers + 1)
        writer.commit()
        return out
    except BaseException:
        writer.abort()
        raise


def _load_cached(cache: QuantCache, cfg, device, act_dtype, group, progress) -> dict | None:
    manifest = cache.manifest()
    if manifest is None:
        return None
    n = cfg.num_hidden_layers
    layers = []
    for i in range(n):
        canonical = cache.read(f"layer-{i:04d}", manifest)
        if canonical is None:
            return None            # truncated or corrupt: the caller rebuilds the whole cache
        layers.append(_pack_layer(canonical, device, act_dtype, group))
        progress("load", i + 1, n + 1)
    rest = cache.read("rest", manifest)
    if rest is None:
        return None
    progress("load", n + 1, n + 1)
    return dict(_pack_rest(rest, device, act_dtype, group), layers=layers)


def _quantize_layer(src: _Source, i: int, fmt: str, group: int, act_dtype) -> dict[str, torch.Tensor]:
    """One decoder layer in canonical form, as flat `field.part` names for safetensors."""
    p = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    for field, mats in LINEARS.items():
        c = qweights.concat([src.quantized(f"{p}{m}.weight", fmt, group, act_dtype) for m in mats])
        out.update({f"{field}.{k}": v for k, v in c.items()})
    if all(src.has(f"{p}self_attn.{x}_proj.bias") for x in "qkv"):
        out["qkv_bias"] = torch.cat([src.rows(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]).float()
    for field, name in PLAIN.items():
        if src.has(p + name):
            out[field] = src.rows(p + name).float()
    return out


def _quantize_rest(src: _Source, fmt: str, group: int, act_dtype, embeddings: bool,
                   head: str) -> dict[str, torch.Tensor]:
    out = {"norm": src.rows("model.norm.weight").float()}
    tables = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}
    for field, held in qweights.table_formats(fmt, embeddings, head, src.tied).items():
        if held:
            out.update({f"{field}.{k}": v for k, v in src.quantized(tables[field], held, group, act_dtype).items()})
        else:
            out[field] = src.converted(tables[field], act_dtype)
    return out


def _unflatten(flat: dict[str, torch.Tensor], field: str) -> dict[str, torch.Tensor] | None:
    c = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(field + ".")}
    return c or None


def _pack_layer(flat: dict[str, torch.Tensor], device, act_dtype, group: int | None) -> llama_family.LayerWeights:
    plain = {k: (flat[k].to(device, act_dtype) if k in flat else None) for k in (*PLAIN, "qkv_bias")}
    linear = {f: qweights.packed(_unflatten(flat, f), device, act_dtype, group) for f in LINEARS}
    return llama_family.LayerWeights(**linear, **plain)


def _pack_rest(flat: dict[str, torch.Tensor], device, act_dtype, group: int | None) -> dict:
    def table(field: str):
        if field in flat:
            return flat[field].to(device, act_dtype)
        c = _unflatten(flat, field)
        return None if c is None else qweights.packed(c, device, act_dtype, group)
    embed = table("embed")
    head = table("head")
    if head is None:                       # tied: the embedding table is the head
        head = embed
    if type(head) is torch.Tensor:         # the fast forward keeps float weights as [in, out] views
        head = head.t()
    return {"embed": embed, "norm": flat["norm"].to(device, act_dtype), "head": head}


def _keep_experts(model, path: Path, cache_root: Path, budget: int, texts) -> str:
    """Keep `budget` bytes of a memory-mapped mixture's experts in memory, the most used
    first; returns what describe() says of it."""
    use = routing.cached(cache_root, path)
    if use is None and texts:
        use = routing.measure(model, texts)
        routing.save(cache_root, path, use)
    blocks = moe.blocks(model)
    if use is None:                          # nothing to measure on: block by block
        use = routing.Routing(tuple((0,) * len(b[1].gate_up) for b in blocks), 0)
    each = sum(t.nbytes for w in (blocks[0][1].gate_up[0], blocks[0][1].down[0]) for t in w.tensors())
    kept = routing.keep_in_memory(model, use, budget // each)
    why = f"the most used on {use.tokens} held tokens" if use.tokens else "no routing measured"
    return f"{len(kept)} of {use.experts} experts in memory ({why}), the rest memory-mapped"
