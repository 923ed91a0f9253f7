"""Hybrid models (gated delta-net layers + one attention layer in four): tiny random
Qwen3.5 and Qwen3-Next checkpoints load through the real code, decode exactly as
transformers' generate() does, keep keys and values for their attention layers only, and
carry a recurrent state from turn to turn that never goes back to a position it cannot:
a re-rendered turn restores the checkpoint at the last turn boundary or prefills anew."""
import gc
import sys

import pytest
import torch

import engine
from engine.cache import RecurrentCache
from engine.planner import ModelShape
from engine.session import render_prompt
from tiny import build_model

PROMPTS = ["Why is the sky blue?", "def fib(n):\n    return n if n < 2 else fib(n - 1)", "Café 東京 🙂 for i in range(10):"]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp(request.param), request.param, layers=4, tokenizer=tokenizer, seed=2)


@pytest.fixture(scope="module")
def hybrid_engine(hybrid):
    return engine.open(str(hybrid), drafter="none")


def test_greedy_equals_generate(hybrid_engine, reference):
    eng = hybrid_engine
    assert isinstance(eng.target.cache, RecurrentCache) and eng.plan.chosen == "resident-exact"
    for prompt in PROMPTS:
        done = list(eng.chat().send(prompt, max_new_tokens=48))[-1]
        want = _generate(reference, render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}]), 48)
        assert list(done.token_ids) == want[:len(done.token_ids)] and done.reason in ("length", "stop"), prompt


def test_keys_and_values_only_for_attention_layers(hybrid, hybrid_engine):
    cfg = hybrid_engine.target.config
    attention = cfg.layer_types.count("full_attention")
    assert 0 < attention < cfg.num_hidden_layers
    cache = hybrid_engine.target.cache
    assert cache.layers == attention and len(cache.states) == cfg.num_hidden_layers - attention
    # the planner's arithmetic, by hand: 2 (k and v) x attention layers x kv heads x head dim x 4 bytes
    shape = ModelShape.from_checkpoint(hybrid)
    assert shape.kv_bytes_per_token(4) == 2 * attention * cfg.num_key_value_heads * cfg.head_dim * 4
    # the recurrent state by hand: per linear layer a conv window (2 x 2 key heads x 16 + 4
    # value heads x 16 = 128 channels, 4 columns, float32) and a state 4 x 16 x 16 in float32
    linear = cfg.num_hidden_layers - attention
    assert shape.state_bytes == linear * (128 * 4 * 4 + 4 * 16 * 16 * 4)
    # ... which is what the cache holds once a prompt has run (and its checkpoint as much again)
    hybrid_engine.cache_owner = None
    cache.rollback(0)
    hybrid_engine.target.forward([1, 2, 3])
    assert cache.state_bytes() == shape.state_bytes
    cache.checkpoint()
    assert cache.state_bytes() == 2 * shape.state_bytes
    cache.rollback(0)


def test_parameter_counts_from_the_config_alone_equal_the_checkpoint(hybrid, tmp_path, tokenizer):
    """What doctor and setup plan a hub model by before it is downloaded (its config.json)
    is what the files hold: the decoder matrices int8/int4 quantize (both layer kinds,
    experts and the shared expert) and the rest (embeddings, norms, conv kernels, router),
    for a published multimodal layout too (its vision tower is not counted: not loaded)."""
    import json
    vl = build_model(tmp_path / "vl", "qwen3_5_vl", layers=4, tokenizer=tokenizer, seed=1)
    for path in (hybrid, vl):
        planned = ModelShape.from_config(json.loads((path / "config.json").read_text()))
        held = ModelShape.from_checkpoint(path)
        assert (planned.linear_params, planned.other_params) == (held.linear_params, held.other_params) != (0, 0)
        assert planned.state_bytes == held.state_bytes and planned.attention_layers == held.attention_layers
    # a config that gives only full_attention_interval plans the same layer pattern
    cfg = json.loads((hybrid / "config.json").read_text())
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 4
    assert ModelShape.from_config(cfg).state_bytes == ModelShape.from_checkpoint(hybrid).state_bytes


@pytest.fixture(scope="module")
def reference(hybrid):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32).eval()


def _generate(reference, ids, n):
    with torch.inference_mode():
        return reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def _turn(chat, prompt, n=16):
    """Send a turn: (its answer's token ids, the prompt's token ids as the chat fed them)."""
    done = list(chat.send(prompt, max_new_tokens=n))[-1]
    return list(done.token_ids), chat.cached_ids[:chat.last_stats.prompt_tokens]


