"""The layer kernel (engine/kernels/layer.c): a resident Llama-family model's decoder
layers in one call of C for one-token steps and verify passes.

What it guarantees by construction, asserted bit for bit: every row of a verify pass is the
one-token step's row, at any thread count. What it computes, asserted within rounding: the
forward's torch operations on the same weights (it rounds where they round, but sums in
its own order, and attention in float32). Where the CPU lacks AVX-512 (bf16: AVX512-BF16)
it is off and these tests skip; the forward then runs its torch operations, which the rest
of the suite covers."""
import subprocess
import sys

import pytest
import torch

import engine
from engine.kernels import layer_kernel, q4_kernel, q8_kernel
from tiny import build_model

DTYPES = ["float32", "bfloat16", "int8", "int4"]


def needs(dtype: str):
    why = layer_kernel.why_not(getattr(torch, dtype))
    if why:
        pytest.skip(f"layer kernel: {why}")


def _qwen2(path, tokenizer):
    """Qwen2: biases on q/k/v (layer.c's qkv_bias), 4 heads over 2 key/value heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():            # random biases: transformers starts them at zero
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def model_path(request, tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2":
        return _qwen2(path, tokenizer)
    return build_model(path, request.param, layers=3, hidden=128, tokenizer=tokenizer, seed=5)


def _open(path, dtype, cache_dir=None):
    """The model in `dtype` ("float32", "bfloat16"), or "int8" / "int4": resident int8 per
    channel or int4 in groups of 32, bf16 activations, products through engine/kernels/q8.c
    or q4.c."""
    needs("bfloat16" if dtype in ("int8", "int4") else dtype)
    if dtype == "int8":
        if not q8_kernel.available():
            pytest.skip(f"int8 kernel: {q8_kernel.why_not()}")
        eng = engine.open(str(path), profile="resident-int8", drafter="none", cache_dir=cache_dir)
    elif dtype == "int4":
        if not q4_kernel.available():
            pytest.skip(f"int4 kernel: {q4_kernel.why_not()}")
        eng = engine.open(str(path), profile="resident-int4", drafter="none", cache_dir=cache_dir)
    else:
        eng = engine.open(str(path), dtype=dtype, drafter="none")
    fwd = eng.target.impl
    assert fwd.layer_kernel_note == "" and fwd._stack is not None
    return eng, fwd


def _torch_ops(fwd):
    """The forward with its layers run as torch operations ."""
    stack = fwd._stack

    class Off:
        def __enter__(self):
            fwd._stack = None

        def __exit__(self, *exc):
            fwd._stack = stack
    return Off()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pass_computes_what_the_torch_operations_do(model_path, dtype, tmp_path):
    eng, fwd = _open(model_path, dtype, tmp_path)
    t = eng.target
    ids = torch.arange(5, 45)
    with torch.inference_mode():
        t.forward(ids[:33])                      # a prefill: torch's operations either way
        at = t.cache.length
        fused = t.forward(ids[33:40], all_logits=True)
        t.cache.length = at
        with _torch_ops(fwd):
            want = t.forward(ids[33:40], all_logits=True)
    scale = want.abs().max().item()
    # float32: sums in another order; bf16: each rounded step may land one bf16 step apart
    tol = 3e-5 if dtype == "float32" else 5e-2
    assert (fused - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_of_a_verify_pass_is_a_one_token_step(model_path, dtype, threads, tmp_path):
    eng, fwd = _open(model_path, dtype, tmp_path)
    t = eng.target
    ids = torch.arange(7, 60)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            t.forward(ids[:20])
            at = t.cache.length
            for width in (2, 5, 17, 33):
                t.cache.length = at
                verify = t.forward(ids[20:20 + width], all_logits=True)
                t.cache.length = at
                steps = torch.cat([t.forward(ids[20 + r:21 + r]) for r in range(width)])
                assert torch.equal(verify, steps), width
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_grown_cache_is_followed(tiny_llama, dtype, tmp_path):
    """The kernel writes keys and values into the cache's own tensors: after the cache is
    reallocated (a conversation outgrew it) it writes into the new ones."""
    eng, fwd = _open(tiny_llama, dtype, tmp_path)
    t = eng.target
    ids = torch.arange(3, 3 + 40)
    with torch.inference_mode():
        t.cache._allocate(16)                   # small, so the steps below grow it
        t.cache.length = 0
        t.forward(ids[:10])
        steps = [t.forward(ids[i:i + 1]) for i in range(10, 40)]
        assert t.cache.capacity >= 40
        t.cache.length = 0
        with _torch_ops(fwd):
            t.forward(ids[:10])
            want = [t.forward(ids[i:i + 1]) for i in range(10, 40)]
    tol = 3e-5 if dtype == "float32" else 5e-2
    assert max((a - b).abs().max().item() for a, b in zip(steps, want)) <= tol * want[-1].abs().max().item()


def test_greedy_answer_with_the_kernel_is_plain_greedy_with_speculation(tiny_qwen3):
    """n-gram speculation over the layer kernel answers exactly as one-token steps do."""
    needs("float32")
    plain = engine.open(str(tiny_qwen3), drafter="none")
    spec = engine.open(str(tiny_qwen3), drafter="ngram", draft_tokens=4)
    for prompt in ["def fib(n):\n    return fib(n - 1)", "The quick brown fox jumps over the lazy dog. " * 3]:
        want = list(plain.chat().send(prompt, max_new_tokens=48))[-1].token_ids
        got = list(spec.chat().send(prompt, max_new_tokens=48))[-1].token_ids
        assert list(got) == list(want)


def test_turned_off_by_the_environment(tiny_llama):
    code = ("import engine; f = engine.open(%r, drafter='none').target.impl; "
            "print(f.layer_kernel_note); assert f._stack is None" % str(tiny_llama))
    env = {**__import__("os").environ, "LOCALCHAT_LAYER_KERNEL": "off"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LOCALCHAT_LAYER_KERNEL=off" in out.stdout


def test_an_int4_model_decodes_eagerly_through_the_kernel(tiny_llama, tmp_path):
    """Its int4 weights stay in the form q4.c reads (no second, repacked copy)."""
    eng, fwd = _open(tiny_llama, "int4", tmp_path)
    assert all(getattr(w, name).canonical for w in fwd.layers for name in layer_kernel.MATRICES)
    assert eng.describe()["layer_kernel"] == ""


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("tied"), "llama", layers=2, tokenizer=tokenizer, seed=9, tie=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_whole_pass_in_one_call_is_the_layers_then_the_head(model_path, dtype, tmp_path):
    """A step or verify pass runs ids to logits in one call of C (embedding, layers, final
    norm, head): its logits are, bit for bit, those of the stack of layers followed by the
    final norm and the head's own product, as a streamed target computes them."""
    _whole_against_apart(*_open(model_path, dtype, tmp_path))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_tied_int8_table_is_embedded_in_the_same_call(tied_llama, dtype, tmp_path):
    """A quantized profile holds a tied table in int8 (the head's format): the pass reads
    its embedding rows from it as Int8Weight.rows dequantizes them."""
    eng, fwd = _open(tied_llama, dtype, tmp_path)
    assert fwd._stack.embed is not None and fwd._stack.embed.group == -1
    _whole_against_apart(eng, fwd)


