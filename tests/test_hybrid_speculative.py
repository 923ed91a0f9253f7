"""Speculative decoding on hybrid models (engine/models/replay.py): a verify pass records
the recurrent layers' inputs instead of overwriting their state, and the accepted updates
are replayed. Greedy output equals plain greedy for every k and drafter kind, in every
profile; the committed state after every round is plain decoding's, bit for bit, where
the matrix kernels are row-invariant (the int8 target, as tests/test_quantized.py checks
of its kernels); replay equals the pass it recorded; the buffer writes land; the reserve
the planner reports is the bytes allocated."""
import math

import pytest
import torch

import engine
from engine.drafters import NgramDrafter, NoDrafter
from engine.planner import ModelShape
from engine.session import render_prompt
from tiny import build_model

PROMPTS = ["Why is the sky blue?", "Repeat: a b c a b c a b c a b c"]


class ScriptedDrafter:
    """Proposes from a known answer: the truth, or the truth with every `wrong_every`-th
    token (or all of them) off by one."""
    kind = "scripted"

    def __init__(self, answer, prompt_len, vocab, wrong_every=None, check=None):
        self.answer, self.prompt_len, self.vocab, self.wrong_every = answer, prompt_len, vocab, wrong_every
        self.check = check
        self.rounds = 0

    def propose(self, history, k, params=None, gen=None):
        if self.check is not None:
            self.check(history)
        self.rounds += 1
        at = len(history) - self.prompt_len
        out = list(self.answer[at:at + k])
        if self.wrong_every:
            out = [(t + 1) % self.vocab if (at + i) % self.wrong_every == self.wrong_every - 1 else t
                   for i, t in enumerate(out)]
        return out, None


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe", "lfm2"])
def hybrid(request, tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp(request.param), request.param, layers=4, tokenizer=tokenizer, seed=9)


def _answer(eng, prompt, n=40):
    chat = eng.chat()
    done = list(chat.send(prompt, max_new_tokens=n))[-1]
    return list(done.token_ids), chat.last_stats


def _prompt_len(eng, prompt):
    return len(render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}]))


def _int8_engine(path, cache_dir):
    """bf16 activations over int8 weights, the head quantized too: every product of a
    verify pass gives a row what a one-token step gives it (the packed kernels' property,
    tests/test_quantized.py), so greedy identity holds by construction, not by the absence
    of near-ties (a dense bf16 or float32 GEMM over k+1 rows may round differently from a
    one-row product: the known limit in docs/speculative.md)."""
    from engine.checkpoint import Checkpoint
    from engine.targets.quantized import load_quantized
    target = load_quantized(path, torch.device("cpu"), "int8", cache_dir=cache_dir, embeddings=True)
    return engine.Engine(Checkpoint(path, "tiny", "dir"), engine.engine._load_tokenizer(path), target,
                         drafter=NoDrafter())


@pytest.mark.parametrize("target", ["float32 exact", "int8"])
def test_greedy_identity_for_every_k_and_drafter(hybrid, target, tmp_path):
    if target == "int8":
        eng = _int8_engine(hybrid, tmp_path)
    else:     # the tiny model's greedy choices are decisive: no near-tie for rounding to flip
        eng = engine.open(str(hybrid), drafter="none", dtype="float32")
    eng.stop_ids = frozenset()                    # every answer runs its length: more rounds
    plain = [_answer(eng, p)[0] for p in PROMPTS]
    vocab = eng.target.vocab_size
    for k in (1, 2, 4, 8, None):
        for kind in ("ngram", "right", "wrong", "mixed"):
            for prompt, want in zip(PROMPTS, plain):
                if kind == "ngram":
                    eng.drafter = NgramDrafter()
                else:
                    every = {"right": None, "wrong": 1, "mixed": 3}[kind]
                    eng.drafter = ScriptedDrafter(want, _prompt_len(eng, prompt), vocab, every)
                eng.draft_tokens = k
                got, stats = _answer(eng, prompt)
                assert got == want, (k, kind, prompt)
                if kind == "right" and k is not None:      # every draft accepted: k+1 a pass
                    assert stats.acceptance == 1.0 and stats.forward_passes == math.ceil(39 / (k + 1))
                if kind == "wrong" and stats.drafted_tokens:
                    assert stats.accepted_tokens == 0 and stats.tokens_per_pass == 1.0
    eng.drafter, eng.draft_tokens = NoDrafter(), None


def _states(target):
    target.cache.settle()
    return [tuple(None if t is None else t.clone() for t in (s.layer.conv_states[0], s.layer.recurrent_states[0]))
            for s in target.cache.states]


