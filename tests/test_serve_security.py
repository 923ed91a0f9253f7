"""`localchat serve` keeps web pages out (localchat/server/guard.py), tested against a real
subprocess with raw HTTP, where a browser's requests are spelled out header by header: a
rebound Host, a foreign Origin and its preflight, a "simple" text/plain POST, a chunked body
over the limit, the API key on every endpoint; and the real openai and ollama clients,
which send no Origin, still served."""
import http.client
import json
import socket

import ollama
import openai
import pytest

from serving import Server
from tiny import build_model
from waiting import wait_until

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 2}
KEY = "sesame"


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    # a short context: a request for a million tokens fills it in moments
    return build_model(tmp_path_factory.mktemp("guarded"), "llama", tokenizer=tokenizer, max_positions=96,
                       endless=True)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def opened(model):
    """A server opened up as docs/serve.md says: a proxy's name, one web app, a key."""
    s = Server(model, "--served-model-name", "tiny", "--allow-host", "proxy.example",
               "--allow-origin", "http://app.example:3000", "--allow-origin", "chrome-extension://*",
               "--api-key", KEY)
    yield s
    s.stop()


def call(server, method, path, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed body or text, headers) of one request with exactly these headers."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    sent = {"Host": f"127.0.0.1:{server.port}", **(headers or {})}
    if data is not None and "Content-Type" not in sent:
        sent["Content-Type"] = "application/json"
    if data is not None:
        sent["Content-Length"] = str(len(data))
    for k, v in sent.items():
        if v is not None:
            c.putheader(k, v)
    c.endheaders(data)
    r = c.getresponse()
    text = r.read()
    c.close()
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = text.decode()
    return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}


def message(body) -> str:
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


@pytest.mark.parametrize("host", ["attacker.example:{port}", "attacker.example", "127.0.0.1.nip.io:{port}",
                                  "192.168.1.20:{port}"])
def test_a_foreign_host_is_refused(server, host):
    # DNS rebinding: the page's own name, pointed at 127.0.0.1, arrives in Host
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/api/chat", CHAT), ("GET", "/api/tags", None)):
        status, got, _ = call(server, method, path, body, {"Host": host.format(port=server.port)})
        assert status == 403, (path, host)
        assert "--allow-host" in message(got) and "\n" not in message(got)
    wait_until(lambda: any(" 403 /v1/chat/completions " in line for line in server.lines), 30)


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "127.0.0.1", "127.0.0.1:{port}", "[::1]:{port}",
                                  "LOCALHOST.:{port}", "127.0.0.2:{port}", "app.localhost:{port}"])
def test_loopback_hosts_are_served(server, host):
    status, got, _ = call(server, "GET", "/v1/models", headers={"Host": host.format(port=server.port)})
    assert status == 200 and got["data"][0]["id"] == "tiny"


def test_a_host_the_operator_allows_is_served(opened):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(opened, "GET", "/v1/models", headers={"Host": "proxy.example", **auth})[0] == 200
    assert call(opened, "GET", "/v1/models", headers={"Host": "Proxy.Example:443", **auth})[0] == 200
    assert call(opened, "GET", "/v1/models", headers={"Host": "other.example", **auth})[0] == 403


@pytest.mark.parametrize("origin", ["http://attacker.example", "https://127.0.0.1.attacker.example", "null",
                                    "http://app.example:3001", "file://"])
def test_a_foreign_origin_is_refused_and_gets_no_cors(server, opened, origin):
    for s in (server, opened):
        status, got, headers = call(s, "POST", "/v1/chat/completions", CHAT,
                                    {"Origin": origin, "Authorization": f"Bearer {KEY}"})
        assert status == 403 and "--allow-origin" in message(got)
        assert "access-control-allow-origin" not in headers


