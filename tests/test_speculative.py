"""Speculative decoding never changes the answer: greedy output is plain greedy output
token for token, sampled output has the target's distribution; caches always hold
exactly the committed tokens; the draft length adapts to what pays."""
import math
import random
from fractions import Fraction

import pytest
import torch

import engine
from engine import speculative
from engine.drafters import ModelDrafter, NgramDrafter, NoDrafter
from engine.sampling import SamplingParams, accept_probability, residual, verify_sampled
from engine.speculative import DraftController, expected_tokens
from engine.targets.resident import load_resident

PROMPTS = ["Why is the sky blue?", "def fib(n):\n    return n if n < 2 else fib(n - 1)", "Café 東京 🙂 for i in range(10):"]


class ScriptedDrafter:
    """Proposes from a known answer: the truth (always right) or the truth + 1 (always wrong)."""
    kind = "scripted"

    def __init__(self, answer: list[int], prompt_len: int, vocab: int, wrong: bool):
        self.answer, self.prompt_len, self.vocab, self.wrong = answer, prompt_len, vocab, wrong

    def propose(self, history, k, params=None, gen=None):
        at = len(history) - self.prompt_len      # answer tokens already in history
        out = self.answer[at:at + k]
        return ([(t + 1) % self.vocab for t in out] if self.wrong else out), None


def answer(eng, prompt, n=48, **kw):
    chat = eng.chat()
    done = list(chat.send(prompt, max_new_tokens=n, **kw))[-1]
    return done, chat.last_stats


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return engine.open(str(tiny_llama), drafter="none")


@pytest.mark.parametrize("k", [1, 2, 4, 8, None])
@pytest.mark.parametrize("kind", ["ngram", "self"])
def test_greedy_identity_for_every_k(tiny_engine, tiny_llama, k, kind):
    eng = tiny_engine
    plain = [answer(eng, p)[0].token_ids for p in PROMPTS]
    if kind == "ngram":
        eng.drafter = NgramDrafter()
    else:   # the target as its own drafter: every draft is accepted
        eng.drafter = ModelDrafter(load_resident(tiny_llama, eng.device, eng.dtype), "self", eng.target.vocab_size)
    eng.draft_tokens, eng.max_draft = k, 8
    try:
        for p, want in zip(PROMPTS, plain):
            done, stats = answer(eng, p)
            assert done.token_ids == want
            if kind == "self" and k is not None and done.reason == "length":
                assert stats.acceptance == 1.0
                assert stats.forward_passes == math.ceil((len(want) - 1) / (k + 1))
    finally:
        eng.drafter, eng.draft_tokens = NoDrafter(), None


@pytest.mark.parametrize("wrong", [True, False])
def test_scripted_drafter_always_wrong_or_right(tiny_engine, wrong):
    eng = tiny_engine
    eng.stop_ids = frozenset()
    try:
        prompt = PROMPTS[0]
        want, plain_stats = answer(eng, prompt, n=40)
        from engine.session import render_prompt
        plen = len(render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}]))
        eng.drafter = ScriptedDrafter(list(want.token_ids), plen, eng.target.vocab_size, wrong)
        eng.draft_tokens = 4
        done, stats = answer(eng, prompt, n=40)
        assert done.token_ids == want.token_ids
        if wrong:
            assert stats.tokens_per_pass == 1.0 and stats.accepted_tokens == 0 and stats.drafted_tokens > 0
        else:
            assert stats.acceptance == 1.0 and stats.forward_passes == math.ceil(39 / 5)
    finally:
        eng.drafter, eng.draft_tokens = NoDrafter(), None
        eng.stop_ids = engine.engine._stop_ids(eng.checkpoint.path, eng.tokenizer)


def test_caches_hold_exactly_the_committed_tokens(tiny_llama):
    """After every round the target's and the drafter's caches hold the committed tokens."""
    eng = engine.open(str(tiny_llama), drafter="none")
    drafter = ModelDrafter(load_resident(tiny_llama, eng.device, eng.dtype, fast=False), "generic",
                           eng.target.vocab_size)
    ids = eng.tokenizer("Hello there, how are you?")["input_ids"]
    history = list(ids)
    first = eng.target.forward(ids)[-1]
    ctl = DraftController(max_draft=6)
    params = SamplingParams(temperature=0.8, seed=0)
    gen = torch.Generator().manual_seed(0)
    rounds = 0
    for out in speculative.generate(eng.target, drafter, ctl, history, first, params, gen, 80, frozenset()):
        rounds += 1
        assert eng.target.cache.length == len(history)
        assert drafter.target.cache.length == len(drafter.ids)
        assert drafter.ids == history[:len(drafter.ids)] or rounds == 1
    assert len(history) > len(ids) + 40


