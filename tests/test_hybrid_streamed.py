"""Hybrid models streamed (targets/streamed_modules.py): transformers' own layers, both
kinds, bound to prefetch slots as they run. The logits are the resident target's bit for
bit whatever share stays resident, on 1 and 2 threads, in float32 and bfloat16; a chat
through engine.open(profile="streamed-exact") answers what resident-exact answers; the
budget is held; a read fault mid-run leaves the conversation and the ring intact."""
import os
import shutil

import pytest
import torch

import engine
from engine.cache import RecurrentCache
from engine.checkpoint import tensor_index
from engine.targets.resident import load_resident
from engine.targets.streamed import load_streamed, minimum_budget
from tiny import build_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_5_vl", "lfm2"])
def hybrid(request, tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp(request.param), request.param, layers=8, tokenizer=tokenizer,
                       seed=5, shard="300KB")


def _passes(target, seed=0):
    """A prefill, one-token steps and multi-token passes (the conv window and the
    recurrent state carried across each), as decoding and a chat's next turn make them."""
    g = torch.Generator().manual_seed(seed)
    out = [target.forward(torch.randint(0, target.vocab_size, (23,), generator=g).tolist(), all_logits=True)]
    for n in (1, 1, 2, 5, 1, 17, 1):
        out.append(target.forward(torch.randint(0, target.vocab_size, (n,), generator=g).tolist(), all_logits=True))
    return out


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("share", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_streamed_logits_equal_resident_bit_for_bit(hybrid, share, dtype, torch_threads):
    ref = _passes(load_resident(hybrid, CPU, dtype))
    total = sum(e.nbytes for e in tensor_index(hybrid).values())
    slot = 4096 * 4          # small slots: the head is streamed in several chunks
    budget = minimum_budget(hybrid, CPU, dtype, slot_numel=slot) + int(total * share * torch.finfo(dtype).bits / 32)
    st = load_streamed(hybrid, CPU, dtype, weight_budget=budget, slot_numel=slot)
    assert st.modules and isinstance(st.cache, RecurrentCache) and len(st.index.head_units) > 1
    assert st.placement.disk and (st.placement.resident_layers(8) > 0) == (share > 0)
    for i, (a, b) in enumerate(zip(ref, _passes(st))):
        assert torch.equal(a, b), f"pass {i}: max difference {(a - b).abs().max().item()}"
    assert st.ledger.peak <= st.weight_budget
    st.close()


def test_chat_streamed_equals_resident(hybrid):
    """As a user runs it: several turns, a re-rendered answer restored from the turn
    checkpoint, the same tokens as resident-exact."""
    total = sum(e.nbytes for e in tensor_index(hybrid).values())
    st = engine.open(str(hybrid), drafter="none", profile="streamed-exact", memory_budget=int(total * 0.6),
                     context=256)
    res = engine.open(str(hybrid), drafter="none", context=256)
    assert st.plan.chosen == "streamed-exact" and st.describe()["streaming"]["disk_units"] > 0
    chats = [st.chat(), res.chat()]
    for i, turn in enumerate(("Hello there.", "Why is the sky blue?", "And the sunset?")):
        got = [list(c.send(turn, max_new_tokens=16))[-1].token_ids for c in chats]
        assert got[0] == got[1], i
        prefill = [c.last_stats.prefill_tokens for c in chats]
        assert prefill[0] == prefill[1]          # the same cache reuse: the state carried over
        if i == 1:
            assert prefill[0] < chats[0].last_stats.prompt_tokens
            for c in chats:                      # the user edits the answer: both go back as far as they can
                edited = [dict(m) for m in c.messages]
                edited[-1]["content"] = "Because of Rayleigh scattering."
                c.restore(edited)


def test_minimum_budget_refusal_and_file_fault(hybrid, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(hybrid, path)
    with pytest.raises(engine.BadRequest, match="raise --vram"):
        engine.open(str(path), profile="streamed-exact", memory_budget="20KB", drafter="none")
    # about the smallest budget the planner streams this model in (steps of 5% of the files)
    total = sum(e.nbytes for e in tensor_index(path).values())
    for step in range(10, 200, 5):
        try:
            eng = engine.open(str(path), profile="streamed-exact", memory_budget=total * step // 100, context=256,
                              drafter="none")
            break
        except engine.BadRequest:
            continue
    assert eng.plan.chosen == "streamed-exact" and eng.target.placement.disk
    chat = eng.chat()
    assert list(chat.send("hello", max_new_tokens=4))[-1].reason in ("length", "stop")
    weights = sorted(path.glob("model-*.safetensors"))[-1]
    saved = tmp_path / "saved.safetensors"
    shutil.copy(weights, saved)
    with open(weights, "r+b") as fh:
        fh.truncate(os.path.getsize(weights) // 2)
    done = list(chat.send("and again", max_new_tokens=4))[-1]
    assert done.reason == "error" and weights.name in done.error
    shutil.copy(saved, weights)
    assert list(chat.send("once more", max_new_tokens=4))[-1].reason in ("length", "stop")