def test_committed_state_after_every_round_is_plain_decodings(hybrid, tmp_path):
    """On the int8 target every product a verify pass computes is row-invariant (the packed
    kernel), so the state replay commits must be plain decoding's to the bit."""
    eng = engine.open(str(hybrid), drafter="none", profile="resident-int8", cache_dir=tmp_path)
    eng.stop_ids = frozenset()
    prompt = PROMPTS[0]
    want, _ = _answer(eng, prompt, n=30)
    # plain decoding's state at every length of this answer
    t = eng.target
    ids = render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}])
    eng.cache_owner = None
    t.cache.rollback(0)
    t.forward(ids)
    plain = {len(ids): _states(t)}
    for i, tok in enumerate(want[:-1]):
        t.forward([tok])
        plain[len(ids) + i + 1] = _states(t)
    eng.cache_owner = None
    t.cache.rollback(0)
    checked = []

    def check(history):            # the drafter is asked at the start of every round
        length = len(history) - 1  # the last token is fed by this round's pass
        if length in plain and length > len(ids):
            for (c, r), (pc, pr) in zip(_states(t), plain[length]):
                assert torch.equal(c, pc) and (r is None or torch.equal(r, pr)), length
            checked.append(length)
    eng.drafter = ScriptedDrafter(want, len(ids), t.vocab_size, wrong_every=3, check=check)
    eng.draft_tokens = 4
    got, stats = _answer(eng, prompt, n=30)
    assert got == want and len(checked) >= 5 and 0 < stats.accepted_tokens < stats.drafted_tokens


def test_replay_equals_the_pass_it_recorded_and_the_writes_land(hybrid):
    """Replaying m recorded positions gives the state the pass itself reached after m (one
    token at a time through the recurrence: the construction), for every m; the buffer
    regions the pass wrote hold its inputs (poisoned with NaN before, none left), and the
    committed state tensors are written in place (their addresses do not move)."""
    with torch.inference_mode():        # the states and buffers are inference tensors
        _replay_checks(engine.open(str(hybrid), drafter="none"))


