"""Does a one-token step give the same bits on fewer threads? Checked on this machine.

The streamed target would like to compute its one-token steps on fewer threads than the
resident target, so that the prefetch readers keep a core of their own (targets/streamed.py).
That is only allowed if the logits stay the resident target's bit for bit, and whether they
do is a property of the CPU and of torch's kernels, not of our code. Measured with torch
2.13 on a 2-core AMD EPYC: every matrix product, norm and elementwise op of a one-token
step gives the same bits on 1 and 2 threads, but `F.scaled_dot_product_attention` over one
query row does not once the cache holds 8 or more positions (its CPU kernel splits the
keys among the threads and adds the partial sums in a thread-dependent order; up to 4e-8
per element, 2.4e-6 in the logits after a few layers). The math backend and multi-row
passes are unaffected.

So nothing is assumed: before the split is used, the one-token layer computation is run
both ways on scratch buffers, on the real shapes, and attention at every cache length up
to 64 and around every power of two up to the context, and the split is used only if every
result is identical. The check runs once per target, takes milliseconds, and says why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Attention is checked at every cache length up to this, then around each power of two.
DENSE_LENGTHS = 64
# Scratch keys/values are allocated for at most this many positions; a pass that attends
# over more than the checked lengths runs on every thread (SplitCheck.upto).
MAX_CHECKED = 1 << 15


@dataclass(frozen=True)
class SplitCheck:
    """The outcome: `threads` to compute one-token steps on (None: torch's setting, the
    resident target's) while the cache holds at most `upto` positions, `full` the count it
    was checked against, and a sentence saying why."""
    threads: int | None
    reason: str
    full: int = 0
    upto: int = 0

    @property
    def short(self) -> str:
        """The choice in a few words, for a stats line."""
        if self.threads is None:
            return f"steps on all {self.full} threads (fewer change the bits here)"
        return f"steps on {self.threads} of {self.full} threads (checked bit-identical)"


def lengths(context: int) -> list[int]:
    """Cache lengths to check attention at: dense where kernels switch block sizes, then
    each power of two and its neighbours up to the context."""
    top = min(context, MAX_CHECKED)
    out = set(range(1, min(DENSE_LENGTHS, top) + 1))
    p = DENSE_LENGTHS
    while p <= top:
        out.update(n for n in (p - 1, p, p + 1) if n <= top)
        p *= 2
    out.add(top)
    return sorted(out)


def same_bits(fn: Callable[[], torch.Tensor], few: int, full: int) -> tuple[bool, float]:
    """Run `fn` on `few` and on `full` threads: (identical, largest difference)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(full)
        a = fn()
        torch.set_num_threads(few)
        b = fn()
    finally:
        torch.set_num_threads(before)
    if torch.equal(a, b):
        return True, 0.0
    return False, (a.float() - b.float()).abs().max().item()


def check_split(attend: Callable, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, context: int, few: int, full: int,
                fixed_ops: Callable[[], torch.Tensor] | None = None, seed: int = 0) -> SplitCheck:
    """Whether one-token steps may run on `few` threads instead of `full`.

    attend(q, keys, values): the forward's attention call for one query row;
    fixed_ops(): the rest of a one-token layer step and the head on the real weight layout
    (their shapes do not change with the position, so one run each way covers them)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    top = min(context, MAX_CHECKED)
    keys = torch.randn(1, kv_heads, top, head_dim, generator=g).to(device=device, dtype=dtype)
    values = torch.randn(1, kv_heads, top, head_dim, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(1, heads, 1, head_dim, generator=g).to(device=device, dtype=dtype)
    with torch.inference_mode():
        for n in lengths(context):
            ok, diff = same_bits(lambda: attend(q, keys[:, :, :n], values[:, :, :n]), few, full)
            if not ok:
                return SplitCheck(None, f"one-token steps on all {full} threads: attention over {n} cached "
                                        f"positions gives other bits on {few} thread{'s' * (few > 1)} on this "
                                        f"machine (max difference {diff:.1e}), and the logits must be the "
                                        f"resident target's", full)
        if fixed_ops is not None:
            ok, diff = same_bits(fixed_ops, few, full)
            if not ok:
                return SplitCheck(None, f"one-token steps on all {full} threads: a layer's matrix products give "
                                        f"other bits on {few} thread{'s' * (few > 1)} on this machine "
                                        f"(max difference {diff:.1e})", full)
    beyond = "" if context <= top else f"; past {top} cached positions on all {full}"
    return SplitCheck(few, f"one-token steps on {few} of {full} threads, the readers on the rest: checked "
                           f"bit-identical to {full} threads on this machine{beyond}", full, top)


def for_streaming(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, context: int,
                  readers: int = 2) -> SplitCheck | None:
    """What a streamed target on this CPU would decide from attention alone (what
    `localchat doctor` can say before loading weights); None with a single thread."""
    import torch.nn.functional as F
    full = torch.get_num_threads()
    if full < 2:
        return None

    def attend(q, keys, values):
        return F.scaled_dot_product_attention(q, keys, values, scale=head_dim ** -0.5, enable_gqa=heads != kv_heads)
    return check_split(attend, heads, kv_heads, head_dim, dtype, torch.device("cpu"), context,
                       max(1, full - readers), full)