def _whole_against_apart(eng, fwd):
    t, stack = eng.target, fwd._stack
    assert stack.has_head and stack.embed is not None
    ids = list(range(7, 60))
    with torch.inference_mode():
        t.forward(ids[:20])
        at = t.cache.length
        for width, all_logits in ((1, False), (5, True), (17, True), (4, False)):
            t.cache.length = at
            whole = t.forward(ids[20:20 + width], all_logits=all_logits)
            t.cache.length = at
            head, stack._head = stack._head, None       # the layers in C, then norm and head apart
            try:
                apart = t.forward(ids[20:20 + width], all_logits=all_logits)
            finally:
                stack._head = head
            assert whole.shape == (width if all_logits else 1, t.vocab_size)
            assert torch.equal(whole, apart), width


def test_an_id_outside_the_vocabulary_is_refused_as_torch_refuses_it(tiny_llama):
    needs("float32")
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    t = eng.target
    with torch.inference_mode():
        t.forward(list(range(3, 10)))
        with pytest.raises(IndexError):
            t.forward([t.vocab_size + 5])


@pytest.mark.parametrize("n", [1, 7, 16, 33, 49152])
def test_argmax_is_torchs(n):
    needs("float32")
    g = torch.Generator().manual_seed(n)
    cases = [torch.randn(n, generator=g), torch.zeros(n), torch.full((n,), float("-inf"))]
    x = torch.randint(-3, 3, (n,), generator=g).float()           # ties: the first of equals
    cases.append(x)
    if n > 2:
        y = torch.randn(n, generator=g)
        y[n // 2] = float("nan")
        y[n - 1] = float("nan")
        cases.append(y)                                            # a NaN is the largest
        z = torch.randn(n, generator=g)
        z[n - 1] = 1e9                                             # the largest in the tail
        cases.append(z)
        cases.append(torch.randn(n, generator=g)[1:])              # not 64-byte aligned
    for x in cases:
        x = x.contiguous()
        assert layer_kernel.argmax(x) == int(torch.argmax(x)), x
