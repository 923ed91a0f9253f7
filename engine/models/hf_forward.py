"""The generic forward: the transformers model's own forward over our KV cache.

Used for architectures the fast Llama-family forward does not cover, and in tests as
the reference. The adapter below makes our preallocated KVCache look like a
transformers `Cache`, so the model writes into it at the committed position."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from ..cache import KVCache
from . import delta_net, hybrid_layers, moe, replay, rows
from .llama_family import ALIGN_BYTES, aligned


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


class LinearState:
    """One linear-attention layer's state (transformers' LinearAttentionLayer, which the
    model's own forward updates in place), as engine.cache.RecurrentCache handles it."""

    def __init__(self, layer: LinearAttentionLayer):
        self.layer = layer

    # The states are inference tensors (the forward runs in inference mode): they are
    # copied and written back in that mode too.
    @torch.inference_mode()
    def snapshot(self):
        lay = self.layer
        if not lay.has_previous_state[0]:
            return None
        # a short-conv layer (LFM2) has no recurrent state
        return tuple(None if t is None else t.clone() for t in (lay.conv_states[0], lay.recurrent_states[0]))

    @torch.inference_mode()
    def restore(self, snap) -> None:
        lay = self.layer
        if snap is None:
            self.reset()
            return
        conv, rec = snap
        if (conv is not None and lay.conv_states[0] is None) or (rec is not None and lay.recurrent_states[0] is None):
            # a state restored from disk before this layer ever ran: transformers allocates it
            lay.lazy_initialization(conv_states=None if lay.conv_states[0] is not None else conv,
                                    recurrent_states=None if lay.recurrent_states[0] is not None else rec)
        # copy_ into the tensors the layer holds: they keep their address (a captured graph
        # may point at them)
        for live, saved in zip((lay.conv_states[0], lay.recurrent_states[0]), snap):
            if saved is not None:
                if live is None or live.shape != saved.shape:
                    raise ValueError(f"a recurrent state of shape {tuple(saved.shape)} for a layer holding "
                                     f"{None if live is None else tuple(live.shape)}")
                live.copy_(saved)
        lay.has_previous_state[0] = True

    def reset(self) -> None:
        # The next pass is a prefill: transformers pads the conv window and starts the
        # recurrence from zeros when the layer says it has no previous state.
        self.layer.has_previous_state[0] = False

    def nbytes(self) -> int:
        lay = self.layer
        return sum(t.numel() * t.element_size() for t in (lay.conv_states[0], lay.recurrent_states[0])
                   if t is not None)


# Layer types (config.layer_types) whose state is a fixed-size conv window and/or recurrent
# state that transformers keeps in a LinearAttentionLayer: Qwen3.5/Qwen3-Next's gated
# delta-nets, LFM2's short convolutions.
RECURRENT_TYPES = ("linear_attention", "conv")


def _dense_linear(m: torch.nn.Linear, fwd: "HFForward"):
    """m's forward by the kernel policy's product for fwd's pass (kernels/dispatch.py): the
    row kernel for the rows of steps and verify passes, a prefill's GEMM, or torch's with a
    one-row product run as two rows where models/rows.py's probe says that makes a step's
    products a verify pass's rows."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return fwd._mm(x.reshape(-1, x.shape[-1]), m.weight.t(), m.bias).view(*x.shape[:-1], -1)
    return forward


def layer_kinds(config) -> list[str]:
    """'attention' or 'linear' (a recurrent state) for each decoder layer (config.layer_types
    where it has them)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return ["linear" if t in RECURRENT_TYPES else "attention" for t in types]


class HFForward(rows.KernelPasses):
    weights_fixed = True           # each module keeps its weight tensors for the session
    def __init__(self, model, cache: KVCache, mapped_experts: dict | None = None):
        """`mapped_experts`: the routed experts of sparse blocks whose modules do not hold
        them (moe.install)."""
        self.model = model
        self.cache = cache
        layers, kv = [], 0
        for kind in layer_kinds(model.config):
            if kind == "linear":
                layers.append(LinearAttentionLayer())
            else:
                layers.append(_PositionLayer(cache, kv))
                kv += 1
        if kv != cache.layers:
            raise ValueError(f"the cache holds {cache.layers} attention layers, the model has {kv}")
        linear = [LinearState(layer) for layer in layers if isinstance(layer, LinearAttentionLayer)]
        if linear:
            cache.states = linear                  # an engine.cache.RecurrentCache rolls them back
            # speculation: verify passes record, the accepted updates are replayed (replay.py)
            cache.replays = replay.install(model, cache, linear)
            if len(cache.replays) != len(linear):
                cache.replays = []                 # a recurrent layer of a kind replay does not know
        # a verify pass's attention row by row, as the one-token steps it stands for
        replay.use_rowwise_attention(model, self)
        self.hf_cache = Cache(layers=layers)
        # One-token steps' products as a verify pass's rows (models/rows.py): dense
        # nn.Linear layers run a single row as two when this machine's kernels need it.
        dense = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self._use_rows(rows.check([(m.in_features, m.out_features) for m in dense], cache.dtype, cache.device),
                       cache.dtype, cache.device)
        if self._kernel or self._pad:
            for m in dense:
                m.forward = _dense_linear(m, self)
        for m in model.modules():
            if hasattr(m, "row_passes"):         # a packed weight's module (targets/module_quant.py)
                m.row_passes = self
        # Every weight starts on 64 bytes, as a streamed slot's views do (matrix-vector
        # kernels may round by alignment: llama_family.ALIGN_BYTES), so a model streamed
        # through these same modules computes the very bits this one does.
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_meta and p.data_ptr() % ALIGN_BYTES:
                    p.data = aligned(p.data)
        # Sparse blocks (a mixture of experts) through the experts kernel (models/moe.py)
        self.experts_note = moe.install(model, self, cache.dtype, mapped_experts) if cache.device.type == "cpu" else ""
        # Gated delta-net layers' per-token conv and recurrence in C, while our passes run
        self.delta_net, self.delta_net_note = (delta_net.install(model) if cache.device.type == "cpu"
                                               else (delta_net.Scope({}), ""))
        # Qwen3.5's layers whole in C for one-token steps and verify passes
        self._pos = 0
        self.hybrid_note = hybrid_layers.install(self, cache.dtype) if self._kernel else ""

    def weight_tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out.append(t)
        return out

    def __call__(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        T = ids.shape[-1]
        self._begin_pass(T, all_logits)
        self._pos = pos
        position_ids = torch.arange(pos, pos + T, device=ids.device).unsqueeze(0)
        with self.delta_net:
            out = self.model(input_ids=ids.view(1, T), position_ids=position_ids, cache=self.hf_cache,
                             use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0].float()
