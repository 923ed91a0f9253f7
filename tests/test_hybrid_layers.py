"""Qwen3.5's decoder layers in C (engine/models/hybrid_layers.py, kernels/hybrid_body.h):
they run the one-token steps and verify passes of dense and mixture-of-experts Qwen3.5
models and of Qwen3-Next; a verify pass's rows are one-token steps bit for bit at every
width, in float32, bfloat16, int8 and int4, at 1 and 2 threads; the logits are close to
transformers' own layers (the bound is derived below); a streamed hybrid runs the same calls;
prefill and LFM2 keep transformers' modules, and describe() says so.

Greedy equality with generate() and speculative equality with plain decoding in every
profile run through these layers in tests/test_hybrid.py and tests/test_hybrid_speculative.py."""
import pytest
import torch

import engine
from engine.models import hybrid_layers
from tiny import build_model

IDS = list(range(5, 30))
DRAFTS = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def family(request):
    return request.param


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def model(request, family, tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp(family), family, layers=4, tokenizer=tokenizer, seed=4,
                       dtype=request.param)


class _Count:
    """How many layer passes ran in C (the wrapped methods return True when they did)."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("_attention", "_delta_net"):
            plain = getattr(hybrid_layers.HybridLayers, name)

            def run(layer_self, *args, _plain=plain):
                ran = _plain(layer_self, *args)
                self.n += bool(ran)
                return ran
            monkeypatch.setattr(hybrid_layers.HybridLayers, name, run)


def _steps_and_verify(eng, width: int):
    """The logits of `width` one-token steps after IDS, and of one verify pass over the same
    tokens from the same state."""
    t, cache = eng.target, eng.target.cache
    eng.cache_owner = None
    cache.rollback(0)
    t.forward(IDS)
    cache.checkpoint()
    steps = torch.cat([t.forward([d], all_logits=True) for d in DRAFTS[:width]])
    cache.rollback(len(IDS))
    with cache.record():
        rows = t.forward(DRAFTS[:width], all_logits=True)
    cache.rollback(len(IDS))
    cache.settle()
    cache.rollback(0)
    return steps, rows


@pytest.mark.parametrize("threads", [1, 2])
def test_verify_rows_are_one_token_steps_bit_for_bit(model, threads, monkeypatch):
    count = _Count(monkeypatch)
    eng = engine.open(str(model), drafter="none")
    assert "in C" in eng.describe()["hybrid_layers"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for width in range(1, len(DRAFTS) + 1):
                steps, rows = _steps_and_verify(eng, width)
                assert torch.equal(steps, rows), width
    finally:
        torch.set_num_threads(before)
    # 4 layers, every step and every verify pass in C (the prefills are transformers')
    widths = range(1, len(DRAFTS) + 1)
    assert count.n == 4 * (sum(widths) + len(widths))


def test_one_and_two_threads_give_the_same_bits(model):
    eng = engine.open(str(model), drafter="none")
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                got.append(_steps_and_verify(eng, 4)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], got[1])


def test_steps_after_the_cache_grows_read_the_new_cache(model):
    """A layer's C description is built once, but the cache's addresses are each pass's: a
    cache that grows mid-conversation (a new, larger tensor per layer) gives the very bits
    a cache that was large from the start gives."""
    got = []
    for grow in (False, True):
        eng = engine.open(str(model), drafter="none")
        t, cache = eng.target, eng.target.cache
        with torch.inference_mode():
            t.forward(IDS)
            steps = [t.forward([d], all_logits=True) for d in DRAFTS[:3]]
            if grow:
                before = cache.k[0].data_ptr()
                cache.reserve(cache.capacity - cache.length + 1)
                assert cache.k[0].data_ptr() != before
            steps += [t.forward([d], all_logits=True) for d in DRAFTS[3:]]
        got.append(torch.cat(steps))
    assert torch.equal(got[0], got[1])


def test_close_to_transformers_layers(family, tmp_path, tokenizer):
    """float32: each one-token step's logits against transformers' forward over the whole
    sequence, with every norm weight, decay and step bias made random too (a fresh tiny
    checkpoint holds them at their zero or one starts, which would hide a kernel that read
    them wrong). Both sides compute the same float32 arithmetic in another order (sums,
    rsqrt against 1/sqrt, exp), so each result may differ in its last bits: a relative 2^-24
    per operation, compounded through a few hundred operations of 4 layers on the way to a
    logit and amplified by the norms. Measured: 2e-6 (dense) and 2e-5 (experts) of the
    logits' range; the bound is 1e-4 of it. Dropping the attention output's sigmoid gate
    from the kernel moves them by about 1, a seventh of the range; reading the norms as
    Llama's (w, not 1 + w), by more than the range."""
    from transformers import AutoModelForCausalLM
    path = build_model(tmp_path, family, layers=4, tokenizer=tokenizer, seed=5)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    ref.save_pretrained(path)
    eng = engine.open(str(path), drafter="none")
    t = eng.target
    with torch.inference_mode():
        t.forward(IDS)
        steps = torch.cat([t.forward([d], all_logits=True) for d in DRAFTS])
        want = ref(torch.tensor([IDS + DRAFTS])).logits[0, len(IDS):].float()
    scale = want.abs().max().item()
    assert (steps - want).abs().max().item() <= 1e-4 * scale