def test_four_turns_decode_as_generate_does_on_the_same_tokens(hybrid_engine, reference):
    """Each turn prefills only its new tokens onto the carried state; its answer is what
    generate() gives for the whole conversation's tokens from scratch."""
    chat = hybrid_engine.chat(system="Be brief.")
    for i, prompt in enumerate(["Hello there.", "Why is the sky blue?", "And the sunset?", "Thanks, bye."]):
        answer, ids = _turn(chat, prompt)
        if i:
            assert chat.last_stats.prefill_tokens < chat.last_stats.prompt_tokens     # the state carried over
        assert answer == _generate(reference, ids, 16)[:len(answer)], i


@pytest.mark.parametrize("where", ["answer", "first prompt"])
def test_a_diverging_re_render_restores_the_checkpoint_or_starts_over(hybrid_engine, reference, where):
    """The next turn shares only part of what the cache holds: restore the state kept at
    the last turn boundary when it covers the shared part (the first answer re-rendered
    differently), else prefill from scratch (the first prompt changed). Either way the
    answer is generate()'s on the same tokens: no state that saw dropped tokens is used."""
    chat = hybrid_engine.chat()
    _, first_ids = _turn(chat, "Tell me about tea.")
    edited = [dict(m) for m in chat.messages]
    if where == "answer":
        edited[1]["content"] = "Tea is a drink."          # an answer re-rendered differently
    else:
        edited[0]["content"] = "Tell me about coffee."
    chat.restore(edited)
    cache = hybrid_engine.target.cache
    assert cache._checkpoint[0] == len(first_ids) < cache.length
    answer, ids = _turn(chat, "And why?")
    stats = chat.last_stats
    if where == "answer":
        assert stats.prompt_tokens - stats.prefill_tokens == len(first_ids)   # restored, not recomputed
    else:
        assert stats.prefill_tokens == stats.prompt_tokens                    # nothing could be kept
    assert answer == _generate(reference, ids, 16)[:len(answer)]


def test_a_recurrent_state_never_goes_back_where_it_cannot(hybrid_engine):
    t = hybrid_engine.target
    hybrid_engine.cache_owner = None
    t.cache.rollback(0)
    t.forward(list(range(5, 25)))
    t.cache.checkpoint()
    t.forward([30, 31, 32])
    cache = t.cache
    assert cache.restorable(22) == 20 and cache.restorable(23) == 23 and cache.restorable(19) == 0
    with pytest.raises(ValueError, match="cannot go back to position 21"):
        cache.rollback(21)
    # back to the checkpoint: the next step's logits are those of a state that saw 20 tokens
    cache.rollback(20)
    again = t.forward([30], all_logits=True)
    cache.rollback(0)
    t.forward(list(range(5, 25)))
    want = t.forward([30], all_logits=True)
    assert torch.equal(again, want)
    cache.rollback(0)


def test_a_budget_nothing_fits_is_refused_with_the_figures(hybrid):
    with pytest.raises(engine.BadRequest, match="does not fit"):
        engine.open(str(hybrid), memory_budget="20KB")


def test_a_published_qwen3_5_checkpoint_runs_its_language_model_only(tmp_path, tokenizer):
    """Hub checkpoints are Qwen3_5ForConditionalGeneration with a vision tower: the
    language model is loaded (transformers maps model.language_model.*), the vision
    weights are not, and it answers as generate() does."""
    from transformers import AutoModelForCausalLM
    path = build_model(tmp_path / "qwen3_5_vl", "qwen3_5_vl", layers=4, tokenizer=tokenizer, seed=4)
    eng = engine.open(str(path), drafter="none")
    model = eng.target.impl.model
    assert not any("visual" in name for name, _ in model.named_parameters())
    assert isinstance(eng.target.cache, RecurrentCache)
    done = list(eng.chat().send("Why is the sky blue?", max_new_tokens=24))[-1]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = _generate(ref, render_prompt(eng.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}]), 24)
    assert list(done.token_ids) == want[:len(done.token_ids)]


def test_doctor_shows_the_recurrent_state_as_its_own_column(hybrid):
    """The planner's state figure is a column of its own in the doctor's table, and part of
    each row's total (weights + KV + state + activations + runtime + margin)."""
    from engine import hardware, planner, profiles
    shape = ModelShape.from_checkpoint(hybrid)
    hw = hardware.detect(vram="1GB", device="cpu")
    plan = planner.make_plan(shape, hw, profiles.builtin(), context=256)
    row = plan.row("resident-exact")
    # the live state, its turn checkpoint, and the replay buffer speculation records into
    draft = profiles.find(profiles.builtin(), "resident-exact").max_draft
    assert row.state == 2 * shape.state_bytes + shape.replay_bytes(draft) > 2 * shape.state_bytes > 0
    assert row.total == row.weights + row.kv + row.state + row.drafter + row.activations + row.runtime + row.margin
    head, first = planner.format_plan(plan).splitlines()[:2]
    assert head.split()[:5] == ["profile", "weights", "read/tok", "KV", "state"] and planner.gb(row.state) in first


