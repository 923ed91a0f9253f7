"""A target whose weights stay on the device for the whole session, in the checkpoint's
(or the requested) dtype."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..cache import KVCache, RecurrentCache
from ..checkpoint import check_finite, import_weights
from ..errors import CheckpointError, UnsupportedModel
from ..models import hf_forward, llama_family

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(path: Path) -> torch.dtype:
    cfg = json.loads((path / "config.json").read_text())
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    return _DTYPES.get(name, torch.float32)


class ResidentTarget:

    def __init__(self, model, device: torch.device, dtype: torch.dtype, fast: bool = True,
                 cache_capacity: int = 1024):
        self._setup(model.config, device, dtype, cache_capacity)
        why_not = llama_family.can_run(model) if fast else "disabled"
        if why_not is None:
            self.impl = llama_family.LlamaFamilyForward(model, self.cache)
            self.kind = "fast"
        else:
            self.impl = hf_forward.HFForward(model, self.cache)
            self.kind = "transformers"
        self.fallback_reason = why_not
        self._weight_bytes = sum(t.numel() * t.element_size() for t in self.impl.weight_tensors())

    def _setup(self, cfg, device: torch.device, dtype: torch.dtype, cache_capacity: int,
                max_positions: int | None = None) -> None:
        """What every target holds besides its weights: the shape, the dtype and a KV cache
        (the quantized and streamed targets call this too)."""
        self.config = cfg
        self.device, self.dtype = device, dtype
        self.vocab_size = cfg.vocab_size
        self.max_positions = max_positions or getattr(cfg, "max_position_embeddings", None) or 1 << 20
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kinds = hf_forward.layer_kinds(cfg)
        # A hybrid keeps keys and values for its attention layers only (a quarter of them in
        # Qwen3.5/Qwen3-Next); its linear layers' states go in the same cache object.
        kind = RecurrentCache if "linear" in kinds else KVCache
        self.cache = kind(kinds.count("attention"), cfg.num_key_value_heads, head_dim, dtype, device,
                          capacity=min(cache_capacity, self.max_positions), max_positions=self.max_positions)

    @torch.inference_mode()
    def forward(self, ids, all_logits: bool = False) -> torch.Tensor:
        """Run `ids` at the end of the cache and commit them. Returns float32 logits:
        [len(ids), vocab] with all_logits, else [1, vocab] for the last position."""
        if isinstance(ids, list) and getattr(self.impl, "takes_lists", False):
            n = len(ids)          # a torch operation fewer a step (llama_family.py says why)
        else:
            ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
            n = ids.numel()
        pos = self.cache.length
        self.cache.reserve(n)
        logits = self.impl(ids, pos, all_logits)
        self.cache.length = pos + n
        return logits

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def device_bytes(self) -> int:
        return self._weight_bytes + self.cache.nbytes()


def read_ahead(path: Path, progress) -> None:
    """Read the weight files once, reporting `progress(file name, bytes read, bytes in all)`.
    transformers loads through mmap and says nothing while the disk works; reading first
    turns the slow part of a large load into visible progress, and the load that follows
    finds the bytes in the page cache. Skipped when the files would not fit in free RAM
    (they would evict themselves before the load reads them)."""
    import psutil

    from ..checkpoint import weight_files
    files = weight_files(path)
    total = sum(f.stat().st_size for f in files)
    if total > 0.8 * psutil.virtual_memory().available:
        return
    buf = bytearray(16 << 20)
    done, last = 0, 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                done += n
                if done - last >= 64 << 20 or done == total:
                    progress(f"reading {f.name}", done, total)
                    last = done
    progress("building the model", total, total)


def load_resident(path: Path, device: torch.device, dtype: torch.dtype, fast: bool = True,
                  progress=None) -> ResidentTarget:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import_weights(path)                  # a GGUF model's float32 copy, on first need
    if progress is not None:
        read_ahead(path, progress)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError) as exc:
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "?")
        raise UnsupportedModel(f"{path}: architecture {model_type!r} is not supported by this "
                               f"transformers version ({exc.__class__.__name__}); pick another model") from None
    text = config.get_text_config()
    if getattr(text, "num_experts", None) or "linear" in hf_forward.layer_kinds(text):
        # a mixture (its experts fused while they are read) or a hybrid: one copy of the
        # weights at any time, where from_pretrained held the mapped files and the model
        from .module_exact import load_exact
        model = load_exact(path, config, device, dtype)
        return ResidentTarget(model, device, dtype, fast=fast)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, use_safetensors=True, trust_remote_code=False,
                attn_implementation="sdpa", output_loading_info=True)
    except (ValueError, OSError, RuntimeError) as exc:
        if isinstance(exc, ValueError) and ("Unrecognized configuration" in str(exc) or "does not support" in str(exc)):
            raise UnsupportedModel(f"{path}: {config.model_type!r} is not a causal language model "
                                   "transformers can load; pick another model") from None
        from ..checkpoint import check_tensors
        check_tensors(path)        # names the tensor that does not match its config, where it can
        raise CheckpointError(f"{path}: cannot load the weights ({str(exc).splitlines()[0]}); "
                              "re-download the model") from None
    # transformers fills a tensor missing from the files with random numbers and only logs it
    missing = [k for k in info.get("missing_keys", ()) if not (k == "lm_head.weight" and
                                                              getattr(config, "tie_word_embeddings", False))]
    if missing or info.get("mismatched_keys"):
        what = f"tensor {missing[0]} is missing" if missing else f"tensor {info['mismatched_keys'][0]} has the wrong shape"
        raise CheckpointError(f"{path}: {what} in the weight files; re-download the model")
    model.to(device).eval()
    check_finite(model.named_parameters(), path)
    return ResidentTarget(model, device, dtype, fast=fast)
