"""A functional forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM).

Why not call the Hugging Face modules? At batch 1 a decode step is a chain of small
matrix-vector products, and on a CPU the per-module overhead of the generic code is a
third of the step. This file does the same arithmetic with fewer, larger operations:
q/k/v in one matmul, gate/up in one, rotary embedding on q and k together, cos/sin
looked up from a table, keys and values written into the preallocated cache.

The arithmetic is the model's own: RMSNorm in float32 as the reference does, SDPA for
attention. `tests/test_fast_forward.py` checks it against the transformers forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..kernels import layer_kernel
from . import graph_step, norms, rows

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
# Passes of up to this many tokens after position 0 attend row by row (see _attend_rowwise).
ROWWISE_MAX = 32


@dataclass
class LayerWeights:
    # Linear weights are kept as transposed views [in, out]: `x @ w` through torch.mm is
    # the very kernel call F.linear makes, without its dispatch layers (linear -> matmul
    # -> t -> mm), which cost more than a small matrix-vector product's launch.
    ln1: torch.Tensor
    qkv: torch.Tensor                 # [hidden, (H + 2*KV) * D]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor             # [hidden, 2 * intermediate]
    down: torch.Tensor
    q_norm: torch.Tensor | None = None   # Qwen3: RMSNorm over each head before rotary
    k_norm: torch.Tensor | None = None


def can_run(model) -> str | None:
    """None if this forward can run `model` exactly, else the reason it cannot."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        return f"model_type {cfg.model_type}"
    types = getattr(cfg, "layer_types", None) or []
    if "linear_attention" in types:
        return "linear-attention layers (a hybrid model)"
    if any(t != "full_attention" for t in types):
        return "sliding-window layers"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
            and cfg.model_type == "mistral":
        return "sliding window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if getattr(cfg, "mlp_bias", False):
        return "mlp bias"
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", None):
        return f"attention implementation {model.config._attn_implementation}"
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            return "sliding-window layers"
    return None