def test_another_hybrid_family_lfm2_through_the_generic_path(tmp_path, tokenizer):
    """LFM2 (short-convolution layers, a conv window and no recurrent state, beside
    attention layers) runs through the same cache: greedy equals generate(), turns carry
    the window over, and the planner counts the window it holds."""
    from transformers import AutoModelForCausalLM
    path = build_model(tmp_path / "lfm2", "lfm2", layers=4, tokenizer=tokenizer, seed=6)
    eng = engine.open(str(path), drafter="none")
    cache = eng.target.cache
    assert isinstance(cache, RecurrentCache) and cache.layers == 1 and len(cache.states) == 3
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        done = list(eng.chat().send(prompt, max_new_tokens=32))[-1]
        want = _generate(ref, render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}]), 32)
        assert list(done.token_ids) == want[:len(done.token_ids)], prompt
    chat = eng.chat()
    for i, prompt in enumerate(["Hello there.", "Why is the sky blue?", "Thanks, bye."]):
        answer, ids = _turn(chat, prompt)
        if i:
            assert chat.last_stats.prefill_tokens < chat.last_stats.prompt_tokens
        assert answer == _generate(ref, ids, 16)[:len(answer)], i
    # the planner, by hand: 3 conv layers x hidden 64 x conv_L_cache 3 columns x 4 bytes
    assert ModelShape.from_checkpoint(path).state_bytes == cache.state_bytes() // 2 == 3 * 64 * 3 * 4


def test_gguf_import_of_a_hybrid_and_a_clear_refusal_of_one_transformers_cannot_read(tmp_path, tokenizer):
    """A hybrid whose GGUF form transformers reads (LFM2) imports once into safetensors and
    answers exactly as the checkpoint it was written from (float32: lossless). A GGUF of
    an architecture neither transformers nor localchat reads (Jamba's) is one line naming
    the file and what to use instead (Qwen3.5's GGUFs: tests/test_gguf_hybrid.py)."""
    import gguf
    from gguf_writer import write_gguf
    src = build_model(tmp_path / "lfm2", "lfm2", layers=4, tokenizer=tokenizer, seed=8)
    path = write_gguf(src, tmp_path / "lfm2-tiny.gguf")
    eng = engine.open(str(path), drafter="none", cache_dir=tmp_path / "cache")
    ref = engine.open(str(src), drafter="none")
    assert eng.checkpoint.source == "gguf" and isinstance(eng.target.cache, RecurrentCache)
    for prompt in PROMPTS[:2]:
        got = list(eng.chat().send(prompt, max_new_tokens=24))[-1].token_ids
        assert got == list(ref.chat().send(prompt, max_new_tokens=24))[-1].token_ids
    other = tmp_path / "jamba.gguf"
    w = gguf.GGUFWriter(str(other), "jamba")
    w.add_block_count(4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(engine.EngineError, match=r"jamba.gguf: transformers .* cannot read GGUF files of the jamba "
                                                 r"architecture; use the model's safetensors checkpoint"):
        engine.open(str(other), drafter="none", cache_dir=tmp_path / "cache")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_a_hybrid_loads_holding_its_weights_once(tmp_path, tokenizer):
    """The peak resident memory of loading a dense Qwen3.5 checkpoint (anonymous memory and
    the mapped pages of its file both count) stays within the weights plus the caches plus
    10% of the weights. transformers' from_pretrained held the mapped file and the model at
    once (a Qwen3.5-2B-shaped 2.95 GB checkpoint peaked at 6.15 GB); the loader copies one
    tensor at a time out of its file (targets/module_exact.py)."""
    path = build_model(tmp_path / "model", "qwen3_5", layers=4, hidden=768, tokenizer=tokenizer, seed=3)
    engine.open(str(build_model(tmp_path / "warm", "qwen3_5", layers=4, tokenizer=tokenizer, seed=3)),
                drafter="none")                  # imports, kernel builds, allocator pools: not the load's
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")                        # reset the peak (VmHWM) to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    base = _rss()["VmRSS"]
    eng = engine.open(str(path), drafter="none")
    peak = _rss()["VmHWM"] - base
    weights, caches = eng.target.weight_bytes(), eng.target.cache.nbytes()
    assert weights > 90e6                      # large beside the allocator's and the import's noise
    assert peak < 1.1 * weights + caches, (peak, weights, caches)


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out
