"""The generic forward: the transformers model's own forward over our KV cache.

Used for architectures the fast Llama-family forward does not cover, and in tests as
the reference. The adapter below makes our preallocated KVCache look like a
transformers `Cache`, so the model writes into it at the committed position."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..cache import KVCache


class _PositionLayer(DynamicLayer):
    """One attention layer's view of the shared KVCache."""

    def __init__(self, cache: KVCache, index: int):
        super().__init__()
        self.kv, self.index = cache, index
        self.is_initialized = True
        self.device = cache.device

    def update(self, key_states, value_states, *args, **kwargs):
        return self.kv.write(self.index, self.kv.length, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.kv.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        # transformers crops layer by layer; the shared cache moves once (on layer 0).
        if self.index == 0:
            self.kv.rollback(self.kv.length - abs(tokens_to_remove))


class HFForward:
    def __init__(self, model, cache: KVCache):
        self.model = model
        self.cache = cache
        self.hf_cache = Cache(layers=[_PositionLayer(cache, i) for i in range(cache.layers)])

    def weight_tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append(t)
        return out

    def __call__(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        T = ids.shape[-1]
        position_ids = torch.arange(pos, pos + T, device=ids.device).unsqueeze(0)
        out = self.model(input_ids=ids.view(1, T), position_ids=position_ids, cache=self.hf_cache,
                         use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0].float()
