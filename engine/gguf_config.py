"""The configs localchat rebuilds from a GGUF file's metadata for architectures it runs from
their blocks but transformers does not read (its integrations/gguf/gguf_config_mapping.py
has qwen35 and qwen35moe, not qwen3next): the keys llama.cpp's converter writes
(conversion/qwen.py), back under transformers' names. Everything the file states is set,
so no config class default stands in for it."""
from __future__ import annotations


def qwen3next(meta: dict, tensor_names) -> dict:
    """Qwen3-Next: gated delta-net layers with full attention every `full_attention_interval`,
    a mixture of experts with a shared expert in every layer."""
    key = lambda name: meta[f"qwen3next.{name}"]  # noqa: E731
    head_dim = key("attention.key_length")
    value_heads = key("ssm.time_step_rank")
    layers = key("block_count") - meta.get("qwen3next.nextn_predict_layers", 0)
    interval = key("full_attention_interval")
    config = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "max_position_embeddings": key("context_length"),
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": key("ssm.inner_size") // value_heads,       # stated whole in the file
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
        "decoder_sparse_step": 1, "mlp_only_layers": [],                     # every layer sparse, as converted
        "norm_topk_prob": True,                                              # llama.cpp's qwen3next graph normalizes
        "rope_parameters": {"rope_type": "default", "rope_theta": key("rope.freq_base"),
                            # a rotary width in dimensions, where transformers takes a fraction of the head
                            "partial_rotary_factor": key("rope.dimension_count") / head_dim},
        "vocab_size": meta["tokenizer.ggml.tokens"],          # the reader keeps a string array's count
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if (width := meta.get("qwen3next.feed_forward_length")) is not None:
        config["intermediate_size"] = width
    return config


# general.architecture -> the config builder
CONFIGS = {"qwen3next": qwen3next}


def config(fields, tensor_names):
    """The transformers config of a file of an architecture in CONFIGS (`fields`: its
    metadata as engine/gguf_reader.read gives it)."""
    from transformers import AutoConfig
    built = CONFIGS[fields["general.architecture"]](fields, set(tensor_names))
    return AutoConfig.for_model(built.pop("model_type"), **built)
