"""Ollama's API on `localchat serve`, driven by the real `ollama` Python client: the same
answers as the OpenAI endpoints, token for token, whole and streamed; its options, format
(a JSON schema, enforced) and tool messages; the model listed, shown and its errors in
Ollama's shape. A tiny model with Qwen3's published template (tools and thinking)."""
import json
from pathlib import Path

import jsonschema
import ollama
import openai
import pytest

from serving import Server
from tiny import build_model

TEMPLATE = str(Path(__file__).parent / "templates" / "qwen3.jinja")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    path = build_model(tmp_path_factory.mktemp("ollama"), "llama", tokenizer=tokenizer, seed=3, endless=True)
    s = Server(path, "--chat-template", TEMPLATE, "--served-model-name", "tiny")
    yield s
    s.stop()


def test_the_model_is_listed_and_shown_as_ollama_does(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}")
    (m,) = [m for m in client.list().models if m.model == "tiny"]          # and any other model here
    assert m.size > 0 and m.details.format == "safetensors" and m.details.family == "llama"
    shown = client.show("tiny")
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == 4096 and "<tool_call>" in shown.template
    assert server.get("/api/version")[1]["version"] and [p.model for p in client.ps().models] == ["tiny"]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and "'llama3'" in err.value.error


def test_chat_and_generate_answer_as_the_openai_endpoints_do(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}")
    oa = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "the cat sat on the mat"}]
    want = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=12).choices[0].message.content
    whole = client.chat(model="tiny", messages=msgs, options={"num_predict": 12, "temperature": 0})
    assert whole.message.content == want and whole.done and whole.done_reason == "length"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 0 and whole.eval_duration > 0
    parts = list(client.chat(model="tiny", messages=msgs, options={"num_predict": 12}, stream=True))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done and not parts[0].done
    gen = client.generate(model="tiny", prompt="the cat sat on the mat", options={"num_predict": 12})
    assert gen.response == want
    raw = client.generate(model="tiny", prompt="def fib(n):", raw=True, options={"num_predict": 16})
    assert raw.response == oa.completions.create(model="tiny", prompt="def fib(n):", max_tokens=16).choices[0].text


def test_format_a_schema_and_a_tool_round_trip(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}")
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "ok?"}], format=SCHEMA,
                    options={"num_predict": 60})
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    msgs = [{"role": "user", "content": "add 2"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]},
            {"role": "tool", "content": "4", "tool_name": "add"}]
    r = client.chat(model="tiny", messages=msgs, tools=tools, options={"num_predict": 6})
    assert r.done and r.prompt_eval_count > 0
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], format={"not": {}})
    assert err.value.status_code == 400 and "not" in err.value.error
