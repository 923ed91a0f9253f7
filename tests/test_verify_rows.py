"""A verify pass's rows are one-token steps, bit for bit, where this machine's kernels
allow it (engine/models/rows.py): the probe's decision holds for the shapes it probed,
and with it speculative greedy output equals plain greedy on bf16 models, Llama family
and hybrid, for a drafter that is always right (every draft must be accepted: a row
that rounded differently would reject one)."""
import math

import pytest
import torch

import engine
from engine.drafters import NoDrafter
from engine.models import rows
from engine.session import render_prompt
from tiny import build_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [64, 576, 1536, 2048])
def test_the_probes_decision_holds(dtype, K):
    check = rows.check([(K, 512)], dtype, CPU)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(512, K, generator=g) * 0.05).to(dtype).t()
    x = torch.randn(9, K, generator=g).to(dtype)
    if not check.exact:
        pytest.skip(check.reason)           # the known limit, reported by describe()
    for M in (2, 5, 9):
        out = torch.mm(x[:M], w)
        assert all(torch.equal(out[r], rows.mm(x[r:r + 1], w, check.pad)[0]) for r in range(M)), M


class Truth:
    """Proposes plain decoding's own answer."""
    kind = "scripted"

    def __init__(self, answer, prompt_len):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, history, k, params=None, gen=None):
        at = len(history) - self.prompt_len
        return list(self.answer[at:at + k]), None


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_bf16_speculation_accepts_every_right_draft(tmp_path, tokenizer, kind):
    # hidden 1536-wide products: where this machine's bf16 matrix-vector kernel differs
    path = build_model(tmp_path / kind, kind, layers=4, hidden=768, tokenizer=tokenizer, seed=4)
    eng = engine.open(str(path), drafter="none", dtype="bfloat16")
    check = eng.target.impl.rows
    assert eng.describe()["verify_rows"] == check.reason
    if not check.exact:
        pytest.skip(check.reason)
    eng.stop_ids = frozenset()
    prompt = "Why is the sky blue?"
    plain = list(list(eng.chat().send(prompt, max_new_tokens=33))[-1].token_ids)
    eng.drafter = Truth(plain, len(render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}])))
    eng.draft_tokens = 4
    chat = eng.chat()
    got = list(list(chat.send(prompt, max_new_tokens=33))[-1].token_ids)
    eng.drafter = NoDrafter()
    assert got == plain
    assert chat.last_stats.acceptance == 1.0 and chat.last_stats.forward_passes == math.ceil(32 / 5)
