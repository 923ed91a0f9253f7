"""Constrained decoding (engine/constrain.py): the grammar's state follows the committed
tokens through drafts, cuts and rollbacks; greedy constrained output with any drafter is
constrained output without one, token for token, on a dense and on a hybrid model; a cut
draft keeps sampled output's distribution; the reasoning stays free; a schema the library
cannot enforce is refused naming the feature."""
import json
import subprocess
import sys

import jsonschema
import pytest
import torch

import engine
from engine import constrain
from engine.constrain import ACTIVE, FREE_FIRST, THINKING, Constraint, Grammar
from engine.drafters import ModelDrafter, NgramDrafter, NoDrafter
from engine.sampling import SamplingParams, verify_sampled
from engine.session import render_prompt
from engine.targets.resident import load_resident
from test_hybrid_speculative import ScriptedDrafter  # noqa: F401  (the truth, or off by one)
from tiny import build_model

# Every value bounded, so that even a random model's answer ends well within the tokens given.
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "name": {"type": "string", "maxLength": 8}},
          "required": ["ok", "n", "color", "tags", "name"]}
PROMPTS = ["Why is the sky blue?", "Repeat: a b c a b c a b c a b c"]


def test_the_state_follows_consumed_tokens_and_rolls_back(tokenizer):
    c = Constraint(Grammar.json_schema(SCHEMA), tokenizer, len(tokenizer))
    text = json.dumps({"ok": True, "n": 12, "color": "red", "tags": ["a"], "name": "x"})
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert c.allowed_prefix(ids) == len(ids) and not c.done       # a probe leaves the state as it was
    masks = []
    for t in ids:
        row = torch.zeros(len(tokenizer))
        c.mask(row)
        assert row[t] == 0                                         # every token of a valid answer allowed
        masks.append(row)
        assert c.consume(t)
    assert c.done
    c.rollback(5)                                                  # back to the state before the last 5
    assert not c.done
    row = torch.zeros(len(tokenizer))
    c.mask(row)
    assert torch.equal(row, masks[-5])
    for t in ids[-5:]:
        assert c.consume(t)
    assert c.done and not c.consume(ids[0])           # nothing may follow a complete answer
    # A wrong token is refused and changes nothing; a draft is allowed up to where it goes wrong.
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]     # noqa: E731
    c = Constraint(Grammar.json_schema(SCHEMA), tokenizer, len(tokenizer))
    head = enc('{"ok": true')
    assert not c.consume(enc("@")[0]) and c.allowed_prefix(head + enc("@") + enc(', "n": 1')) == len(head)


def test_unbounded_objects_close_and_integers_get_a_range():
    s = constrain.closed({"type": "object", "properties": {"a": {"type": "integer"},
                                                           "b": {"type": "object", "properties": {}},
                                                           "c": {"type": "object", "additionalProperties": True,
                                                                 "properties": {}}},
                          "enum_like": {"const": {"properties": {}}}})
    assert s["additionalProperties"] is False and s["properties"]["b"]["additionalProperties"] is False
    assert s["properties"]["c"]["additionalProperties"] is True
    assert s["properties"]["a"]["maximum"] == 2 ** 53 - 1
    assert s["enum_like"] == {"const": {"properties": {}}}                # values are values, not schemas


@pytest.mark.parametrize("schema,feature", [({"type": "array", "uniqueItems": True}, "uniqueItems"),
                                            ({"not": {"type": "string"}}, "not")])
def test_a_schema_the_library_cannot_enforce_is_refused_naming_the_feature(schema, feature):
    with pytest.raises(engine.BadRequest) as err:
        Grammar.json_schema(schema, "response_format")
    assert str(err.value).startswith("response_format:") and feature in str(err.value)
    with pytest.raises(engine.BadRequest, match="must be a JSON object"):
        Grammar.json_schema([1], "--json-schema s.json")


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def test_reasoning_is_free_and_the_grammar_starts_when_it_closes(thinking_tokenizer):
    tok = thinking_tokenizer
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]     # noqa: E731
    assert constrain.first_phase(tok, "<|im_start|>assistant\n<think>\n", True) == THINKING
    assert constrain.first_phase(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n", True) == ACTIVE
    assert constrain.first_phase(tok, "<|im_start|>assistant\n", True) == FREE_FIRST
    assert constrain.first_phase(tok, "<|im_start|>assistant\n", False) == ACTIVE
    answer = enc(json.dumps({"ok": False, "n": 7, "color": "blue", "tags": [], "name": ""}))
    # Open in the prompt: anything goes (nothing masked) until the model closes the block.
    c = Constraint(Grammar.json_schema(SCHEMA), tok, len(tok), THINKING)
    free = enc("so } [ not json") + enc("</think>")
    for t in free:
        row = torch.zeros(len(tok))
        assert torch.equal(c.mask(row), torch.zeros(len(tok))) and c.consume(t)
    assert c.phase == ACTIVE and c.allowed_prefix(answer) == len(answer)
    c.rollback(1)                                  # the closing tag taken back: free again
    assert c.phase == THINKING and c.consume(enc("}")[0])
    # Free to open: the first position allows the opening tag beside the grammar's tokens.
    c = Constraint(Grammar.json_schema(SCHEMA), tok, len(tok), FREE_FIRST)
    row = c.mask(torch.zeros(len(tok)))
    opens = enc("<think>")[0]
    assert row[opens] == 0 and row[answer[0]] == 0 and row[enc("x")[0]] == float("-inf")
    assert c.allowed_prefix(answer) == len(answer)                # not opened: the grammar at once
    assert c.consume(opens) and c.phase == THINKING
    c.rollback(1)
    assert c.phase == FREE_FIRST


def test_a_cut_draft_leaves_the_sampled_distribution_the_masked_target():
    """A draft the grammar forbids is cut before the pass; its position then samples from
    norm(max(0, p - q)) as if the draft had been drawn and rejected, which it was: 40,000
    first tokens through the engine's verification, chi-square against the masked p.
    (Sampling that position from p instead would overweight tokens q favours.)"""
    p = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    allowed = torch.tensor([True, True, True, True, False, False])
    q = torch.tensor([0.05, 0.4, 0.05, 0.1, 0.2, 0.2])          # the drafter favours forbidden tokens
    logits = torch.log(p).masked_fill(~allowed, float("-inf")).expand(2, -1).clone()
    target = torch.where(allowed, p, 0) / p[allowed].sum()
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(7)
    N = 40_000
    counts = torch.zeros(len(p))
    for x in torch.multinomial(q, N, replacement=True, generator=gen).tolist():
        if allowed[x]:
            n, nxt = verify_sampled(logits, [x], q.view(1, -1), params, gen)
            first = x if n == 1 else nxt
        else:                                    # cut: a pass over the last token alone
            _, first = verify_sampled(logits[:1], [], None, params, gen, after=q)
        counts[first] += 1
    assert counts[~allowed].sum() == 0
    expected = target[allowed] * N
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, counts / N)        # df = 3, p = 0.001


