"""torch's own packed int8 and int4 kernels (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm[_for_cpu]`): whether this torch build runs them on a device, and
the int4 layout they read. Where localchat's kernels do not run (a CPU without the
instruction sets they build for, a GPU), the kernel policy (dispatch.py) takes these."""
from __future__ import annotations

import torch

_RUNS: dict[tuple, bool] = {}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> the device kernel's packed layout."""
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # The CUDA converter takes [N, K/2] uint8 with the even k in the high nibble (as torchao
    # feeds it) and tiles K by inner_k_tiles * 16: take the largest tiling that divides K.
    K = codes.shape[1]
    tiles = next(t for t in (8, 4, 2) if K % (t * 16) == 0)
    u8 = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(u8, tiles)


def runs(device: torch.device, dtype: torch.dtype, fmt: str) -> bool:
    """Whether this torch build has the kernel of `fmt` (int8, int4) for this device and
    activation dtype: tried once on a small random weight and compared with its definition
    (a kernel that runs but answers otherwise would be worse than none)."""
    key = (device.type, dtype, fmt)
    if key not in _RUNS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 256, generator=g).to(dtype)
        try:
            if fmt == "int8":
                q = torch.randint(-128, 128, (64, 256), generator=g, dtype=torch.int8)
                scale = (torch.rand(64, generator=g) * 0.01 + 0.001).to(dtype)
                y = torch.ops.aten._weight_int8pack_mm(x.to(device), q.to(device), scale.to(device))
                w = q.float() * scale.float()[:, None]
            else:
                codes = torch.randint(0, 16, (64, 256), generator=g, dtype=torch.uint8)
                scale = (torch.rand(64, 8, generator=g) * 0.01 + 0.001).to(dtype)
                zero = (torch.randn(64, 8, generator=g) * 0.01).to(dtype)
                sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(device)
                op = (torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu"
                      else torch.ops.aten._weight_int4pack_mm)
                y = op(x.to(device), pack_int4(codes.to(device)), 32, sz)
                w = ((codes.float().view(64, 8, 32) - 8) * scale.float()[..., None]
                     + zero.float()[..., None]).view(64, 256)
            want = x.float() @ w.t()
            _RUNS[key] = bool(torch.allclose(y.float().cpu(), want, rtol=0.02, atol=0.02 * want.abs().max().item()))
        except (RuntimeError, NotImplementedError):
            _RUNS[key] = False
    return _RUNS[key]
