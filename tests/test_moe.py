"""Mixtures of experts run as mixtures: the experts kernel (engine/kernels/moe_kernel.py)
computes what transformers' experts modules compute, every row a lone row's bits at any
thread count; the engine runs it in every profile that can; published MoE configs (no
intermediate_size) load and plan by what a token reads; an MoE setting this version does
not run is one line."""
import json
import subprocess
import sys

import pytest
import torch

import engine
from engine.checkpoint import CheckpointError
from engine.kernels import moe_kernel
from engine.planner import ModelShape
from tiny import build_model

SHARED = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "models" / "qwen-hybrid-configs.json"


def _experts(dtype, hidden=128, inter=64, experts=8, seed=0):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=2,
                               moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                               layer_types=["full_attention"])
    module = Qwen3_5MoeForCausalLM(cfg).model.layers[0].mlp.experts.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_computes_the_experts_module_and_every_row_alone(dtype):
    if moe_kernel.why_not(dtype):
        pytest.skip(moe_kernel.why_not(dtype))
    module = _experts(dtype)
    g = torch.Generator().manual_seed(1)
    T = 9
    x = torch.randn(T, 128, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    idx[3] = torch.tensor([7, 0])                      # an order other than ascending
    w = torch.rand(T, 2, generator=g).to(dtype)
    kernel = moe_kernel.Experts(dtype, 8, 128, 64)
    dense = (module.gate_up_proj.data, module.down_proj.data)
    with torch.no_grad():
        want = module(x, idx, w).float()
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(kernel(x, idx, w, dense=dense))
            # each row computed as a lone row is the same bits as in the pass of T rows
            alone = torch.cat([kernel(x[i:i + 1], idx[i:i + 1], w[i:i + 1], dense=dense) for i in range(T)])
            assert torch.equal(alone, runs[-1]), n
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1])
    # Close to transformers' module: the same roundings, other summation orders inside a
    # product (a 128-long dot product in float32 accumulators, then rounded to the dtype):
    # within a few units in the last place of the output's scale.
    ulp = torch.finfo(dtype).eps * want.abs().max()
    assert (runs[0].float() - want).abs().max() <= 4 * ulp


@pytest.mark.parametrize("fmt,dtype", [("int4", None), ("int8", "bfloat16"), ("int8", "float32")])
def test_quantized_experts_take_the_kernel_and_equal_the_packed_loop(tmp_path, tokenizer, fmt, dtype):
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=3)
    eng = engine.open(str(path), drafter="none", profile=f"resident-{fmt}", dtype=dtype, cache_dir=tmp_path)
    act = eng.target.cache.dtype
    if moe_kernel.why_not(act) or (fmt == "int4" and act != torch.bfloat16):
        assert "transformers' experts loop" in eng.describe().get("experts", "")
        return
    assert "one C call a pass" in eng.describe()["experts"]
    block = next(m for m in eng.target.impl.model.modules() if type(m).__name__ == "PackedExperts")
    assert all(getattr(w, "own_kernel" if fmt == "int8" else "canonical") for w in block.gate_up + block.down)
    g = torch.Generator().manual_seed(0)
    T = 7
    x = torch.randn(T, 64, generator=g).to(act)
    idx = torch.tensor([[0, 1], [3, 2], [1, 3], [2, 0], [3, 1], [0, 3], [2, 1]])
    w = torch.rand(T, 2, generator=g).to(act)
    loop = type(block).forward(block, x, idx, w).float()         # the packed weights' own loop
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(block(x, idx, w))
            alone = torch.cat([block(x[i:i + 1], idx[i:i + 1], w[i:i + 1]) for i in range(T)])
            assert torch.equal(alone, runs[-1]), n                  # every row a lone row's bits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1])
    got = runs[0].float()
    assert (got - loop).abs().max() <= 4 * torch.finfo(act).eps * loop.abs().max()


