"""Speculative verify passes on hybrid models: the recurrent state is rolled back by
replaying the accepted updates, not by keeping a state per draft position.

While the target verifies k drafts it does not know how many it will accept. A verify
pass (k+1 tokens after the committed ones) here leaves the committed conv window and
recurrent state of each recurrent layer untouched: the layer's projections run over the
k+1 rows at once, its conv and its recurrence step token by token from the committed state
into working copies, with the very functions a one-token step uses (kernels/gdn.c's where
they run, else transformers' `causal_conv1d_update` and `torch_recurrent_gated_delta_rule`;
either over j tokens is bitwise j one-token calls), and each position's inputs to the
recurrence (q, k, v after the conv, the decay g and the rate beta) and its raw pre-conv
columns go into a preallocated replay buffer of max_draft+1 positions per layer.

When the engine settles how many positions were accepted (m), each layer advances its
committed state by exactly those m updates, replayed from the buffer through the same
function (all k+1 accepted: the working state is taken as is), and its conv window takes
the last K raw columns: the committed state is, bit for bit, what plain decoding of the
accepted tokens would have left. The buffer is a few MiB where a state per position is
hundreds (engine.planner.ModelShape.replay_bytes).

Attention layers in a verify pass attend row by row (`rowwise_sdpa`), each row exactly the
call a one-token step makes, as the Llama-family forward does."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def _fns(mod: nn.Module):
    """The conv and recurrence functions the module's own forward calls: gdn.c's where
    delta_net.install gave the layer them, else its modeling module's."""
    mine = getattr(mod, "_localchat_fns", None)
    if mine is not None:
        return mine
    m = sys.modules[type(mod).__module__]
    return m.causal_conv1d_update, getattr(m, "torch_recurrent_gated_delta_rule", None)


