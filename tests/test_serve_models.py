"""`localchat serve` for every model on this machine: a second tiny model in a hub cache
laid out as huggingface_hub lays it out, loaded on its first request; requests alternating
between the two answer as each model alone does; a memory budget that holds one model at a
time unloads the least recently used; --keep-alive unloads an idle one. The real openai client."""
import openai
import pytest

import engine
from serving import Server
from test_models_cli import _hf_cache
from tiny import build_model
from waiting import wait_until

MSGS = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def two(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("two")
    # wide enough (160 MB of float32 weights each) that weights, not the plan's fixed terms, decide what fits
    a = build_model(root / "a", "llama", tokenizer=tokenizer, seed=1, hidden=1024, layers=4)
    b_src = build_model(root / "b-src", "qwen3", tokenizer=tokenizer, seed=2, hidden=1024, layers=4)
    hub = root / "hub"
    b = _hf_cache(hub, "someone/tiny-b", b_src)
    want = {}
    for name, path in (("a", a), ("someone/tiny-b", b)):
        chat = engine.open(str(path), drafter="none").chat()
        want[name] = list(chat.send(MSGS[0]["content"], max_new_tokens=12))[-1].text
    return a, hub, want


def _loaded(server):
    """Which of the two are loaded (the test cache's demo import is listed too)."""
    return {m["id"]: m["loaded"] for m in server.get("/v1/models")[1]["data"] if m["id"] in ("a", "someone/tiny-b")}


def test_requests_alternate_between_models_each_loaded_on_demand(two):
    a, hub, want = two
    server = Server(a, "--served-model-name", "a", env={"HF_HUB_CACHE": str(hub)})
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert {"a", "someone/tiny-b"} <= set(listed)
        assert listed["a"].model_extra["loaded"] and not listed["someone/tiny-b"].model_extra["loaded"]
        assert listed["someone/tiny-b"].model_extra["context_length"] == 4096
        for name in ("someone/tiny-b", "a", "someone/tiny-b", "a"):
            r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=12)
            assert r.choices[0].message.content == want[name] and r.model == name
        assert _loaded(server) == {"a": True, "someone/tiny-b": True}        # both fit: both stay
        health = server.get("/health")[1]
        assert set(health["loaded"]) == {"a", "someone/tiny-b"} and health["loading"] == []
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MSGS, max_tokens=2)
    finally:
        server.stop()


def test_a_budget_for_one_model_unloads_the_least_recently_used_and_keep_alive_an_idle_one(two):
    a, hub, want = two
    # each plan counts 160 MB of weights, its cache and the device's margin: 300 MiB holds one, not two
    server = Server(a, "--served-model-name", "a", "--vram", "300MiB", "--keep-alive", "2",
                    env={"HF_HUB_CACHE": str(hub)})
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        r = client.chat.completions.create(model="someone/tiny-b", messages=MSGS, max_tokens=12)
        assert r.choices[0].message.content == want["someone/tiny-b"]
        assert _loaded(server) == {"a": False, "someone/tiny-b": True}
        r = client.chat.completions.create(model="a", messages=MSGS, max_tokens=12)
        assert r.choices[0].message.content == want["a"]
        assert _loaded(server) == {"a": True, "someone/tiny-b": False}
        wait_until(lambda: not any(_loaded(server).values()), 30)          # idle past --keep-alive
        r = client.chat.completions.create(model="a", messages=MSGS, max_tokens=12)      # loads again
        assert r.choices[0].message.content == want["a"]
    finally:
        server.stop()
