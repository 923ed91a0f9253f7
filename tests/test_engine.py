"""The engine on tiny random models: exactness against transformers, the KV cache,
multi-turn prefix reuse, sampling, cancel, and the errors of a request."""
import threading

import pytest
import torch

import engine
from engine.session import render_prompt
from engine.targets.resident import load_resident


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])
def test_fast_forward_matches_transformers(kind, request):
    """The fast forward gives the transformers model's logits: prefill, one-token steps,
    and a multi-token pass that starts mid-cache (a later turn, a verify pass)."""
    path = request.getfixturevalue(kind)
    ref = hf_model(path)
    fast = load_resident(path, torch.device("cpu"), torch.float32, fast=True)
    assert fast.kind == "fast"
    ids = torch.randint(0, ref.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids).logits[0].float()
    got = torch.cat([fast.forward(ids[0, :20], all_logits=True),
                     fast.forward(ids[0, 20:21], all_logits=True),
                     fast.forward(ids[0, 21:29], all_logits=True),
                     fast.forward(ids[0, 29:], all_logits=True)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fast.cache.length == 40


def test_generic_forward_is_the_transformers_forward(tiny_llama):
    ref = hf_model(tiny_llama)
    gen = load_resident(tiny_llama, torch.device("cpu"), torch.float32, fast=False)
    assert gen.kind == "transformers"
    ids = torch.arange(3, 33).view(1, -1)
    with torch.inference_mode():
        want = ref(ids).logits[0]
    got = torch.cat([gen.forward(ids[0, :17], all_logits=True), gen.forward(ids[0, 17:], all_logits=True)])
    if gen.impl.rows.kernel:
        # the passes' products ran the row kernel (engine/kernels), the reference torch's:
        # the same arithmetic, each product's float32 sums rounded in another order
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("fast", [True, False])
def test_greedy_equals_generate(kind, fast, request):
    path = request.getfixturevalue(kind)
    eng = engine.open(str(path), fast=fast)
    ref = hf_model(path)
    for prompt in ["Why is the sky blue?", "def fib(n):", "Café 東京 🙂"]:
        chat = eng.chat()
        events = list(chat.send(prompt, max_new_tokens=40))
        done = events[-1]
        ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}])])
        with torch.inference_mode():
            want = ref.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        assert list(done.token_ids) == want


def test_text_deltas_concatenate_to_decode(tiny_llama):
    """Streaming never breaks UTF-8 nor doubles spaces: the deltas add up to decode()."""
    eng = engine.open(str(tiny_llama))
    eng.stop_ids = frozenset()
    chat = eng.chat()
    events = list(chat.send("Café, naïve, 東京 🙂", max_new_tokens=200, temperature=1.0, seed=3))
    text = "".join(e.text for e in events if isinstance(e, engine.TextDelta))
    done = events[-1]
    assert text == eng.tokenizer.decode(list(done.token_ids), skip_special_tokens=True) == done.text
    assert len(done.token_ids) == 200


def test_incremental_decoder_on_multibyte_and_code(tokenizer):
    from engine.detokenize import IncrementalDecoder
    for sample in ["東京 🙂 Привет, naïve café", "def fib(n):\n    return n if n < 2 else fib(n - 1)\n\tx = '  '"]:
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        dec = IncrementalDecoder(tokenizer)
        parts = [dec.push([i]) for i in ids] + [dec.flush()]
        assert "".join(parts) == tokenizer.decode(ids) == sample
        assert all("\ufffd" not in p for p in parts)


def test_second_turn_prefills_only_new_tokens(tiny_llama):
    """Turn 2 runs only the tokens added since turn 1: the end of the answer, the new
    user message and the template around it, not the history."""
    eng = engine.open(str(tiny_llama))
    chat = eng.chat(system="You are terse.")
    list(chat.send("Why is the sky blue?", max_new_tokens=12))
    first = chat.last_done
    turn1_tokens = chat.last_stats.prompt_tokens + len(first.token_ids)
    list(chat.send("And the sunset?", max_new_tokens=12))
    s = chat.last_stats
    # The new part: "<|im_end|>\n<|im_start|>user\nAnd the sunset?<|im_end|>\n<|im_start|>assistant\n"
    tok = eng.tokenizer
    new = tok("<|im_end|>\n<|im_start|>user\nAnd the sunset?<|im_end|>\n<|im_start|>assistant\n",
              add_special_tokens=False)["input_ids"]
    stopped = first.reason == "stop"   # a stop token is replaced by the template's own end-of-turn
    assert s.prompt_tokens == turn1_tokens + len(new) - (1 if stopped else 0)
    # Everything up to the last generated token (never fed back) came from the cache.
    assert s.prefill_tokens == len(new) + 1


