"""Qwen3.5's decoder layers (dense and mixture of experts) and Qwen3-Next's through kernels/hybrid_kernel.py
for the passes whose rows must be one-token steps: one-token steps and verify passes.

Each decoder layer's forward is wrapped: such a pass runs the C layer over the layer's own
weights and the forward's caches; any other pass (a prefill, a traced graph, a layer
whose weights are not held as the kernels read them) runs transformers' forward. A verify
pass of a gated delta-net layer steps from the committed state into working copies and
records each position's inputs to the recurrence into the layer's replay buffer, as
models/replay.py's verify forward does, so the replay that settles the round is unchanged.
A mixture-of-experts layer's second half runs its norm and shared expert (with the expert's
sigmoid gate) in one more C call; the router and the routed experts are models/moe.py's.
A layer's C description (its weights' addresses and formats) is built on its first pass
and kept: rebuilding it took about a tenth of a Qwen3.5-2B-shaped bf16 step in Python
(5.5 ms of some 70 on the development EPYC). A streamed forward, whose layers are bound to
a slot's views anew on every pass, builds it every pass; the caches' addresses are each
pass's everywhere (a cache grows into new tensors).
`LOCALCHAT_HYBRID_KERNEL=off` keeps transformers' modules everywhere, for comparisons."""
from __future__ import annotations

import ctypes
import os
import threading

import torch
from torch import nn

from ..kernels import gdn_kernel, hybrid_kernel
from ..kernels.hybrid_kernel import Shape, Weights, mat

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")      # modeling modules whose layers hybrid_body.h computes
MAX_DIM = 512