def test_every_profile_reports_where_the_experts_ran(tmp_path, tokenizer):
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=4)
    for profile, dtype in (("resident-exact", "float32"), ("resident-exact", "bfloat16"),
                           ("resident-int8", None)):
        eng = engine.open(str(path), drafter="none", profile=profile, dtype=dtype, cache_dir=tmp_path)
        note = eng.describe()["experts"]
        act = eng.target.cache.dtype
        if not moe_kernel.why_not(act):
            assert note.startswith("the experts of 4 sparse blocks run in one C call"), (profile, note)
        assert list(eng.chat().send("hi", max_new_tokens=4))[-1].reason == "length"


def test_a_published_moe_config_loads_without_intermediate_size(tmp_path, tokenizer):
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=5)
    cfg = json.loads((path / "config.json").read_text())
    assert "intermediate_size" not in cfg
    shape = ModelShape.from_checkpoint(path)
    planned = ModelShape.from_config(cfg)
    # the routed experts by hand: 4 layers x 4 experts x 3 matrices of 64 x 64
    assert shape.expert_params == planned.expert_params == 4 * 4 * 3 * 64 * 64
    assert (planned.linear_params, planned.other_params) == (shape.linear_params, shape.other_params)
    assert (shape.experts, shape.experts_per_tok) == (4, 2)


def test_an_moe_setting_this_version_does_not_run_is_one_line(tmp_path, tokenizer):
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=6)
    cfg = json.loads((path / "config.json").read_text())
    cfg["n_group"] = 8                                  # a grouped router (DeepSeek's)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: n_group is a mixture-of-experts setting"):
        engine.open(str(path), drafter="none")
    proc = subprocess.run([sys.executable, "-m", "localchat", "--model", str(path), "--no-log", "hi"],
                          capture_output=True, timeout=300)
    err = proc.stderr.decode().strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "n_group" in err and "Traceback" not in err
    del cfg["n_group"]
    cfg["num_experts_per_tok"] = 9                      # more than the 4 experts it has
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_experts_per_tok = 9 is more than num_experts = 4"):
        engine.open(str(path), drafter="none")


