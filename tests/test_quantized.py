"""The quantized resident target: the formats round-trip within their step, the kernels
compute their format's definition, a quantized model stays close to the exact one,
speculation never changes its greedy answer, the disk cache is used only when it is
whole and current, and quantization holds about one layer of host memory at a time."""
import gc
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine import checkpoint, fidelity
from engine.drafters import ModelDrafter, NgramDrafter, NoDrafter
from engine.kernels import aten, q4_kernel, q8_kernel
from engine.kernels.dispatch import Pass
from engine.targets import qweights
from engine.targets.quantized import load_quantized
from engine.targets.resident import load_resident

CPU = torch.device("cpu")
DATA = Path(__file__).parent.parent / "engine" / "data"   # the held texts ship with the engine (doctor --fidelity)


def load(path, cache, fmt, **kw):
    return load_quantized(path, CPU, fmt, cache_dir=cache, **kw)


# ---------------------------------------------------------------- formats and kernels

@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_within_half_a_step(param_dtype):
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(0)) * 0.1
    w[3, 7] = 2.0                                   # an outlier only widens its own row's step
    c = qweights.quantize_int8(w, param_dtype)
    err = (qweights.dequantize_int8(c) - w).abs()
    step = c["scale"].float()[:, None]
    # Half a step, plus (bf16 scales) the clipping of a row maximum whose scale rounded down.
    assert (err <= step * (0.5 if param_dtype == torch.float32 else 0.51) + 1e-7).all()
    assert float(err[4:].max()) < float(err[3].max())


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_within_half_a_step_per_group(param_dtype, group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.1
    c = qweights.quantize_int4(w, group, param_dtype)
    err = (qweights.dequantize_int4(c) - w).abs().view(64, -1, group)
    step = c["scale"].float()[..., None]
    zero = c["zero"].float()[..., None].abs()
    # f32 parameters: half a step. bf16: the zero point's rounding shifts the grid by up
    # to 2^-9 of |zero|, which the end codes may have to absorb.
    slack = 0 if param_dtype == torch.float32 else zero * 2 ** -8 + step * 0.01
    assert (err <= step * 0.5 + slack + 1e-7).all()
    # and the step is 1/15 of the group's range: 4 bits, nothing wasted
    rng = w.view(64, -1, group).amax(-1) - w.view(64, -1, group).amin(-1)
    torch.testing.assert_close(c["scale"].float(), rng / 15, rtol=0.01, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["own", "aten", "none"])
def test_kernels_compute_the_definition(fmt, act, kernel, monkeypatch):
    """x @ dequantize(w).T (+ bias) to the rounding of the output dtype, through localchat's
    kernels (engine/kernels/q8.c: int8; q4.c: int4 with bf16 activations), through the aten
    kernel, and through the fallback a device without either uses."""
    own = q8_kernel if fmt == "int8" else q4_kernel
    if kernel == "own":
        if fmt == "int4" and act != torch.bfloat16:
            pytest.skip("localchat's int4 kernel takes int4 weights with bf16 activations")
        if not own.available():
            pytest.skip(f"{fmt} kernel: {own.why_not()}")
    else:
        monkeypatch.setattr(own, "_state", ["turned off (test)"])
    if kernel == "none":
        monkeypatch.setattr(aten, "runs", lambda *a: False)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(192, 256, generator=g) * 0.05
    bias = torch.randn(192, generator=g).to(act)
    c = qweights.quantize(w, fmt, 32, act)
    packed = (qweights.Int8Weight(c, CPU, act) if fmt == "int8" else qweights.Int4Weight(c, CPU, act, 32))
    assert packed.kernel == (kernel != "none")
    assert getattr(packed, "canonical" if fmt == "int4" else "own_kernel") == (kernel == "own")
    want_w = qweights.dequantize(c)
    tol = 2e-2 if act == torch.bfloat16 else 1e-5
    for M in (1, 5, 33, 100):       # 100: past dispatch.GEMM_ROWS, the dequantized weight and a GEMM
        x = torch.randn(M, 256, generator=g).to(act)
        want = x.float() @ want_w.t() + bias.float()
        for kind in (Pass.STEP, Pass.VERIFY, Pass.PREFILL):   # a prefill takes another kernel past a few rows
            got = packed.mm(x, bias, kind).float()
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    ids = torch.tensor([0, 63, 64, 100, 191])
    torch.testing.assert_close(packed.rows(ids).float(), want_w[ids], rtol=tol, atol=tol * 0.1)


def test_kernel_rows_do_not_depend_on_the_batch():
    """A verify pass of k+1 rows must give each row what a one-token step gives it, bit
    for bit, or speculation could change a greedy answer."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(320, 192, generator=g) * 0.05
    x = torch.randn(17, 192, generator=g).bfloat16()
    for packed in (qweights.Int8Weight(qweights.quantize_int8(w, torch.bfloat16), CPU, torch.bfloat16),
                   qweights.Int4Weight(qweights.quantize_int4(w, 32, torch.bfloat16), CPU, torch.bfloat16, 32)):
        whole = packed.mm(x)
        assert all(torch.equal(whole[r], packed.mm(x[r:r + 1])[0]) for r in range(17))


def test_packed_int4_rows_read_back_for_every_block_shape():
    """The tied-embedding lookup reads rows out of the kernel's packed layout: full
    64-row blocks, a tail block, and fewer rows than one block."""
    for n in (16, 48, 64, 80, 192, 208):
        w = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
        c = qweights.quantize_int4(w, 32, torch.float32)
        packed = qweights.Int4Weight(c, CPU, torch.float32, 32)
        assert torch.equal(packed._reader.codes(packed.packed, None), qweights.int4_codes(c["q"]))


# ---------------------------------------------------------------- the quantized target

def dequantized_reference(path, fmt: str):
    """The exact forward over weights replaced by their quantize->dequantize round trip
    (the layers in `fmt`, the head in int8): what the quantized target computes, in plain
    float32 arithmetic."""
    from transformers import AutoModelForCausalLM
    from engine.targets.resident import ResidentTarget
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (*vars(layer.self_attn)["_modules"].values(), *vars(layer.mlp)["_modules"].values()):
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.copy_(qweights.dequantize(qweights.quantize(lin.weight, fmt, 32, torch.float32)))
        # the head in int8 per channel (a tied table with it: its rows serve the lookups)
        model.lm_head.weight.copy_(qweights.dequantize(qweights.quantize(model.lm_head.weight, "int8", 32,
                                                                         torch.float32)))
    return ResidentTarget(model, CPU, torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_logits_match_their_definition_and_stay_near_exact(tiny_llama, tmp_path, fmt):
    ids = list(range(3, 80))
    q = load(tiny_llama, tmp_path, fmt, act_dtype=torch.float32)
    got = q.forward(ids, all_logits=True)
    # Same weights, plain arithmetic: only float32 summation order differs.
    want = dequantized_reference(tiny_llama, fmt).forward(ids, all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Against the exact model. The tiny model's weights are wide random noise (std 0.2,
    # hidden 64: two int4 groups a row), the worst case for quantization, so this bounds
    # the error instead of asking for agreement (the demo-model test does that): the RMS
    # of the logit error stays under 6% (int8) / 60% (int4) of the logits' spread
    # (measured: 3.2% / 40%).
    exact = load_resident(tiny_llama, CPU, torch.float32).forward(ids, all_logits=True)
    rel = float((got - exact).pow(2).mean().sqrt() / exact.std())
    assert rel < (0.06 if fmt == "int8" else 0.6), rel


def test_bf16_activations_and_quantized_embeddings(tiny_qwen3, tmp_path):
    """Qwen3 (q/k norms) with bf16 activations, the (untied) embeddings and head quantized or not."""
    exact = load_resident(tiny_qwen3, CPU, torch.float32)
    ids = list(range(3, 60))
    want = exact.forward(ids, all_logits=True)
    for embeddings in (False, True):
        q = load(tiny_qwen3, tmp_path, "int8", act_dtype=torch.bfloat16, embeddings=embeddings)
        got = q.forward(ids, all_logits=True)
        assert q.dtype == torch.bfloat16 and q.cache.k[0].dtype == torch.bfloat16
        # int8 weights and bf16 activations: logit RMS error under 5% of the spread
        assert float((got - want).pow(2).mean().sqrt() / want.std()) < 0.05
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.8
    q4 = load(tiny_qwen3, tmp_path, "int4", act_dtype=torch.bfloat16, embeddings=True)
    assert q4.weight_bytes() < exact.weight_bytes() * 0.2


def test_group_size_that_does_not_divide_is_refused(tiny_llama, tmp_path):
    with pytest.raises(engine.BadRequest, match=r"--group-size 128: .*does not divide the input width 64.*use --group-size 32"):
        load(tiny_llama, tmp_path, "int4", group_size=128)
    with pytest.raises(engine.BadRequest, match="--group-size 48"):
        load(tiny_llama, tmp_path, "int4", group_size=48)
    with pytest.raises(engine.BadRequest, match="--weights int3"):
        load(tiny_llama, tmp_path, "int3")


# ---------------------------------------------------------------- speculation on the quantized target

@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_speculative_greedy_equals_plain_on_the_quantized_target(tiny_llama, tmp_path, fmt):
    ckpt = checkpoint.Checkpoint(tiny_llama, "tiny", "dir")
    tok = engine.engine._load_tokenizer(tiny_llama)
    eng = engine.Engine(ckpt, tok, load(tiny_llama, tmp_path, fmt, act_dtype=torch.bfloat16), drafter=NoDrafter())
    eng.stop_ids = frozenset()
    prompts = ["Why is the sky blue?", "def fib(n):\n    return n if n < 2 else fib(n - 1)"]

    def answers():
        return [list(eng.chat().send(p, max_new_tokens=40))[-1].token_ids for p in prompts]

    plain = answers()
    # a quantized copy of the target drafting for itself (the same cached weights), and n-gram
    self_drafter = ModelDrafter(load(tiny_llama, tmp_path, fmt, act_dtype=torch.bfloat16), "self", eng.target.vocab_size)
    for drafter, k in [(NgramDrafter(), 3), (self_drafter, 4), (self_drafter, None)]:
        eng.drafter, eng.draft_tokens = drafter, k
        assert answers() == plain


# ---------------------------------------------------------------- the disk cache

def test_cache_miss_then_hit_then_rebuilds_what_is_stale_or_broken(tiny_llama, tmp_path):
    ids = list(range(5, 40))
    first = load(tiny_llama, tmp_path, "int4")
    assert not first.quant.cache_hit
    want = first.forward(ids, all_logits=True)
    cache_dir = first.quant.cache_dir
    assert cache_dir.parent == tmp_path / "quantized" and cache_dir.name.endswith("-int4-g32-" + str(first.dtype)[6:] + "-head8")

    hit = load(tiny_llama, tmp_path, "int4")
    assert hit.quant.cache_hit and torch.equal(hit.forward(ids, all_logits=True), want)
    assert not load(tiny_llama, tmp_path, "int8").quant.cache_hit          # another format: its own entry

    layer = cache_dir / "layer-0001.safetensors"
    data = layer.read_bytes()
    layer.write_bytes(data[: len(data) // 2])                               # truncated
    again = load(tiny_llama, tmp_path, "int4")
    assert not again.quant.cache_hit and torch.equal(again.forward(ids, all_logits=True), want)
    assert load(tiny_llama, tmp_path, "int4").quant.cache_hit

    data = bytearray(layer.read_bytes())
    data[-5] ^= 0xFF                                                        # same size, one bit pattern flipped
    layer.write_bytes(bytes(data))
    assert not load(tiny_llama, tmp_path, "int4").quant.cache_hit

    (cache_dir / "manifest.json").unlink()                                  # an interrupted write
    assert not load(tiny_llama, tmp_path, "int4").quant.cache_hit
    assert load(tiny_llama, tmp_path, "int4").quant.cache_hit


def test_cache_is_rebuilt_when_the_source_changes(tmp_path, tokenizer):
    from tiny import build_model
    src = build_model(tmp_path / "model", "llama", tokenizer=tokenizer, seed=5)
    cache = tmp_path / "cache"
    ids = list(range(5, 30))
    before = load(src, cache, "int8").forward(ids, all_logits=True)
    assert load(src, cache, "int8").quant.cache_hit
    build_model(src, "llama", tokenizer=tokenizer, seed=6)                  # re-downloaded: new weights
    after = load(src, cache, "int8")
    assert not after.quant.cache_hit
    assert not torch.equal(after.forward(ids, all_logits=True), before)
    assert after.forward(ids, all_logits=True).shape == before.shape


# ---------------------------------------------------------------- host memory while quantizing

def _rss_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_layerwise_quantization_holds_under_two_layers_plus_output(tmp_path, tokenizer, fmt):
    """Peak resident memory of the process while quantizing (anonymous memory and the
    mapped pages of the source file both count) stays below two float32 layers plus
    the quantized output. The model: 4 layers of 21 MB each, 85 MB in all, so holding
    the whole model, or even three layers, fails."""
    from tiny import build_model
    src = build_model(tmp_path / "model", "llama", tokenizer=tokenizer, layers=4, hidden=768)
    layer_bytes = sum(e.nbytes for n, e in checkpoint.tensor_index(src).items() if n.startswith("model.layers.0."))
    load(src, tmp_path / "warm", fmt)             # imports, kernel checks, allocator pools: not the quantizer's
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")                         # reset the peak (VmHWM) to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    base = _rss_status()["VmRSS"]
    target = load(src, tmp_path / "cold", fmt)
    peak = _rss_status()["VmHWM"] - base
    assert not target.quant.cache_hit
    output = target.device_bytes()                # quantized weights and the KV cache it allocated
    assert peak < 2 * layer_bytes + output, (peak, layer_bytes, output)
    assert layer_bytes > 20e6


# ---------------------------------------------------------------- the demo model

HELD = ["held_prose.txt", "held_code.py.txt"]


@pytest.mark.demo
def test_demo_fidelity(demo_engine):
    """Teacher-forced against the exact float32 model on the first 384 tokens of each held
    text (benchmarks/fidelity.py measures the whole texts). Held to what a format's rounding
    controls: the KL of the next-token distributions and the perplexity, smooth in the
    rounding error. The share of equal greedy picks is not: a pick flips wherever the exact
    model's top two are nearer than the error (bf16 activations alone flip a few), so that
    count moves with each CPU's arithmetic; its floor here only catches a broken kernel."""
    eng = demo_engine
    texts = [eng.tokenizer((DATA / f).read_text())["input_ids"][:384] for f in HELD]
    exact = load_resident(eng.checkpoint.path, CPU, torch.float32)
    got = fidelity.compare(exact, {fmt: load_quantized(eng.checkpoint.path, CPU, fmt) for fmt in ("int8", "int4")},
                           texts)
    for fmt, f in got.items():
        assert f.top1_agreement >= 0.85, (fmt, f)
        assert f.mean_kl < 0.01 and abs(f.ppl_candidate / f.ppl_reference - 1) < 0.02, (fmt, f)
