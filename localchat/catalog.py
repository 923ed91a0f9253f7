"""The models `localchat setup` offers: real model families with the numbers of their
published config.json (enough for `engine.planner.ModelShape.from_config` to plan them
without downloading anything), the hub repo, the approximate download and a drafter
that shares the tokenizer.

Config numbers are those of the repos' config.json files. Download sizes are the
safetensors totals shown on the hub, rounded (they are approximate: the setup wizard
adds headroom when it checks free disk). Qwen3-0.6B and Qwen3-1.7B/4B store the output
head as well although their config ties it, so their downloads exceed 2 bytes a parameter."""
from __future__ import annotations

from dataclasses import dataclass, field

DEMO_ID = "demo"


@dataclass(frozen=True)
class CatalogModel:
    repo: str | None            # hub repo id; None = the demo model (bundled, no download)
    label: str
    download_bytes: int         # approximate: safetensors + tokenizer
    config: dict = field(default_factory=dict)    # the published config.json numbers
    drafter: str | None = None  # a smaller model with the same tokenizer
    note: str = ""

    @property
    def key(self) -> str:
        return self.repo or DEMO_ID

    def shape(self):
        from engine.planner import ModelShape
        return ModelShape.from_config(self.config, self.label)


def _cfg(model_type: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int,
         tied: bool, head_dim: int | None = None, dtype: str = "bfloat16") -> dict:
    cfg = {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": head_dim or hidden // heads, "intermediate_size": inter, "vocab_size": vocab,
           "tie_word_embeddings": tied, "torch_dtype": dtype}
    return cfg


GB, MB = 10**9, 10**6

# Qwen3 dense models (Qwen/Qwen3-*/config.json): head_dim 128 throughout, q/k RMSNorm,
# vocab 151936; the three smallest tie the embeddings.
_QWEN3 = [
    ("Qwen/Qwen3-0.6B", 1024, 28, 16, 8, 3072, True, 1.5 * GB),
    ("Qwen/Qwen3-1.7B", 2048, 28, 16, 8, 6144, True, 4.1 * GB),
    ("Qwen/Qwen3-4B", 2560, 36, 32, 8, 9728, True, 8.1 * GB),
    ("Qwen/Qwen3-8B", 4096, 36, 32, 8, 12288, False, 16.4 * GB),
    ("Qwen/Qwen3-14B", 5120, 40, 40, 8, 17408, False, 29.5 * GB),
    ("Qwen/Qwen3-32B", 5120, 64, 64, 8, 25600, False, 65.5 * GB),
]

CATALOG: list[CatalogModel] = [
    CatalogModel(None, "demo: SmolLM2-135M (bundled, no download)", 0,
                 # The bundled GGUF is dequantized once to float32 safetensors.
                 _cfg("llama", 576, 30, 9, 3, 1536, 49152, True, dtype="float32"),
                 drafter=None, note="installed with localchat; small and fast, not very clever"),
    CatalogModel("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", 270 * MB,
                 _cfg("llama", 576, 30, 9, 3, 1536, 49152, True)),
    CatalogModel("HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2-360M-Instruct", 725 * MB,
                 _cfg("llama", 960, 32, 15, 5, 2560, 49152, True),
                 drafter="HuggingFaceTB/SmolLM2-135M-Instruct"),
    CatalogModel("HuggingFaceTB/SmolLM2-1.7B-Instruct", "SmolLM2-1.7B-Instruct", int(3.4 * GB),
                 _cfg("llama", 2048, 24, 32, 32, 8192, 49152, True),
                 drafter="HuggingFaceTB/SmolLM2-135M-Instruct"),
    CatalogModel("meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct", int(2.5 * GB),
                 _cfg("llama", 2048, 16, 32, 8, 8192, 128256, True, head_dim=64),
                 note="gated: accept the licence on huggingface.co and run `hf auth login`"),
    CatalogModel("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct", int(16.1 * GB),
                 _cfg("llama", 4096, 32, 32, 8, 14336, 128256, False),
                 drafter="meta-llama/Llama-3.2-1B-Instruct",
                 note="gated: accept the licence on huggingface.co and run `hf auth login`"),
] + [
    CatalogModel(repo, repo.split("/")[1], int(size), _cfg("qwen3", h, n, a, kv, i, 151936, tied, head_dim=128),
                 drafter=None if repo == "Qwen/Qwen3-0.6B" else "Qwen/Qwen3-0.6B")
    for repo, h, n, a, kv, i, tied, size in _QWEN3
]


# A hybrid (gated delta-net + attention, one layer in four) with a mixture of experts: the
# numbers transformers' Qwen3NextConfig defaults to, which its docstring gives as those of
# Qwen/Qwen3-Next-80B-A3B-Instruct (transformers 5.24, configuration_qwen3_next.py). No
# Qwen3.5 size is listed: no config with its linear-attention numbers could be cited here;
# `localchat setup --model Qwen/Qwen3.5-...` plans any of them from its own config.json.
_QWEN3_NEXT_80B = dict(
    _cfg("qwen3_next", 2048, 48, 16, 2, 5632, 151936, False, head_dim=256),
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
    linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[])
# Its download is the parameter count at 2 bytes (bf16), not a figure read off the hub.
CATALOG.append(CatalogModel("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Instruct", int(159.4 * GB),
                            _QWEN3_NEXT_80B,
                            note="hybrid MoE (3 B of 80 B parameters active a token); tok/s bounds count every "
                                 "expert's bytes, so they understate it"))


def find(key: str | None) -> CatalogModel | None:
    """The catalog entry for a repo id (case-insensitive) or 'demo'; None if not listed."""
    key = (key or DEMO_ID).strip().lower()
    return next((m for m in CATALOG if m.key.lower() == key), None)
