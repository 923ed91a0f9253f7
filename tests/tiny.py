"""Tiny models and tokenizers built in the test, saved to disk, so the real loading
code runs. Seeded: the same weights every run."""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Why is the sky blue? Rayleigh scattering of sunlight by the air.",
    "Café, naïve, façade, 東京, Привет, emoji 🙂 and tabs\tand newlines\n",
    "for i in range(10):\n    print(i * i)\n",
]


def build_tokenizer(vocab_size: int = 400, corpus: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(path: Path, kind: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
                max_positions: int = 4096, tokenizer=None, tie: bool = False, shard: str | None = None,
                dtype: torch.dtype = torch.float32, endless: bool = False) -> Path:
    """Save a random tiny model and tokenizer to `path` with save_pretrained
    (`shard`: a max shard size such as "100KB" for a multi-file checkpoint). `endless`:
    greedy answers never end on their own, for tests that stop a long answer: the stop
    tokens' output rows are zero, so their logit is exactly 0, and the largest of the
    other random logits is positive but with odds of 2^-vocab; without it, where a random
    model says its end-of-turn token depends on every rounding of its kernels."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or build_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tie_word_embeddings=tie)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    elif kind == "qwen3_5_vl":
        # Qwen3.5 as published: Qwen3_5ForConditionalGeneration, a vision tower beside the
        # language model (model.language_model.*, model.visual.*), its numbers in text_config.
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        text = dict(common, head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2,
                    linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                              tie_word_embeddings=tie))
    elif kind in ("qwen3_5", "qwen3_next"):
        # Hybrids: gated delta-net (linear attention) layers and one full-attention layer in
        # four (config.layer_types), small enough for a CPU; Qwen3-Next with a few experts.
        linear = dict(head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2,
                      linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4)
        if kind == "qwen3_5":
            from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**linear, **common))
        else:
            from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
            model = Qwen3NextForCausalLM(Qwen3NextConfig(**linear, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                                                         **common))
    elif kind == "qwen3_5_moe":
        # Qwen3.5's mixture of experts (every layer sparse: no intermediate_size, as published):
        # 4 experts, top-2, a shared expert; widths of 64 so int4 experts take q4.c's kernel.
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        linear = dict(head_dim=hidden // 4, linear_num_value_heads=4, linear_num_key_heads=2,
                      linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4)
        moe = dict(common)
        del moe["intermediate_size"]
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**linear, **moe, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=64, shared_expert_intermediate_size=64))
    elif kind == "qwen3_moe":
        # Qwen3-MoE (Qwen3-30B-A3B's family): every layer sparse, 4 experts, top-2, no shared
        # expert, the top-k weights normalized (as published)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=hidden // 4, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=64, norm_topk_prob=True, **common))
    elif kind == "lfm2":
        # Another hybrid family: LFM2's short-convolution layers (a conv window, no
        # recurrent state) beside attention layers.
        from transformers import Lfm2Config, Lfm2ForCausalLM
        pattern = ["conv", "conv", "full_attention", "conv"]
        model = Lfm2ForCausalLM(Lfm2Config(**dict(common, layer_types=[pattern[i % 4] for i in range(layers)])))
    else:
        raise ValueError(kind)
    # Random init at std 0.02 gives near-uniform logits; a wider spread makes the
    # greedy choice decisive, so exactness tests compare real decisions, not ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        if endless:
            assert not tie, "an endless model's output rows are its own"
            stops = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
            for t in stops - {None}:
                model.lm_head.weight[t].zero_()
    model.to(dtype).save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return Path(path)


def budget_for(path: Path, profile: str, context: int = 64, dtype: torch.dtype | None = None) -> int:
    """The smallest budget (in steps of 2% of the checkpoint) under which the planner picks
    `profile` for this model on the CPU, as engine.open would (computing in `dtype`, if given)."""
    import engine
    from engine import hardware, planner, profiles
    from engine.checkpoint import tensor_index
    total = sum(e.nbytes for e in tensor_index(Path(path)).values())
    shape = planner.ModelShape.from_checkpoint(Path(path))
    if dtype is not None:
        from dataclasses import replace
        shape = replace(shape, dtype_bytes=torch.finfo(dtype).bits // 8)
    every = profiles.builtin()
    for step in range(10, 200, 2):
        hw = hardware.detect(vram=total * step // 100, device="cpu")
        plan = planner.make_plan(shape, hw, every, context=context, runnable=engine.runnable(every))
        if plan.chosen == profile:
            return total * step // 100
    raise AssertionError(f"no budget picks {profile} for {path}")


def add_mtp(path: Path, seed: int = 0) -> Path:
    """Give a tiny Qwen3.5 / Qwen3-Next checkpoint the multi-token-prediction layer the
    published ones carry (`mtp.*`: fc, the two pre-fc norms, one full-attention decoder
    layer of the model's kind, a final norm), random and seeded, in its own file; a sparse
    layer's experts one matrix per expert, as published."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.mtp import MtpLayer
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layer = MtpLayer(model.model, cfg).to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    file = path / "model.safetensors"
    data = load_file(file)
    dtype = next(iter(data.values())).dtype
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05))
            stored = layer.stored_name(name)
            base, _, leaf = stored.rpartition(".")
            if p.dim() == 3 and leaf in ("gate_up_proj", "down_proj"):
                parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
                for e in range(p.shape[0]):
                    for part, rows in zip(parts, p[e].chunk(len(parts))):
                        data[f"{base}.{e}.{part}.weight"] = rows.detach().to(dtype).contiguous()
                continue
            data[stored] = p.detach().to(dtype).contiguous()
    save_file(data, file, metadata={"format": "pt"})
    return path