def _replay_checks(eng):
    t, cache = eng.target, eng.target.cache
    eng.cache_owner = None
    cache.rollback(0)
    t.forward(list(range(5, 30)))
    base = _states(t)
    cache.checkpoint()
    addresses = [s.layer.conv_states[0].data_ptr() for s in cache.states]
    drafts = [40, 41, 42, 43, 44]
    with cache.record():
        t.forward(drafts, all_logits=True)              # allocates the buffers
    cache.rollback(25)
    cache.settle()
    for rep in cache.replays:
        for buf in rep.buf.values():
            buf.fill_(float("nan"))
    for m in range(1, len(drafts) + 1):
        with cache.record():
            t.forward(drafts, all_logits=True)
        for rep in cache.replays:
            assert all(not torch.isnan(b.narrow(2 if n == "raw" else 1, 0, 5).float()).any()
                       for n, b in rep.buf.items())
        cache.rollback(25 + m)
        cache.settle()
        got = _states(t)
        # the reference: the same recorded inputs, one position at a time, from the base state
        for rep, (c0, r0), (c, r) in zip(cache.replays, base, got):
            if rep.kind == "delta":
                from engine.models.replay import _fns
                _, rule = _fns(rep.mod)
                state = r0.clone()
                for j in range(m):
                    _, state = rule(*(rep.buf[n].narrow(1, j, 1) for n in ("q", "k", "v")),
                                    g=rep.buf["g"].narrow(1, j, 1), beta=rep.buf["beta"].narrow(1, j, 1),
                                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
                assert torch.equal(r, state), m
            raw = rep.buf["raw"].narrow(2, 0, m).to(c0.dtype)
            assert torch.equal(c, torch.cat([c0, raw], -1)[..., -c0.shape[-1]:]), m
        cache.rollback(25)                                 # the turn checkpoint: back to the base
    assert [s.layer.conv_states[0].data_ptr() for s in cache.states] == addresses
    cache.rollback(0)


def test_every_profile_drafts_and_stays_plain(hybrid, tmp_path):
    for profile in ("resident-int4", "streamed-exact"):
        eng = _open_smallest(hybrid, profile, tmp_path)
        if profile == "streamed-exact":
            assert eng.target.placement.disk           # some layers really are read every pass
        assert eng.drafter.kind == "ngram" and not eng.describe()["drafter_note"]
        eng.stop_ids = frozenset()
        want = [_answer(eng, p)[0] for p in PROMPTS]
        eng.drafter = NoDrafter()
        assert [_answer(eng, p)[0] for p in PROMPTS] == want
        for p, w in zip(PROMPTS, want):
            eng.drafter, eng.draft_tokens = ScriptedDrafter(w, _prompt_len(eng, p), eng.target.vocab_size, 3), 4
            assert _answer(eng, p)[0] == w


def _open_smallest(path, profile, cache_dir):
    """The profile under about the smallest budget it runs in (steps of 5% of the files)."""
    from engine.checkpoint import tensor_index
    total = sum(e.nbytes for e in tensor_index(path).values())
    for step in range(10, 400, 5):
        try:
            # float32 throughout (the int4 target's activations too): decisive greedy choices
            return engine.open(str(path), drafter="ngram", profile=profile, memory_budget=total * step // 100,
                               context=256, cache_dir=cache_dir, dtype="float32")
        except engine.BadRequest:
            continue
    raise AssertionError(f"{profile} opens under no budget")


def test_the_reserve_the_planner_reports_is_what_is_allocated(hybrid):
    eng = engine.open(str(hybrid), drafter="none")
    t, cache = eng.target, eng.target.cache
    eng.cache_owner = None
    cache.rollback(0)
    t.forward(list(range(5, 30)))
    with cache.record():                          # the widest pass: max_draft + 1 positions
        t.forward(list(range(40, 40 + eng.max_draft + 1)), all_logits=True)
    cache.rollback(25)
    shape = ModelShape.from_checkpoint(hybrid)
    assert cache.replay_bytes() == shape.replay_bytes(eng.max_draft, 4) > 0
    # far less than a state per draft position
    assert shape.replay_bytes(eng.max_draft, 4) < (eng.max_draft + 1) * shape.state_bytes
    cache.rollback(0)


@pytest.mark.parametrize("k", [2, 4, None])
def test_a_hybrid_drafter_replays_its_own_state(hybrid, tmp_path, k):
    """A hybrid drafts for a hybrid: its own steps are recorded and, at the next round,
    rolled back to what the target accepted by replay. Target and drafter are the same
    int8 weights with the head quantized too, every product row-invariant, so every draft
    must be accepted (k+1 tokens a pass): a drafter state that kept a rejected token, or
    lost an accepted one, would propose something else. And --draft-model self runs."""
    from engine.drafters import ModelDrafter

    eng = _int8_engine(hybrid, tmp_path)
    eng.stop_ids = frozenset()
    plain = [_answer(eng, p)[0] for p in PROMPTS]
    eng.drafter = ModelDrafter(_int8_engine(hybrid, tmp_path).target, "self", eng.target.vocab_size)
    eng.drafter.target.cache.replay_capacity = eng.max_draft + 2
    eng.draft_tokens = k
    for p, want in zip(PROMPTS, plain):
        got, stats = _answer(eng, p)
        assert got == want
        if k is not None:
            assert stats.acceptance == 1.0 and stats.forward_passes == math.ceil(39 / (k + 1))
    # as a user asks for it: an int4 copy of the hybrid drafting for it
    user = engine.open(str(hybrid), drafter="model", draft_model="self", cache_dir=tmp_path)
    assert user.drafter.kind == "model" and not user.describe()["drafter_note"]
    user.stop_ids = frozenset()
    user.draft_tokens = 3
    ref = engine.open(str(hybrid), drafter="none")
    ref.stop_ids = frozenset()
    for p in PROMPTS:
        got, stats = _answer(user, p)
        assert got == _answer(ref, p)[0] and stats.drafted_tokens > 0


def test_sampled_verification_through_the_recorded_pass_keeps_p(hybrid):
    """Sampling: 3000 rounds of one drafted token (drawn from a q unlike p) verified by a
    recorded pass on the real cache, each rolled back to the same committed state; the
    emitted token follows the target's p (chi-square over its top tokens and the rest),
    and the committed state is untouched by all of them."""
    from engine.sampling import SamplingParams, probabilities
    from engine.speculative import verify_sampled
    with torch.inference_mode():
        eng = engine.open(str(hybrid), drafter="none")
        t, cache = eng.target, eng.target.cache
        eng.cache_owner = None
        cache.rollback(0)
        prefix = list(range(5, 30))
        t.forward(prefix)
        cache.checkpoint()
        before = _states(t)
        params = SamplingParams(temperature=1.5, seed=0)
        p = probabilities(t.forward([31], all_logits=True)[0], params)     # plain: the token after 31
        cache.rollback(len(prefix))                     # back to the prefix via its checkpoint
        top = torch.topk(p, 5).indices
        q = torch.full_like(p, 1.0 / p.numel())         # a uniform drafter
        gen = torch.Generator().manual_seed(1234)
        counts, N = torch.zeros(6), 3000
        for _ in range(N):
            x = int(torch.multinomial(q, 1, generator=gen))
            with cache.record():
                logits = t.forward([31, x], all_logits=True)
            n, nxt = verify_sampled(logits, [x], q.view(1, -1), params, gen)
            first = x if n == 1 else nxt
            cache.rollback(len(prefix))                 # inside the recording: nothing committed
            hit = (top == first).nonzero()
            counts[int(hit[0]) if hit.numel() else 5] += 1
        want = torch.cat([p[top], (1 - p[top].sum()).view(1)]) * N
        chi2 = float(((counts - want) ** 2 / want).sum())
        assert chi2 < 20.52, (chi2, counts, want)      # df = 5, p = 0.001
        cache.settle()
        assert all(torch.equal(a, b) for s0, s1 in zip(before, _states(t)) for a, b in zip(s0, s1) if a is not None)
