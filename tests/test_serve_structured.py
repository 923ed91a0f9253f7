"""Structured output and tool calls through `localchat serve` on the demo model, with the
real `openai` client: five JSON schemas answered whole and streamed, each answer parsing
and validating, token for token the same with and without a drafter; a named tool choice
whose arguments validate; a tool round trip (call, result, answer) that reuses the cache.
The servers use Qwen3's published template (tests/templates/qwen3.jinja): the demo model's
own has no tool-call format, and Qwen's is ChatML like it."""
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.checkpoint import demo_gguf_path
from serving import Server

pytestmark = pytest.mark.demo

TEMPLATE = str(Path(__file__).parent / "templates" / "qwen3.jinja")
TEXT = {"type": "string", "maxLength": 40}
SCHEMAS = [
    ("Describe Ada Lovelace.", {"type": "object", "properties": {
        "name": TEXT, "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "known_for": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 3}},
        "required": ["name", "born", "known_for"]}),
    ("Is the sky blue?", {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]}, "confident": {"type": "boolean"}},
        "required": ["answer", "confident"]}),
    ("What is the capital of France?", {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": TEXT, "country": TEXT}, "required": ["name", "country"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["city", "population_millions"]}),
    ("How do I boil an egg?", {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"step": {"type": "integer", "minimum": 1, "maximum": 9}, "text": TEXT},
        "required": ["step", "text"]}}),
    ("When is Christmas in 2026?", {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "holiday": {"anyOf": [{"const": "yes"}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
        "required": ["date", "holiday"]}),
]
WEATHER = {"type": "object", "properties": {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": TEXT},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def servers():
    plain = Server(demo_gguf_path(), "--chat-template", TEMPLATE, "--served-model-name", "demo")
    try:
        drafted = Server(demo_gguf_path(), "--chat-template", TEMPLATE, "--served-model-name", "demo", "--drafter", "ngram")
    except BaseException:
        plain.stop()
        raise
    yield plain, drafted
    plain.stop()
    drafted.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def _ask(client, prompt, schema, stream):
    kw = dict(model="demo", messages=[{"role": "user", "content": prompt}], max_tokens=200,
              response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                      "strict": True}})
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("prompt,schema", SCHEMAS, ids=[p for p, _ in SCHEMAS])
def test_every_answer_matches_its_schema_the_same_with_and_without_a_drafter(servers, prompt, schema):
    answers = [_ask(_client(s), prompt, schema, stream) for s in servers for stream in (False, True)]
    text, finish, tokens = answers[0]
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert all(a == answers[0] for a in answers), answers


def test_json_object_and_a_schema_the_library_cannot_enforce(servers):
    client = _client(servers[0])
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "A JSON object about cats"}],
                                       max_tokens=120, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:             # cut off by max_tokens: still an object's beginning
        assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}})
    assert err.value.param == "response_format" and "uniqueItems" in err.value.message


def test_a_named_tool_choice_calls_it_with_valid_arguments_whole_and_streamed(servers):
    msgs = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    for server in servers:
        client = _client(server)
        r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        chunks = list(client.chat.completions.create(
            model="demo", messages=msgs, tools=TOOLS, max_tokens=100, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
            [(0, "get_weather", call.function.arguments)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_round_trip_answers_from_the_result_and_reuses_the_cache(servers):
    client = _client(servers[0])
    msgs = [{"role": "user", "content": "What time is it in Tokyo?"}]
    first = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, tool_choice="required",
                                           max_tokens=100, parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "14:05"})}]
    second = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=40)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # the call as the template renders it is what the model wrote: all of the first request,
    # and the answer's tokens, came from the cache
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2


def test_the_responses_api_answers_streams_calls_tools_and_keeps_to_a_schema(servers):
    """POST /v1/responses (Codex CLI, the Agents SDK) through the real client: the same
    answer whole and as events, a function_call item and its round trip, text.format."""
    client = _client(servers[0])
    whole = client.responses.create(model="demo", input="Why is the sky blue?", max_output_tokens=24)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 24
    events = list(client.responses.create(model="demo", input="Why is the sky blue?", max_output_tokens=24,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    flat = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = client.responses.create(model="demo", input="What's the weather in Oslo?", tools=flat, max_output_tokens=100,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model="demo", tools=flat, max_output_tokens=30, input=[
        {"role": "user", "content": "What's the weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "snow", "celsius": -3}'}])
    assert follow.status in ("completed", "incomplete") and (follow.output_text or follow.output)
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    prompt, schema = SCHEMAS[1]
    shaped = client.responses.create(model="demo", input=prompt, max_output_tokens=100, text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="demo", input="hi", previous_response_id="resp_1")
    assert err.value.param == "previous_response_id"