def test_prefill_and_other_families_keep_transformers_modules(tmp_path, tokenizer, monkeypatch):
    count = _Count(monkeypatch)
    path = build_model(tmp_path / "a", "qwen3_5", layers=4, tokenizer=tokenizer, seed=6)
    eng = engine.open(str(path), drafter="none")
    with torch.inference_mode():
        eng.target.forward(IDS)
    assert count.n == 0                         # a prefill: transformers' modules
    lfm2 = engine.open(str(build_model(tmp_path / "b", "lfm2", layers=4, tokenizer=tokenizer, seed=6)),
                       drafter="none")
    assert lfm2.describe()["hybrid_layers"] == "the hybrid layers of lfm2 run transformers' modules"


@pytest.mark.parametrize("profile", ["resident-int8", "resident-int4"])
def test_quantized_weights_run_in_the_layers_and_rows_stay_steps(family, profile, tmp_path, tokenizer, monkeypatch):
    """int8 and int4 weights (bf16 activations) go through q8.c's and q4.c's products in the
    same calls: the verify rows are still one-token steps bit for bit."""
    count = _Count(monkeypatch)
    path = build_model(tmp_path, family, layers=4, tokenizer=tokenizer, seed=7, dtype=torch.bfloat16)
    eng = engine.open(str(path), drafter="none", profile=profile, cache_dir=tmp_path / "cache")
    with torch.inference_mode():
        for width in (1, 3, 6):
            steps, rows = _steps_and_verify(eng, width)
            assert torch.equal(steps, rows), width
    assert count.n == 4 * (1 + 3 + 6 + 3)


def test_streamed_layers_run_in_c_as_resident_ones(tmp_path, tokenizer, monkeypatch):
    """A streamed hybrid's layers, bound to their slots as they run, take the same C calls:
    its answer is the resident model's token for token (tests/test_hybrid_streamed.py
    compares their logits bit for bit)."""
    path = build_model(tmp_path, "qwen3_5", layers=4, tokenizer=tokenizer, seed=8)
    resident = list(engine.open(str(path), drafter="none").chat().send("hello there", max_new_tokens=12))[-1]
    count = _Count(monkeypatch)
    streamed = engine.open(str(path), drafter="none", profile="streamed-exact")
    done = list(streamed.chat().send("hello there", max_new_tokens=12))[-1]
    assert streamed.plan.chosen == "streamed-exact"
    assert list(done.token_ids) == list(resident.token_ids)
    assert count.n == 4 * (len(done.token_ids) - 1)
