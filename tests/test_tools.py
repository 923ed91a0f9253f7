"""Tool calls (engine/tools.py) with the published templates of Qwen3 (JSON in <tool_call>),
Qwen3.5 (the XML form) and Llama 3.2 (a bare JSON object), tests/templates/: the calls
the template renders parse back and are what the grammar writes, so a conversation's next
turn reuses the cache; a required or named choice gives a valid call from a random model,
the same with every drafter; the text of a call never streams as text."""
import copy
import json
from pathlib import Path

import jsonschema
import pytest

import engine
from engine import tools
from engine.constrain import Constraint
from engine.drafters import NgramDrafter, NoDrafter
from engine.session import render_text
from test_hybrid_speculative import ScriptedDrafter
from tiny import CHAT_TEMPLATE

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {"qwen3": "hermes", "qwen3_5": "qwen-xml", "llama3_2": "llama3"}
# Every value bounded, so that a random model's call ends within the tokens given.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
NUMBER = {"type": "integer", "minimum": -1000, "maximum": 1000}    # a random model writes digits on and on
ADD = {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"]}
TOOLS = tools.read_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}])
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def templated(tokenizer, name):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.mark.parametrize("name", FAMILIES)
def test_each_template_s_own_calls_parse_back_and_are_what_the_grammar_writes(tokenizer, name):
    tok = templated(tokenizer, name)
    fam = tools.family(tok)
    assert fam == FAMILIES[name]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}]
    if fam != "llama3":                             # Llama 3.2's template takes one call a turn
        calls.append({"name": "add", "arguments": {"a": 2, "b": -35}})
    user = [{"role": "user", "content": "Weather in Paris, and 2 + 3.5?"}]
    whole, _ = render_text(tok, user + [{"role": "assistant", "content": "", "tool_calls": calls},
                                        {"role": "tool", "content": "sunny"}], None, TOOLS)
    head, end = (("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>") if fam == "llama3"
                 else ("<|im_start|>assistant\n", "<|im_end|>"))
    at = whole.index(head, whole.index(user[0]["content"])) + len(head)
    written = whole[at:whole.index(end, at)].removeprefix("<think>\n\n</think>\n\n")  # the call as the template writes it
    got = tools.parse(fam, written, TOOLS)
    assert list(got.calls) == calls and got.content == "" and not got.error
    # The grammar of a required choice accepts exactly that text, to its end.
    c = Constraint(tools.grammar(fam, TOOLS), tok, len(tok))
    ids = tok(written, add_special_tokens=False)["input_ids"]
    assert c.allowed_prefix(ids) == len(ids)
    for t in ids:
        assert c.consume(t)
    assert c.matcher.is_accepting()


def test_text_before_a_call_is_content_and_a_broken_call_stays_text():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
    got = tools.parse("hermes", text, TOOLS)
    assert got.content == "Let me look." and got.calls[0]["arguments"] == {"city": "Oslo", "days": 1}
    for broken, says in (('<tool_call>\n{"name": "get_weather", "arguments": {"city": ', "did not parse"),
                         ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "'rm_rf'"),
                         ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "not a JSON object")):
        got = tools.parse("hermes", broken, TOOLS)
        assert got.calls == () and got.content == broken and says in got.error     # reported, never dropped
    xml = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n</function>"
    assert tools.parse("qwen-xml", xml, TOOLS).calls == ({"name": "add", "arguments": {"a": 2, "b": True}},)
    assert tools.parse("llama3", "The answer is 4.", TOOLS).content == "The answer is 4."
    assert tools.parse("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
                       TOOLS).calls == ({"name": "add", "arguments": {"a": 1, "b": 2}},)


@pytest.mark.parametrize("fam,text,shown", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "add"}</tool_call>', "Sure.\n"),
    ("hermes", "a <tool but not a call", "a <tool but not a call"),
    ("llama3", '  {"name": "add", "parameters": {}}', ""),
    ("llama3", "  Four.", "  Four.")])
def test_a_call_never_streams_as_text_wherever_the_text_is_cut(fam, text, shown):
    for cut in range(len(text) + 1):
        w = tools.CallWatch(fam)
        out = w.push(text[:cut]) + w.push(text[cut:]) + w.flush()
        assert out == shown and w.in_call == (shown != text)
        assert not w.in_call or w.held == text[len(shown):]