def test_a_drafters_catch_up_is_not_counted_as_draft_cost(tiny_llama):
    # The first proposal prefills the whole prompt into the drafter; that prefill is timed
    # apart (the controller would otherwise think each drafted token costs a prefill, and
    # stop drafting for good), and the draft steps after it feed one token each.
    eng = engine.open(str(tiny_llama), drafter="none")
    drafter = ModelDrafter(load_resident(tiny_llama, eng.device, eng.dtype), "self", eng.target.vocab_size)
    history = eng.tokenizer("Hello there, how are you today? I am fine, thank you.")["input_ids"]
    fed = []
    forward = drafter.target.forward
    drafter.target.forward = lambda ids, *a, **kw: fed.append(len(ids)) or forward(ids, *a, **kw)
    tokens, _ = drafter.propose(history, 3, SamplingParams(), None)
    assert drafter.catch_up_seconds > 0
    assert fed == [len(history) - 1, 1, 1, 1]
    assert drafter.ids == history + tokens[:-1]
    fed.clear()
    drafter.propose(history + tokens[:1], 2, SamplingParams(), None)
    assert drafter.catch_up_seconds == 0.0 and fed == [1, 1]
    # Every draft accepted plus the target's own token: a round's usual two, not a catch-up.
    fed.clear()
    drafter.propose(history + tokens[:1] + [5, 6], 2, SamplingParams(), None)
    assert drafter.catch_up_seconds == 0.0 and fed[0] == 2


def test_long_chat_same_text_with_speculation(tiny_llama):
    plain = engine.open(str(tiny_llama), drafter="none")
    spec = engine.open(str(tiny_llama), drafter="ngram", draft_tokens=3)
    a, b = plain.chat(system="Be brief."), spec.chat(system="Be brief.")
    for q in ["Why is the sky blue?", "Tell me more.", "def fib(n):", "Again, shorter."]:
        ta = list(a.send(q, max_new_tokens=30))[-1]
        tb = list(b.send(q, max_new_tokens=30))[-1]
        assert ta.token_ids == tb.token_ids and ta.text == tb.text


# ---------------------------------------------------------------- the acceptance rule

