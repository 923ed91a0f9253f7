"""A mixture streamed on a CPU reads only its routed experts (targets/streamed_modules.py,
expert_views): a sparse layer's streamed unit holds everything but its experts, and the
experts kernel reads the experts a pass routes to where they lie in the checkpoint's files,
memory-mapped. The logits are the resident target's bit for bit; speculation stays plain
greedy; what a pass reads is its distinct routed experts, counted; the plan counts the
experts as read per token, not streamed per pass."""
from dataclasses import replace

import pytest
import torch

import engine
from engine import hardware, planner, profiles
from engine.checkpoint import tensor_index
from engine.kernels import moe_kernel
from engine.planner import ModelShape
from engine.targets.resident import load_resident
from engine.targets.streamed import load_streamed, minimum_budget
from test_moe import _in_file_mapping
from tiny import build_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(bool(moe_kernel.why_not(torch.float32)), reason="no experts kernel on this CPU")


@pytest.fixture(scope="module", params=[("qwen3_5_moe", torch.float32), ("qwen3_5_moe", torch.bfloat16),
                                        ("qwen3_next", torch.float32), ("qwen3_next", torch.bfloat16)],
                ids=["qwen3_5_moe-f32", "qwen3_5_moe-bf16", "qwen3_next-f32", "qwen3_next-bf16"])
