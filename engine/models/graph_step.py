"""One-token steps and verify passes in the shape a GPU's CUDA graphs capture (gpt-fast's):
a Llama-family forward's passes of few rows as one compiled function of static shapes.

- Every such pass is `width` rows wide (the engine's widest verify pass, max_draft + 1); a
  one-token step or a shorter verify pass is padded with copies of its last token. The
  padding's keys and values land past the committed length, where the next pass
  overwrites them; at the end of the context, in the cache's slack (width - 1 positions
  never committed), so the last positions run the same graph as every other.
- The positions are a device tensor: the KV cache is written with index_copy_ and read whole
  under a mask, and the rotary tables are indexed on the device, so one graph serves every
  position.
- `torch.compile(mode="reduce-overhead")` compiles it in process and, on a GPU, captures it
  in a CUDA graph. It reads the forward's own weights and cache (marked as static addresses,
  as transformers' StaticCache marks its own): no second copy, no child process. A cache that
  grows (a reallocation) is compiled for once more.

Exact where checked: a one-token step and a verify pass are the same compiled function on
the same shapes, and each row's norms, products and attention over its own prefix read
nothing from the other rows. But a compiled GEMM may still round a row by its place in the
pass (a tail block of rows taking another micro-kernel: on an AVX2-only EPYC, row 8 of 9
did), so row r of a verify pass is a one-token step's row 0 only where the kernels treat
every row alike. Every shape is static, so which kernel and order a row gets is fixed by the
shapes, not the data: before the graph serves a pass at a cache size, it runs once as a
verify pass of `width` distinct tokens and once as each of its rows alone, past the committed
length, and serves only if every row is a step's bits; else the eager forward runs (exact by
localchat's row kernels) and `graph_note` says why. tests/test_graph_step.py checks it on the
CPU, where torch.compile runs the same graph without CUDA graphs.

It runs on CUDA for resident forwards whose weights are plain tensors (the int8/int4 weights
bring their own kernels); `LOCALCHAT_GRAPH_STEP=on` forces it on the CPU (the tests),
`=off` turns it off. Prefill keeps the eager forward: its width varies and it runs once a
turn."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENV = "LOCALCHAT_GRAPH_STEP"


def wanted(device: torch.device) -> bool:
    """Whether a forward on `device` uses the graph step (the module doc)."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode in ("off", "0", "no", "false"):
        return False
    return mode in ("on", "1", "yes", "true") or device.type == "cuda"


def why_not(fwd) -> str:
    """'' where GraphStep can run `fwd` (a LlamaFamilyForward holding its weights)."""
    if not fwd.layers:
        return "the weights are not held by this forward (streamed)"
    if not all(isinstance(t, torch.Tensor) for t in _weights(fwd)):
        return "weights that are not plain tensors (int8/int4 bring their own kernels)"
    return ""


def _weights(fwd) -> list:
    """Every weight a pass reads: the tables, the final norm and each layer's."""
    tables = [getattr(fwd, name, None) for name in ("embed", "norm", "head")]
    return tables + [t for w in fwd.layers for t in vars(w).values() if t is not None]