def test_a_foreign_origins_preflight_is_refused(server):
    status, _, headers = call(server, "OPTIONS", "/v1/chat/completions",
                              headers={"Origin": "http://attacker.example", "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "content-type"})
    assert status == 403 and "access-control-allow-origin" not in headers


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:8080", "https://[::1]"])
def test_a_loopback_origin_is_served_with_cors(server, origin):
    status, got, headers = call(server, "POST", "/v1/chat/completions", CHAT, {"Origin": origin})
    assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    assert headers["access-control-allow-origin"] == origin and "origin" in headers["vary"].lower()


def test_an_allowed_origin_is_served_and_its_preflight_answered(opened):
    origin = "http://app.example:3000"
    status, _, headers = call(opened, "OPTIONS", "/v1/chat/completions",
                              headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204 and headers["access-control-allow-origin"] == origin
    assert "POST" in headers["access-control-allow-methods"]
    assert "x-stainless-os" in headers["access-control-allow-headers"]
    status, got, headers = call(opened, "POST", "/v1/chat/completions", CHAT,
                                {"Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and got["choices"][0]["message"]["content"] is not None
    assert headers["access-control-allow-origin"] == origin
    ext = "chrome-extension://abcdefgh"
    assert call(opened, "GET", "/api/tags", headers={"Origin": ext, "Authorization": f"Bearer {KEY}"})[0] == 200


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                  None])
def test_a_body_that_is_not_declared_json_is_refused(server, kind):
    # what a page may send cross-site without asking first: 415, nothing run
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/api/chat", "/api/generate"):
        status, got, _ = call(server, "POST", path, headers={"Content-Type": kind}, raw=json.dumps(CHAT).encode())
        assert status == 415, (path, kind)
        assert "application/json" in message(got) and "\n" not in message(got)
        assert isinstance(got["error"], str) == path.startswith("/api/")     # each API's own error shape


def test_json_with_a_charset_is_served(server):
    status, got, _ = call(server, "POST", "/v1/chat/completions", CHAT,
                          {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and got["usage"]["completion_tokens"] == 2


def chunked(server, chunks, size=64 << 10) -> tuple[int, dict]:
    """POST a body in chunks with no Content-Length: (status, body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for part in chunks:
                for i in range(0, len(part), size):
                    piece = part[i:i + size]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                            # refused before the end: the answer is waiting to be read
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            got = sock.recv(65536)
            if not got:
                break
            data += got
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[:_length(data)])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


def test_a_chunked_body_is_held_to_the_size_limit(server):
    small = json.dumps(CHAT).encode()
    status, got = chunked(server, [small[:10], small[10:]], size=7)
    assert status == 200 and got["usage"]["completion_tokens"] == 2
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    status, got = chunked(server, [big])
    assert status == 413 and "MiB" in got["error"]["message"]
    status, got, _ = call(server, "POST", "/v1/chat/completions", raw=big)       # announced: the same
    assert status == 413
    assert call(server, "GET", "/health")[0] == 200                              # and the server goes on


ENDPOINTS = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
             ("POST", "/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2}),
             ("POST", "/v1/responses", {"model": "tiny", "input": "the cat", "max_output_tokens": 2}),
             ("POST", "/api/chat", {**CHAT, "stream": False}), ("POST", "/api/generate", {"model": "tiny", "prompt": "the",
                                                                                       "stream": False}),
             ("GET", "/api/tags", None), ("GET", "/api/ps", None), ("GET", "/api/version", None),
             ("POST", "/api/show", {"model": "tiny"})]


@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[p for _, p, _ in ENDPOINTS])
def test_the_key_is_required_on_every_endpoint_but_health(opened, method, path, body):
    for auth in (None, "Bearer wrong", "Bearer", f"Bearer {KEY}x"):
        status, got, _ = call(opened, method, path, body, {"Authorization": auth})
        assert status == 401 and "API key" in message(got), (path, auth)
    status, _, _ = call(opened, method, path, body, {"Authorization": f"Bearer {KEY}"})
    assert status == 200, path


def test_health_needs_no_key_and_the_key_is_never_logged(opened):
    assert call(opened, "GET", "/health")[0] == 200
    call(opened, "GET", "/v1/models", headers={"Authorization": "Bearer not-the-key"})
    wait_until(lambda: any(" 401 /v1/models " in line for line in opened.lines), 30)
    assert not any(KEY in line or "not-the-key" in line for line in opened.lines)


def test_the_real_clients_are_served_with_a_key(opened):
    oa = openai.OpenAI(base_url=opened.url, api_key=KEY, max_retries=0)
    r = oa.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3)
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=opened.url, api_key="wrong", max_retries=0).models.list()
    client = ollama.Client(host=f"http://127.0.0.1:{opened.port}", headers={"Authorization": f"Bearer {KEY}"})
    assert "tiny" in [m.model for m in client.list().models]
    assert client.chat(model="tiny", messages=CHAT["messages"], options={"num_predict": 3}).eval_count == 3
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=f"http://127.0.0.1:{opened.port}").list()
    assert err.value.status_code == 401


def test_max_tokens_over_the_context_is_held_to_it_and_said(server):
    status, got, _ = call(server, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 10 ** 6})
    assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    # the context holds the prompt and every answer token but the last (never fed back)
    assert got["usage"]["total_tokens"] <= 96 + 1 and "over the context" in got["timings"]["note"]
    wait_until(lambda: any("max_tokens 1000000 is over the context" in line for line in server.lines), 30)