def test_multi_turn_matches_fresh_prefill(tiny_llama):
    """Reusing the cache across turns gives the same tokens as one prefill of the same token history."""
    eng = engine.open(str(tiny_llama))
    chat = eng.chat()
    for q in ["Why is the sky blue?", "Tell me more.", "def fib(n):"]:
        list(chat.send(q, max_new_tokens=15))
    history = list(chat._turn_ids)
    cached = list(chat.send("Once more.", max_new_tokens=15))[-1].token_ids
    prompt = history + eng.tokenizer("<|im_end|>\n<|im_start|>user\nOnce more.<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)["input_ids"]
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False)[0, len(prompt):].tolist()
    assert list(cached) == want


def test_kv_cache_rollback_and_growth(tiny_llama):
    t = load_resident(tiny_llama, torch.device("cpu"), torch.float32)
    t.cache._allocate(8)                       # start small to force growth
    ids = list(range(3, 23))
    a = t.forward(ids[:12], all_logits=True)
    assert t.cache.capacity >= 12 and t.cache.length == 12
    t.cache.rollback(5)
    b = t.forward(ids[5:20], all_logits=True)
    t2 = load_resident(tiny_llama, torch.device("cpu"), torch.float32)
    full = t2.forward(ids[:20], all_logits=True)
    torch.testing.assert_close(torch.cat([a[:5], b]), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        t.cache.rollback(99)


def test_an_answer_that_fills_the_context_ends_at_length_and_says_so(tmp_path, tokenizer):
    """It stops where the context is full, as at max_tokens (the OpenAI API's "length"),
    with a note why; drafting near the end drafts only what fits, so the answer is the
    same with and without a drafter. A prompt that does not fit at all is refused."""
    from tiny import build_model
    path = build_model(tmp_path / "short", "llama", max_positions=64, tokenizer=tokenizer)
    answers = []
    for drafter in ("none", "ngram"):
        eng = engine.open(str(path), drafter=drafter)
        eng.stop_ids = frozenset()
        eng.draft_tokens = None if drafter == "none" else 8
        chat = eng.chat()
        done = list(chat.send("Why is the sky blue?", max_new_tokens=500))[-1]
        assert done.reason == "length" and "context is full (64 tokens)" in done.error and done.text
        assert eng.target.cache.length == 64 and chat.last_stats.context_tokens == 64
        answers.append(done.token_ids)
        with pytest.raises(engine.BadRequest, match="context holds 64"):
            chat.send("and then? " * 40)
    assert answers[0] == answers[1]


def test_sampling_is_seeded_and_varies(tiny_llama):
    eng = engine.open(str(tiny_llama))
    runs = [list(eng.chat().send("Hello", max_new_tokens=20, temperature=1.0, seed=s))[-1].token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_top_k_one_is_greedy(tiny_llama):
    eng = engine.open(str(tiny_llama))
    greedy = list(eng.chat().send("Hello", max_new_tokens=20))[-1].token_ids
    topk1 = list(eng.chat().send("Hello", max_new_tokens=20, temperature=1.5, top_k=1, seed=1))[-1].token_ids
    assert greedy == topk1


def test_top_p_keeps_the_nucleus():
    from engine.sampling import SamplingParams, probabilities
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).sum() == 3


@pytest.mark.parametrize("written, want, note", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}, (0.6, 0.95, 20), "generation_config.json"),
    ({"do_sample": True, "temperature": 0.7}, (0.7, 1.0, 0), "generation_config.json"),
    ({"do_sample": True, "temperature": None, "top_k": 40}, (1.0, 1.0, 40), "generation_config.json"),
    ({"temperature": 0.6, "top_p": 0.95}, (0.0, 1.0, 0), "does not sample"),
    ({"do_sample": "yes", "temperature": 0.6}, (0.0, 1.0, 0), "does not sample"),
    ({"do_sample": True, "temperature": -1}, (0.0, 1.0, 0), "out of range"),
    ({"do_sample": True, "top_p": 1.5}, (0.0, 1.0, 0), "out of range"),
    ({"do_sample": True, "top_k": 2.5}, (0.0, 1.0, 0), "out of range"),
    ({"do_sample": True, "temperature": "hot"}, (0.0, 1.0, 0), "out of range"),
    ([0.6], (0.0, 1.0, 0), "does not sample"),
    (None, (0.0, 1.0, 0), "has no generation_config.json"),
    ("{not json", (0.0, 1.0, 0), "cannot be read"),
])
def test_the_models_recommended_sampling_comes_from_its_generation_config(tmp_path, written, want, note):
    """Sampling is what the file turns on (do_sample true, as transformers reads it), with
    the values it writes and the neutral ones for those it leaves out; anything else is
    greedy, with a note that says why."""
    import json
    from engine.sampling import describe, model_defaults
    if written is not None:
        text = written if isinstance(written, str) else json.dumps(written)
        (tmp_path / "generation_config.json").write_text(text)
    params, why = model_defaults(tmp_path)
    assert (params.temperature, params.top_p, params.top_k) == want
    assert why.endswith(note)
    assert describe(params) == ("greedy" if want[0] == 0 else
                                f"temperature {want[0]:g}, top-p {want[1]:g}, top-k {want[2] or 'off'}")


