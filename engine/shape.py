"""A model's shape from its config.json (or a local checkpoint's safetensors headers, for
exact counts): parameters by kind, KV bytes per token, a hybrid's recurrent state, a
mixture's experts, and the bytes a pass reads. No weights are read. The planner
(planner.py) prices every profile from it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import BadRequest, CheckpointError


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    linear_params: int          # decoder linear weights: what int8/int4 quantize
    other_params: int           # embeddings, head, norms: kept exact
    tied_embeddings: bool
    attention_layers: int
    # A hybrid's linear-attention layers: bytes of their conv windows and recurrent states
    # for one conversation (fixed, not per token); the cache keeps one checkpoint copy too.
    state_bytes: int = 0
    # What a speculative verify pass records per position to replay the accepted updates
    # (engine/models/replay.py): elements in the activation dtype, and in float32.
    replay_act: int = 0
    replay_f32: int = 0
    # A mixture of experts: the routed experts' matrices (part of linear_params), how many
    # experts a sparse layer holds and how many a token reads. A token reads the rest of
    # the weights and only its top-k experts in each sparse layer.
    expert_params: int = 0
    experts: int = 0
    experts_per_tok: int = 0
    # The checkpoint's multi-token-prediction layer (mtp.*, Qwen3.5 and Qwen3-Next): what
    # `--drafter mtp` loads beside the target; 0 where the files have none.
    mtp_params: int = 0
    # The element size the files hold, where a loader computes in another (dtype_bytes): a
    # streamed unit is then read through a staging buffer of its file bytes. 0: the same.
    file_dtype_bytes: int = 0
    # The longest context the model was made for (max_position_embeddings; 0: not said)
    max_positions: int = 0
    # A .gguf model's bytes as its file stores them (the resident-gguf profile holds them so):
    # the decoder matrices, the routed experts among them, the output head (or the tied
    # table), and everything else (embedding table, norms). 0: not a GGUF model.
    gguf_linear_bytes: int = 0
    gguf_expert_bytes: int = 0
    gguf_head_bytes: int = 0
    gguf_other_bytes: int = 0

    def replay_bytes(self, max_draft: int, act_bytes: int | None = None) -> int:
        """The replay buffer of a conversation drafting up to max_draft tokens a round."""
        if max_draft <= 0:
            return 0
        return (max_draft + 1) * (self.replay_act * (act_bytes or self.dtype_bytes) + 4 * self.replay_f32)

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def layer_linear_params(self) -> int:
        return self.linear_params // self.layers

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        return 2 * self.attention_layers * self.kv_heads * self.head_dim * (dtype_bytes or self.dtype_bytes)

    def weight_bytes(self, weights: str = "exact", group_size: int = 32, head: str = "exact") -> int:
        """Every weight held: the decoder matrices in `weights`, the output head (a tied
        table, which also serves the embedding lookups) in `head`, the rest exact; "gguf":
        the file's own bytes."""
        if weights == "gguf":
            return self.gguf_linear_bytes + self.gguf_head_bytes + self.gguf_other_bytes
        return (self.linear_bytes(weights, group_size) + self.other_params * self.dtype_bytes
                - self._head_saving(head, group_size))

    def _head_saving(self, head: str, group_size: int) -> int:
        """The bytes the output head saves held as `head` (int8, int4) rather than exact."""
        if head == "exact":
            return 0
        p = self.vocab * self.hidden
        return p * self.dtype_bytes - self.linear_bytes(head, group_size, p)

    def expert_fraction(self, positions: int = 1) -> float:
        """The share of a sparse layer's routed experts a pass of `positions` tokens reads:
        the distinct experts they route to, E(1 - (1 - k/E)^n) of E under uniform routing."""
        if not self.experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_tok / self.experts) ** max(1, positions)

    def read_bytes(self, weights: str = "exact", group_size: int = 32, positions: int = 1,
                   head: str = "exact") -> int:
        """The bytes a pass of `positions` tokens reads: every decoder matrix but the routed
        experts, the experts its tokens route to, the norms and the head (in `head`), and one
        embedding row a token (a tied table is read whole, as the head)."""
        if weights == "gguf":
            dense = self.gguf_linear_bytes - self.gguf_expert_bytes
            rows = 0 if self.tied_embeddings else positions * self.hidden * 4
            return (dense + int(self.gguf_expert_bytes * self.expert_fraction(positions)) + self.gguf_head_bytes
                    + rows + 4 * self.hidden * (2 * self.layers + 1))
        dense = self.linear_params - self.expert_params
        linear = self.linear_bytes(weights, group_size, dense) \
            + int(self.linear_bytes(weights, group_size, self.expert_params) * self.expert_fraction(positions))
        table = 0 if self.tied_embeddings else self.vocab * self.hidden
        other = self.other_params - table + min(table, positions * self.hidden)
        return linear + other * self.dtype_bytes - self._head_saving(head, group_size)

    def linear_bytes(self, weights: str = "exact", group_size: int = 32, params: int | None = None) -> int:
        p = self.linear_params if params is None else params
        if weights == "exact":
            return p * self.dtype_bytes
        if weights == "int8":        # 1 byte a weight + a bf16 scale per output channel
            return p + 2 * (p // self.hidden)
        if weights == "int4":        # half a byte a weight + bf16 scale and zero per group
            return p // 2 + 4 * (p // group_size)
        if weights == "gguf":        # as the file stores them (its mix of block formats)
            if p == self.expert_params:
                return self.gguf_expert_bytes
            return self.gguf_linear_bytes if p == self.linear_params else p * self.gguf_linear_bytes // max(
                1, self.linear_params)
        raise BadRequest(f"weights {weights!r}: use exact, int8, int4 or gguf")

    @classmethod
    def from_config(cls, cfg: dict, name: str = "", dtype_bytes: int | None = None,
                    where: str = "config.json") -> "ModelShape":
        """Parameter counts from the published config numbers alone (Llama/Qwen/Mistral family).
        A number that is missing, not a whole number or not positive is a CheckpointError
        naming `where` and the key (a config edited by hand, or a broken download)."""
        from .checkpoint import config_numbers
        text, number = config_numbers(cfg, where)
        hidden, layers = number("hidden_size"), number("num_hidden_layers")
        heads = number("num_attention_heads")
        kv = number("num_key_value_heads", heads)
        hd = number("head_dim", hidden // heads)
        from .checkpoint import has_dense_mlp, sparse_layer
        vocab = number("vocab_size")
        # A mixture with no dense layer has no intermediate_size: its widest MLP activation
        # (what the activation memory counts) is then k experts' and the shared expert's.
        inter = number("intermediate_size") if has_dense_mlp(text) else \
            number("moe_intermediate_size") * number("num_experts_per_tok") + (text.get("shared_expert_intermediate_size") or 0)
        if heads % kv:
            raise CheckpointError(f"{where}: num_attention_heads = {heads} is not a multiple of "
                                  f"num_key_value_heads = {kv}; fix the file or re-download the model")
        tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        attention = hidden * heads * hd + 2 * hidden * kv * hd + heads * hd * hidden
        bias = (heads + 2 * kv) * hd if text.get("attention_bias") or text.get("model_type") == "qwen2" else 0
        norms = 2 * hidden + (2 * hd if text.get("model_type", "").startswith("qwen3") else 0)
        dt = dtype_bytes or _dtype_bytes(text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype"))
        types = _layer_types(text, layers)
        # KV per token: attention layers only; a hybrid's linear_attention layers keep a fixed state
        attn = sum(1 for t in types if "attention" in t and "linear" not in t) if types else layers
        mlp = [_mlp_params(text, number, sparse_layer(text, i)) for i in range(layers)]
        experts = sum(m[2] for m in mlp)
        if "linear_attention" in types:
            linear, extra = _hybrid_params(text, types, number)
        else:
            linear, extra = layers * attention, layers * (norms + bias)
        linear += sum(m[0] for m in mlp)
        other = vocab * hidden * (1 if tied else 2) + hidden + extra + sum(m[1] for m in mlp)
        n_experts, k = (number("num_experts"), number("num_experts_per_tok")) if experts else (0, 0)
        return cls(name or text.get("model_type", "model"), layers, hidden, heads, kv, hd, inter, vocab, dt,
                   linear, other, tied, attn or layers, _state_bytes(text, types, dt), *_replay_elems(text, types),
                   expert_params=experts, experts=n_experts, experts_per_tok=k,
                   max_positions=text.get("max_position_embeddings") if isinstance(
                       text.get("max_position_embeddings"), int) else 0)

    @classmethod
    def from_checkpoint(cls, path: Path, name: str = "") -> "ModelShape":
        """Exact counts from the safetensors headers of a local checkpoint."""
        from .checkpoint import tensor_index
        where = Path(path) / "config.json"
        try:
            cfg = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: unreadable config ({exc}); re-download the model") from None
        shape = cls.from_config(cfg, name or Path(path).name, where=str(where))
        linear = other = 0
        dt = shape.dtype_bytes
        index = tensor_index(Path(path))
        experts = mtp = 0
        # A published multimodal checkpoint (Qwen3.5) holds a vision tower that is not loaded,
        # and Qwen3.5's a multi-token-prediction layer (mtp.*) the target does not run
        nested = any(name.startswith("model.language_model.") for name in index)
        for e in index.values():
            n = 1
            for d in e.shape:
                n *= d
            if e.name.startswith("mtp."):
                mtp += n
                continue
            if nested and not e.name.startswith(("model.language_model.", "lm_head.")):
                continue
            dt = e.nbytes // max(n, 1) or dt
            # decoder matrices (what int8/int4 quantize): 2-D weights of the layers, and
            # experts fused into 3-D tensors; not a router, not a conv kernel
            matrix = (e.name.endswith(".weight") and len(e.shape) == 2 and not e.name.endswith("mlp.gate.weight")) \
                or e.name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if ".layers." in e.name and matrix:
                linear += n
                if _ROUTED.search(e.name):
                    experts += n
            else:
                other += n
        return replace(shape, dtype_bytes=dt, linear_params=linear, other_params=other, expert_params=experts,
                       mtp_params=mtp, file_dtype_bytes=dt)

    @classmethod
    def of(cls, ckpt) -> "ModelShape":
        """The shape of a resolved model (checkpoint.Checkpoint): from its .gguf file's table
        where it is one, else from its safetensors headers."""
        if getattr(ckpt, "gguf", None) is not None:
            return cls.from_gguf(ckpt.gguf, ckpt.path, ckpt.name)
        return cls.from_checkpoint(ckpt.path, ckpt.name)

    @classmethod
    def from_gguf(cls, gguf: Path, config_dir: Path, name: str = "") -> "ModelShape":
        """A .gguf model's shape: its structure from the config of its import (config_dir),
        its parameters and bytes from the file's tensor table (no weight is read). Counted
        as a float32 checkpoint of the same weights (what the other profiles load: the
        import's dequantized copy), and as the file's bytes for resident-gguf."""
        from .gguf_file import held_bytes
        from .gguf_reader import read
        where = Path(config_dir) / "config.json"
        try:
            cfg = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: unreadable config ({exc}); delete that folder to import again") from None
        shape = cls.from_config(cfg, name or Path(gguf).name, dtype_bytes=4, where=str(where))
        _, tensors = read(Path(gguf))
        linear = other = experts = 0
        lin_b = exp_b = head_b = other_b = 0
        for t in tensors.values():
            n = 1
            for d in t.shape:
                n *= d
            size = held_bytes(t)             # as held: F16 widens to float32, a type without a kernel converts
            if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) >= 2 \
                    and not t.name.endswith("ffn_gate_inp.weight"):
                linear += n
                lin_b += size
                if "_exps." in t.name:
                    experts += n
                    exp_b += size
            else:
                other += n
                if t.name == "output.weight" or t.name == "token_embd.weight" and "output.weight" not in tensors:
                    head_b += size
                else:
                    other_b += size
        return replace(shape, linear_params=linear, other_params=other, expert_params=experts, file_dtype_bytes=0,
                       gguf_linear_bytes=lin_b, gguf_expert_bytes=exp_b, gguf_head_bytes=head_b,
                       gguf_other_bytes=other_b)

    def mtp_drafter(self, context: int) -> "ModelShape":
        """The MTP layer as a drafter's shape for the plan: its weights (loaded in the
        target's dtype, and in a quantized profile's format), the keys and values of one attention
        layer, the target's hidden state of every position (`context` rows it reads), and
        nothing of the embedding or head it shares with the target."""
        return replace(self, layers=1, linear_params=self.mtp_params, other_params=context * self.hidden,
                       tied_embeddings=True,
                       attention_layers=1, state_bytes=0, replay_act=0, replay_f32=0, expert_params=0,
                       mtp_params=0)


# A routed expert's matrices in the files: fused 3-D (experts.gate_up_proj) or one a matrix
# (experts.7.up_proj.weight); not the shared expert (shared_expert.*)
_ROUTED = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj|\d+\.)")


