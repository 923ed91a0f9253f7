"""gemm.c, a prefill's float32 products: right against float64 over every tail of its tiles
and blocks, each row's result independent of the rows beside it and of the thread count,
and a model prefilled through it decodes as transformers' generate() does."""
import pytest
import torch

import engine
from engine.kernels import gemm
from engine.session import render_prompt
from tiny import build_model

pytestmark = pytest.mark.skipif(gemm.why_not() != "", reason=f"gemm.c does not run here: {gemm.why_not()}")


@pytest.fixture
def gemm_on(monkeypatch):
    """gemm.c for every float32 prefill, on any CPU it builds for (on Intel torch's MKL
    runs them unless told)."""
    monkeypatch.setenv("LOCALCHAT_GEMM_KERNEL", "on")
    gemm.own_f32.cache_clear()
    yield
    gemm.own_f32.cache_clear()


def _operands(M, N, K, seed, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + stride_pad, generator=g)[:, :K]        # a row stride past K
    w = torch.randn(N, K + stride_pad, generator=g)[:, :K]
    return x, w, torch.randn(N, generator=g)


# rows: one, short of a vector, one tile (48 on AVX-512, 16 on AVX2) and either side of it,
# more than a block of tiles (384 / 96 rows); columns: short of a tile of 8 (6) and past it;
# K: one, around a vector, past a chunk of 256 steps
@pytest.mark.parametrize("M", [1, 5, 16, 47, 48, 49, 100, 400])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 17), (9, 300), (100, 513)])
def test_gemm_kernel_products_against_float64(M, N, K):
    x, w, b = _operands(M, N, K, seed=M * 1000 + N + K, stride_pad=3)
    for bias in (None, b):
        got = gemm.f32(x, w.t(), bias).double()
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        # K products summed in float32, in order: each sum's rounding error is at most
        # about K * 2^-24 times the sum of |x||w| (plus the bias's last rounding).
        bound = (K + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t() + (0 if bias is None else b.abs()))
        assert ((got - want).abs() <= bound + 1e-30).all()


def test_gemm_kernel_rows_do_not_depend_on_their_neighbours_or_the_threads():
    """Each output is one float32 sum over K in order, from zero, whatever tile, block or
    thread computes it: a row alone, the same row among 400, at 1 and 2 threads."""
    x, w, b = _operands(400, 37, 520, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        many = gemm.f32(x, w.t(), b)
        torch.set_num_threads(1)
        one_thread = gemm.f32(x, w.t(), b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one_thread)
    for i in (0, 47, 48, 383, 384, 399):
        assert torch.equal(gemm.f32(x[i:i + 1], w.t(), b), many[i:i + 1])


def test_a_float32_prefill_runs_the_gemm_kernel_as_described(gemm_on, tiny_llama):
    eng = engine.open(str(tiny_llama), dtype="float32")
    assert "gemm.c" in eng.describe()["products"]["float32"]["prefill"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_greedy_through_the_gemm_kernel_equals_generate(gemm_on, kind, tmp_path, tokenizer):
    """The Llama-family forward's prefill (llama_family) and a hybrid's (transformers'
    modules, hf_forward) through gemm.c: generate()'s tokens."""
    from transformers import AutoModelForCausalLM
    path = build_model(tmp_path / kind, kind, layers=4 if kind == "qwen3_5" else 2, tokenizer=tokenizer, seed=5)
    eng = engine.open(str(path), dtype="float32", drafter="none")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in ["Why is the sky blue? " * 4, "def fib(n):"]:
        chat = eng.chat()
        done = list(chat.send(prompt, max_new_tokens=24))[-1]
        ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}])])
        with torch.inference_mode():
            want = ref.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert list(done.token_ids) == want
