"""A resident Llama-family model's decoder layers in one call of C (layer.c) for one-token
steps and verify passes: the rows engine/kernels/row_kernel.py computes the products of,
with everything between the products done in the same call.

Why: on a small model a one-token step is mostly the dispatch of some 25 torch operations a
layer (norms, rotary, the cache writes, attention, SiLU, residuals), not their arithmetic;
the demo model (30 layers) spent more time there than reading its weights. One call per
pass removes it. Every row of a pass is computed as a lone row is (layer.c says how), so a
verify pass's rows are one-token steps bit for bit, as with the row kernel alone.

Where the forward's embedding table and output head are in forms layer.c reads (dense in the
dtype; a quantized profile's int8 table and head; an int4 head), the whole pass is that one
call: ids in, float32 logits out (LayerStack.logits). After the layers have streamed the
weights through the caches, each torch operation of a step starts cold: on the 2-core Xeon
the final RMSNorm, the embedding lookup and argmax took 100-300 us each after a pass and
10-30 again. The pass in one call, with the greedy argmax in C too (argmax()), decoded the
demo model 3-4% faster in float32 and bf16, 6-7% in int8 and int4 (medians of 8 interleaved
rounds each).

It runs where the row kernel for the dtype runs (the same compiler flags and CPU needs) and
the model is plain: weights resident, dense in the dtype, per-channel int8 (q8.c), (bf16)
int4 in the form engine/kernels/q4.c reads, or (float32) a GGUF file's blocks (gguf.c); head
size at most 512. Elsewhere,
and while torch.compile traces a graph, the forward runs its torch operations.
`LOCALCHAT_KERNELS=off` turns it off with the row kernel; `LOCALCHAT_LAYER_KERNEL=off`
alone, for comparisons."""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import build, row_kernel

SOURCE = "layer"
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_HEAD_DIM = 512           # layer.c's per-head buffers

VECTORS = ("ln1", "qkv_bias", "o_bias", "ln2", "q_norm", "k_norm")
MATRICES = ("qkv", "o", "gate_up", "down")


class _Mat(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("group", ctypes.c_int64)]


GG_MAT = -2                  # layer.c's Mat.group of a GGUF file's blocks
GG_PARTS = 8


class _GGPart(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("w", ctypes.c_void_p)]


class _GGMat(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int64), ("part", _GGPart * GG_PARTS)]