def _mlp_params(text: dict, number, sparse: bool) -> tuple[int, int, int]:
    """(decoder matrices, other parameters, routed experts' matrices) of one layer's MLP:
    a dense SwiGLU MLP, or a mixture of experts (routed experts, a shared expert and its
    one-output gate: matrices; the router: not)."""
    hidden = number("hidden_size")
    if not sparse:
        return 3 * hidden * number("intermediate_size"), 0, 0
    experts, moe = number("num_experts"), number("moe_intermediate_size")
    shared = text.get("shared_expert_intermediate_size") or 0
    routed = 3 * hidden * experts * moe
    return routed + 3 * hidden * shared + (hidden if shared else 0), hidden * experts, routed


def _layer_types(text: dict, layers: int) -> list[str]:
    """config.layer_types, or the pattern transformers derives from full_attention_interval
    (Qwen3-Next configs may give only that: every interval-th layer is full attention)."""
    types = text.get("layer_types")
    if types:
        return list(types)
    interval = text.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and "linear_num_value_heads" in text:
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    return []


def _hybrid_params(text: dict, types: list, number) -> tuple[int, int]:
    """(decoder matrices, the rest of the decoder layers) of a Qwen3.5 / Qwen3-Next config:
    gated attention layers (q_proj twice as wide: its second half gates the output),
    gated delta-net layers (q/k/v/z, beta and decay projections, out_proj; conv weights,
    decay parameters and the gated norm besides), two norms a layer; the MLPs are
    _mlp_params'. Checked against the tensors of saved checkpoints in tests/test_hybrid.py."""
    hidden, heads = number("hidden_size"), number("num_attention_heads")
    kv = number("num_key_value_heads", heads)
    hd = number("head_dim", hidden // heads)
    kh, kd = number("linear_num_key_heads"), number("linear_key_head_dim")
    vh, vd = number("linear_num_value_heads"), number("linear_value_head_dim")
    conv_k = number("linear_conv_kernel_dim", 4)
    conv_dim = 2 * kh * kd + vh * vd
    linear = other = 0
    for kind in types:
        if kind == "linear_attention":
            linear += hidden * (conv_dim + vh * vd + 2 * vh) + vh * vd * hidden
            other += conv_dim * conv_k + 2 * vh + vd
        else:
            linear += hidden * heads * hd * 2 + 2 * hidden * kv * hd + heads * hd * hidden
            other += 2 * hd
        other += 2 * hidden
    return linear, other


def _state_bytes(text: dict, types: list, dtype_bytes: int) -> int:
    """The gated delta-net state of one conversation (Qwen3.5, Qwen3-Next): per linear layer
    a conv window of the last K pre-conv q/k/v columns, conv_dim = 2 x key heads x key dim +
    value heads x value dim, in the model's dtype; and a recurrent state of value heads x
    key dim x value dim in float32 (even in a bf16 model)."""
    # LFM2's short-conv layers: a window of the last conv_L_cache columns of the hidden size
    conv_layers = sum(1 for t in types if t == "conv") * text.get("hidden_size", 0) * text.get("conv_L_cache", 3)
    linear = sum(1 for t in types if t == "linear_attention")
    if not linear:
        return conv_layers * dtype_bytes
    kh, kd = text.get("linear_num_key_heads", 0), text.get("linear_key_head_dim", 0)
    vh, vd = text.get("linear_num_value_heads", 0), text.get("linear_value_head_dim", 0)
    conv = (2 * kh * kd + vh * vd) * text.get("linear_conv_kernel_dim", 4) * dtype_bytes
    return linear * (conv + vh * kd * vd * 4)


def _replay_elems(text: dict, types: list) -> tuple[int, int]:
    """Per verified position, what the replay buffer records (activation-dtype elements,
    float32 elements): per gated delta-net layer its q, k, v after the conv, its rate beta
    and its raw pre-conv q/k/v columns (for the conv window), and its decay g in float32;
    per short-conv layer (LFM2) its raw pre-conv columns."""
    delta = sum(1 for t in types if t == "linear_attention")
    conv = sum(1 for t in types if t == "conv")
    kh, kd = text.get("linear_num_key_heads", 0), text.get("linear_key_head_dim", 0)
    vh, vd = text.get("linear_num_value_heads", 0), text.get("linear_value_head_dim", 0)
    conv_dim = 2 * kh * kd + vh * vd
    return delta * (2 * conv_dim + vh) + conv * text.get("hidden_size", 0), delta * vh


def _dtype_bytes(name) -> int:
    name = str(name or "bfloat16").replace("torch.", "")
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(name, 2)
