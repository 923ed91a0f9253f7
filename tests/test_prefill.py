"""A prefill runs in chunks (engine/decode.py): its activations are bounded by a chunk, which
the plan counts; each chunk but the last reports progress; and a cancel stops a long prompt
within one chunk, the cache holding exactly the tokens that ran, so the next turn goes on
from there."""
import pytest
import torch

import engine
from engine import decode, planner
from engine.shape import ModelShape


@pytest.fixture(scope="module")
def eng(tiny_llama):
    return engine.open(str(tiny_llama), dtype="float32", drafter="none")


def _long_prompt(n_words: int) -> str:
    return " ".join(f"word{i % 97}" for i in range(n_words))


def test_chunks_give_the_last_logits_of_one_pass(eng):
    t = eng.target
    ids = [3 + i % 50 for i in range(3 * decode.PREFILL_CHUNK + 17)]
    t.cache.rollback(0)
    whole = t.forward(ids)[-1].clone()
    t.cache.rollback(0)
    steps = list(decode.prefill_chunks(t, ids))
    assert [d for d, _ in steps] == [512, 1024, 1536, len(ids)] and all(x is None for _, x in steps[:-1])
    assert t.cache.length == len(ids)
    # other GEMM shapes, the same sums to float32 rounding
    assert torch.allclose(steps[-1][1], whole, rtol=1e-4, atol=1e-4)
    t.cache.rollback(0)


def test_a_long_prefill_is_cancelled_within_one_chunk_and_the_next_turn_goes_on(eng):
    chat = eng.chat()
    events, cancelled_at = [], None
    for ev in chat.send(_long_prompt(420), max_new_tokens=4):
        events.append(ev)
        if isinstance(ev, engine.Stats) and cancelled_at is None and ev.prefill_pending:
            cancelled_at = ev.prefill_tokens - ev.prefill_pending
            chat.cancel()
    done = events[-1]
    total = next(e.prefill_tokens for e in events if isinstance(e, engine.Stats))
    assert total > 3 * decode.PREFILL_CHUNK                 # several chunks' worth
    assert cancelled_at == decode.PREFILL_CHUNK            # the first chunk's progress
    assert isinstance(done, engine.Done) and done.reason == "cancelled" and done.token_ids == ()
    assert not any(isinstance(e, engine.TextDelta) for e in events)
    assert eng.target.cache.length == cancelled_at         # exactly what ran, nothing after the cancel
    # The next answer prefills only what the cancelled one did not run
    chat2_events = list(chat.send("and then?", max_new_tokens=3))
    stats = chat.last_stats
    assert chat2_events[-1].reason in ("length", "stop")
    assert stats.prefill_pending == 0 and stats.prefill_tokens < stats.prompt_tokens - cancelled_at + 8


def test_the_plan_counts_a_prefill_chunk():
    shape = ModelShape(name="x", layers=28, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128,
                       vocab=151936, dtype_bytes=2, linear_params=1, other_params=1, tied_embeddings=True,
                       attention_layers=28)
    verify = 9
    act = planner.activation_bytes(shape, verify, 8192)
    per_pos = 4 * 2048 + 2 * 6144 + (16 + 16) * 128
    assert act == 512 * per_pos * 4 + 512 * 16 * 8192 * 4 + verify * 151936 * 4
    wide = planner.activation_bytes(shape, verify, 8192, planner.STREAMED_PREFILL_CHUNK)
    assert wide > act


def test_a_small_budget_prefills_in_narrower_chunks_rather_than_refuse(tiny_llama):
    from engine import hardware, profiles
    shape = planner.ModelShape("m", 2, 64, 4, 2, 16, 128, 400, 4, 10**6, 10**5, False, 2)
    hw = hardware.Hardware((), 10**10, 10**10, 10**10, "/", "cpu", 2, False, "cpu", 10**9, ("vram",))
    wide = planner.make_plan(shape, hw, profiles.builtin(), context=4096).row("resident-exact")
    assert wide.prefill_chunk == decode.PREFILL_CHUNK
    budget = int((wide.total - wide.margin - wide.activations // 3) / 0.9)
    small = hardware.Hardware((), 10**10, 10**10, 10**10, "/", "cpu", 2, False, "cpu", budget, ("vram",))
    row = planner.make_plan(shape, small, profiles.builtin(), context=4096, force="resident-exact").row("resident-exact")
    assert row.fits and row.prefill_chunk < decode.PREFILL_CHUNK and row.total <= budget
    # and the engine prefills in the chunks its plan counted
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    assert eng.target.prefill_chunk == eng.plan.row(eng.plan.chosen).prefill_chunk
