"""`--backend URL`: one-shot mode, bench and the chat UI answered by an OpenAI-compatible
server (here `localchat serve` on a tiny model, a subprocess on 127.0.0.1), and the one-line
errors for a server that is not there, refuses the key, lacks the model or speaks
something else (a plain HTTP server)."""
import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

import engine
from serving import ROOT, Server
from tiny import build_model

pytest.importorskip("textual")

from localchat.config import Settings  # noqa: E402
from localchat.remote import RemoteEngine  # noqa: E402
from localchat.tui.app import ChatApp  # noqa: E402
from localchat.tui.widgets import AssistantMessage  # noqa: E402
from tui_helpers import SIZE, wait_for  # noqa: E402

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("backend"), "llama", tokenizer=tokenizer, layers=4, hidden=512,
                       endless=True)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--served-model-name", "tiny")
    yield s
    s.stop()


def cli(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env_extra or {}))
    for k in ("LOCALCHAT_API_KEY", "OPENAI_API_KEY"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "localchat", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def one_line(proc, *needles):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("localchat:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_one_shot_through_a_backend_is_the_servers_answer(model, server):
    local = engine.open(str(model), dtype="float32", drafter="none").chat()
    list(local.send(PROMPT, max_new_tokens=16))
    proc = cli("--backend", server.url, "-n", "16", "--json", "--no-log", PROMPT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == local.last_done.text and out["model"] == f"tiny @ {server.url}"
    s = out["stats"]
    assert s["backend"] == server.url and s["generated_tokens"] == len(local.last_done.token_ids)
    assert s["server_decode_tps"] > 0 and s["ttft_seconds"] > 0          # our server sends its timings
    proc = cli("--backend", server.url, "-n", "8", "--stats", "--no-log", PROMPT)
    assert proc.returncode == 0 and proc.stdout.strip()
    assert f"backend {server.url} · first token" in proc.stderr and "server: prefill" in proc.stderr


def test_bench_through_a_backend(server, tmp_path):
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"id": "cat", "kind": "prose", "prompt": PROMPT}) + "\n")
    proc = cli("bench", "--backend", server.url, "--workloads", str(work), "-n", "8", "--runs", "2",
               "--json", str(tmp_path / "b.json"))
    assert proc.returncode == 0, proc.stderr
    assert "first token s" in proc.stdout and "cat" in proc.stdout
    got = json.loads((tmp_path / "b.json").read_text())
    assert got["backend"] == server.url and got["workloads"][0]["decode_tps"] > 0
    assert len(got["workloads"][0]["runs"]) == 2


def test_backend_errors_are_one_line(model, server, tmp_path):
    import socket
    with socket.socket() as s:            # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    one_line(cli("--backend", f"http://127.0.0.1:{free}/v1", "hi"), "connection refused")
    one_line(cli("--backend", server.url, "--backend-model", "nope", "hi"), "--backend-model nope", "tiny")
    one_line(cli("--backend", "ftp://x", "hi"), "not an http(s) URL")
    keyed = Server(model, "--api-key", "sesame")
    try:
        one_line(cli("--backend", keyed.url, "hi", env_extra={"OPENAI_API_KEY": "wrong"}), "API key")
        ok = cli("--backend", keyed.url, "-n", "4", "--no-log", "hi", env_extra={"LOCALCHAT_API_KEY": "sesame"})
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    finally:
        keyed.stop()
    # A web server that is not an OpenAI API.
    (tmp_path / "index.html").write_text("<html>hello</html>")
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **kw)  # noqa: E731
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        one_line(cli("--backend", f"http://127.0.0.1:{web.server_address[1]}/v1", "hi"), "OpenAI-compatible")
        one_line(cli("--backend", f"http://127.0.0.1:{web.server_address[1]}/", "hi"), "OpenAI-compatible")
    finally:
        web.shutdown()


def test_the_chat_ui_through_a_backend_streams_shows_the_figures_and_stops_on_escape(server):
    settings = Settings(max_tokens=24, backend=server.url)

    async def main():
        app = ChatApp(lambda s, progress: RemoteEngine(s.backend), settings)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the backend")
            assert app.status_bar.model == f"tiny @ {server.url}"
            app.put_in_prompt(PROMPT)
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating, what="the answer")
            reply = app.query(AssistantMessage).first()
            assert reply.text and reply.text == app.chat.last_done.text
            status = app.status_bar.text
            assert "first token" in status and "server" in status and "prompt" in status, status
            # A long answer, stopped with Esc: the request is closed, the partial text kept,
            # and the server is free for the next question at once.
            # (as long as the model's context allows: a 900-token answer once ended before the
            # Esc reached it, on a machine faster than the test assumed)
            app.settings = Settings(max_tokens=3800, backend=server.url)
            app.put_in_prompt("tell me more")
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.query(AssistantMessage)) == 2
                           and app.query(AssistantMessage)[1].text, what="the second answer to start")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, what="the answer to stop")
            done = app.chat.last_done
            assert done.reason == "cancelled" and app.chat.messages[-1]["content"] == done.text
    asyncio.run(main())
    assert server.get("/health")[0] == 200


def test_the_backend_can_come_from_the_environment_or_the_config(server, tmp_path):
    proc = cli("-n", "4", "--no-log", PROMPT, env_extra={"LOCALCHAT_BACKEND": server.url})
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    (tmp_path / "config.toml").write_text(f'backend = "{server.url}"\nbackend_model = "tiny"\n')
    proc = cli("-n", "4", "--no-log", "--stats", PROMPT, env_extra={"LOCALCHAT_CONFIG_DIR": str(tmp_path)})
    assert proc.returncode == 0 and f"backend {server.url}" in proc.stderr, proc.stderr