class LayerReplay:
    """One recurrent layer's replay buffer and the verify forward that fills it."""

    def __init__(self, mod: nn.Module, state):
        self.mod = mod
        self.state = state            # models.hf_forward.LinearState: the layer's committed state
        self.kind = "conv" if not hasattr(mod, "A_log") else "delta"
        self.buf: dict[str, torch.Tensor] = {}
        self.positions = 0            # how many positions the pending pass recorded
        self.final = None             # the working state after all of them
        self.window = None            # the working conv window after all of them

    # -- the buffer (allocated once, reused every round; grown, keeping what it holds, only
    # if a recording outruns it)
    def _slot(self, name: str, like: torch.Tensor, capacity: int, dim: int, at: int) -> None:
        buf = self.buf.get(name)
        need = at + like.shape[dim]
        if buf is None or buf.shape[dim] < need or buf.dtype != like.dtype:
            shape = list(like.shape)
            shape[dim] = max(capacity, need)
            grown = torch.empty(shape, dtype=like.dtype, device=like.device)
            if buf is not None and at:
                grown.narrow(dim, 0, at).copy_(buf.narrow(dim, 0, at))
            self.buf[name] = buf = grown
        # a slice view: `buf[idx].copy_(x)` with an index tensor would write into a copy
        buf.narrow(dim, at, like.shape[dim]).copy_(like)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buf.values())

    # -- a recorded pass: from the committed state, or from where the recording has got to
    def verify(self, hidden_states: torch.Tensor, capacity: int) -> torch.Tensor:
        mod, lay = self.mod, self.state.layer
        B, T, _ = hidden_states.shape
        conv_update, rule = _fns(mod)
        at = self.positions
        window = (self.window if at else lay.conv_states[0]).clone()
        if self.kind == "conv":                       # LFM2 short conv: B * x -> conv -> C *
            BCx = mod.in_proj(hidden_states).transpose(-1, -2)
            Bg, Cg, x = BCx.chunk(3, dim=-2)
            raw = Bg * x
            conv = torch.cat([conv_update(raw[:, :, t:t + 1], window, mod.conv.weight.squeeze(1), mod.conv.bias)
                              for t in range(T)], -1)
            self._slot("raw", raw, capacity, 2, at)
            self.positions, self.window = at + T, window
            y = (Cg * conv).transpose(-1, -2).contiguous()
            return mod.out_proj(y)
        # a gated delta-net: the module's own projections (Qwen3-Next orders them itself)
        if hasattr(mod, "in_proj_qkvz"):
            q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(hidden_states),
                                                                mod.in_proj_ba(hidden_states))
            q, k, v = (t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v))
            mixed = torch.cat((q, k, v), dim=-1)
        else:
            mixed = mod.in_proj_qkv(hidden_states)
            z = mod.in_proj_z(hidden_states).reshape(B, T, -1, mod.head_v_dim)
            b, a = mod.in_proj_b(hidden_states), mod.in_proj_a(hidden_states)
        raw = mixed.transpose(1, 2)
        w = mod.conv1d.weight.squeeze(1)
        conv = torch.cat([conv_update(raw[:, :, t:t + 1], window, w, mod.conv1d.bias, mod.activation)
                          for t in range(T)], -1).transpose(1, 2)
        q, k, v = torch.split(conv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        q = q.reshape(B, T, -1, mod.head_k_dim)
        k = k.reshape(B, T, -1, mod.head_k_dim)
        v = v.reshape(B, T, -1, mod.head_v_dim)
        beta = b.sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
        core, final = rule(q, k, v, g=g, beta=beta, initial_state=self.final if at else lay.recurrent_states[0],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            self._slot(name, t, capacity, 1, at)
        self._slot("raw", raw, capacity, 2, at)
        self.positions, self.final, self.window = at + T, final, window
        shape = z.shape
        core = mod.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
        return mod.out_proj(core.reshape(shape).reshape(B, T, -1))

    # -- settling: advance the committed state by the accepted positions
    @torch.inference_mode()
    def commit(self, m: int) -> None:
        lay = self.state.layer
        T, self.positions = self.positions, 0
        final, window, self.final, self.window = self.final, self.window, None, None
        if m <= 0:
            return
        if m == T:                                    # every position accepted: the working state is it
            lay.conv_states[0].copy_(window)
            if final is not None:
                lay.recurrent_states[0].copy_(final)
            return
        conv = lay.conv_states[0]
        K = conv.shape[-1]
        raw = self.buf["raw"].narrow(2, 0, m)
        conv.copy_(torch.cat([conv, raw.to(conv.dtype)], -1)[..., -K:])
        if self.kind == "delta":
            _, rule = _fns(self.mod)
            b = self.buf
            _, state = rule(*(b[n].narrow(1, 0, m) for n in ("q", "k", "v")), g=b["g"].narrow(1, 0, m),
                            beta=b["beta"].narrow(1, 0, m), initial_state=lay.recurrent_states[0],
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
            lay.recurrent_states[0].copy_(state)


def install(model: nn.Module, cache, states) -> list[LayerReplay]:
    """Give each recurrent layer of `model` a verify forward (used while `cache.verifying`)
    and each attention layer row-by-row attention in a verify pass."""
    replays = []
    mixers = [m for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "A_log")
              or type(m).__name__.endswith("ShortConv")]
    for mod, state in zip(mixers, states):
        rep = LayerReplay(mod, state)

        def forward(*args, _rep=rep, _orig=mod.forward, **kw):
            hidden = kw["hidden_states"] if "hidden_states" in kw else args[0]
            if cache.verifying:
                return _rep.verify(hidden, cache.replay_capacity)
            return _orig(*args, **kw)
        mod.forward = forward
        replays.append(rep)
    return replays


def use_rowwise_attention(model: nn.Module, passes) -> None:
    """Route the model's attention through rowwise_sdpa (transformers' attention registry;
    masks as SDPA's); `passes` (a models.rows.KernelPasses) says which passes are verify
    passes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register("localchat_sdpa", rowwise_sdpa)
    AttentionMaskInterface.register("localchat_sdpa", sdpa_mask)
    model.config._attn_implementation = "localchat_sdpa"
    for m in model.modules():
        # an attention module (its output projection is o_proj, or LFM2's out_proj)
        if hasattr(m, "num_key_value_groups") and (hasattr(m, "o_proj") or hasattr(m, "out_proj")):
            m._localchat_passes = passes


def rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except in a verify pass: each query row alone over the
    keys it may see, as the one-token step that would have produced it calls it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    passes = getattr(module, "_localchat_passes", None)
    T = query.shape[2]
    if T == 1 or passes is None or not passes.lone_rows():
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    L = key.shape[2]
    rows = [sdpa_attention_forward(module, query[:, :, r:r + 1], key[:, :, :L - T + r + 1],
                                   value[:, :, :L - T + r + 1], None, **kwargs)[0] for r in range(T)]
    return torch.cat(rows, 1), None
