"""Compute kernels of our own, in C, compiled on the machine at first use (build.py): where
torch's kernels leave speed on the table for batch-1 decoding, and where the engine needs a
property torch does not promise (bf16.py: every row computed alike)."""
from __future__ import annotations


def status() -> dict[str, str]:
    """Every kernel library this CPU can run, built now if it was not yet: its name -> ''
    when it runs here, else why not (the engine keeps torch's kernels for it then)."""
    from . import gdn_kernel, gemm, gguf_kernel, layer_kernel, q4_kernel, q8_kernel, row_kernel
    out = {f"rows {str(d).removeprefix('torch.')}": row_kernel.why_not(d) for d in row_kernel.FUNCTIONS}
    out |= {f"layers {str(d).removeprefix('torch.')}": layer_kernel.why_not(d) for d in layer_kernel.SUFFIX}
    out["int8"] = q8_kernel.why_not()
    out["int4"] = q4_kernel.why_not()
    out["gated delta-net"] = gdn_kernel.why_not()
    out["prefill float32"] = gemm.why_not()
    out["GGUF blocks"] = gguf_kernel.why_not()
    return out


def instruction_sets() -> dict[str, str]:
    """dtype name -> the instruction set its kernels run in here (row_kernel.choose), for
    the dtypes whose kernels run."""
    from . import row_kernel
    return {str(d).removeprefix("torch."): row_kernel.isa(d) for d in row_kernel.FUNCTIONS if row_kernel.isa(d)}


def note(dtype) -> str:
    """Which build of the kernels a pass in `dtype` runs here, or why none does: one line for
    Engine.describe()."""
    from . import row_kernel
    why = row_kernel.why_not(dtype)
    return f"the {row_kernel.isa(dtype)} build" if not why else f"none ({why}): torch's kernels"


def default_dtype(device, checkpoint_dtype):
    """hardware.default_dtype, but bfloat16 on a CPU without bf16 instructions wherever
    localchat's bf16 kernels run: their AVX2 build widens it in registers (the demo decoded
    1.97x faster than in float32 there, prefilled at 0.92x, in half the memory), and the
    int4 kernel takes bf16 activations only."""
    import torch

    from .. import hardware
    from . import row_kernel
    if (device.type == "cpu" and checkpoint_dtype in (torch.bfloat16, torch.float16)
            and row_kernel.available(torch.bfloat16)):
        return torch.bfloat16
    return hardware.default_dtype(device, checkpoint_dtype)