def _plain(t, dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_cpu and t.is_contiguous()


def _matrix(m, dtype):
    """The weight of a linear module without bias as layer.c reads it (a dense tensor in
    `dtype`, per-channel int8 with scales in `dtype`, bf16 layers' canonical int4), or None."""
    if getattr(m, "bias", None) is not None:
        return None
    if isinstance(m, nn.Linear):
        return m.weight if _plain(m.weight, dtype) else None
    w = getattr(m, "w", None)                  # targets/module_quant.PackedLinear
    if getattr(w, "gguf_blocks", False):       # a GGUF file's blocks (targets/gguf_modules.py)
        return w if dtype == torch.float32 else None
    if getattr(w, "canonical", False):
        return w if dtype == torch.bfloat16 else None
    if getattr(w, "own_kernel", False):
        return w if w.scale.dtype == dtype else None
    return None


def _matrices(dtype, *modules) -> list | None:
    out = [_matrix(m, dtype) for m in modules]
    return None if any(w is None for w in out) else out


class HybridLayers:
    """The wrapped decoder layers of one forward (models/hf_forward.HFForward)."""

    def __init__(self, fwd, layers: list[nn.Module], dtype: torch.dtype):
        self.fwd, self.dtype, self.lib = fwd, dtype, hybrid_kernel.Library(dtype)
        self._mine = threading.local()
        cfg = fwd.model.config
        cfg = getattr(cfg, "text_config", cfg)
        attn = next(m.self_attn for m in layers if hasattr(m, "self_attn"))
        gdn = next(m.linear_attn for m in layers if hasattr(m, "linear_attn"))
        D = attn.head_dim
        rot = int(D * (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0))
        dense = next((m.mlp for m in layers if hasattr(m.mlp, "gate_proj")), None)
        shared = next((m.mlp.shared_expert for m in layers if hasattr(m.mlp, "shared_expert")), None)
        self.shape = dict(hidden=cfg.hidden_size, inter=dense.intermediate_size if dense is not None else 0,
                          shared_inter=shared.intermediate_size if shared is not None else 0,
                          heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=D, rot=rot,
                          Hk=gdn.num_k_heads, Hv=gdn.num_v_heads, Dk=gdn.head_k_dim, Dv=gdn.head_v_dim,
                          eps=cfg.rms_norm_eps, scale=attn.scaling)
        self.conv_k = gdn.conv_kernel_size
        # A layer's C description, built on its first pass and kept where the weights stay
        # put (a streamed forward binds each layer to a slot's views anew: built every pass)
        self._fixed = fwd.weights_fixed
        self._shapes: dict[int, Shape] = {}
        kv = 0
        for i, layer in enumerate(layers):
            orig = layer.forward
            if hasattr(layer, "self_attn"):
                layer.forward = self._wrap(orig, self._attention, layer, kv)
                kv += 1
            else:
                rep = next(r for r in fwd.cache.replays if r.mod is layer.linear_attn) if fwd.cache.replays else None
                layer.forward = self._wrap(orig, self._delta_net, layer, (fwd.hf_cache.layers[i], rep))

    def _wrap(self, orig, run, layer, where):
        def forward(hidden_states, *args, **kw):
            T = hidden_states.shape[1]
            if (hidden_states.shape[0] == 1 and self.fwd._row_kernel(T) and hidden_states.dtype == self.dtype
                    and not torch.compiler.is_compiling()):
                h = hidden_states.reshape(T, -1).contiguous()
                if run(layer, where, h, T, kw):
                    return h.view(1, T, -1)
            return orig(hidden_states, *args, **kw)
        return forward

    # -- the C descriptions
    def _shape(self, capacity: int = 0) -> Shape:
        shape = self._shapes.get(capacity)
        if shape is None:
            shape = self._shapes[capacity] = Shape(capacity=capacity, **self.shape)
        return shape

    def _described(self, layer, build):
        """`build(layer)`: the layer's C description, or None where its weights are not held
        as the kernels read them; kept for the next pass where weights stay put, per thread
        (a pass writes its cache's addresses into it)."""
        if not self._fixed:
            return build(layer)
        desc = getattr(self._mine, "desc", None)
        if desc is None:
            desc = self._mine.desc = {}
        key = id(layer)
        if key not in desc:
            desc[key] = build(layer)
        return desc[key]

    def _buffers(self, T: int, C: int, VD: int, Hv: int) -> tuple:
        """A delta-net pass's intermediates (raw, conv, z, beta, g, core), this thread's own;
        nothing keeps them past the pass (the replay buffers copy what they record)."""
        bufs = getattr(self._mine, "bufs", None)
        if bufs is None:
            bufs = self._mine.bufs = {}
        b = bufs.get(T)
        if b is None:
            dt = self.dtype
            b = bufs[T] = (torch.empty(T, C, dtype=dt), torch.empty(T, C, dtype=dt), torch.empty(T, VD, dtype=dt),
                           torch.empty(T, Hv, dtype=dt), torch.empty(T, Hv, dtype=torch.float32),
                           torch.empty(T, VD, dtype=dt))
        return b

    def _mlp(self, d: Weights, layer) -> bool:
        d.ln2 = layer.post_attention_layernorm.weight.data_ptr()
        mlp = layer.mlp
        if not hasattr(mlp, "gate_proj"):
            return True                        # a sparse block: the module runs it
        ws = _matrices(self.dtype, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if ws is None or mlp.gate_proj.out_features != self.shape["inter"]:
            return False
        d.gate, d.up, d.down = (mat(w) for w in ws)
        return True

    def _scratch(self, shape: Shape, T: int, context: int) -> torch.Tensor:
        threads = torch.get_num_threads()
        need = self.lib.scratch_bytes(ctypes_ref(shape), T, context, threads)
        s = getattr(self._mine, "scratch", None)
        if s is None or s.numel() < need:
            s = self._mine.scratch = torch.empty(max(need, 2 * (0 if s is None else s.numel())), dtype=torch.uint8)
        return s

    def _moe_desc(self, d: Weights, layer) -> bool:
        """A sparse block's shared expert and its gate into `d`; False where the module must
        run it (not held as the kernels read them)."""
        mlp = layer.mlp
        se, score = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
        ws = None if se is None or score is None else _matrices(self.dtype, se.gate_proj, se.up_proj, se.down_proj,
                                                                 score)
        if ws is None or se.gate_proj.out_features != self.shape["shared_inter"]:
            return False
        d.se_gate, d.se_up, d.se_down, d.se_score = (mat(w) for w in ws)
        return True

    def _moe_half(self, layer, sparse: int, dr: int, sr: int, h: torch.Tensor, T: int, scratch) -> None:
        """A sparse block's half of the layer (`sparse`: 0 for a dense MLP, which ran in the
        layer's call; 1 for a shared expert held as the kernels read it; 2 for the module):
        its norm and shared expert in C (the router and the experts kernel on the normed
        rows), else the modules, each rounding as transformers' block does."""
        if not sparse:
            return
        mlp = layer.mlp
        if sparse == 2:
            y = mlp(layer.post_attention_layernorm(h.view(1, T, -1)))
            h.add_((y[0] if isinstance(y, tuple) else y).view(T, -1))
            return
        x, shared = torch.empty_like(h), torch.empty_like(h)
        self.lib.moe_in(dr, sr, h.data_ptr(), T, x.data_ptr(), shared.data_ptr(), scratch.data_ptr(),
                        torch.get_num_threads())
        _, weights, chosen = mlp.gate(x)
        h.add_(mlp.experts(x, chosen, weights).view(T, -1) + shared)

    def _common(self, d: Weights, layer):
        """The input norm and the layer's second half into `d`: how its sparse block runs
        (as _moe_half takes it), or None where the layer cannot run in C."""
        d.ln1 = layer.input_layernorm.weight.data_ptr()
        if not self._mlp(d, layer):
            return None
        if hasattr(layer.mlp, "gate_proj"):
            return 0
        return 1 if self._moe_desc(d, layer) else 2

    # -- a gated attention layer
    def _attention_desc(self, layer):
        att = layer.self_attn
        ws = _matrices(self.dtype, att.q_proj, att.k_proj, att.v_proj, att.o_proj)
        d = Weights()
        sparse = None if ws is None else self._common(d, layer)
        if sparse is None:
            return None
        d.q_norm, d.k_norm = att.q_norm.weight.data_ptr(), att.k_norm.weight.data_ptr()
        d.q, d.k, d.v, d.o = (mat(w) for w in ws)
        return d, ctypes_ref(d), sparse

    def _attention(self, layer, kv: int, h: torch.Tensor, T: int, kw) -> bool:
        dt = self.dtype
        cache, pos = self.fwd.cache, self.fwd._pos
        kc, vc = cache.k[kv], cache.v[kv]
        cos, sin = kw["position_embeddings"]
        if not (_plain(kc, dt) and _plain(vc, dt) and cos.dtype == dt and cos.shape[-1] == self.shape["rot"]
                and pos + T <= kc.shape[2]):
            return False
        desc = self._described(layer, self._attention_desc)
        if desc is None:
            return False
        d, dr, sparse = desc
        d.k_cache, d.v_cache = kc.data_ptr(), vc.data_ptr()     # the cache may have grown
        shape = self._shape(kc.shape[2])
        sr = ctypes_ref(shape)
        cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
        scratch = self._scratch(shape, T, pos + T)
        self.lib.attn(dr, sr, h.data_ptr(), T, pos, cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
        self._moe_half(layer, sparse, dr, sr, h, T, scratch)
        return True

    # -- a gated delta-net layer
    def _delta_net_desc(self, layer):
        mod, dt = layer.linear_attn, self.dtype
        grouped = hasattr(mod, "in_proj_qkvz")            # Qwen3-Next
        if grouped and hasattr(mod.in_proj_qkvz, "qkv"):  # a GGUF file's, its parts apart (targets/gguf_modules.py)
            grouped = False
            ws = _matrices(dt, mod.in_proj_qkvz.qkv, mod.in_proj_qkvz.z, mod.in_proj_ba.b, mod.in_proj_ba.a,
                           mod.out_proj)
        else:
            ws = (_matrices(dt, mod.in_proj_qkvz, mod.in_proj_ba, mod.out_proj) if grouped else
                  _matrices(dt, *(getattr(m, "inner", m) for m in (mod.in_proj_qkv, mod.in_proj_z)),
                            mod.in_proj_b, mod.in_proj_a, mod.out_proj))
        if ws is None or not _plain(mod.conv1d.weight, dt) or not _plain(mod.norm.weight, dt):
            return None
        d = Weights()
        sparse = self._common(d, layer)
        if sparse is None:
            return None
        if grouped:
            d.qkvz, d.ba, d.out = (mat(w) for w in ws)
        else:
            d.qkv, d.z, d.b, d.a, d.out = (mat(w) for w in ws)
        # a GGUF file's order of value heads (targets/gguf_modules.py): the in-projections'
        # outputs and the out projection's input, as the kernel takes them
        heads = (self.shape["Hk"], self.shape["Hv"] // self.shape["Hk"], self.shape["Dv"])
        tiled = [getattr(getattr(mod, n, None), "tiled", None) for n in ("in_proj_qkv", "in_proj_z")]
        if tiled[0] != tiled[1] or tiled[0] not in (None, heads):
            return None
        d.in_tiled = int(tiled[0] is not None)
        tiled = getattr(mod.out_proj, "tiled", None)
        if tiled not in (None, heads):
            return None
        d.out_tiled = int(tiled is not None)
        d.norm, d.dt_bias = mod.norm.weight.data_ptr(), mod.dt_bias.data_ptr()
        a_neg = -mod.A_log.float().exp()
        d.a_neg = a_neg.data_ptr()
        C = 2 * self.shape["Hk"] * self.shape["Dk"] + self.shape["Hv"] * self.shape["Dv"]
        # a_neg is kept with the description that points at it
        return d, ctypes_ref(d), sparse, mod.conv1d.weight.view(C, -1), a_neg

    def _delta_net(self, layer, where, h: torch.Tensor, T: int, kw) -> bool:
        lay, rep = where
        if not lay.has_previous_state[0] or rep is None:
            # a first pass: transformers' forward starts the state; without a replay (a layer
            # replay.py does not know) verify passes are transformers', so one-token steps
            # must be too
            return False
        window, state = lay.conv_states[0], lay.recurrent_states[0]
        if not _plain(window, self.dtype) or not _plain(state, torch.float32):
            return False
        desc = self._described(layer, self._delta_net_desc)
        if desc is None:
            return False
        d, dr, sparse, conv_w, _ = desc
        s = self.shape
        Hk, Hv, Dk, Dv = s["Hk"], s["Hv"], s["Dk"], s["Dv"]
        C = 2 * Hk * Dk + Hv * Dv
        raw, conv, z, beta, g, core = self._buffers(T, C, Hv * Dv, Hv)
        shape = self._shape()
        sr = ctypes_ref(shape)
        scratch = self._scratch(shape, T, 0)
        threads = torch.get_num_threads()
        self.lib.gdn_in(dr, sr, h.data_ptr(), T, raw.data_ptr(), z.data_ptr(), beta.data_ptr(), g.data_ptr(),
                        scratch.data_ptr(), threads)
        verifying = self.fwd.cache.verifying
        if verifying:                           # from the committed state (or the recording so far) into copies
            at = rep.positions
            window = (rep.window if at else window).clone()
            s_in = rep.final if at else state
            s_out = torch.empty_like(state)
        else:                                   # the committed state advanced in place
            s_in = s_out = state
        self.lib.step(raw.data_ptr(), window.data_ptr(), conv_w.data_ptr(), conv.data_ptr(), g.data_ptr(),
                      beta.data_ptr(), s_in.data_ptr(), s_out.data_ptr(), core.data_ptr(), T, Hk, Hv, Dk, Dv,
                      self.conv_k, self.dtype == torch.bfloat16, threads)
        if verifying:
            cap = self.fwd.cache.replay_capacity
            qkv = conv.view(1, T, C)
            rep._slot("q", qkv[..., :Hk * Dk].view(1, T, Hk, Dk), cap, 1, at)
            rep._slot("k", qkv[..., Hk * Dk:2 * Hk * Dk].view(1, T, Hk, Dk), cap, 1, at)
            rep._slot("v", qkv[..., 2 * Hk * Dk:].reshape(1, T, Hv, Dv), cap, 1, at)
            rep._slot("g", g.view(1, T, Hv), cap, 1, at)
            rep._slot("beta", beta.view(1, T, Hv), cap, 1, at)
            rep._slot("raw", raw.t().unsqueeze(0), cap, 2, at)
            rep.positions, rep.final, rep.window = at + T, s_out, window
        self.lib.gdn_out(dr, sr, h.data_ptr(), T, core.data_ptr(), z.data_ptr(), scratch.data_ptr(), threads)
        self._moe_half(layer, sparse, dr, sr, h, T, scratch)
        return True


def ctypes_ref(s) -> int:
    return ctypes.addressof(s)


def install(fwd, dtype: torch.dtype) -> str:
    """Wrap `fwd`'s Qwen3.5 or Qwen3-Next decoder layers; a note for describe() ('' for a
    model without recurrent layers)."""
    decoder = [m for m in fwd.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not getattr(fwd.cache, "states", None) or not decoder:
        return ""                               # not a hybrid
    family = {type(m).__module__.rsplit(".", 1)[-1].removeprefix("modeling_") for m in decoder}
    if not family <= set(FAMILIES):
        return f"the hybrid layers of {', '.join(sorted(family))} run transformers' modules"
    layers = decoder
    why = hybrid_kernel.why_not(dtype) if fwd.cache.device.type == "cpu" else "not on the CPU"
    if os.environ.get("LOCALCHAT_HYBRID_KERNEL", "").lower() in ("off", "0", "no", "false"):
        why = "turned off (LOCALCHAT_HYBRID_KERNEL=off)"
    attn = next((m.self_attn for m in layers if hasattr(m, "self_attn")), None)
    gdn = next((m.linear_attn for m in layers if hasattr(m, "linear_attn")), None)
    if not why and (attn is None or gdn is None or attn.head_dim > MAX_DIM or fwd.cache.dtype != dtype
                    or max(gdn.head_k_dim, gdn.head_v_dim) > gdn_kernel.MAX_DIM
                    or gdn.num_v_heads % gdn.num_k_heads):
        why = "a layer shape the kernels do not take"
    if why:
        return f"the hybrid layers run transformers' modules ({why})"
    HybridLayers(fwd, layers, dtype)
    return (f"one-token steps and verify passes run the {len(layers)} hybrid layers in C (where their "
            "weights are held as the kernels read them: dense, int8, bf16's int4, GGUF blocks; a prefill runs "
            "transformers' modules)")
