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


# The hybrids: gated delta-net layers with one full-attention layer in four, from the
# published config.json fields gathered in shared/models/qwen-hybrid-configs.json (each
# entry there names its sources: copies of the repos' config.json, Megatron launch
# arguments and GGUF metadata). Every Qwen3.5 size has head_dim 256, 16 linear key heads,
# key and value head dims 128, a conv window of 4 and the 248,320-token vocabulary (so
# Qwen3.5-0.8B drafts for all of them). A download is the text parameters at 2 bytes (bf16):
# the published repos also hold a small vision tower, which localchat does not load.
def _hybrid(model_type: str, hidden: int, layers: int, heads: int, kv: int, value_heads: int, vocab: int,
            tied: bool, inter: int | None = None, experts: tuple[int, int, int] | None = None) -> dict:
    cfg = dict(_cfg(model_type, hidden, layers, heads, kv, inter or 0, vocab, tied, head_dim=256),
               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
               linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=value_heads,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144)
    if inter is None:
        del cfg["intermediate_size"]                  # every layer sparse: the published configs have none
    if experts:
        n, k, width = experts
        cfg.update(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=width,
                   shared_expert_intermediate_size=width)
    return cfg


_QWEN35_VOCAB = 248320
# (repo, hidden, layers, heads, kv heads, linear value heads, tied, intermediate or (experts,
# top-k, width), download in GB: the parameters these numbers give, at 2 bytes; note)
_QWEN35 = [
    ("Qwen/Qwen3.5-0.8B", 1024, 24, 8, 2, 16, True, 3584, 1.50, ""),
    # tie_word_embeddings of 2B is unconfirmed (inferred from 0.8B and 4B, which tie)
    ("Qwen/Qwen3.5-2B", 2048, 24, 8, 2, 16, True, 6144, 3.76, ""),
    ("Qwen/Qwen3.5-4B", 2560, 32, 16, 4, 32, True, 9216, 8.41, ""),
    ("Qwen/Qwen3.5-9B", 4096, 32, 16, 4, 32, False, 12288, 17.9, ""),
    ("Qwen/Qwen3.5-27B", 5120, 64, 24, 4, 48, False, 17408, 53.8, ""),
    ("Qwen/Qwen3.5-35B-A3B", 2048, 40, 16, 2, 32, False, (256, 8, 512), 69.3,
     "hybrid MoE: about 3 B of 35 B parameters read a token"),
    # tie_word_embeddings of 122B is unconfirmed (untied gives the stated 122 B)
    ("Qwen/Qwen3.5-122B-A10B", 3072, 48, 32, 2, 64, False, (256, 8, 1024), 244.2,
     "hybrid MoE: about 10 B of 122 B parameters read a token"),
    ("Qwen/Qwen3.5-397B-A17B", 4096, 60, 32, 2, 64, False, (512, 10, 1024), 792.7,
     "hybrid MoE: about 17 B of 397 B parameters read a token"),
]


def _qwen35_entry(repo, hidden, layers, heads, kv, vh, tied, mlp, download, note) -> CatalogModel:
    moe = isinstance(mlp, tuple)
    cfg = _hybrid("qwen3_5_moe_text" if moe else "qwen3_5_text", hidden, layers, heads, kv, vh, _QWEN35_VOCAB, tied,
                  inter=None if moe else mlp, experts=mlp if moe else None)
    return CatalogModel(repo, repo.split("/")[1], int(download * GB), cfg,
                        drafter=None if repo == "Qwen/Qwen3.5-0.8B" else "Qwen/Qwen3.5-0.8B", note=note)


CATALOG += [_qwen35_entry(*row) for row in _QWEN35]

# Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Thinking's config.json, copied verbatim in the
# shared file; the Instruct model's GGUF metadata matches): 512 experts, 10 a token, every
# layer sparse (its intermediate_size, 5120, is unused), vocab 151936, untied; the download
# is its parameters at 2 bytes.
_QWEN3_NEXT_80B = dict(_hybrid("qwen3_next", 2048, 48, 16, 2, 32, 151936, False, inter=5120,
                               experts=(512, 10, 512)), decoder_sparse_step=1, mlp_only_layers=[])
CATALOG.append(CatalogModel("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Instruct",
                            int(159.3 * GB), _QWEN3_NEXT_80B,
                            note="hybrid MoE: about 3 B of 80 B parameters read a token"))


def find(key: str | None) -> CatalogModel | None:
    """The catalog entry for a repo id (case-insensitive) or 'demo'; None if not listed."""
    key = (key or DEMO_ID).strip().lower()
    return next((m for m in CATALOG if m.key.lower() == key), None)
