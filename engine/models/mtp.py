"""The multi-token-prediction layer Qwen3.5 and Qwen3-Next checkpoints carry (`mtp.*`), as a
drafter's model: one full-attention decoder layer of the target's own kind (its MoE block
where the target is a mixture) that reads the target's final hidden state at a position and
the embedding of the token after it, and predicts the token after that, through the target's
own head.

    e = pre_fc_norm_embedding(embed(x[i + 1]));  h = pre_fc_norm_hidden(target_hidden[i])
    g = norm(layer(fc([e; h])))  at position i;  logits = lm_head(g)

A draft of k tokens chains it: the next step reads the drafted token and g, one position on.
The layer is held as the target's text model of one layer (transformers' own class, so its
attention, rotary and masks are the target's), over a cache of its own.

Why: the checkpoint's own drafter shares the tokenizer and the target's representations,
so it needs no second model and drafts well where no small model of the family exists;
vLLM and SGLang draft Qwen3.5 and Qwen3-Next this way."""
from __future__ import annotations

import copy

import torch
from torch import nn

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
FC = "mtp.fc.weight"


def why_not(cfg, names) -> str:
    """'' when the checkpoint (its text config, its tensor names) carries an MTP layer this
    loads, else why not, in words for a one-line error."""
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
        return f"{kind or 'this model'} has no multi-token-prediction layer this version runs (Qwen3.5, Qwen3-Next)"
    if FC not in names:
        return "the checkpoint has no mtp.* tensors (its multi-token-prediction layer was not published with it)"
    layers = getattr(cfg, "mtp_num_hidden_layers", getattr(cfg, "num_nextn_predict_layers", 1))
    if layers != 1:
        return f"mtp_num_hidden_layers = {layers}: this version runs one multi-token-prediction layer"
    return ""


def why_not_at(path) -> str:
    """why_not() for the checkpoint in the folder `path` (its config.json and files)."""
    import json
    from types import SimpleNamespace

    from ..checkpoint import tensor_index
    stored = json.loads((path / "config.json").read_text())
    return why_not(SimpleNamespace(**(stored.get("text_config") or stored)), tensor_index(path))


class MtpLayer(nn.Module):
    def __init__(self, text_model: nn.Module, cfg):
        super().__init__()
        one = copy.deepcopy(cfg)
        one.num_hidden_layers = 1
        one.layer_types = ["full_attention"]
        if hasattr(one, "mlp_only_layers"):        # Qwen3-Next: the MTP layer is sparse like the others
            one.mlp_only_layers = []
            one.decoder_sparse_step = 1
        self.config = one
        hidden = cfg.hidden_size
        norm = type(text_model.norm)
        with torch.device("meta"):
            self.model = type(text_model)(one)
            self.model.embed_tokens = None             # the target's is used (embed_ids)
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.pre_fc_norm_embedding = norm(hidden, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = norm(hidden, eps=cfg.rms_norm_eps)

    def stored_name(self, name: str) -> str:
        """The checkpoint's name for one of this module's parameters."""
        if name.startswith("model."):
            return "mtp." + name.removeprefix("model.")
        return "mtp." + name

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, cache):
        """embeds, target_hidden [T, hidden] -> the layer's normed output [T, hidden], the
        keys and values of positions [T] written into `cache` (a transformers DynamicCache)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(target_hidden)], dim=-1)
        h = self.fc(x).unsqueeze(0)
        out = self.model(inputs_embeds=h, position_ids=positions.unsqueeze(0), cache=cache, use_cache=True)
        return out.last_hidden_state[0]
