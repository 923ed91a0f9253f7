"""Conversations that resume warm (engine/resume.py): a conversation kept by one engine and
reopened by another (a new process, as a user reopens it) answers its next turn token for
token as the conversation that never closed does, and leaves the cache, recurrent states
included, bit for bit as that one's; it prefills only the new turn. In every profile and for
a hybrid. A damaged entry is never used; a stale one (other weights, another profile) never
matches; the store keeps to its budget, least recently used first; a chat that switches
conversations keeps the one it leaves and finds it again. One-shot --continue and serve
(the real openai client) resume from the store."""
import json
import os
import shutil
import subprocess
import sys

import openai
import pytest
import torch

import engine
from engine.checkpoint import tensor_index
from serving import Server
from tiny import budget_for, build_model

FIRST = "The quick brown fox jumps over the lazy dog. " * 10      # kept: well over MIN_TOKENS
NEXT = "Why is the sky blue? Rayleigh scattering of sunlight by the air."
OTHER = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", layers=8, tokenizer=tokenizer, seed=5,
                       shard="300KB")


CASES = [("llama", "resident-exact"), ("llama", "resident-int8"), ("llama", "resident-int4"),
         ("deep", "streamed-exact"), ("hybrid", "resident-exact"), ("hybrid", "resident-int4"),
         ("hybrid", "streamed-exact")]


def _open(request, tmp_path, which: str, profile: str, store=None, path=None):
    path = path or request.getfixturevalue({"llama": "tiny_llama", "deep": "tiny_deep", "hybrid": "hybrid"}[which])
    opts = {}
    if profile == "streamed-exact":
        if which == "hybrid":
            opts["memory_budget"] = int(sum(e.nbytes for e in tensor_index(path).values()) * 0.6)
        else:
            opts["memory_budget"] = budget_for(path, profile, context=256)
    eng = engine.open(str(path), profile=profile, context=256, cache_dir=tmp_path / "cache", **opts)
    assert eng.plan.chosen == profile
    eng.resume = store
    return eng


def _turn(chat, text):
    events = list(chat.send(text, max_new_tokens=24))
    return events[-1], events[-2]


@pytest.mark.parametrize("which,profile", CASES, ids=[f"{w}-{p}" for w, p in CASES])
def test_a_resumed_conversation_answers_as_if_it_never_closed(request, tmp_path, which, profile):
    never = _open(request, tmp_path, which, profile)
    chat = never.chat()
    _turn(chat, FIRST)
    held = len(chat.cached_ids)
    want, want_stats = _turn(chat, NEXT)

    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    first = _open(request, tmp_path, which, profile, store)
    chat = first.chat()
    _turn(chat, FIRST)
    assert chat.keep()
    saved = [dict(m) for m in chat.messages]
    del first, chat

    again = _open(request, tmp_path, which, profile, store)        # a new process, as far as the cache knows
    chat = again.chat()
    chat.restore(saved)
    got, stats = _turn(chat, NEXT)
    assert got.token_ids == want.token_ids
    assert stats.restored_tokens == held and stats.prefill_tokens == want_stats.prefill_tokens
    assert stats.prompt_tokens == want_stats.prompt_tokens
    a, b = never.target.cache.export(), again.target.cache.export()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    if which == "hybrid":
        assert any(k.startswith("state.") for k in a) and "checkpoint" in a


