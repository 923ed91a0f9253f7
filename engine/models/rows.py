"""Whether a one-token step's matrix products give the bits a verify pass gives its rows.

Speculative decoding keeps a draft only if it is the model's argmax at its position in the
verify pass, so greedy output equals plain decoding's only if each row of a k+1-row pass
is computed as the one-token step computes it. The CPU's dense GEMMs do not promise that.
Measured with torch 2.13 on the development EPYC: in bfloat16 a 1-row product takes
another kernel (a matrix-vector one) than a multi-row product once the input width is
large enough (1152, 1536, 2048 differ; 1024, 1280 do not), while every row of a 2-, 3-,
... 17-row product equals that row computed in a 2-row product; in float32 the kernels
change again past 3 rows. The demo model in bfloat16 changed its n-gram-speculative answer
on all 8 benchmark workloads because of it.

So, per model, a probe at load (random matrices of its real input widths, a few hundred
milliseconds at most) decides: if 1-row products already equal multi-row rows, nothing
changes; if running a one-token step's products as two identical rows makes them equal
to every row of every pass width up to the widest verify pass, one-token steps do that
(measured: a 2-row bf16 product costs what a 1-row one does, 0.90-1.03x); otherwise (float32
MKL here) the rows may differ in their last bits and speculative greedy output rests on
no near-tie, the known limit `describe()` reports.

On a CPU with AVX-512 (bfloat16: with AVX512-BF16) none of that is needed: one-token
steps and verify passes run engine/kernels/row_kernel.py's kernel, which computes every
row as a lone row is computed by construction, and reads the weights faster than torch's
one-row product. The probe is then skipped: a prefill's products (torch's kernels) are
not compared with any other pass's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dispatch, row_kernel
from ..kernels.dispatch import Pass

# Pass widths probed: every verify width up to 17 (max_draft 16), then the wider ones a
# larger --max-draft reaches.
WIDTHS = (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 33, 48, 65)
PROBE_COLUMNS = 1024        # output columns probed per matrix (reduction order depends on the width K)
_cache: dict = {}


@dataclass(frozen=True)
class RowCheck:
    pad: bool                # run one-row products as two rows (with torch's kernels)
    exact: bool              # one-token steps then equal every verify row
    reason: str
    kernel: bool = False     # one-token steps and verify passes run the row kernel


def check(widths_in: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> RowCheck:
    """(in, out) shapes of the dense matrices a forward multiplies by, in `dtype`."""
    key = (tuple(sorted(set(widths_in))), dtype, str(device), torch.get_num_threads())
    if key not in _cache:
        # (no dense matrix at all, every one packed: the passes are the packed kernels' and the
        # C layers', and those compute lone rows too)
        if device.type == "cpu" and row_kernel.available(dtype):
            _cache[key] = RowCheck(False, True, "one-token steps and verify passes run localchat's row kernel, "
                                   "which computes every row as a one-token step does", kernel=True)
        else:
            _cache[key] = _probe(key[0], dtype, device)
    return _cache[key]


def _probe(shapes, dtype, device) -> RowCheck:
    if not shapes or device.type != "cpu":
        # GPUs: not measured here (no device lent); nothing is changed
        return RowCheck(False, False, "not checked on this device")
    g = torch.Generator().manual_seed(0)
    one_ok = pad_ok = True
    for K, N in shapes:
        N = min(N, PROBE_COLUMNS)
        # [out, in] in memory, multiplied through its transposed view: as nn.Linear and the
        # fast forward hold their weights (the kernel may depend on the layout)
        w = (torch.randn(N, K, generator=g) * 0.05).to(dtype).t()
        b = torch.randn(N, generator=g).to(dtype)
        x = torch.randn(max(WIDTHS), K, generator=g).to(dtype)
        # the plain product and the one with a bias (q/k/v biases: addmm), as the forwards call them
        # rows checked in each pass: the first, the last and two between (a kernel's row
        # blocks: a tail block is where a different micro-kernel would show)
        picks = {M: sorted({0, 1, M // 2, M - 1}) for M in WIDTHS}
        need = sorted({r for rs in picks.values() for r in rs})
        for op in (lambda a: torch.mm(a, w), lambda a: torch.addmm(b, a, w)):
            single = {r: op(x[r:r + 1])[0] for r in need}
            doubled = {r: op(torch.cat([x[r:r + 1], x[r:r + 1]]))[0] for r in need}
            for M in WIDTHS:
                out = op(x[:M])
                one_ok = one_ok and all(torch.equal(out[r], single[r]) for r in picks[M])
                pad_ok = pad_ok and all(torch.equal(out[r], doubled[r]) for r in picks[M])
                if not (one_ok or pad_ok):
                    return RowCheck(False, False, f"{str(dtype).removeprefix('torch.')} products of {K} inputs "
                                    "round a verify pass's rows differently from a one-token step on this machine")
    if one_ok:
        return RowCheck(False, True, "one-token steps compute each product as a verify pass's rows do")
    return RowCheck(True, True, "one-token steps run their products as two rows, as a verify pass's rows are "
                                "computed on this machine")


class KernelPasses:
    """A forward's passes as the kernel policy sees them (kernels/dispatch.py): each pass's
    kind (a prompt's prefill, a one-token step, a verify pass), set by `_begin_pass` at its
    start, which every product of the pass is multiplied by; the routes of its dense weights;
    and its RowCheck (`_use_rows`)."""
    _kernel = False                 # one-token steps and verify passes run the row kernel
    _pad = False                    # else torch's one-row products run as two rows
    pass_kind = Pass.PREFILL
    dense: dict = {}                # Pass -> dispatch.Route of the weights in the activation dtype

    def _use_rows(self, check: RowCheck, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self._pad, self._kernel = check, check.pad, check.kernel
        name = str(dtype).removeprefix("torch.")
        self.dense = dispatch.routes(name, device, dtype) if name in dispatch.DENSE else {}

    def _begin_pass(self, T: int, all_logits: bool) -> None:
        self.pass_kind = dispatch.pass_of(T, all_logits)

    def lone_rows(self) -> bool:
        """Whether this pass's rows must each be computed as a lone row (a step or a verify pass)."""
        return self.pass_kind is not Pass.PREFILL

    def _row_kernel(self, T: int) -> bool:
        """Whether a product of T rows in this pass runs lone-row kernels (the row kernel, whole
        layers in C): a step's or a verify pass's, or a prefill's single row (its last, for the
        head)."""
        return self._kernel and (T == 1 or self.pass_kind is not Pass.PREFILL)

    def _mm(self, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w_t (+ bias) for a weight in the activation dtype, by the policy's product for this pass."""
        return dispatch.dense_mm(x, w_t, bias, self.dense[self.pass_kind].pick(x.shape[0]), self._pad)