class GraphStep:
    """A forward's passes of up to `width` rows (one-token steps, verify passes), compiled."""

    def __init__(self, fwd, width: int):
        self.fwd, self.width = fwd, width
        self._marked: tuple | None = None
        cache = fwd.cache
        cache.slack = width - 1
        if cache.capacity >= cache.max_positions:      # its last growth, before any graph is made for it
            cache.grow_to(cache.max_positions + cache.slack)
        for t in _weights(fwd):
            torch._dynamo.mark_static_address(t)
        self._offsets = torch.arange(width, device=fwd.cache.device)
        # dynamo keeps its graphs per code object, and every GraphStep shares _pass's: each
        # forward (a server that loads model after model) and each cache size is one more
        # graph, past the default limit of 8 the passes would fall back to eager operations
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for n in {fwd.layers[0].ln1.shape[0], fwd.head_dim}:
            fwd._scalars(n, fwd.cache.device)          # made now, not while a graph is traced
        self._compiled = torch.compile(self._pass, mode="reduce-overhead", fullgraph=True, dynamic=False)
        self.refused = ""                              # why the graph does not serve (the module doc)
        self._rows_are_steps(cache.length)             # compiled and checked now, at load

    def __call__(self, ids: list[int], pos: int, rows: int) -> torch.Tensor | None:
        """float32 logits [rows, vocab] of the last `rows` of the len(ids) tokens at pos.. (the
        caller reserved their room in the cache); None where the graph does not give every
        row a one-token step's bits here (`refused` says why: the caller runs the eager pass)."""
        f, W = self.fwd, self.width
        cache = f.cache
        if self.refused:
            return None
        cache.grow_to(pos + W)                         # the padding's room too (the caller checked the context)
        f._rope_table(pos + W)
        if self._mark(cache) and not self._rows_are_steps(pos):
            return None
        T = len(ids)
        dev = cache.device
        ids_t = torch.tensor(list(ids) + [ids[-1]] * (W - T), dtype=torch.long, device=dev)
        positions = self._offsets + pos
        logits = self._compiled(ids_t, positions)
        return logits[T - rows:T].clone()              # out of the graph's own output buffer

    def _mark(self, cache) -> bool:
        """The cache's and the rotary tables' tensors as static addresses, again after any of
        them was reallocated (the compiled function then guards on the new ones); whether
        they were new."""
        f = self.fwd
        now = (id(cache), cache.k[0].data_ptr(), f._cos.data_ptr())
        if now == self._marked:
            return False
        for t in cache.k + cache.v + [f._cos, f._sin]:
            torch._dynamo.mark_static_address(t)
        self._marked = now
        return True

    def _rows_are_steps(self, pos: int) -> bool:
        """Run the graph as a verify pass of `width` distinct tokens at `pos` and as each of
        its rows alone (a padded one-token step), past the committed length (nothing is
        committed); whether every row matched. Where one did not, the graph stops serving."""
        f, W = self.fwd, self.width
        cache = f.cache
        room = cache.max_positions + cache.slack
        if pos + 2 * W - 1 > room:
            self.refused = "the cache grew too near the end of the context to check the graph's rows there"
        else:
            cache.grow_to(pos + 2 * W - 1)
            f._rope_table(pos + 2 * W - 1)
            self._mark(cache)
            vocab = f.embed.shape[0]
            ids = torch.tensor([(7 + 31 * r) % vocab for r in range(W)], dtype=torch.long, device=cache.device)
            verify = self._compiled(ids, self._offsets + pos).clone()
            for r in range(W):
                step = self._compiled(ids[r].repeat(W), self._offsets + pos + r)
                if not torch.equal(step[0], verify[r]):
                    self.refused = (f"its compiled products give row {r} of a {W}-row pass other bits than a "
                                    "one-token step on this machine")
                    break
        if self.refused:
            f.graph_note = f"the eager forward: {self.refused}"
        return not self.refused

    def _pass(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        f = self.fwd
        W = ids.shape[0]
        H, KV, D = f.heads, f.kv_heads, f.head_dim
        half, inter = D // 2, f.intermediate
        cache = f.cache
        h = F.embedding(ids, f.embed)
        cos, sin = f._cos[positions].unsqueeze(0), f._sin[positions].unsqueeze(0)        # [1, W, D]
        # row r sees the cache up to its own position: the same mask row whatever the pass
        mask = (torch.arange(cache.k[0].shape[2], device=ids.device)[None, :] <= positions[:, None])[None, None]
        for i, w in enumerate(f.layers):
            x = f._rms(h, w.ln1)
            qkv = (x @ w.qkv if w.qkv_bias is None else torch.addmm(w.qkv_bias, x, w.qkv)).view(W, H + 2 * KV, D)
            if w.q_norm is not None:
                qk = torch.cat([f._rms(qkv[:, :H], w.q_norm), f._rms(qkv[:, H:H + KV], w.k_norm)], 1).transpose(0, 1)
            else:
                qk = qkv[:, :H + KV].transpose(0, 1)
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), -1) * sin
            kc, vc = cache.k[i], cache.v[i]
            kc.index_copy_(2, positions, qk[None, H:])
            vc.index_copy_(2, positions, qkv[:, H + KV:].transpose(0, 1)[None])
            o = F.scaled_dot_product_attention(qk[None, :H], kc, vc, attn_mask=mask, scale=f.scaling,
                                               enable_gqa=f.gqa)
            o = o[0].transpose(0, 1).reshape(W, H * D)
            h = h + (o @ w.o if w.o_bias is None else torch.addmm(w.o_bias, o, w.o))
            gu = f._rms(h, w.ln2) @ w.gate_up
            h = h + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w.down
        return (f._rms(h, f.norm) @ f.head).float()