@pytest.mark.parametrize("which", ["llama", "hybrid"])
def test_an_edited_answer_resumes_from_what_it_shares(request, tmp_path, which):
    """The last answer edited (the chat UI's edit, a client sending other text): the kept
    cache gives the tokens the new prompt shares with it, as far back as the cache can go
    (keys and values anywhere, a recurrent state to its turn checkpoint), as the
    conversation kept in memory does; the answer is that conversation's."""
    never = _open(request, tmp_path, which, "resident-exact")
    chat = never.chat()
    _, first_stats = _turn(chat, FIRST)
    edited = [dict(m) for m in chat.messages]
    edited[-1]["content"] = "Something else entirely."
    chat.restore(edited)
    want, want_stats = _turn(chat, NEXT)

    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    chat = _open(request, tmp_path, which, "resident-exact", store).chat()
    _turn(chat, FIRST)
    assert chat.keep()
    chat = _open(request, tmp_path, which, "resident-exact", store).chat()
    chat.restore(edited)
    got, stats = _turn(chat, NEXT)
    assert got.token_ids == want.token_ids
    assert stats.restored_tokens == want_stats.prompt_tokens - want_stats.prefill_tokens > 0
    if which == "hybrid":
        assert stats.restored_tokens == first_stats.prompt_tokens          # the turn checkpoint


def test_the_demo_model_resumes_warm(demo_engine, tmp_path):
    eng = demo_engine
    first = "Here are some notes about the weather in spring, summer, autumn and winter. " * 6
    never = eng.chat()
    _turn(never, first)
    want, _ = _turn(never, "Which season is the warmest?")
    eng.claim_cache(eng.chat())            # an empty chat holds the cache: nothing of another test's is kept
    eng.resume = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    try:
        chat = eng.chat()
        _turn(chat, first)
        assert chat.keep()
        again = eng.chat()                 # takes the cache: the kept entry is what it finds
        again.restore([dict(m) for m in chat.messages])
        eng.claim_cache(eng.chat())
        got, stats = _turn(again, "Which season is the warmest?")
        assert got.token_ids == want.token_ids and stats.restored_tokens > 0
    finally:
        eng.resume = None


def _kept(request, tmp_path, store, path=None):
    """A conversation of one turn kept in `store` (resident-exact): its messages."""
    eng = _open(request, tmp_path, "llama", "resident-exact", store, path)
    chat = eng.chat()
    _turn(chat, FIRST)
    assert chat.keep()
    return [dict(m) for m in chat.messages]


@pytest.mark.parametrize("damage", ["a flipped bit", "truncated", "not safetensors"])
def test_a_damaged_entry_is_never_used(request, tmp_path, damage):
    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    saved = _kept(request, tmp_path, store)
    [entry] = store.entries()
    data = bytearray(entry.path.read_bytes())
    if damage == "a flipped bit":
        data[len(data) // 2] ^= 0x10            # inside the tensors: the header still parses
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = b"\x00" * 64
    entry.path.write_bytes(bytes(data))

    cold = _open(request, tmp_path, "llama", "resident-exact").chat()
    cold.restore(saved)
    want, _ = _turn(cold, NEXT)
    chat = _open(request, tmp_path, "llama", "resident-exact", store).chat()
    chat.restore(saved)
    got, stats = _turn(chat, NEXT)
    assert stats.restored_tokens == 0 and stats.prefill_tokens == stats.prompt_tokens
    assert got.token_ids == want.token_ids
    assert not entry.path.exists()                 # not tried again


def test_a_stale_entry_never_matches(request, tmp_path, tiny_llama):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    saved = _kept(request, tmp_path, store, model)
    [entry] = store.entries()

    other = _open(request, tmp_path, "llama", "resident-int8", store, model).chat()     # another profile
    other.restore(saved)
    assert _turn(other, NEXT)[1].restored_tokens == 0

    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))        # the weights changed since
    chat = _open(request, tmp_path, "llama", "resident-exact", store, model).chat()
    chat.restore(saved)
    assert _turn(chat, NEXT)[1].restored_tokens == 0
    assert entry.path.exists()                  # another model's: left for `models prune`


