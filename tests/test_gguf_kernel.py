"""The GGUF block kernels (engine/kernels/gguf.c): every format's blocks decode to exactly
the weights gguf-py reads from the same bytes; products equal those weights times the input
rounded to 16 bits per 32 values, within float32 summation's bound; and every row of a pass is a lone row, bit for bit, at
any width a verify pass has and on 1 or 2 threads. Random valid blocks: random codes and
scale bytes, finite half-float scales."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import hardware
from engine.kernels import gguf_kernel, row_kernel

pytestmark = pytest.mark.skipif(not gguf_kernel.available(), reason=f"no GGUF kernel here: {gguf_kernel.why_not()}")
FORMATS = list(gguf_kernel.TYPES)


def _file_weights(w: torch.Tensor, name: str, K: int) -> torch.Tensor:
    """gguf-py's reading of the bytes: the reference weights."""
    got = quants.dequantize(w.numpy(), GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(got)).view(w.shape[0], K)


@pytest.mark.parametrize("name", FORMATS)
def test_blocks_decode_to_the_files_own_weights(name):
    g = torch.Generator().manual_seed(gguf_kernel.TYPES[name])
    bs, _ = gguf_kernel.block(name)
    for N, K in ((1, bs), (5, 3 * bs), (33, 4 * 256)):
        w = gguf_kernel.random_blocks(name, N, K, g)
        assert torch.equal(gguf_kernel.dequantize(w, name, K), _file_weights(w, name, K)), (N, K)
    out = torch.full((5, 2 * bs + 3), -1.0)                # into a strided view: only its columns
    gguf_kernel.dequantize(gguf_kernel.random_blocks(name, 5, 2 * bs, g), name, 2 * bs, out[:, :2 * bs])
    assert (out[:, 2 * bs:] == -1).all()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_products_are_the_weights_times_x_and_every_row_a_lone_row(name, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(100 + gguf_kernel.TYPES[name])
        N, K = 37, 3 * 256
        w = gguf_kernel.random_blocks(name, N, K, g)
        ref = _file_weights(w, name, K).double()
        x = torch.randn(65, K, generator=g) * torch.rand(65, K // 32, 1, generator=g).expand(65, K // 32, 32).reshape(65, K)
        x[3, 64:96] = 0                                                   # an all-zero chunk
        x[4, 256:512] = 0                                                 # an all-zero block of 256
        lone = torch.cat([gguf_kernel.linear(x[m:m + 1], w, name, K) for m in range(65)])
        xr = gguf_kernel.rounded_activations(x, name)
        want = xr @ ref.t()
        bound = 2 * K * 2.0 ** -24 * (xr.abs() @ ref.abs().t())          # float32 sums of K products
        assert ((lone.double() - want).abs() <= bound).all()
        # x rounded to 16 bits is within about half a step, 1/65534 of its block's largest value
        bs = gguf_kernel.block(name)[0]
        largest = x.abs().view(65, -1, bs).amax(-1, keepdim=True).expand(65, K // bs, bs).reshape(65, K)
        assert ((xr - x.double()).abs() <= largest.double() / 65534 * 1.01).all()
        for M in (2, 3, 5, 9, 17, 33, 65):                             # verify widths: each row a lone row
            assert torch.equal(gguf_kernel.linear(x[:M], w, name, K), lone[:M]), M
        assert torch.equal(gguf_kernel.linear(x[:4].bfloat16(), w, name, K),
                           gguf_kernel.linear(x[:4].bfloat16().float(), w, name, K))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", FORMATS)
def test_a_prefills_gemm_is_the_decoded_weights_times_x(name):
    # the GEMM over rows decoded a few at a time: the file's weights exactly, x in float32;
    # row counts past one packing of rows (128 on AVX2, 384 on AVX-512), weight rows past
    # a whole number of column blocks
    g = torch.Generator().manual_seed(200 + gguf_kernel.TYPES[name])
    for M, N, K in ((9, 13, 256), (130, 37, 512), (400, 7, 256)):
        w = gguf_kernel.random_blocks(name, N, K, g)
        ref = _file_weights(w, name, K).double()
        x = torch.randn(M, K, generator=g)
        got = gguf_kernel.gemm(x, w, name, K).double()
        bound = K * 2.0 ** -24 * (x.double().abs() @ ref.abs().t())        # float32 sums of K products
        assert ((got - x.double() @ ref.t()).abs() <= bound).all(), (M, N, K)
        assert torch.equal(gguf_kernel.gemm(x[:5], w, name, K), got[:5].float())   # rows apart from their neighbours


def test_a_non_finite_input_reaches_the_outputs():
    w = gguf_kernel.random_blocks("Q4_K", 3, 512, torch.Generator().manual_seed(1))
    x = torch.randn(2, 512)
    x[1, 300] = float("nan")
    y = gguf_kernel.linear(x, w, "Q4_K", 512)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    x[1, 300] = float("inf")
    assert not torch.isfinite(gguf_kernel.linear(x, w, "Q4_K", 512)[1]).any()


def test_a_row_of_part_of_a_block_is_refused():
    w = gguf_kernel.random_blocks("Q4_K", 2, 256, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="256-weight blocks"):
        gguf_kernel.linear(torch.randn(1, 200), w[:, :100], "Q4_K", 200)
    with pytest.raises(ValueError, match="do not fit"):
        gguf_kernel.linear(torch.randn(1, 512), w, "Q4_K", 512)


@pytest.mark.skipif("avx512_vnni" not in hardware.cpu_flags() or row_kernel.choose(torch.float32)[0] != "avx512",
                    reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS", "Q2_K"])
def test_a_build_with_or_without_vnni_gives_the_same_bits(name):
    # VNNI fuses the 16-bit multiply-add and the 32-bit sum; the sums are exact integers either way
    import ctypes

    from engine.kernels import build
    g = torch.Generator().manual_seed(7)
    N, K = 19, 2 * 256
    w = gguf_kernel.random_blocks(name, N, K, g)
    x = torch.randn(5, K, generator=g)
    flags = row_kernel.choose(torch.float32)[1] + ["-ffp-contract=off"]
    outs = []
    for f in (flags, [f for f in flags if f != "-mavx512vnni"]):
        fn = build.library(gguf_kernel.SOURCE, f).gguf_linear_f32
        fn.restype = ctypes.c_int
        P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [I, P, I64, P, I64, P, I64, I, I, I, I]
        y = torch.empty(5, N)
        assert fn(gguf_kernel.TYPES[name], x.data_ptr(), K, w.data_ptr(), w.stride(0), y.data_ptr(), N, 5, N, K, 2) == 0
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
