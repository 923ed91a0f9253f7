"""Write a tiny Hugging Face checkpoint as a GGUF file, for tests of the GGUF import of
architectures whose GGUF form transformers reads (the demo GGUF is a Llama; this makes a
hybrid one). Tensor names come from gguf-py's own name map (the one llama.cpp's converter
uses, through transformers' `get_gguf_hf_weights_map`), metadata from transformers' GGUF
config map read backwards, the byte-level BPE tokenizer as a "gpt2" GGUF vocabulary.
Float32 tensors: a lossless round trip, so the imported model must answer exactly as the
source does."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_gguf(src: Path, out: Path, sampling: dict | None = None, types: dict[str, str] | None = None) -> Path:
    """`sampling`: general.sampling.* keys to write, as llama.cpp's converter copies them
    from a generation_config.json ({"temp": 0.6, "top_p": 0.95, "top_k": 20}). `types`: a
    GGUF tensor name's ending -> the block type gguf-py's quantizer writes it in
    ({"ffn_down.weight": "MXFP4"}); the rest float32."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = model.config
    arch = cfg.model_type
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg.to_dict())
    to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(model, processor).items()}
    w = gguf.GGUFWriter(str(out), arch)
    for key, attr in GGUF_CONFIG_MAPPING[arch].items():
        if attr is None or attr == "num_key_value_heads":
            continue
        value = getattr(cfg, attr, None)
        if value is None and attr == "rope_theta":
            value = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        if value is None and attr == "rms_norm_eps":
            value = getattr(cfg, "norm_eps", None)            # LFM2's name for it
        if attr == "intermediate_size" and arch == "lfm2":
            # the width the weights have (LFM2 adjusts intermediate_size when it builds them)
            value = model.model.layers[0].feed_forward.w1.weight.shape[0]
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    if arch == "lfm2":       # llama.cpp marks attention layers by a KV head count, conv layers by 0
        w.add_array(f"{arch}.attention.head_count_kv",
                    [cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None) and arch != "lfm2":      # as llama.cpp's converter states it
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    tok = AutoTokenizer.from_pretrained(src)
    import json
    state = json.loads(tok.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])]
    for added in state["added_tokens"]:
        if added["id"] >= len(tokens):
            tokens.append(added["content"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    special = {a["id"] for a in state["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    for key, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{key}")(value)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch == "lfm2" and name.endswith("conv.conv.weight"):
            a = a[:, 0, :]                       # GGUF keeps the depthwise kernel as [hidden, L]
        kind = next((k for end, k in (types or {}).items() if to_gguf[name].endswith(end)), None)
        if kind is None:
            w.add_tensor(to_gguf[name], np.ascontiguousarray(a))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(to_gguf[name], gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
