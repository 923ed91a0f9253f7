"""The kernel policy (engine/kernels/dispatch.py): one table picks every product by weight
format and pass kind; whatever it picks, a step's and a verify pass's rows are lone rows
(what keeps speculation exact), and the engine reports the policy it runs."""
import pytest
import torch

import engine
from engine.gguf_file import GGUFWeight
from engine.kernels import dispatch, gguf_kernel, row_kernel
from engine.kernels.dispatch import Pass
from engine.targets import qweights

CPU = torch.device("cpu")
LONE = {"rows", "torch", "q8", "q4", "aten", "blocks"}      # matrix-vector products: rows share nothing


def test_a_pass_says_its_kind():
    assert dispatch.pass_of(1, False) is dispatch.pass_of(1, True) is Pass.STEP
    assert dispatch.pass_of(9, True) is Pass.VERIFY
    assert dispatch.pass_of(9, False) is Pass.PREFILL                 # a prompt's rows, the last one's logits
    assert dispatch.pass_of(row_kernel.MAX_ROWS + 1, True) is Pass.PREFILL


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_every_format_has_a_product_for_every_pass_and_steps_take_lone_rows(act):
    for fmt in [*dispatch.DENSE, *dispatch.QUANTIZED]:
        for kind in Pass:
            r = dispatch.route(fmt, kind, CPU, act)
            assert all(p in dispatch.PRODUCTS for _, p in r.steps) and r.describe()
            if kind is not Pass.PREFILL:
                assert {r.pick(M) for M in range(1, row_kernel.MAX_ROWS + 1)} <= LONE, (fmt, kind)
            assert r.pick(1) in LONE                           # a prefill's single row (the head's) too
    with pytest.raises(ValueError, match="no kernel policy"):
        dispatch.route("int3", Pass.STEP, CPU, act)


def test_route_steps_read_in_order():
    r = dispatch.Route.of("q8", 1, "aten", 12, "decoded")
    assert [r.pick(M) for M in (1, 2, 12, 13, 500)] == ["q8", "aten", "aten", "decoded", "decoded"]
    assert r.describe() == ("localchat's int8 kernel (q8.c) for one row, torch's packed kernel (aten) for 2-12 rows, "
                            "else decoded, then torch's GEMM")
    assert r.describe(1) == "localchat's int8 kernel (q8.c)"


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    yield "int8", qweights.Int8Weight(qweights.quantize(w, "int8", 32, torch.bfloat16), CPU, torch.bfloat16)
    yield "int4", qweights.Int4Weight(qweights.quantize(w, "int4", 32, torch.bfloat16), CPU, torch.bfloat16, 32)
    if not gguf_kernel.why_not():
        for kind in ("Q4_K", "Q6_K", "IQ4_XS", "Q8_0"):
            yield kind, GGUFWeight([(kind, gguf_kernel.random_blocks(kind, 96, 256, g))], 256)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_verify_pass_computes_each_row_as_a_step_whatever_the_format(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(17, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
        for name, w in _weights():
            xs = x if name.startswith("int") else x.float()
            steps = torch.cat([w.mm(xs[r:r + 1], None, Pass.STEP) for r in range(17)])
            for M in (2, 5, 17):
                assert torch.equal(w.mm(xs[:M], None, Pass.VERIFY), steps[:M]), (name, M)
            prefill = w.mm(xs, None, Pass.PREFILL)            # a GEMM: the same values, summed its own way
            torch.testing.assert_close(prefill.float(), steps.float(), rtol=2e-2, atol=2e-2)
    finally:
        torch.set_num_threads(old)


def test_the_engine_reports_the_policy_it_runs(tiny_llama, tmp_path):
    eng = engine.open(str(tiny_llama), profile="resident-int8", drafter="none", cache_dir=tmp_path)
    k = eng.kernels
    layers = eng.target.impl.layers[0]
    assert "int8" in k.products and layers.qkv.format == "int8"
    assert k.products["int8"][Pass.STEP] == dispatch.routes("int8", CPU, eng.dtype)[Pass.STEP].describe(
        row_kernel.MAX_ROWS)
    d = eng.describe()
    assert d["products"]["int8"]["prefill"] == k.products["int8"][Pass.PREFILL]
    assert d["verify_rows"] == eng.target.impl.rows.reason and "kernels" in d
    assert any(line.startswith("int8: ") for line in k.lines())


def test_a_gguf_prefill_leaves_the_block_kernel_where_its_build_stops_winning(monkeypatch):
    # the block kernel shares a block's unpacking among four rows; the GEMM overtakes it at a
    # row count that depends on the build (AVX-512's products are the faster)
    assert dispatch.GGUF_PREFILL_ROWS["avx512"] > dispatch.GGUF_PREFILL_ROWS["avx2"]
    for isa, rows in dispatch.GGUF_PREFILL_ROWS.items():
        monkeypatch.setattr(row_kernel, "isa", lambda dtype, isa=isa: isa)
        route = dispatch.route("Q4_K", Pass.PREFILL, CPU, torch.float32)
        assert (route.pick(rows), route.pick(rows + 1)) == ("blocks", "blocks-gemm"), isa
        assert dispatch.route("Q4_K", Pass.VERIFY, CPU, torch.float32).pick(64) == "blocks"
