"""`localchat serve` as a user runs it: a subprocess on 127.0.0.1 (a free port), a tiny
model built in the test, driven by the real `openai` client and by raw HTTP where the
client hides what is tested (status codes, headers, a connection closed mid-stream)."""
import re
import threading
import time

import openai
import pytest

import engine
from serving import Server
from tiny import build_model
from waiting import wait_until

@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    # Wide enough that a long answer lasts a few seconds (the queue test needs one running
    # while another waits), with a context the tests can overflow.
    return build_model(tmp_path_factory.mktemp("served"), "llama", tokenizer=tokenizer, layers=4, hidden=512,
                       max_positions=1024, endless=True)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--max-queue", "1", "--served-model-name", "served")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the cat sat on the mat"}]


def test_answers_equal_the_engines_token_for_token(model, client):
    chat = engine.open(str(model), dtype="float32", drafter="none").chat("You are terse.")
    list(chat.send("the cat sat on the mat", max_new_tokens=24))
    want = chat.last_done.text
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=MSGS, max_tokens=24)
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason in ("length", "stop")
    assert got.usage.completion_tokens == len(chat.last_done.token_ids)
    assert got.usage.prompt_tokens == chat.last_stats.prompt_tokens
    t = got.model_extra["timings"]
    assert t["profile"] == "resident-exact" and t["decode_per_second"] > 0 and t["tokens_per_pass"] >= 1
    # Streamed: the same text, in chunks, then usage when asked for.
    chunks = list(client.chat.completions.create(model=got.model, messages=MSGS, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason


def test_plain_text_completions_equal_the_engines_token_for_token(model, server, client):
    """POST /v1/completions continues a prompt without the chat template, whole and
    streamed, with OpenAI's default of 16 tokens; a bad prompt names the field."""
    chat = engine.open(str(model), dtype="float32", drafter="none").chat()
    list(chat.complete("def fib(n):", max_new_tokens=16))
    want = chat.last_done.text
    got = client.completions.create(model="served", prompt="def fib(n):")
    assert got.object == "text_completion" and got.choices[0].text == want
    assert got.choices[0].finish_reason in ("length", "stop")
    assert got.usage.completion_tokens == len(chat.last_done.token_ids) == 16
    assert got.usage.prompt_tokens == chat.last_stats.prompt_tokens
    chunks = list(client.completions.create(model="served", prompt=["def fib(n):"], stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 16
    for body, param in (({"model": "served"}, "prompt"), ({"model": "served", "prompt": ["a", "b"]}, "prompt"),
                        ({"model": "served", "prompt": "x", "echo": True}, "echo")):
        status, answer, _ = server.request("POST", "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer


def test_a_stop_string_ends_the_answer_before_it(client):
    whole = client.chat.completions.create(model="served", messages=MSGS, max_tokens=24).choices[0].message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assume = whole.index(stop)
    got = client.chat.completions.create(model="served", messages=MSGS, max_tokens=24, stop=[stop])
    assert got.choices[0].message.content == whole[:assume] and got.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="served", messages=MSGS, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole[:assume]


def test_a_stateless_conversation_prefills_only_the_new_turn(client):
    msgs = [{"role": "user", "content": "one two three four"}]
    prefilled = []
    for turn in range(4):
        r = client.chat.completions.create(model="served", messages=msgs, max_tokens=12)
        prefilled.append((r.model_extra["timings"]["prefill_tokens"], r.usage.prompt_tokens,
                          r.usage.prompt_tokens_details.cached_tokens))
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"and then {turn}"}]
    # From turn 2 on, what was cached covers the whole earlier request: only the new
    # messages (the answer's end and the next question, in the template) are prefilled, the
    # same few tokens each turn however long the history grows.
    for (run, total, cached), (_, before, _) in zip(prefilled[1:], prefilled):
        assert cached >= before and run == total - cached
    runs = [run for run, _, _ in prefilled[1:]]
    assert max(runs) - min(runs) <= 2 and runs[-1] * 3 < prefilled[-1][1]


def test_bad_requests_get_openais_error_with_the_field(server, client):
    cases = [({"temperature": 7}, 400, "temperature"), ({"n": 2}, 400, "n"), ({"top_p": 0}, 400, "top_p"),
             ({"max_tokens": 0}, 400, "max_tokens"), ({"stop": [""]}, 400, "stop"),
             ({"messages": []}, 400, "messages"), ({"tools": [{"type": "function"}]}, 400, "tools"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              400, "messages"),
             ({"messages": [{"role": "function", "content": "42"}]}, 400, "messages"),
             ({"messages": [{"role": "assistant", "content": None,
                             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
                            {"role": "tool", "content": "42"}]}, 400, "messages"),
             # a valid tool, but this model's template has no tool-call format
             ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"}, 400, "tool_choice"),
             ({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
              400, "response_format"),
             ({"response_format": {"type": "yaml"}}, 400, "response_format"),
             ({"model": "gpt-4"}, 404, "model")]
    for extra, status, param in cases:
        got, body, _ = server.request("POST", "/v1/chat/completions", {"model": "served", "messages": MSGS, **extra})
        assert got == status and body["error"]["param"] == param, (extra, body)
        assert "\n" not in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="served", messages=[{"role": "user", "content": "word " * 1100}])
    assert err.value.code == "context_length_exceeded" and "context" in err.value.message
    status, body, _ = server.request("POST", "/v1/chat/completions", None)
    assert status == 400
    plain = client.chat.completions.create(model="served", messages=MSGS, max_tokens=4,
                                           response_format={"type": "text"})
    assert plain.choices[0].message.content


def test_the_queue_is_bounded_and_a_client_that_leaves_frees_the_engine(server, client):
    # One answer runs, one waits (--max-queue 1): a third is refused at once with Retry-After.
    long = {"model": "served", "messages": MSGS, "max_tokens": 900}
    results = {}

    def ask(name):
        results[name] = server.request("POST", "/v1/chat/completions", long)
    threads = [threading.Thread(target=ask, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
        time.sleep(0.3)
    wait_until(lambda: server.get("/health")[1]["queued"] == 1, 30)
    status, body, headers = server.request("POST", "/v1/chat/completions", long)
    assert status == 503 and body["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
    for t in threads:
        t.join(300)
    assert results["a"][0] == results["b"][0] == 200
    # A stream closed after its first words: the answer stops at the engine's next step,
    # and the next request is answered at once.
    stream = client.chat.completions.create(model="served", messages=MSGS, max_tokens=4000, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_until(lambda: any("client left" in line for line in server.lines), 30)
    t0 = time.monotonic()
    r = client.chat.completions.create(model="served", messages=MSGS, max_tokens=4)
    assert r.usage.completion_tokens <= 4 and time.monotonic() - t0 < 60


def test_an_api_key_is_required_when_set(model):
    s = Server(model, "--api-key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.url, api_key="sesame", max_retries=0)
        assert ok.models.list().data[0].id
        assert s.get("/health")[0] == 200                # health needs no key (load balancers)
    finally:
        s.stop()


def test_one_line_per_request_on_stderr(server, client):
    client.chat.completions.create(model="served", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nobody", messages=MSGS, max_tokens=2)
    wait_until(lambda: any(" 404 " in x for x in server.lines), 30)
    assert any(re.search(r"200 /v1/chat/completions .* tokens .* decode [\d.]+ tok/s", x) for x in server.lines)


def test_a_request_that_waits_too_long_is_refused(model):
    s = Server(model, "--queue-timeout", "0.5", "--served-model-name", "served")
    try:
        long = {"model": "served", "messages": MSGS, "max_tokens": 900}
        first = threading.Thread(target=lambda: s.request("POST", "/v1/chat/completions", long))
        first.start()
        time.sleep(0.3)                  # it is being answered (a few seconds of tokens)
        status, body, headers = s.request("POST", "/v1/chat/completions", dict(long, max_tokens=2))
        first.join(300)
        assert status == 503 and body["error"]["code"] == "queue_timeout" and int(headers["retry-after"]) >= 1
    finally:
        s.stop()


def test_a_request_without_sampling_values_gets_the_models_recommendation(tmp_path, tiny_llama):
    """Unset in the request and in the user's settings, temperature, top-p and top-k are
    what the checkpoint's generation_config.json recommends (as vLLM serves them); a
    request's own value wins, and temperature 0 is plain greedy."""
    import json
    import shutil
    path = shutil.copytree(tiny_llama, tmp_path / "m")
    written = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**written, "do_sample": True, "temperature": 1.5,
                                                             "top_p": 0.9, "top_k": 50}))
    eng = engine.open(str(path), dtype="float32", drafter="none")

    def local(**sampling):
        return list(eng.chat("You are terse.").send("the cat sat on the mat", max_new_tokens=16,
                                                   **sampling))[-1].text

    s = Server(path, "--served-model-name", "served", env={"LOCALCHAT_CONFIG_DIR": str(tmp_path / "config")})
    try:
        client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)

        def served(**sampling):
            return client.chat.completions.create(model="served", messages=MSGS, max_tokens=16,
                                                  **sampling).choices[0].message.content

        assert served(seed=3) == local(temperature=1.5, top_p=0.9, top_k=50, seed=3)
        assert served(seed=3, extra_body={"top_k": 5}) == local(temperature=1.5, top_p=0.9, top_k=5, seed=3)
        assert served(temperature=0) == local() != local(temperature=1.5, top_p=0.9, top_k=50, seed=3)
    finally:
        s.stop()