class _Weights(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in VECTORS] + [(name, _Mat) for name in MATRICES]
                + [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)])


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("inter", ctypes.c_int), ("capacity", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_libs: dict[torch.dtype, ctypes.CDLL] = {}
_state: dict[torch.dtype, str] = {}


def _off() -> bool:
    return os.environ.get("LOCALCHAT_LAYER_KERNEL", "").lower() in ("off", "0", "no", "false")


def why_not(dtype: torch.dtype) -> str:
    """'' when the layer kernel for `dtype` runs here, else why it does not."""
    if dtype not in _state:
        _state[dtype] = _load(dtype)
    return _state[dtype]


def _load(dtype: torch.dtype) -> str:
    if _off():
        return "turned off (LOCALCHAT_LAYER_KERNEL=off)"
    if dtype not in SUFFIX:
        return f"no layer kernel for {dtype}"
    why = row_kernel.why_not(dtype)          # its products, flags and CPU needs are the row kernel's
    if why:
        return why
    flags = row_kernel.choose(dtype)[1]
    lib = build.library(SOURCE, flags)
    if lib is None:
        return build.why(SOURCE, flags)
    sfx = SUFFIX[dtype]
    fn = getattr(lib, f"layers_{sfx}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    size = getattr(lib, f"layer_scratch_bytes_{sfx}")
    size.restype = ctypes.c_int64
    size.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    P, I = ctypes.c_void_p, ctypes.c_int
    norm = getattr(lib, f"rms_rows_{sfx}")
    norm.restype, norm.argtypes = None, [P, P, P, I, I, ctypes.c_float]
    whole = getattr(lib, f"pass_{sfx}")
    whole.restype = None
    whole.argtypes = [P, I, P, P, P, P, I, I, P, P, P, I, P, P, I, I, P, P]
    size = getattr(lib, f"tail_scratch_bytes_{sfx}")
    size.restype, size.argtypes = ctypes.c_int64, [I, I, I]
    lib.argmax_f32.restype, lib.argmax_f32.argtypes = ctypes.c_int64, [P, ctypes.c_int64]
    _libs[dtype] = lib
    return ""


def why_not_for(fwd, dtype: torch.dtype, layers=None) -> str:
    """'' when `fwd`'s layers (llama_family.LayerWeights; `layers` if given) can run the
    layer kernel."""
    why = why_not(dtype)
    if why:
        return why
    if fwd.cache.dtype != dtype or fwd.cache.device.type != "cpu":
        return "the cache is not on the CPU in the weights' dtype"
    if fwd.head_dim > MAX_HEAD_DIM or fwd.head_dim % 2 or fwd.heads % fwd.kv_heads:
        return f"head size {fwd.head_dim} with {fwd.heads}/{fwd.kv_heads} heads"
    return why_not_weights(fwd.layers if layers is None else layers, dtype)


def why_not_weights(layers, dtype: torch.dtype) -> str:
    """'' when these layers' weights are held as layer.c reads them."""
    for w in layers:
        for name, t in vars(w).items():
            if t is None:
                continue
            if name in MATRICES and getattr(t, "canonical", False):
                if dtype != torch.bfloat16:
                    return "int4 weights with float32 activations"
                continue                             # int4 in the form q4.c reads (qweights.Int4Weight)
            if name in MATRICES and getattr(t, "gguf_blocks", False):
                if dtype != torch.float32:
                    return "GGUF blocks with activations other than float32"
                if len(t.parts) > GG_PARTS:
                    return f"{name} stacks more than {GG_PARTS} GGUF tensors"
                continue                             # a GGUF file's blocks (gguf_file.GGUFWeight)
            if name in MATRICES and getattr(t, "own_kernel", False):
                if t.scale.dtype != dtype:
                    return f"int8 scales in {t.scale.dtype} in a {dtype} layer"
                continue                             # int8 that q8.c reads (qweights.Int8Weight)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_cpu:
                return f"{name} weights are not plain {str(dtype).removeprefix('torch.')} tensors"
            base = t.t() if t.dim() == 2 else t      # matrices are held as transposed views
            if not base.is_contiguous():
                return f"{name} weights are not contiguous"
    return ""


def argmax(x: torch.Tensor) -> int | None:
    """torch.argmax(x) of a contiguous float32 CPU tensor through layer.c (None where no
    layer kernel is loaded): a greedy step's token without a torch operation."""
    for lib in _libs.values():
        return lib.argmax_f32(x.data_ptr(), x.numel())
    return None


def _table_fits(t, dtype: torch.dtype, hidden: int) -> bool:
    """Whether layer.c's pass reads this embedding table: dense [vocab, hidden] in the dtype,
    or per-channel int8 with scales in it (qweights.Int8Weight)."""
    if isinstance(t, torch.Tensor):
        return t.dtype == dtype and t.is_cpu and t.dim() == 2 and t.shape[1] == hidden and t.is_contiguous()
    return (getattr(t, "own_kernel", False) and t.scale.dtype == dtype and t.q.is_contiguous()
            and t.shape[1] == hidden)


def _head_fits(head, norm, dtype: torch.dtype) -> bool:
    """Whether layer.c's tail reads this output head and final norm: the norm a plain tensor
    in the dtype; the head a transposed [vocab, hidden] matrix in it, per-channel int8 with
    scales in it, or (bf16) int4 in q4.c's form."""
    if not (isinstance(norm, torch.Tensor) and norm.dtype == dtype and norm.is_cpu and norm.is_contiguous()):
        return False
    if isinstance(head, torch.Tensor):
        return head.dtype == dtype and head.is_cpu and head.dim() == 2 and head.t().is_contiguous()
    if getattr(head, "own_kernel", False):
        return head.scale.dtype == dtype
    if getattr(head, "gguf_blocks", False):
        return dtype == torch.float32 and len(head.parts) <= GG_PARTS
    return getattr(head, "canonical", False) and dtype == torch.bfloat16


def _mat(t) -> _Mat:
    if isinstance(t, torch.Tensor):
        return _Mat(t.data_ptr(), None, None, 0)
    if getattr(t, "gguf_blocks", False):
        # The description lives as long as the weight (the pointer in _Mat is to it).
        gg = getattr(t, "_layer_c", None)
        if gg is None:
            gg = t._layer_c = _GGMat(len(t.parts))
            for part, (type_id, rows, row_bytes, ptr) in zip(gg.part, t.c_parts()):
                part.type, part.rows, part.row_bytes, part.w = type_id, rows, row_bytes, ptr
        return _Mat(ctypes.addressof(gg), None, None, GG_MAT)
    if getattr(t, "own_kernel", False):
        return _Mat(t.q.data_ptr(), t.scale.data_ptr(), None, -1)
    return _Mat(t.q.data_ptr(), t.scale.data_ptr(), t.zero.data_ptr(), t.group)


def _describe(d: _Weights, w, kc: torch.Tensor, vc: torch.Tensor) -> None:
    for name in VECTORS:
        t = getattr(w, name)
        setattr(d, name, t.data_ptr() if t is not None else None)
    for name in MATRICES:
        setattr(d, name, _mat(getattr(w, name)))
    d.k_cache, d.v_cache = kc.data_ptr(), vc.data_ptr()


class LayerStack:
    """The C descriptions of a forward's layers, over whichever KV cache the forward holds
    when it is called. The descriptions and the scratch memory are kept per thread (engines
    on two threads, as in `serve` beside a benchmark, never share them) and rebuilt when the
    cache changes (a reallocation, another cache)."""

    def __init__(self, fwd, dtype: torch.dtype, hidden: int | None = None):
        self.layers, self.dtype = fwd.layers, dtype
        lib = _libs[dtype]
        sfx = SUFFIX[dtype]
        self._run = getattr(lib, f"layers_{sfx}")
        self._size = getattr(lib, f"layer_scratch_bytes_{sfx}")
        hidden = hidden or fwd.layers[0].ln1.shape[0]
        self._shape = (hidden, fwd.heads, fwd.kv_heads, fwd.head_dim, fwd.intermediate, fwd.eps, fwd.scaling)
        self._mine = threading.local()
        self._norm_rows = getattr(lib, f"rms_rows_{sfx}")
        self._whole = getattr(lib, f"pass_{sfx}")
        self._tail_size = getattr(lib, f"tail_scratch_bytes_{sfx}")
        # A resident forward's output head and embedding table, where a whole pass can run in
        # one call (logits()); a streamed forward brings its own, a layer at a time.
        self._head = self.embed = None
        self.vocab = 0
        head = getattr(fwd, "head", None)
        if head is not None and _head_fits(head, fwd.norm, dtype):
            self._head = (_mat(head if not isinstance(head, torch.Tensor) else head.t()), fwd.norm,
                          head.shape[1] if isinstance(head, torch.Tensor) else head.shape[0])
        embed = getattr(fwd, "embed", None)
        if _table_fits(embed, dtype, hidden):
            self.embed, self.vocab = _mat(embed), embed.shape[0]

    def _state(self, cache):
        """This thread's (descriptions, shape, scratch) for `cache`, None where its tensors
        are not one contiguous [1, kv_heads, capacity, head_dim] block per layer."""
        me = self._mine
        k0 = cache.k[0]
        key = (id(cache), k0.data_ptr(), k0.shape[2], cache.v[0].data_ptr())
        if getattr(me, "key", None) == key:
            return me.descs, me.shape
        shape = tuple(k0.shape)
        if len(cache.k) != len(self.layers) or any(t.shape != shape or not t.is_contiguous() or t.dtype != self.dtype
                                                   for t in cache.k + cache.v):
            return None
        descs = (_Weights * len(self.layers))()
        for d, w, kc, vc in zip(descs, self.layers, cache.k, cache.v):
            _describe(d, w, kc, vc)
        hidden, heads, kv, hd, inter, eps, scale = self._shape
        me.descs, me.shape, me.key = descs, _Shape(hidden, heads, kv, hd, inter, shape[2], eps, scale), key
        return me.descs, me.shape

    def __call__(self, cache, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """All layers over h [T, hidden] (in place) at positions pos..pos+T-1 of `cache`;
        cos/sin [T, D]. None (h untouched) where the cache is not laid out as the kernel reads it."""
        state = self._state(cache)
        if state is None:
            return None
        return self._pass(*state, h, pos, cos, sin)

    def layer(self, cache, i: int, w, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Layer i alone, with the weights `w` (llama_family.LayerWeights: a streamed slot's
        views), over h in place, as the whole stack runs it: the same call, the same bits.
        False (h untouched) where the cache is not laid out as the kernel reads it."""
        kc, vc = cache.k[i], cache.v[i]
        if not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == vc.dtype == self.dtype):
            return False
        d = _Weights()
        _describe(d, w, kc, vc)
        hidden, heads, kv, hd, inter, eps, scale = self._shape
        self._pass((_Weights * 1)(d), _Shape(hidden, heads, kv, hd, inter, kc.shape[2], eps, scale), h, pos, cos, sin)
        return True

    def _pass(self, descs, shape, h: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        threads = torch.get_num_threads()
        need = self._size(ctypes.addressof(shape), T, pos + T, threads)
        scratch = getattr(self._mine, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._mine.scratch = torch.empty(max(need, 2 * (0 if scratch is None else scratch.numel())),
                                                       dtype=torch.uint8)
        self._run(ctypes.addressof(descs), len(descs), ctypes.addressof(shape), h.data_ptr(),
                  T, pos, cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(), threads)
        return h

    def norm(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of h [T, hidden] with w, as the tail computes it."""
        out = torch.empty_like(h)
        self._norm_rows(h.data_ptr(), w.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], self._shape[5])
        return out

    @property
    def has_head(self) -> bool:
        return self._head is not None

    def logits(self, cache, ids: list[int] | None, h: torch.Tensor | None, pos: int, cos: torch.Tensor,
               sin: torch.Tensor, rows: int) -> torch.Tensor | None:
        """float32 logits [rows, vocab] for the last `rows` rows of a whole pass in one call:
        the embedding table's rows at `ids` (checked to be in range; or the hidden rows h
        [T, hidden], for a table this file does not read), every layer at positions pos..,
        the final norm and the head (has_head must be true); cos/sin: the rotary tables from
        position 0, covering the pass. None where the cache is not laid out as the kernel
        reads it."""
        state = self._state(cache)
        if state is None:
            return None
        descs, shape = state
        mat, norm, vocab = self._head
        T = len(ids) if ids is not None else h.shape[0]
        hidden = self._shape[0]
        threads = torch.get_num_threads()
        me = self._mine
        # sized for a context as long as the cache holds, so a step asks C once per shape
        key = (T, rows, shape.capacity, threads)
        sizes = me.__dict__.setdefault("sizes", {})
        if key not in sizes:
            sizes[key] = (self._size(ctypes.addressof(shape), T, shape.capacity, threads),
                          self._tail_size(rows, hidden, vocab))
        need, tail_need = sizes[key]
        scratch = getattr(me, "scratch", None)
        if scratch is None or scratch.numel() < need + tail_need:
            scratch = me.scratch = torch.empty(2 * (need + tail_need), dtype=torch.uint8)
        if ids is not None:
            rows_h = getattr(me, "h", None)
            if rows_h is None or rows_h.numel() < T * hidden:
                rows_h = me.h = torch.empty(max(T, 16) * hidden, dtype=self.dtype)
            h_ptr = rows_h.data_ptr()
            id_arr = (ctypes.c_int64 * T)(*ids)
        else:
            h_ptr, id_arr = h.data_ptr(), None
        out = torch.empty(rows, vocab, dtype=torch.float32)
        base = scratch.data_ptr()
        tail_at = base + need + (-(base + need)) % 64
        self._whole(ctypes.addressof(descs), len(descs), ctypes.addressof(shape), id_arr,
                    ctypes.addressof(self.embed) if ids is not None else None, h_ptr, T, pos, cos.data_ptr(),
                    sin.data_ptr(), base, threads, norm.data_ptr(), ctypes.addressof(mat), vocab, rows,
                    out.data_ptr(), tail_at)
        return out
