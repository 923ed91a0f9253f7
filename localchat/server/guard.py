"""What every request passes before the API reads it: a page in the user's browser must not
reach the local model.

A server on 127.0.0.1 is reachable from every web page the user opens. Two ways in, both
closed here, in this order:
- DNS rebinding: a page on a name its owner re-points at 127.0.0.1 talks to us as its own
  origin. Its requests carry that name in `Host`, so a Host that is not a loopback name or
  address, the address we listen on, or a name the operator allows (--allow-host) gets 403.
  An IP literal cannot be rebound, so with --host 0.0.0.0 any address is taken.
- Cross-site requests: a browser adds `Origin` to every cross-site POST, and sends a "simple"
  one (text/plain, a form) without asking first. A request with an Origin is served only
  when that origin is loopback, the server's own, or listed (--allow-origin); CORS headers
  go to those alone, and only their preflights are answered. Bodies must say
  `application/json` (415 otherwise), which no simple request can.
Then the API key (every path but /health), and the body's size, counted as it arrives
whether or not a Content-Length announced it. Clients that send no Origin (the openai and
ollama clients, curl, `--backend`) meet only the key and the content type.

A refusal is one line of JSON in the shape of the API asked (Ollama's under /api/)."""
from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import json
import time
from urllib.parse import urlsplit

from .jobs import log

MAX_BODY = 4 << 20                      # bytes: a conversation, not an upload
DRAIN_LIMIT = 64 << 20                  # bytes of a refused body read and dropped, so the client sees the 413
WILDCARDS = ("0.0.0.0", "::", "")
PREFLIGHT_MAX_AGE = "600"


def host_name(value: str) -> str:
    """The name or address of a Host header or netloc, without its port, lower case."""
    value = value.strip().lower()
    if value.startswith("["):                         # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:                        # name:port (a bare IPv6 address has several)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """localhost (and names under .localhost, which resolve to loopback by rule) or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    addr = _address(name)
    return addr is not None and addr.is_loopback


def split_list(values) -> list[str]:
    """Repeated flags and comma-separated settings as one list of entries."""
    out = []
    for v in values or ():
        out += [p.strip() for p in str(v or "").split(",") if p.strip()]
    return out


class Guard:
    """ASGI middleware around the API (make_app wraps it): the checks of the module doc."""

    def __init__(self, app, bound_host: str = "127.0.0.1", allow_hosts=(), allow_origins=(),
                 api_key: str | None = None, max_body: int = MAX_BODY):
        self.app, self.api_key, self.max_body = app, api_key or None, max_body
        self.bound = host_name(bound_host)
        self.allow_hosts = {host_name(h) for h in split_list(allow_hosts)}
        self.allow_origins = [o.rstrip("/").lower() for o in split_list(allow_origins)]

    def host_ok(self, host: str | None) -> bool:
        if not host or "*" in self.allow_hosts:      # HTTP/1.0 sends none; a browser always does
            return True
        name = host_name(host)
        if is_loopback(name) or name in self.allow_hosts or (name == self.bound and self.bound not in WILDCARDS):
            return True
        return self.bound in WILDCARDS and _address(name) is not None

    def origin_ok(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if any(pattern == "*" or fnmatch.fnmatchcase(origin, pattern) for pattern in self.allow_origins):
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False                              # "null" (a sandboxed page, a file), extensions
        if is_loopback(host_name(parts.netloc)):
            return True
        return bool(host) and parts.netloc == host.strip().lower()     # the server's own origin

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        host, origin = headers.get("host"), headers.get("origin")

        async def refuse(status: int, message: str, extra: dict | None = None, drain: bool = False):
            if drain:
                await _drain(receive)
            log(status, path, t0, note=message)
            if path.startswith("/api/"):
                body = {"error": message}
            else:
                kind = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
                body = {"error": {"message": message, "type": kind, "param": None,
                                  "code": "invalid_api_key" if status == 401 else None}}
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                    *((k.encode(), v.encode()) for k, v in (extra or {}).items())]})
            await send({"type": "http.response.body", "body": data})

        if not self.host_ok(host):
            return await refuse(403, f"Host {host!r} is not this server's: start it with --allow-host "
                                     f"{host_name(host)} to serve requests addressed to that name")
        cors = None
        if origin is not None:
            if not self.origin_ok(origin, host):
                return await refuse(403, f"Origin {origin!r} may not use this server: start it with "
                                         f"--allow-origin {origin.strip()} to let pages from there in")
            cors = {"access-control-allow-origin": origin.strip(), "vary": "Origin"}
            if method == "OPTIONS" and "access-control-request-method" in headers:
                return await _preflight(send, cors, headers)
        if self.api_key and path != "/health":
            got = headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(got.encode(), self.api_key.encode()):
                return await refuse(401, "a valid API key is required: Authorization: Bearer KEY", cors)
        size = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            return await refuse(413, f"the request body is over {self.max_body >> 20} MiB", cors, drain=True)
        if method in ("POST", "PUT", "PATCH") and (chunked or (size or "0") != "0"):
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return await refuse(415, f"the body must be JSON sent as Content-Type: application/json, not "
                                         f"{kind or 'no type'} (curl: -H 'Content-Type: application/json')", cors)
        if chunked and size is None:
            body = await _read_upto(receive, self.max_body)
            if body is None:
                return await refuse(413, f"the request body is over {self.max_body >> 20} MiB", cors, drain=True)
            receive = _replay(body, receive)
        if cors is not None:
            send = _with_headers(send, cors)
        return await self.app(scope, receive, send)


async def _preflight(send, cors: dict, headers: dict):
    out = {**cors, "access-control-allow-methods": "GET, POST, OPTIONS", "access-control-max-age": PREFLIGHT_MAX_AGE,
           "access-control-allow-headers": headers.get("access-control-request-headers", "authorization, content-type"),
           "content-length": "0"}
    await send({"type": "http.response.start", "status": 204,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]})
    await send({"type": "http.response.body", "body": b""})


def _with_headers(send, extra: dict):
    pairs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *pairs]}
        await send(message)
    return wrapped


async def _read_upto(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes (what came stays unread)."""
    parts, total = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)                    # the client left; the app sees an empty body
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _drain(receive) -> None:
    """Read and drop what is left of a refused body, up to DRAIN_LIMIT, before answering: a
    client still sending then reads its 413 instead of a reset connection."""
    total = 0
    while total <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        total += len(message.get("body", b""))


def _replay(body: bytes, receive):
    given = False

    async def replayed():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()                        # later: the disconnect the streams watch for
    return replayed