def test_one_chat_switching_conversations_keeps_the_one_it_leaves(request, tmp_path):
    """As serve and the chat UI use one chat: a prompt that drops most of the cache keeps it
    first; coming back finds it. The store keeps to its budget, the least recently used
    going first, and a longer entry of a conversation replaces its shorter one."""
    never = _open(request, tmp_path, "llama", "resident-exact").chat()
    _turn(never, FIRST)
    want, _ = _turn(never, NEXT)

    store = engine.ResumeStore(tmp_path / "resume", 1 << 30)
    eng = _open(request, tmp_path, "llama", "resident-exact", store)
    chat = eng.chat()
    _turn(chat, FIRST)
    a = [dict(m) for m in chat.messages]
    assert store.entries() == []
    chat.restore([])
    _turn(chat, OTHER)                                   # another conversation: the first is kept
    [kept_a] = store.entries()
    chat.restore(a)
    got, stats = _turn(chat, NEXT)
    assert got.token_ids == want.token_ids and stats.restored_tokens == kept_a.tokens

    chat.keep()                                          # the same conversation, longer: replaces it
    entries = store.entries()
    assert kept_a.path not in [e.path for e in entries] and max(e.tokens for e in entries) > kept_a.tokens

    # a budget for two entries: a third pushes out the one used least recently
    size = max(e.path.stat().st_size for e in entries)
    store.budget = int(2.5 * size)
    for text in ("Café, naïve, façade. " * 12, "for i in range(10):\n    print(i * i)\n" * 8):
        chat.restore([])
        _turn(chat, text)
    assert store.total_bytes() <= store.budget and len(store.entries()) == 2


def test_what_is_not_kept(request, tmp_path):
    store = engine.ResumeStore(tmp_path / "resume", 0)
    eng = _open(request, tmp_path, "llama", "resident-exact", store)
    chat = eng.chat()
    _turn(chat, FIRST)
    assert not chat.keep() and store.entries() == []           # a budget of 0
    store.budget = 1 << 30
    held = len(chat.cached_ids)
    other = eng.chat()
    assert not other.keep()                                    # the cache is not its
    _turn(other, "hi")                                         # it is now: the first chat's is kept
    assert [e.tokens for e in store.entries()] == [held]
    assert not other.keep() and len(store.entries()) == 1      # too short to be worth a file
    store.forget()
    store.budget = 1000
    chat.restore([])
    _turn(chat, FIRST)
    assert not chat.keep() and "more than the resume store may hold" in store.problem
    assert store.entries() == []


def _cli(*args, data):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "localchat", *args, "--data-dir", str(data)], capture_output=True,
                       text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    return r


def test_oneshot_continue_resumes_warm(tmp_path, tiny_llama):
    data = tmp_path / "data"
    base = ["--model", str(tiny_llama), "--drafter", "none", "-n", "8"]
    r = _cli(*base, FIRST, data=data)
    assert r.returncode == 0, r.stderr
    assert list((data / "resume").glob("*.safetensors"))
    r = _cli(*base, "--continue", "--json", NEXT, data=data)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["restored_tokens"] > 0 and stats["prefill_tokens"] < stats["prompt_tokens"] - stats["restored_tokens"] + 40
    r = _cli(*base, "--continue", "--json", "--resume-budget", "0", "and then?", data=data)
    assert r.returncode == 0 and json.loads(r.stdout)["stats"]["restored_tokens"] == 0
    r = _cli(*base, "--resume-budget", "lots", "hi", data=data)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "localchat: --resume-budget lots: not a size; write it like 8GiB, 16GB or 512MiB"]


def test_serve_resumes_a_conversation_another_one_displaced(tmp_path, tiny_llama):
    server = Server(tiny_llama, "--served-model-name", "x", env={"LOCALCHAT_DATA_DIR": str(tmp_path / "data")})
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        a = [{"role": "user", "content": FIRST}]
        r = client.chat.completions.create(model="x", messages=a, max_tokens=8)
        a += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": NEXT}]
        first_prompt = r.usage.prompt_tokens
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": OTHER}], max_tokens=8)
        r = client.chat.completions.create(model="x", messages=a, max_tokens=8)
        assert r.usage.prompt_tokens_details.cached_tokens >= first_prompt
    finally:
        server.stop()
