"""A verify pass's rows are one-token steps, bit for bit, where this machine's kernels
allow it (engine/models/rows.py): the probe's decision holds for the shapes it probed,
and with it speculative greedy output equals plain greedy on bf16 (and, through the row
kernel, float32) models, Llama family and hybrid, for a drafter that is always right (every draft must be accepted: a row
that rounded differently would reject one). Both with bf16 products through the row
kernel (engine/kernels, where this CPU has AVX512-BF16) and through torch's kernels, as a
CPU without it runs them."""
import math

import pytest
import torch

import engine
from engine.drafters import NoDrafter
from engine.kernels import dispatch, row_kernel
from engine.models import rows
from engine.session import render_prompt
from tiny import build_model

CPU = torch.device("cpu")


@pytest.fixture(params=["row kernel", "torch"])
def kernels(request, monkeypatch):
    """Products through the row kernels, or through torch's as on a CPU without AVX-512."""
    if request.param == "row kernel" and not row_kernel.available(torch.bfloat16):
        pytest.skip(f"row kernel: {row_kernel.why_not(torch.bfloat16)}")
    if request.param == "torch":
        monkeypatch.setattr(row_kernel, "_state", {d: "turned off (test)" for d in row_kernel.FUNCTIONS})
    monkeypatch.setattr(rows, "_cache", {})
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [64, 576, 1536, 2048])
def test_the_probes_decision_holds(dtype, K, kernels):
    check = rows.check([(K, 512)], dtype, CPU)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(512, K, generator=g) * 0.05).to(dtype).t()
    x = torch.randn(9, K, generator=g).to(dtype)
    if not check.exact:
        pytest.skip(check.reason)           # the known limit, reported by describe()
    assert check.kernel == (kernels == "row kernel")
    for M in (2, 5, 9):
        product = "rows" if check.kernel else "torch"         # a verify pass's, a step's
        out = dispatch.dense_mm(x[:M], w, None, product, check.pad)
        assert all(torch.equal(out[r], dispatch.dense_mm(x[r:r + 1], w, None, product, check.pad)[0])
                   for r in range(M)), M


class Truth:
    """Proposes plain decoding's own answer."""
    kind = "scripted"

    def __init__(self, answer, prompt_len):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, history, k, params=None, gen=None):
        at = len(history) - self.prompt_len
        return list(self.answer[at:at + k]), None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_speculation_accepts_every_right_draft(tmp_path, tokenizer, kind, dtype, kernels):
    # hidden 1536-wide products: where this machine's bf16 matrix-vector kernel differs
    # (float32: torch's kernels round rows apart at every width; the row kernel does not)
    path = build_model(tmp_path / kind, kind, layers=4, hidden=768, tokenizer=tokenizer, seed=4)
    eng = engine.open(str(path), drafter="none", dtype=dtype)
    check = eng.target.impl.rows
    assert check.kernel == (kernels == "row kernel")
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