# Matrix-vector kernels may round differently by where a weight starts in memory (measured
# with torch 2.13 on an AVX-512 EPYC: a 1-row product with a weight 40 bytes past a 64-byte
# boundary differs from the same product on a 64-byte-aligned copy by ~1e-7). Every weight
# this forward reads starts on a multiple of ALIGN_BYTES, as the streamed target's slots
# do (targets/layer_index.py), so both targets run the very same kernels on the same bits.
ALIGN_BYTES = 64


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`, or a copy of it starting on an ALIGN_BYTES boundary (torch's CPU allocator
    aligns fresh tensors to 64 bytes). A transposed view stays a transposed view."""
    if t is None or t.data_ptr() % ALIGN_BYTES == 0:
        return t
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return t.t().clone().t()
    return t.clone()


def _linear(fwd: rows.KernelPasses, x: torch.Tensor, w_t, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w_t.T, bias) for 2-D x, by the kernel policy's product for the forward's
    pass (kernels/dispatch.py): a dense weight's through the forward's routes, a packed one
    (int8/int4, targets/qweights.py; GGUF blocks, gguf_file.py) through its own."""
    if isinstance(w_t, torch.Tensor):
        return fwd._mm(x, w_t, bias)
    return w_t.mm(x, bias, fwd.pass_kind)


class LlamaFamilyForward(rows.KernelPasses):
    takes_lists = True                 # ids as a list of ints, or a tensor
    _stack: layer_kernel.LayerStack | None = None
    # A forward whose weights come and go (streamed): each layer's step in the same C
    # call, one layer at a time, so its bits are the whole stack's.
    _one: layer_kernel.LayerStack | None = None
    _one_fits: bool | None = None      # whether its layers' views are laid out as layer.c reads them (one layout)
    layer_kernel_note = "the weights are not held by this forward"
    _graph: graph_step.GraphStep | None = None
    graph_note = ""                    # why steps do not run the graph step, where it was asked for
    def __init__(self, model, cache: KVCache):
        inner = model.model
        self._setup(model.config, cache, inner.rotary_emb, inner.layers[0].self_attn.scaling)
        tied = model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
        self.embed = aligned(inner.embed_tokens.weight)
        self.norm = aligned(inner.norm.weight)
        self.head = self.embed.t() if tied else aligned(model.lm_head.weight).t()
        self.layers = [self._take_layer(layer) for layer in inner.layers]
        self._use_layer_kernel()

    def _use_layer_kernel(self) -> None:
        """One-token steps and verify passes run all layers in one call of C where they can
        (engine/kernels/layer_kernel.py: the operations between the products cost more than
        the products on a small model). For forwards whose layers stay resident in
        `self.layers`; a streamed one, whose weights come and go, keeps the operations below."""
        self.layer_kernel_note = (layer_kernel.why_not_for(self, self.cache.dtype) if self._kernel
                                  else "the row kernel does not run here")
        if not self.layer_kernel_note:
            self._stack = layer_kernel.LayerStack(self, self.cache.dtype)

    def use_graph_step(self, width: int) -> None:
        """One-token steps and verify passes of up to `width` rows as one compiled graph, where
        graph_step.wanted() this device (a GPU); graph_note says why not where it was wanted."""
        if not graph_step.wanted(self.cache.device):
            return
        self.graph_note = graph_step.why_not(self)
        if not self.graph_note:
            graph = graph_step.GraphStep(self, width)
            self._graph = None if graph.refused else graph

    def _setup(self, cfg, cache: KVCache, rotary, scaling: float) -> None:
        """The shape constants and tables every variant of this forward needs (targets that
        keep their weights elsewhere call this instead of __init__)."""
        self.cache = cache
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.gqa = bool(self.heads != self.kv_heads)   # a plain bool: a traced graph must not see it symbolic
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scaling = scaling
        self.rotary = rotary
        self._cos = self._sin = None
        self._scalar_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Which faster RMSNorm forms round as the reference on this machine, per width:
        # decided before any pass (a traced graph must not run the probe).
        widths = {cfg.hidden_size, self.head_dim}
        self._fused_rms = {n: norms.fused_matches(n, self.eps, cache.device) for n in widths}
        self._sum_mean = {n: norms.sum_matches_mean(n, cache.device) for n in widths}
        # Whether one-token steps' products must run as two rows to be a verify pass's rows
        H, KV, D, h = self.heads, self.kv_heads, self.head_dim, cfg.hidden_size
        self._use_rows(rows.check([(h, (H + 2 * KV) * D), (H * D, h), (h, 2 * self.intermediate),
                                   (self.intermediate, h), (h, cfg.vocab_size)], cache.dtype, cache.device),
                       cache.dtype, cache.device)

    @staticmethod
    def _take_layer(layer) -> LayerWeights:
        a, m = layer.self_attn, layer.mlp
        biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        # torch.cat makes fresh (aligned) tensors; the rest are the module's own, aligned if
        # they are not already (see ALIGN_BYTES).
        w = LayerWeights(
            ln1=aligned(layer.input_layernorm.weight),
            qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t(),
            qkv_bias=qkv_bias,
            o=aligned(a.o_proj.weight).t(), o_bias=aligned(a.o_proj.bias),
            ln2=aligned(layer.post_attention_layernorm.weight),
            gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).t(),
            down=aligned(m.down_proj.weight).t(),
            q_norm=aligned(getattr(getattr(a, "q_norm", None), "weight", None)),
            k_norm=aligned(getattr(getattr(a, "k_norm", None), "weight", None)),
        )
        # The forward holds its own copies now: free the module's (fused or realigned).
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            lin.weight = None
            lin.bias = None
        return w

    def weight_tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm]
        if self.head.data_ptr() != self.embed.data_ptr():   # tied embeddings count once
            out.append(self.head)
        for w in self.layers:
            out += [t for t in vars(w).values() if t is not None]
        return out

    # -- rotary table: the reference computes cos/sin per call; a table of the same
    # values (same function, same positions) avoids that work on every step.
    def _rope(self, pos: int, n: int, like: torch.Tensor):
        self._rope_table(pos + n, like)
        return self._cos[pos:pos + n], self._sin[pos:pos + n]

    def _rope_table(self, need: int, like: torch.Tensor | None = None) -> None:
        """The tables [size, head_dim] (contiguous, in the cache's dtype) cover positions < need."""
        if self._cos is None or self._cos.shape[0] < need:
            size = max(need, 2 * (0 if self._cos is None else self._cos.shape[0]), 1024)
            if like is None:
                like = torch.empty(0, dtype=self.cache.dtype, device=self.cache.device)
            ids = torch.arange(size, device=like.device).unsqueeze(0)
            cos, sin = self.rotary(like, ids)
            # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2) exactly (a sign flip
            # rounds nothing), which saves negating x on every layer.
            half = sin.shape[-1] // 2
            self._cos = cos[0].contiguous()
            self._sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and w.dtype == torch.float32 and self._fused_rms.get(x.shape[-1]):
            # torch's fused rms_norm, where it rounds exactly as the reference does (probed
            # at load, norms.py): one kernel instead of six, ~8% of a CPU decode step.
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        # The reference's RMSNorm (float32 statistics, product with the weight in x's dtype).
        # sum/n, where the probe found it bit-identical to mean(), skips mean's dtype
        # bookkeeping, which costs more than the sum at this size; n and eps as 0-dim tensors
        # skip wrapping a Python scalar on every call.
        xf = x.float()
        if self._sum_mean.get(x.shape[-1]):
            n, eps = self._scalars(x.shape[-1], xf.device)
            var = xf.pow(2).sum(-1, keepdim=True).div_(n)
            return w * (xf * var.add_(eps).rsqrt_()).to(x.dtype)
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _scalars(self, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._scalar_cache.get(width)
        if got is None:
            got = (torch.tensor(float(width), dtype=torch.float32, device=device),
                   torch.tensor(self.eps, dtype=torch.float32, device=device))
            self._scalar_cache[width] = got
        return got

    def _attend_rowwise(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
        """Attention of a short pass (a verify pass) one query row at a time, each row
        exactly the call a one-token step makes. The masked multi-row kernel rounds
        differently, and a verified token must get the logits plain decoding gives it."""
        rows = [self._attend(q[:, :, r:r + 1], keys[:, :, :pos + r + 1], values[:, :, :pos + r + 1])
                for r in range(q.shape[2])]
        return torch.cat(rows, 2)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask=None,
                causal: bool = False) -> torch.Tensor:
        """SDPA over the cached keys and values: the one place attention is computed, so a
        target that changes the thread count around a pass (targets/streamed.py) can keep
        this op on the count the resident target uses (its result depends on it)."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                              scale=self.scaling, enable_gqa=self.gqa)

    # -- the hooks a target that keeps its weights elsewhere overrides (targets/streamed.py):
    # where the layers' weights come from, how token rows are embedded, the output head.
    def iter_layers(self):
        """The weights of each decoder layer in order, valid until the next one is asked for."""
        return self.layers

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.head)

    def __call__(self, ids: torch.Tensor | list[int], pos: int, all_logits: bool) -> torch.Tensor:
        T = len(ids) if isinstance(ids, list) else ids.shape[-1]
        self._begin_pass(T, all_logits)
        graph = self._graph
        if graph is not None and T <= graph.width and (T == 1 or all_logits) and not torch.compiler.is_compiling():
            out = graph(ids.view(T).tolist() if isinstance(ids, torch.Tensor) else ids, pos, T if all_logits else 1)
            if out is not None:
                return out
            self._graph = None                 # its rows are not steps here (graph_note says why)
        stack = self._stack
        if stack is not None and stack.has_head and self._row_kernel(T) and not torch.compiler.is_compiling():
            # The whole pass in one call of C, ids to logits: after the layers have streamed
            # the weights through the caches, every torch operation of a step starts cold.
            self._rope_table(pos + T)
            rows = T if all_logits else 1
            if isinstance(ids, torch.Tensor):
                ids = ids.view(T).tolist()
            if stack.embed is not None and all(0 <= i < stack.vocab for i in ids):
                out = stack.logits(self.cache, ids, None, pos, self._cos, self._sin, rows)
            else:
                out = stack.logits(self.cache, None, self._embed(torch.tensor(ids)), pos, self._cos, self._sin, rows)
            if out is not None:
                return out
        if isinstance(ids, list):
            ids = torch.tensor(ids, dtype=torch.long, device=self.cache.device)
        # Hidden states stay 2-D [T, hidden]: a [1, T, hidden] input makes every linear
        # reshape on the way in and out, which is measurable at batch 1.
        D = self.head_dim
        h = self._embed(ids.view(T))
        cos, sin = self._rope(pos, T, h)
        cos, sin = cos.view(1, T, D), sin.view(1, T, D)
        # Causal masking: from position 0 SDPA's is_causal is exact; a pass that starts
        # later (next turn, verify pass) needs the offset mask [T, pos+T].
        mask, causal = None, False
        rowwise = 1 < T <= ROWWISE_MAX and pos > 0
        if T > 1 and not rowwise:
            if pos == 0:
                causal = True
            else:
                q_pos = torch.arange(pos, pos + T, device=h.device).view(T, 1)
                mask = torch.arange(pos + T, device=h.device).view(1, pos + T) <= q_pos
        out = None
        if self._stack is not None and self._row_kernel(T) and not torch.compiler.is_compiling():
            out = self._stack(self.cache, h, pos, cos[0], sin[0])
        in_c = out is not None        # every layer ran in layer.c: so does the final norm
        if in_c:
            h = out
        else:
            one = self._one if self._row_kernel(T) and not torch.compiler.is_compiling() else None
            in_c = one is not None
            for i, w in enumerate(self.iter_layers()):
                if one is not None and self._one_fits is None:     # every slot's views share one layout
                    self._one_fits = not layer_kernel.why_not_weights([w], self.cache.dtype)
                if one is not None and self._one_fits and one.layer(self.cache, i, w, h, pos, cos[0], sin[0]):
                    continue
                in_c = False
                h = self._layer(i, w, h, pos, cos, sin, mask, causal, rowwise)
        if not all_logits:
            h = h[-1:]
        # Where the layers ran in C the final norm is layer.c's too, so a streamed target's
        # logits are the resident stack's bit for bit (its tail computes the same norm).
        stack = self._stack if self._stack is not None else self._one
        x = stack.norm(h, self.norm) if in_c else self._rms(h, self.norm)
        return self._output(x).float()

    def _layer(self, i: int, w: LayerWeights, h: torch.Tensor, pos: int, cos, sin, mask, causal: bool,
               rowwise: bool) -> torch.Tensor:
        T = h.shape[0]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        half, inter = D // 2, self.intermediate
        x = self._rms(h, w.ln1)
        qkv = _linear(self, x, w.qkv, w.qkv_bias).view(T, H + 2 * KV, D)
        if w.q_norm is not None:
            qk = torch.cat([self._rms(qkv[:, :H], w.q_norm), self._rms(qkv[:, H:H + KV], w.k_norm)], 1)
            qk = qk.transpose(0, 1)
        else:
            qk = qkv[:, :H + KV].transpose(0, 1)
        # Rotary embedding on q and k at once ([heads, T, D]), as rotate_half does.
        qk = (qk * cos).add_(torch.cat((qk[..., half:], qk[..., :half]), -1).mul_(sin))
        keys, values = self.cache.write(i, pos, qk[H:], qkv[:, H + KV:].transpose(0, 1))
        if rowwise:
            o = self._attend_rowwise(qk[None, :H], keys, values, pos)
        else:
            o = self._attend(qk[None, :H], keys, values, mask, causal)
        h = h + _linear(self, o[0].transpose(0, 1).reshape(T, H * D), w.o, w.o_bias)
        gu = _linear(self, self._rms(h, w.ln2), w.gate_up)
        return h + _linear(self, F.silu(gu[:, :inter], inplace=True).mul_(gu[:, inter:]), w.down)
