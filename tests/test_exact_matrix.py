"""Speculation never changes a greedy answer, in every format and placement the engine
runs a Llama-family model in: float32, bf16, int8 and int4 weights resident, float32 and
bf16 streamed layer by layer, each with n-gram drafting at a fixed k = 4 and with the
int4 self-drafter (a quantized copy of the target) at k = 4 and adaptive k. Each answer is
the plain answer of the same target token for token, and the drafter did draft. The
prompts repeat themselves, so n-gram drafts are taken and rejected both."""
import pytest
import torch

import engine
from tiny import budget_for

PROMPTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "def f(x):\n    return x + 1\ndef g(x):\n"]
TARGETS = [("resident-exact", "float32"), ("resident-exact", "bfloat16"), ("resident-int8", "float32"),
           ("resident-int4", None), ("streamed-exact", "float32"), ("streamed-exact", "bfloat16")]
DRAFTERS = [("ngram", None, 4), ("model", "self", 4), ("model", "self", None)]


def _answers(eng) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        chat = eng.chat()
        events = list(chat.send(p, max_new_tokens=32))
        out.append((list(events[-1].token_ids), chat.last_stats))
    return out


@pytest.mark.parametrize("profile,dtype", TARGETS, ids=[f"{p}-{d or 'bf16'}" for p, d in TARGETS])
def test_speculative_equals_plain_in_every_format_and_placement(request, tmp_path, profile, dtype):
    if profile == "streamed-exact":     # a deeper model under a budget that streams most of its layers
        model = request.getfixturevalue("tiny_deep")
        opts = dict(memory_budget=budget_for(model, profile, context=256, dtype=getattr(torch, dtype)),
                    context=256)
    else:
        model = request.getfixturevalue("tiny_llama")
        opts = {}
    eng = engine.open(str(model), drafter="none", profile=profile, dtype=dtype, cache_dir=tmp_path, **opts)
    eng.stop_ids = frozenset()
    want = [a for a, _ in _answers(eng)]
    for kind, draft_model, k in DRAFTERS:
        eng.set_drafter(kind, draft_model, cache_dir=tmp_path)
        eng.draft_tokens = k
        got = _answers(eng)
        assert [a for a, _ in got] == want, (kind, k)
        assert sum(s.drafted_tokens for _, s in got) > 0, (kind, k)
    if profile == "streamed-exact":
        moved = eng.target.stream_stats()
        assert moved.disk_bytes + moved.host_bytes > 0                # layers were read as they ran


@pytest.fixture(scope="module")
def busy_core():
    """Another process keeping a core busy for the module's tests, stopped by its pid."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def _threads_changing(target):
    """Make every pass of `target` run on another thread count than the one before (1, 2,
    1, ...): whatever changes the count between passes (a streamed target's one-token
    steps, the user's own code), the answer must not follow it."""
    import itertools
    forward, counts = target.forward, itertools.cycle([1, 2])

    def changing(ids, all_logits=False):
        before = torch.get_num_threads()
        torch.set_num_threads(next(counts))
        try:
            return forward(ids, all_logits)
        finally:
            torch.set_num_threads(before)
    target.forward = changing


LOADED = TARGETS + [("hybrid-qwen3_5", "float32"), ("hybrid-qwen3_5", "bfloat16"), ("hybrid-qwen3_5_moe", "bfloat16")]


@pytest.mark.parametrize("profile,dtype", LOADED, ids=[f"{p}-{d or 'bf16'}" for p, d in LOADED])
def test_speculative_equals_plain_beside_a_busy_core_with_the_threads_changing(request, tmp_path, tokenizer,
                                                                              busy_core, profile, dtype):
    # the plain answer of a quiet engine; then n-gram drafting, fixed and adaptive, with
    # another process on a core and the thread count changed before every pass
    opts = {}
    if profile == "streamed-exact":
        model = request.getfixturevalue("tiny_deep")
        opts = dict(memory_budget=budget_for(model, profile, context=256, dtype=getattr(torch, dtype)),
                    context=256)
    elif profile.startswith("hybrid-"):
        from tiny import build_model
        model = build_model(tmp_path / "m", profile.removeprefix("hybrid-"), layers=4, tokenizer=tokenizer, seed=9)
        profile = "resident-exact"
    else:
        model = request.getfixturevalue("tiny_llama")
    eng = engine.open(str(model), drafter="none", profile=profile, dtype=dtype, cache_dir=tmp_path, **opts)
    eng.stop_ids = frozenset()
    want = [a for a, _ in _answers(eng)]
    _threads_changing(eng.target)
    for k in (4, None):
        eng.set_drafter("ngram", None, cache_dir=tmp_path)
        eng.draft_tokens = k
        got = _answers(eng)
        assert [a for a, _ in got] == want, k
        assert sum(s.drafted_tokens for _, s in got) > 0, k
