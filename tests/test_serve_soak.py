"""`localchat serve` under load, as clients load it: 200 requests from 8 concurrent clients
(the real `openai` client), whole and streamed, some leaving mid-stream, against a queue of
4. Every completed answer is the one the same request gets alone; a refusal is a 503 with
Retry-After; the server's threads and open files come back to where they started. A
server killed with SIGKILL mid-answer starts again and serves; SIGTERM stops it with the
line Ctrl-C prints."""
import os
import random
import signal
import threading

import openai
import pytest

from serving import Server
from tiny import build_model
from waiting import wait_until

PROMPTS = ["the cat sat on the mat", "def fib(n):", "Why is the sky blue?", "one two three four"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("soak"), "llama", tokenizer=tokenizer, layers=2, endless=True)


def _ask(c, prompt: str, stream: bool, leave: bool = False) -> str | None:
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        return c.chat.completions.create(model="m", messages=msgs, max_tokens=12).choices[0].message.content
    s = c.chat.completions.create(model="m", messages=msgs, max_tokens=12 if not leave else 2000, stream=True)
    parts = []
    for i, chunk in enumerate(s):
        if leave and i == 2:
            s.close()                          # the client goes away mid-answer
            return None
        parts.extend(ch.delta.content or "" for ch in chunk.choices)
    return "".join(parts)


def _threads(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("Threads:")).split()[1])


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:")).split()[1]) * 1024


def test_200_requests_from_8_clients_answer_as_alone_and_leave_nothing_behind(model):
    s = Server(model, "--max-queue", "4", "--served-model-name", "m")
    try:
        c = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
        alone = {p: _ask(c, p, stream=False) for p in PROMPTS}
        assert all(_ask(c, p, stream=True) == alone[p] for p in PROMPTS)     # streamed: the same text
        pid = s.proc.pid
        before = (_threads(pid), _fds(pid), _rss(pid))
        answered, refused, left, failures = [], [], [], []
        lock = threading.Lock()

        def client(k: int) -> None:
            rng = random.Random(k)
            mine = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=300)
            for _ in range(25):
                p, mode = rng.choice(PROMPTS), rng.choice(["whole", "stream", "stream", "leave"])
                try:
                    text = _ask(mine, p, stream=mode != "whole", leave=mode == "leave")
                    with lock:
                        (left if mode == "leave" else answered).append((p, text))
                except openai.APIStatusError as exc:
                    with lock:
                        refused.append((exc.status_code, exc.response.headers.get("retry-after")))
                except Exception as exc:      # noqa: BLE001 — any other failure fails the test below
                    with lock:
                        failures.append(repr(exc))
        workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(900)
        assert not failures, failures[:3]
        assert len(answered) + len(refused) + len(left) == 200 and answered
        assert [(p, t) for p, t in answered if t != alone[p]] == []
        assert all(status == 503 and retry and int(retry) >= 1 for status, retry in refused), refused[:3]
        # idle again: every request's thread and connection gone
        wait_until(lambda: s.get("/health")[1]["queued"] == 0 and (_threads(pid), _fds(pid)) == before[:2], 120)
        assert _rss(pid) < 2 * before[2]
        print(f"soak: {len(answered)} answered, {len(refused)} refused, {len(left)} left mid-stream; "
              f"RSS {before[2] >> 20} -> {_rss(pid) >> 20} MiB; threads {before[0]}, fds {before[1]}")
    finally:
        s.stop()


def test_a_server_killed_mid_answer_serves_again_and_sigterm_says_stopped(model):
    s = Server(model, "--served-model-name", "m")
    c = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
    stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4000,
                                       stream=True)
    next(iter(stream))                          # mid-answer
    s.proc.send_signal(signal.SIGKILL)
    assert s.proc.wait(30) == -signal.SIGKILL
    again = Server(model, "--served-model-name", "m")
    try:
        c2 = openai.OpenAI(base_url=again.url, api_key="none", max_retries=0)
        assert c2.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices[0].message.content
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(60) == 0
    wait_until(lambda: "localchat serve: stopped" in again.lines, 10)