def test_an_engine_carries_its_models_recommendation_and_send_stays_greedy(tmp_path, tiny_llama):
    """eng.sampling is the checkpoint's recommendation, for the app to use; send() itself,
    told nothing, answers greedy whatever the model recommends."""
    import json
    import shutil
    model = shutil.copytree(tiny_llama, tmp_path / "m")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.6,
                                                              "top_k": 20}))
    eng = engine.open(str(model))
    assert (eng.sampling.temperature, eng.sampling.top_k, eng.sampling.top_p) == (0.6, 20, 1.0)
    assert eng.sampling_note == "the model's generation_config.json"
    assert engine.open(str(tiny_llama)).sampling.greedy
    greedy = list(engine.open(str(tiny_llama)).chat().send("Hello", max_new_tokens=12))[-1].token_ids
    assert list(eng.chat().send("Hello", max_new_tokens=12))[-1].token_ids == greedy


def test_cancel_from_another_thread(tiny_llama):
    eng = engine.open(str(tiny_llama))
    eng.stop_ids = frozenset()
    chat = eng.chat()
    seen = 0
    for ev in chat.send("Tell me a long story", max_new_tokens=3000):
        if isinstance(ev, engine.TextDelta):
            seen += 1
            if seen == 5:
                threading.Thread(target=chat.cancel).start()
    done = chat.last_done
    assert done.reason == "cancelled" and 5 <= len(done.token_ids) < 3000
    assert chat.messages[-1] == {"role": "assistant", "content": done.text}


def test_bad_requests(tiny_llama):
    eng = engine.open(str(tiny_llama))
    chat = eng.chat()
    with pytest.raises(engine.BadRequest, match="empty"):
        chat.send("   ")
    with pytest.raises(engine.BadRequest, match="--max-tokens 0"):
        chat.send("hi", max_new_tokens=0)
    with pytest.raises(engine.BadRequest, match="--top-p"):
        chat.send("hi", top_p=0)
    with pytest.raises(engine.BadRequest, match="--dtype"):
        engine.open(str(tiny_llama), dtype="int3")
    assert chat.messages == []


def test_stop_token_ends_the_answer(tiny_llama):
    eng = engine.open(str(tiny_llama))
    chat = eng.chat()
    first = list(chat.send("Hello", max_new_tokens=30))[-1]
    # Make the first generated token a stop token: the answer ends there, with no text.
    eng.stop_ids = frozenset({first.token_ids[0]})
    done = list(eng.chat().send("Hello", max_new_tokens=30))[-1]
    assert done.reason == "stop" and done.token_ids == (first.token_ids[0],) and done.text == ""


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_rms_norm_is_the_reference_bit_for_bit_whichever_form_it_uses(request, fixture):
    """The fast forward uses a faster RMSNorm form only where the probe found it rounds as
    the reference does on this machine (engine/models/norms.py); either way its output is
    the reference's bits, in float32 and in bfloat16."""
    from engine.models import norms
    for dtype in (torch.float32, torch.bfloat16):
        fast = load_resident(request.getfixturevalue(fixture), torch.device("cpu"), dtype).impl
        g = torch.Generator().manual_seed(0)
        for width, w in [(fast.norm.numel(), fast.norm), (fast.head_dim, fast.layers[0].q_norm)]:
            if w is None:
                continue
            for rows in (1, 5, 33):
                x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
                assert torch.equal(fast._rms(x, w), norms.reference(x, w, fast.eps)), (dtype, width, rows)


def test_transformers_cache_adapter_crops_the_shared_cache(tiny_llama):
    t = load_resident(tiny_llama, torch.device("cpu"), torch.float32, fast=False)
    t.forward(list(range(3, 23)))
    t.impl.hf_cache.crop(-5)
    assert t.cache.length == 15 and t.impl.hf_cache.get_seq_length() == 15