def mixture(request, tmp_path_factory, tokenizer):
    """A tiny mixture whose files hold `dtype`, the dtype it computes in."""
    kind, dtype = request.param
    return build_model(tmp_path_factory.mktemp(kind), kind, layers=4, tokenizer=tokenizer, seed=11,
                       shard="300KB", dtype=dtype), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_split_experts_are_the_fused_kernel_bit_for_bit(dtype, threads):
    """The kernel over per-expert gate, up and down matrices (as checkpoints store them) gives
    the bits of the same kernel over the fused [E, 2I, hid] tensor, every row a lone row."""
    from test_moe import _experts
    if moe_kernel.why_not(dtype):
        pytest.skip(moe_kernel.why_not(dtype))
    module = _experts(dtype, experts=8)
    E, hid, inter = 8, 128, 64
    gu, down = module.gate_up_proj.data, module.down_proj.data
    fused = moe_kernel.Experts(dtype, E, hid, inter)
    split = moe_kernel.Experts(dtype, E, hid, inter, split=([gu[e, :inter].contiguous() for e in range(E)],
                                                            [gu[e, inter:].contiguous() for e in range(E)],
                                                            [down[e].contiguous() for e in range(E)]))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, hid, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(7)])
    wts = torch.rand(7, 2, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = fused(x, idx, wts, dense=(gu, down))
        got = split(x, idx, wts)
        rows = torch.cat([split(x[i:i + 1], idx[i:i + 1], wts[i:i + 1]) for i in range(7)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want) and torch.equal(rows, want)
    # what it read: each pass's distinct experts, three matrices of inter x hid each
    assert split.expert_bytes == 3 * inter * hid * torch.finfo(dtype).bits // 8
    assert split.hits == len(set(idx.flatten().tolist())) + sum(len(set(r.tolist())) for r in idx)


def test_streamed_mixture_reads_its_experts_from_the_files_and_equals_resident(mixture):
    from test_hybrid_streamed import _passes
    path, dtype = mixture
    index = tensor_index(path)
    st = load_streamed(path, CPU, dtype, weight_budget=minimum_budget(path, CPU, dtype))
    assert st.mapped_experts and st.placement.disk and not st.placement.resident_layers(4)   # every layer streamed
    # the layers' units hold all but their routed experts, which stay in the checkpoint's mapping
    experts = sum(e.nbytes for n, e in index.items() if ".mlp.experts." in n)
    layers = sum(e.nbytes for n, e in index.items() if n.startswith("model.layers."))
    assert sum(u.file_bytes for u in st.index.layer_units) == layers - experts
    blocks = [m for m in st.impl.model.modules() if hasattr(m, "kernel") and hasattr(m, "gate_up_proj")]
    assert len(blocks) == 4 and all(b.gate_up_proj.is_meta for b in blocks)
    assert all(_in_file_mapping(t, path) for b in blocks for part in b.kernel._keep for t in part)
    ref = _passes(load_resident(path, CPU, dtype))
    before = st.stream_stats().expert_bytes
    for i, (a, b) in enumerate(zip(ref, _passes(st))):
        assert torch.equal(a, b), f"pass {i}: max difference {(a - b).abs().max().item()}"
    # a one-token step reads k = 2 distinct experts in each of the 4 sparse layers, no more
    one = st.stream_stats().expert_bytes
    st.forward([7])
    each = blocks[0].kernel.expert_bytes
    assert each == experts // (4 * 4) and st.stream_stats().expert_bytes - one == 4 * 2 * each
    assert one > before
    st.close()


def test_a_mixture_computed_in_another_dtype_streams_its_experts_whole(mixture):
    """float32 files computed in bfloat16 (or the reverse) cannot be read in place: the
    experts are streamed with their layers, as on a GPU, and the answer is the same."""
    from test_hybrid_streamed import _passes
    path, files = mixture
    dtype = torch.bfloat16 if files == torch.float32 else torch.float32
    st = load_streamed(path, CPU, dtype, weight_budget=minimum_budget(path, CPU, dtype))
    assert not st.mapped_experts and st.stream_stats().expert_bytes == 0
    for a, b in zip(_passes(load_resident(path, CPU, dtype)), _passes(st)):
        assert torch.equal(a, b)
    st.close()


def test_speculation_on_a_streamed_mixture_is_plain_greedy(mixture, tmp_path):
    """With an int4 copy of the model drafting (every round drafts), under a budget that
    streams its layers: the answer is plain greedy's, token for token."""
    path, dtype = mixture
    total = sum(e.nbytes for e in tensor_index(path).values())
    prompt = "Why is the sky blue?"
    plain = engine.open(str(path), drafter="none", context=256)
    plain.stop_ids = frozenset()
    want = list(plain.chat().send(prompt, max_new_tokens=24))[-1]
    for step in range(20, 400, 5):            # about the smallest budget it streams in
        try:
            st = engine.open(str(path), drafter="model", draft_model="self", profile="streamed-exact",
                             memory_budget=total * step // 100, context=256, cache_dir=tmp_path)
            break
        except engine.BadRequest:
            continue
    st.stop_ids = frozenset()
    st.draft_tokens = 3
    events = list(st.chat().send(prompt, max_new_tokens=24))
    done, stats = events[-1], [e for e in events if isinstance(e, engine.Stats)][-1]
    assert st.plan.chosen == "streamed-exact" and st.target.mapped_experts and st.target.placement.disk
    assert list(done.token_ids) == list(want.token_ids) and stats.drafted_tokens > 0
    assert stats.expert_bytes > 0 and "only the experts a pass routes to" in st.describe()["experts"]


def test_the_plan_reads_the_routed_experts_and_streams_the_rest(mixture):
    """On a CPU the streamed row's units leave the experts out; a token reads the rest of the
    weights and its routed experts (as resident: ModelShape.read_bytes), those from the page
    cache as far as the memory the plan leaves free holds them, the rest from disk."""
    path, dtype = mixture
    shape = ModelShape.from_checkpoint(path)
    experts = shape.expert_params * shape.dtype_bytes
    whole, _, _ = planner.streamed_units(shape)
    parts, _, _ = planner.streamed_units(shape, without_experts=True)
    assert sum(whole[:4]) - sum(parts[:4]) == pytest.approx(experts, abs=4 * shape.dtype_bytes)
    every = profiles.builtin()
    bw = {"cpu": 20e9, "disk": 1e9, "cuda": 20e9, "host_to_device": 20e9}
    plan = lambda budget, device="cpu": planner.make_plan(     # noqa: E731
        shape, replace(hardware.detect(vram=budget, device="cpu"), device=device), every, context=64,
        bandwidth=bw).row("streamed-exact")
    routed = int(experts * 2 / 4)                         # k = 2 of E = 4 experts a token
    roomy = plan(10**9)
    assert roomy.fits and roomy.mapped_experts == experts and roomy.kept_experts == experts
    assert roomy.disk_per_token == 0 and roomy.read_per_token == pytest.approx(shape.read_bytes(), rel=0.02)
    # a budget whose free memory holds half the experts (the margin is a tenth of a small budget)
    half = int((roomy.total - roomy.margin + experts / 2) / 0.9)
    row = plan(half)
    assert row.fits and row.kept_experts == pytest.approx(experts / 2, abs=16)
    assert row.disk_per_token == pytest.approx(routed / 2, abs=16)
    assert 1 / row.tps_bound == pytest.approx(1 / roomy.tps_bound + routed / 2 / 1e9 - routed / 2 / 20e9, rel=1e-3)
    # doctor's line, for a user's streamed profile of any name
    mine = [replace(p, name="my-stream") if p.placement == "streamed" else p for p in every]
    text = planner.format_plan(planner.make_plan(shape, hardware.detect(vram=10**9, device="cpu"), mine,
                                                 context=64, bandwidth=bw))
    assert "my-stream: the routed experts" in text and "memory-mapped: only those a token routes to" in text
    # a device streams every expert of a layer: nothing is read in place
    gpu = plan(10**9, "cuda:0")
    assert gpu.mapped_experts == 0 and gpu.read_per_token > roomy.read_per_token


def test_published_mixtures_stream_at_what_a_token_reads():
    """Qwen3-Next-80B-A3B in bf16 on a 2-core, 24 GB CPU (the issue's case: 155 GB streamed per
    pass, 0.0 tok/s): the always-read weights, 4.7 GB, stay in memory; a token reads its 10
    of 512 routed experts in each of 48 layers from the files, 3% of 155 GB."""
    from test_moe import SHARED, _published
    if not SHARED.is_file():
        pytest.skip("shared/models is not beside this checkout")
    shape = ModelShape.from_config(_published("Qwen/Qwen3-Next-80B-A3B"))
    every = profiles.builtin()
    row = planner.make_plan(shape, hardware.detect(vram=22 * 10**9, device="cpu"), every, context=4096,
                            runnable=engine.runnable(every)).row("streamed-exact")
    experts = shape.expert_params * 2
    assert row.fits and row.streamed_bytes_per_pass == 0 and row.mapped_experts == experts
    assert row.weights < 5e9 and row.read_per_token == pytest.approx(shape.read_bytes(), rel=0.01)
    assert row.disk_per_token < experts * 10 / 512