def _published(model: str) -> dict:
    """A published config from shared/models as a config.json would hold it."""
    entry = next(m for m in json.loads(SHARED.read_text()) if m["model"].startswith(model))
    f = entry["fields"]
    n = f["num_hidden_layers"]
    cfg = {k: v for k, v in f.items() if isinstance(v, (int, float, list)) and not isinstance(v, bool)}
    cfg.update(model_type="qwen3_5_moe_text" if "3.5" in model else "qwen3_next", tie_word_embeddings=False,
               layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    if "3.5" in model:
        cfg.pop("intermediate_size", None)
    return cfg


@pytest.mark.skipif(not SHARED.is_file(), reason="shared/models is not beside this checkout")
def test_bytes_a_token_reads_of_the_published_mixtures():
    """By hand, in bf16 (2 bytes a weight), per layer with hidden h:
    - a gated delta-net layer: in_proj_qkv h x (2 x 16 x 128 + V x 128), in_proj_z h x V x 128,
      in_proj_b/a 2 x h x V, out_proj V x 128 x h (V linear value heads);
    - a full-attention layer: q (with its gate) h x 2 x H x 256, k and v 2 x h x 2 x 256, o H x 256 x h;
    - every layer: the router h x E, the shared expert 3 x h x s and its gate h, and k of E
      routed experts of 3 x h x m; the head vocab x h and one embedding row.
    Qwen3.5-35B-A3B (h 2048, V 32, H 16, E 256, k 8, m = s = 512, 30 + 10 layers, vocab 248320):
      delta 16.777e6 + 8.389e6 + 0.131e6 + 8.389e6 = 33.686e6 x 30 = 1010.6e6; attention
      16.777e6 + 2.097e6 + 8.389e6 = 27.263e6 x 10 = 272.6e6; per layer 0.524e6 + 3.148e6 +
      8 x 3.146e6 = 28.837e6 x 40 = 1153.5e6; head 508.6e6; with the norms and conv kernels
      (0.33e6 x 30 + ...) 2.946e9 weights: 5.89 GB, of 69.3 GB held.
    Qwen3.5-122B-A10B (h 3072, V 64, H 32, E 256, k 8, m = s = 1024, 36 + 12 layers): 9.0e9 read.
    Qwen3-Next-80B-A3B (h 2048, V 32, H 16, E 512, k 10, m = s = 512, 36 + 12, vocab 151936):
      10 of 512 experts a token: 3.56e9 read of 79.7e9.
    Held in int8, the 35B-A3B's head saves 508.6e6 bytes less its 248320 bf16 scales."""
    a3b = ModelShape.from_config(_published("Qwen/Qwen3.5-35B-A3B"))
    delta = 2048 * (2 * 16 * 128 + 32 * 128) + 2048 * 32 * 128 + 2 * 2048 * 32 + 32 * 128 * 2048
    attention = 2048 * 2 * 16 * 256 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048
    sparse = 2048 * 256 + 3 * 2048 * 512 + 2048 + 8 * 3 * 2048 * 512
    small = 30 * (8192 * 4 + 2 * 32 + 128) + 10 * 2 * 256 + 40 * 2 * 2048 + 2048    # conv, decay, norms
    want = 30 * delta + 10 * attention + 40 * sparse + 248320 * 2048 + 2048 + small
    assert a3b.read_bytes() == 2 * want
    assert a3b.read_bytes() == pytest.approx(5.89e9, rel=0.005)
    assert a3b.weight_bytes() == pytest.approx(69.3e9, rel=0.005)
    # the quantized profiles hold the head in int8 per channel: a byte a weight and a bf16
    # scale a row, instead of two bytes; every token reads it whole
    head_saving = 248320 * 2048 * 2 - (248320 * 2048 + 2 * 248320)
    assert a3b.read_bytes("int4", head="int8") == a3b.read_bytes("int4") - head_saving
    assert a3b.weight_bytes("int4", head="int8") == a3b.weight_bytes("int4") - head_saving
    assert ModelShape.from_config(_published("Qwen/Qwen3.5-122B-A10B")).read_bytes() == pytest.approx(2 * 9.0e9, rel=0.01)
    nxt = ModelShape.from_config(_published("Qwen/Qwen3-Next-80B-A3B"))
    assert nxt.read_bytes() == pytest.approx(2 * 3.56e9, rel=0.01) and nxt.params == pytest.approx(79.7e9, rel=0.01)
    # a verify pass of n tokens reads the distinct experts they route to: E(1 - (1 - k/E)^n)
    one, nine = a3b.read_bytes(positions=1), a3b.read_bytes(positions=9)
    experts = 40 * 256 * 3 * 2048 * 512 * 2
    assert nine - one == pytest.approx(experts * ((1 - (1 - 8 / 256) ** 9) - 8 / 256) + 8 * 2048 * 2, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_mixture_loads_tensor_by_tensor_to_what_from_pretrained_builds(tmp_path, tokenizer, dtype):
    """The resident loader fills each fused experts tensor expert by expert (one copy of the
    weights at any time): every tensor equals what transformers' own loading makes of the
    files, for experts stored one matrix per expert (as saved) and stored fused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.targets.module_exact import load_exact
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=7)
    want = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
    got = load_exact(path, AutoConfig.from_pretrained(path), torch.device("cpu"), dtype).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # the same weights with the experts stored fused, as transformers holds them
    fused = {k: v for k, v in load_file(path / "model.safetensors").items() if ".experts." not in k}
    fused.update({k: v.to(torch.float32) for k, v in want.items() if k.endswith(("experts.gate_up_proj",
                                                                                 "experts.down_proj"))})
    save_file({k: v.contiguous() for k, v in fused.items()}, path / "model.safetensors", metadata={"format": "pt"})
    got = load_exact(path, AutoConfig.from_pretrained(path), torch.device("cpu"), dtype).state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_mixture_short_of_ram_plans_its_experts_memory_mapped(tmp_path, tokenizer):
    """On a CPU, a quantized mixture that misses the budget by less than its experts keeps
    what does not fit memory-mapped on disk: the row fits, holds that much less, and a token
    reads its share of the routed experts from disk (uniform routing: the mapped fraction of
    k/E of the experts). Where the disk would halve the speed, none is left there."""
    from engine import hardware, planner, profiles
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=8)
    shape = ModelShape.from_checkpoint(path)
    every = profiles.builtin()
    experts = shape.linear_bytes("int4", 32, shape.expert_params)
    full = planner.make_plan(shape, hardware.detect(vram=10**9, device="cpu"), every, context=64,
                             runnable=engine.runnable(every)).row("resident-int4")
    assert full.fits and full.mapped_experts == 0
    fast_disk = {"cpu": 20e9, "disk": 20e9}
    # a budget with room for all but half the experts (its margin is a tenth of itself)
    rest = full.total - full.weights - full.margin
    short = hardware.detect(vram=int((rest + full.weights - experts // 2) / 0.9) + 1, device="cpu")
    row = planner.make_plan(shape, short, every, context=64, runnable=engine.runnable(every),
                            bandwidth=fast_disk).row("resident-int4")
    # what does not fit is exactly what stays on disk (the margin is a tenth of a small budget)
    assert row.fits and row.total == row.budget and 0 < row.mapped_experts < experts
    assert row.weights + row.mapped_experts == full.weights
    assert row.disk_per_token == int(experts * (2 / 4) * row.mapped_experts / experts)
    assert "memory-mapped" in row.note
    slow_disk = planner.make_plan(shape, short, every, context=64, runnable=engine.runnable(every),
                                  bandwidth={"cpu": 20e9, "disk": 1e6}).row("resident-int4")
    # no expert left on disk; what still fits is the prefill in narrower chunks (planner._chunked_row)
    assert slow_disk.mapped_experts == 0 and slow_disk.prefill_chunk < row.prefill_chunk
    assert not slow_disk.fits or slow_disk.total <= slow_disk.budget


def test_mapped_experts_are_read_from_the_cache_files_and_answer_the_same(tmp_path, tokenizer):
    from engine.checkpoint import Checkpoint
    from engine.targets.quantized import load_quantized
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=9)
    answers = []
    for mapped in (False, True, True):                 # the last from the cache the first mapped load wrote
        cache = tmp_path / ("mapped" if mapped else "plain")
        target = load_quantized(path, torch.device("cpu"), "int4", cache_dir=cache,
                                experts_in_memory=0 if mapped else None)
        eng = engine.Engine(Checkpoint(path, "tiny", "dir"), engine.engine._load_tokenizer(path), target)
        eng.stop_ids = frozenset()
        answers.append(list(list(eng.chat().send("Why is the sky blue?", max_new_tokens=16))[-1].token_ids))
        block = next(m for m in target.impl.model.modules() if type(m).__name__ == "PackedExperts")
        assert _in_file_mapping(block.gate_up[0].q, target.quant.cache_dir) == mapped
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 16


def _in_file_mapping(t: torch.Tensor, folder) -> bool:
    """Whether the tensor's memory lies in a mapping of a file under `folder` (/proc/self/maps)."""
    for line in open("/proc/self/maps").read().splitlines():
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        if str(folder) in line and lo <= t.data_ptr() < hi:
            return True
    return False


def test_the_most_used_experts_stay_in_memory_and_the_rest_mapped(tmp_path, tokenizer):
    """A mixture short of RAM keeps whole experts in memory, the most used first: routing
    counted on the held texts at the first load (every token's k picks in every block),
    kept per model and read back by the next load and the plan; the others stay in the
    cache's file mapping, and the answers are the all-in-memory engine's."""
    from engine import fidelity
    from engine.checkpoint import Checkpoint
    from engine.targets import routing
    from engine.targets.quantized import load_quantized
    path = build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer, seed=10)
    tok = engine.engine._load_tokenizer(path)
    texts = fidelity.held_texts(tok, routing.TOKENS)
    assert routing.cached(tmp_path, path) is None
    answers, files = [], []
    for keep in (None, 5, 5):                          # the last reads the counts the first mapped load wrote
        target = load_quantized(path, torch.device("cpu"), "int4", cache_dir=tmp_path / str(keep),
                                experts_in_memory=None if keep is None else keep * 7680, routing_texts=texts)
        eng = engine.Engine(Checkpoint(path, "tiny", "dir"), tok, target)
        eng.stop_ids = frozenset()
        answers.append(list(list(eng.chat().send("Why is the sky blue?", max_new_tokens=16))[-1].token_ids))
        if keep is None:
            continue
        use = routing.cached(tmp_path / str(keep), path)
        files.append(routing._file(tmp_path / str(keep), path).stat().st_mtime_ns)
        assert use.tokens == sum(map(len, texts))
        assert all(sum(row) == use.tokens * 2 for row in use.counts)          # top-2 in each of the 4 blocks
        assert target.experts_placement.startswith("5 of 16 experts in memory (the most used on 512 held tokens)")
        blocks = [m for m in target.impl.model.modules() if type(m).__name__ == "PackedExperts"]
        # an int4 expert here: gate_up [128, 64] and down [64, 64], half a byte a code plus bf16 scale and zero
        each = sum(t.nbytes for w in (blocks[0].gate_up[0], blocks[0].down[0]) for t in w.tensors())
        assert each == 128 * 32 + 2 * 128 * 2 * 2 + 64 * 32 + 2 * 64 * 2 * 2 == 7680
        kept = set(use.ranked()[:5])
        for b, block in enumerate(blocks):
            for e in range(4):
                for w in (block.gate_up[e], block.down[e]):
                    assert _in_file_mapping(w.q, target.quant.cache_dir) == ((b, e) not in kept), (b, e)
        counts = sorted((c for row in use.counts for c in row), reverse=True)
        assert sorted((use.counts[b][e] for b, e in kept), reverse=True) == counts[:5]
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 16
    assert files[0] == files[1]                        # measured once, read back by the next load


def test_the_plan_reads_from_disk_what_the_measured_routing_leaves_there(tmp_path, tokenizer):
    """With measured routing, the experts kept are whole ones, the most used; a token reads
    from disk the share of its routings that land on the rest. By hand, for 4 blocks of 4
    experts with a quarter of the experts' bytes short: 12 experts stay in memory; uniform
    counts leave 4 of 16 routings on disk; counts of (1000, 1, 1, 1) in every block keep the
    4 busy experts and 8 idle ones, and leave 4 of 4012 routings there."""
    from engine import hardware, planner, profiles
    from engine.targets.routing import Routing
    shape = ModelShape.from_checkpoint(build_model(tmp_path / "m", "qwen3_5_moe", layers=4, tokenizer=tokenizer))
    every = profiles.builtin()
    int4 = next(p for p in every if p.name == "resident-int4")
    experts = shape.linear_bytes("int4", 32, shape.expert_params)
    routed = experts * shape.expert_fraction(1)
    short = -(experts // 4)
    even = Routing(((10,) * 4,) * 4, 20)
    mapped, disk, kept = planner._mapped_experts(shape, int4, short, 50e9, 50e9, even)
    assert (mapped, kept) == (experts - int(12 * experts / 16), int(12 * experts / 16))
    assert disk == int(routed * (1 - 12 / 16))
    skew = Routing(((1000, 1, 1, 1),) * 4, 2003)
    assert skew.ranked()[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    _, disk_skew, _ = planner._mapped_experts(shape, int4, short, 50e9, 50e9, skew)
    assert disk_skew == int(routed * (1 - 4008 / 4012)) < disk
    # the plan takes the counts: the row's disk reads and what it says of them
    full = planner.make_plan(shape, hardware.detect(vram=10**9, device="cpu"), every, context=64,
                             routing=skew).row("resident-int4")
    hw = hardware.detect(vram=int((full.total - full.margin + short) / 0.9) + 1, device="cpu")
    row = planner.make_plan(shape, hw, every, context=64, routing=skew,
                            bandwidth={"cpu": 20e9, "disk": 20e9}).row("resident-int4")
    assert 0 < row.mapped_experts and row.kept_experts + row.mapped_experts == experts
    assert row.routing_tokens == 2003 and row.disk_per_token < routed * row.mapped_experts / experts
    assert "routing measured on 2003 held tokens" in planner.format_plan(
        planner.make_plan(shape, hw, every, context=64, routing=skew, bandwidth={"cpu": 20e9, "disk": 20e9}))