def emission(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that the first emitted token is x, through the engine's own rule:
    draft x ~ q, kept with accept_probability, else replaced from residual(p, q)."""
    keep = torch.tensor([q[x] * accept_probability(float(p[x]), float(q[x])) for x in range(len(p))],
                        dtype=torch.float64)
    return keep + (1 - keep.sum()) * residual(p, q)


def test_acceptance_rule_gives_exactly_p():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    torch.testing.assert_close(emission(p, q), p, rtol=0, atol=1e-15)
    # The same by hand in exact fractions: A kept always (p > q), B always, C with 2/5;
    # rejection mass 3/10 goes to norm(max(0, p - q)) = (1, 0, 0).
    P, Q = [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)], [Fraction(1, 5), Fraction(3, 10), Fraction(1, 2)]
    kept = [Q[i] * min(1, P[i] / Q[i]) for i in range(3)]
    assert [accept_probability(float(P[i]), float(Q[i])) for i in range(3)] == [1.0, 1.0, 0.4]
    assert [kept[0] + (1 - sum(kept)), kept[1], kept[2]] == P


def test_acceptance_rule_on_random_distributions():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 12, (1,), generator=g))
        p = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        q = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        p, q = p / p.sum(), q / q.sum()
        torch.testing.assert_close(emission(p, q), p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("one_hot", [False, True])
def test_sampled_first_token_follows_p(one_hot):
    """50,000 first tokens through the real verification path; chi-square against p."""
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])
    logits = torch.log(p).expand(2, -1).clone()           # the target's two positions
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(p))
    N = 50_000
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
    for x in drafts:
        if one_hot:    # n-gram style: a fixed proposal (here token 3), q one-hot
            n, nxt = verify_sampled(logits, [3], None, params, gen)
            first = 3 if n == 1 else nxt
        else:
            n, nxt = verify_sampled(logits, [x], q.view(1, -1), params, gen)
            first = x if n == 1 else nxt
        counts[first] += 1
    expected = p * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.52, (chi2, counts / N)       # df = 5, p = 0.001


@pytest.mark.parametrize("a,k", [(0.3, 1), (0.5, 3), (0.8, 4), (0.9, 8), (0.6, 6)])
def test_expected_tokens_matches_simulation(a, k):
    rng = random.Random(42)
    rounds, total = 100_000, 0
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        total += n + 1
    assert abs(total / rounds - expected_tokens(a, k)) / expected_tokens(a, k) < 0.02


def test_controller_picks_plain_decoding_when_drafting_does_not_pay():
    c = DraftController(max_draft=8, prior_acceptance=0.3)
    for n in range(1, 10):
        c.t_pass[n] = 0.01 * n            # compute-bound: each position costs a full step
    c.t_draft = 0.0
    assert c.choose() == 0
    c.t_pass = {n: 0.01 * (1 + 0.02 * (n - 1)) for n in range(1, 10)}    # weight-bound: nearly flat
    c.a = 0.8
    assert c.choose() >= 4


def test_controller_measures_a_plain_step_before_weighing_drafts():
    # Only a 3-position pass measured (the first draft round): extrapolated, a plain step would look as dear as a verify
    # pass; the controller takes one plain step to measure it instead.
    c = DraftController(max_draft=8, prior_acceptance=0.6)
    c.t_draft, c.t_pass = 0.002, {3: 0.030}
    assert c.choose() == 0
    c.observe(0, 0, 0.0, 0.010)                 # a plain step: a third of the verify pass
    assert c.t_pass[1] == 0.010
    assert c.choose() == 0                      # 1.6 tokens for 34 ms loses to 1 for 10 ms
    c.t_pass[1] = 0.028                         # a plain step as dear as the verify pass
    assert c.choose() > 0


def test_a_new_chat_starts_from_the_acceptance_earlier_chats_measured(tiny_llama):
    eng = engine.open(str(tiny_llama), drafter="model", draft_model=str(tiny_llama), dtype="float32")
    assert eng.new_controller().a == 0.5        # nothing measured: the prior
    chat = eng.chat()
    list(chat.send("the cat sat on the mat", max_new_tokens=40))
    assert chat.last_stats.drafted_tokens > 0 and eng.costs.acceptance == pytest.approx(1.0)   # it drafts for itself
    assert eng.new_controller().a == pytest.approx(1.0)
    eng.set_drafter("ngram")                     # another drafter: its acceptance is unknown
    assert eng.new_controller().a == 0.5


def test_controller_probes_again_after_a_plain_streak():
    c = DraftController(max_draft=8, prior_acceptance=0.05, probe_every=4)
    c.t_pass = {n: 0.01 * n for n in range(1, 10)}
    c.t_draft = 0.001
    ks = [c.choose() for _ in range(8)]
    assert ks.count(0) == 6 and ks[3] > 0 and ks[7] > 0


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 0, 2, 3]
    assert d.propose(history, 3)[0] == [7, 8]             # "2 3" most recently followed by 7 8 (2-token match: 2)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(history, 3)[0] == [4, 5, 9]          # the longer match "1 2 3" wins, and proposes k
    assert d.propose([4, 6, 5, 6], 3)[0] == [5]           # a 1-token match proposes 1
    assert d.propose([5, 6, 7], 2) == ([], None)          # nothing repeats
    assert d.propose(history, 0) == ([], None)


def test_drafter_with_another_tokenizer_is_refused(tiny_llama, tmp_path):
    from tiny import build_model, build_tokenizer
    other_tok = build_tokenizer(corpus=["zebra quokka " * 5, "xylophone jazz " * 5, "0123456789 " * 3])
    other = build_model(tmp_path / "other", "llama", tokenizer=other_tok)
    with pytest.raises(engine.BadRequest, match="does not share the tokenizer"):
        engine.open(str(tiny_llama), drafter="model", draft_model=str(other))


def test_controller_does_not_probe_a_drafter_as_slow_as_the_target():
    c = DraftController(max_draft=8, prior_acceptance=0.9, probe_every=4)
    c.t_pass = {n: 0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}
    c.t_draft = 0.01                      # a draft step costs a whole target pass
    assert [c.choose() for _ in range(12)] == [0] * 12


def test_lookup_ceiling_takes_the_longest_earlier_run():
    from localchat.bench import ceiling_speedup, lookup_ceiling
    context = [1, 2, 3, 4, 5, 9, 2, 3]
    # The pass that feeds 7 can draft 2,3,4,5 (found earlier), so it ends with the
    # target's own 8: 5 tokens; the last token 8 counts as one more.
    assert lookup_ceiling(context, [7, 2, 3, 4, 5, 8]) == [5, 1]
    assert lookup_ceiling(context, [7, 2, 3, 4, 5, 8], max_draft=2) == [3, 2, 1]
    # Nothing repeats: one token per pass, the ceiling is plain decoding.
    rounds = lookup_ceiling([1, 2], [3, 4, 5])
    assert rounds == [1, 1, 1]
    assert ceiling_speedup(rounds, {1: 0.1, 2: 0.11}) == pytest.approx(1.0)
    # 5 tokens in 2 passes of 1 and 4 positions, a 4-position pass costing 1.5 steps.
    assert ceiling_speedup([1, 4], {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.5}) == pytest.approx(5 / 2.5)


def test_a_new_chat_knows_the_drafters_cost_and_does_not_probe_again(tiny_llama):
    # The tiny model drafting for itself: a draft step costs a whole target pass, so once
    # measured, no chat of this engine should spend passes drafting with it again.
    eng = engine.open(str(tiny_llama), drafter="model", draft_model=str(tiny_llama), dtype="float32")
    first = eng.chat()
    list(first.send("the cat sat on the mat", max_new_tokens=40))
    assert first.last_stats.drafted_tokens > 0                     # the first chat probes to measure
    assert eng.costs.t_draft is not None
    # as if drafting were plainly too slow: far past any pass time a busy machine can measure
    # (at 10x a pass, a step slowed 20x by another process made the periodic probe look worth it)
    eng.costs.t_draft = 1e6 * eng.costs.t_pass[1]
    second = eng.chat()
    list(second.send("the cat sat on the mat", max_new_tokens=40))
    assert second.last_stats.drafted_tokens == 0
    eng.set_drafter("ngram")                                # another drafter: its cost is unknown
    assert eng.costs.t_draft is None and eng.costs.t_pass