def test_bad_tool_lists_are_refused_naming_the_entry():
    for bad, says in (([{"type": "function"}], r"tools\[0\]"), ([{"type": "function", "function": {"name": "a b"}}], "name"),
                      ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "parameters"),
                      ({"name": "f"}, "must be a list")):
        with pytest.raises(engine.BadRequest, match=says):
            tools.read_tools(bad)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return engine.open(str(tiny_llama), drafter="none", dtype="float32")


def _ask(eng, choice, **kw):
    chat = eng.chat()
    chat.thinking = False        # Qwen3.5 opens the reasoning in the prompt; a random model never closes it
    done = list(chat.send("What is the weather in Paris?", max_new_tokens=300, tools=TOOLS, tool_choice=choice,
                          **kw))[-1]
    return done, chat


@pytest.mark.parametrize("name", FAMILIES)
def test_a_named_or_required_choice_gives_valid_calls_with_every_drafter(tiny, tokenizer, name):
    eng = tiny
    eng.tokenizer = templated(tokenizer, name)
    try:
        for choice in ("get_weather", "add", "required"):
            want, chat = _ask(eng, choice, parallel_tool_calls=False)
            assert want.reason == "stop" and len(want.tool_calls) == 1 and not want.tool_error, chat.messages[-1]
            call = want.tool_calls[0]
            assert choice in (call["name"], "required")
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
            plen = chat.last_stats.prompt_tokens
            for drafter in (NgramDrafter(), ScriptedDrafter(list(want.token_ids), plen, eng.target.vocab_size, 2)):
                eng.drafter, eng.draft_tokens = drafter, 3
                got, _ = _ask(eng, choice, parallel_tool_calls=False)
                assert got.token_ids == want.token_ids and got.tool_calls == want.tool_calls
            eng.drafter, eng.draft_tokens = NoDrafter(), None
    finally:
        eng.tokenizer = tokenizer
        eng.drafter, eng.draft_tokens = NoDrafter(), None


def test_a_template_without_tools_and_an_unknown_tool_are_refused(tiny, tokenizer):
    assert tiny.tokenizer.chat_template == CHAT_TEMPLATE and tools.family(tiny.tokenizer) is None
    chat = tiny.chat()
    with pytest.raises(engine.BadRequest, match="^tools: this model's chat template has no tool-call format"):
        chat.send("hi", tools=TOOLS)
    assert chat.messages == []                          # refused: the conversation is as it was
    tiny.tokenizer = templated(tokenizer, "qwen3")
    try:
        with pytest.raises(engine.BadRequest, match="^tool_choice: no tool named 'nope'"):
            chat.send("hi", tools=TOOLS, tool_choice="nope")
        # tool_choice none: the template lists no tools and nothing is read as a call
        done = list(chat.send("hi", tools=TOOLS, tool_choice="none", max_new_tokens=8))[-1]
        assert done.tool_calls == () and "# Tools" not in chat._turn_text and "<tool_call>" not in chat._turn_text
    finally:
        tiny.tokenizer = tokenizer


def test_a_round_trip_renders_the_call_and_its_result_and_reuses_the_cache(tiny, tokenizer):
    tiny.tokenizer = templated(tokenizer, "qwen3")
    try:
        chat = tiny.chat()
        first = list(chat.send("Weather in Paris?", max_new_tokens=80, tools=TOOLS, tool_choice="get_weather"))[-1]
        assert first.tool_calls
        # The client sends the call back with its result: what the template renders for the
        # call is what the model wrote, so only the result and the next prompt are prefilled.
        chat.restore([{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": list(first.tool_calls)},
                      {"role": "tool", "content": json.dumps({"sky": "clear", "celsius": 21})}])
        events = list(chat.reply(max_new_tokens=12, tools=TOOLS))
        stats, done = events[-2], events[-1]
        assert done.reason in ("stop", "length") and not done.tool_error
        assert stats.prompt_tokens - stats.prefill_tokens >= len(first.token_ids) - 1
        with pytest.raises(engine.BadRequest, match="must end with a user message or a tool result"):
            chat.reply()
    finally:
        tiny.tokenizer = tokenizer