def _answer(eng, prompt, n=80, **kw):
    chat = eng.chat()
    done = list(chat.send(prompt, max_new_tokens=n, grammar=Grammar.json_schema(SCHEMA), **kw))[-1]
    return done, chat.last_stats


def _identity_for_every_drafter(eng, self_drafter=None):
    plain = [_answer(eng, p)[0] for p in PROMPTS]
    for done in plain:
        assert done.reason == "stop", done
        jsonschema.validate(json.loads(done.text), SCHEMA)
    vocab = eng.target.vocab_size
    cut = 0
    for k in (1, 3, 8, None):
        kinds = ["ngram", "right", "wrong", "mixed"] + (["self"] if self_drafter else [])
        for kind in kinds:
            for prompt, want in zip(PROMPTS, plain):
                if kind == "ngram":
                    eng.drafter = NgramDrafter()
                elif kind == "self":
                    eng.drafter = self_drafter
                else:
                    plen = len(render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}]))
                    every = {"right": None, "wrong": 1, "mixed": 3}[kind]
                    eng.drafter = ScriptedDrafter(list(want.token_ids), plen, vocab, every)
                eng.draft_tokens = k
                done, stats = _answer(eng, prompt)
                assert done.token_ids == want.token_ids and done.reason == "stop", (k, kind, prompt)
                if kind == "right" and k is not None:
                    assert stats.acceptance == 1.0 and stats.tokens_per_pass > 1
                cut += stats.drafted_tokens < stats.forward_passes * (k or 1) and kind == "wrong"
    eng.drafter, eng.draft_tokens = NoDrafter(), None
    assert cut, "no round cut a draft the grammar forbids"


def test_greedy_constrained_output_is_the_same_with_every_drafter(tiny_llama):
    eng = engine.open(str(tiny_llama), drafter="none", dtype="float32")
    selfd = ModelDrafter(load_resident(tiny_llama, eng.device, eng.dtype), "self", eng.target.vocab_size)
    _identity_for_every_drafter(eng, selfd)


def test_greedy_constrained_output_on_a_hybrid_with_every_drafter(tmp_path_factory, tokenizer):
    """Qwen3.5's layers: the recurrent state replays only the accepted drafts, and the
    grammar's state rolls back with it."""
    path = build_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", layers=4, tokenizer=tokenizer, seed=9)
    _identity_for_every_drafter(engine.open(str(path), drafter="none", dtype="float32"))


def test_sampled_constrained_answers_match_the_schema_with_a_drafter(tiny_llama):
    eng = engine.open(str(tiny_llama), drafter="ngram", dtype="float32")
    for seed in range(6):
        # which tokens a seed draws depends on the draft lengths the timing chose (each keeps
        # the distribution): room for a long one (8 many-token characters in "name")
        done, _ = _answer(eng, PROMPTS[seed % 2], n=400, temperature=1.0, top_p=0.95, seed=seed)
        assert done.reason == "stop", done
        jsonschema.validate(json.loads(done.text), SCHEMA)


def test_a_completion_is_constrained_too_and_the_grammar_state_is_per_answer(tiny_llama):
    eng = engine.open(str(tiny_llama), drafter="none", dtype="float32")
    chat = eng.chat()
    g = Grammar.json_schema({"enum": ["yes", "no"]})
    for _ in range(2):
        done = list(chat.complete("Is it? ", max_new_tokens=10, grammar=g))[-1]
        assert done.text in ('"yes"', '"no"') and done.reason == "stop"


def test_one_shot_json_schema_from_a_file(tiny_llama, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "localchat", "--model", str(tiny_llama), "--no-log",
                               "--drafter", "ngram", "-n", "80", *args], capture_output=True, text=True, timeout=300)
    r = run("--json-schema", str(schema), "Describe a cat")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    for content, says in (("{nope", "not JSON"), (json.dumps({"not": {}}), 'Unimplemented keys: ["not"]')):
        schema.write_text(content)
        r = run("--json-schema", str(schema), "x")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and str(schema) in r.stderr
    r = run("--json-schema", str(tmp_path / "missing.json"), "x")
    assert r.returncode == 2 and "missing.json: cannot read it" in r.stderr
