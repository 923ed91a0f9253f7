"""A local HTTP server that speaks the part of the Hugging Face hub's protocol that
huggingface_hub's download code uses, so that code runs unchanged against it (HF_ENDPOINT):

- GET  /api/models/<repo>[/revision/<rev>]   the model info: commit sha, files with sizes,
                                             git blob ids and LFS sha256;
- HEAD /<repo>/resolve/<rev>/<file>          X-Repo-Commit, ETag / X-Linked-Etag, sizes; an
                                             LFS file answers 302 to its CDN address;
- GET  /<repo>/resolve/<rev>/<file>, /cdn/<sha256>   the bytes, honouring Range.

Faults are set per file name: `fail[name] = n` answers the next n GETs with 500, `stall[name]
= s` sleeps s seconds before the next body, `corrupt[name] = n` flips a byte in the next n bodies,
`rate` (bytes/s) throttles every body. `sent[name]` counts the body bytes written."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class RepoFile:
    name: str
    data: bytes
    lfs: bool
    sha256: str = ""
    blob_id: str = ""


@dataclass
class Hub:
    repos: dict[str, list[RepoFile]] = field(default_factory=dict)
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    fail: dict[str, int] = field(default_factory=dict)
    stall: dict[str, float] = field(default_factory=dict)
    corrupt: dict[str, int] = field(default_factory=dict)
    rate: float | None = None
    sent: dict[str, int] = field(default_factory=dict)
    gets: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_folder(self, repo: str, folder: Path) -> None:
        files = []
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                name = p.relative_to(folder).as_posix()
                blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
                files.append(RepoFile(name, data, name.endswith(LFS_SUFFIXES),
                                      hashlib.sha256(data).hexdigest(), blob))
        self.repos[repo] = files

    def file(self, repo: str, name: str) -> RepoFile | None:
        return next((f for f in self.repos.get(repo, []) if f.name == name), None)

    def by_sha256(self, sha: str) -> RepoFile | None:
        return next((f for files in self.repos.values() for f in files if f.sha256 == sha), None)


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 5            # an idle keep-alive connection ends, so shutdown never waits long

        def log_message(self, *args):
            pass

        def _json(self, code: int, obj, headers=None):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, code="EntryNotFound"):
            self._json(404, {"error": code}, {"X-Error-Code": code})

        def _route(self):
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/models/"):
                rest = path[len("/api/models/"):]
                repo = "/".join(rest.split("/")[:2])
                return "info", repo, None
            if path.startswith("/cdn/"):
                f = hub.by_sha256(path[len("/cdn/"):])
                return "cdn", None, f
            parts = path.lstrip("/").split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = "/".join(parts[:2])
                return "resolve", repo, (repo, "/".join(parts[4:]))
            return None, None, None

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        def _serve(self, head: bool):
            kind, repo, arg = self._route()
            if kind == "info":
                if repo not in hub.repos:
                    return self._not_found("RepoNotFound")
                siblings = [{"rfilename": f.name, "size": len(f.data), "blobId": f.blob_id,
                             **({"lfs": {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}}
                                if f.lfs else {})} for f in hub.repos[repo]]
                return self._json(200, {"id": repo, "modelId": repo, "sha": hub.sha, "siblings": siblings,
                                        "private": False, "tags": []})
            if kind == "resolve":
                repo, name = arg
                if repo not in hub.repos:
                    return self._not_found("RepoNotFound")
                f = hub.file(repo, name)
                if f is None:
                    return self._not_found()
                common = {"X-Repo-Commit": hub.sha, "Accept-Ranges": "bytes"}
                if f.lfs:
                    self.send_response(302)
                    # the CDN on another host name, as the hub's is: the client does not follow it on HEAD
                    port = self.server.server_address[1]
                    for k, v in {**common, "Location": f"http://localhost:{port}/cdn/{f.sha256}",
                                 "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data)),
                                 "ETag": f'"{f.blob_id}"', "Content-Length": "0"}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    return
                return self._body(f, {**common, "ETag": f'"{f.blob_id}"'}, head)
            if kind == "cdn":
                if arg is None:
                    return self._not_found()
                return self._body(arg, {"ETag": f'"{arg.sha256}"', "Accept-Ranges": "bytes"}, head)
            self._not_found()

        def _body(self, f: RepoFile, headers: dict, head: bool):
            data = f.data
            if not head:
                with hub.lock:
                    hub.gets[f.name] = hub.gets.get(f.name, 0) + 1
                    failing = hub.fail.get(f.name, 0)
                    if failing:
                        hub.fail[f.name] = failing - 1
                    corrupting = hub.corrupt.get(f.name, 0)
                    if corrupting and not failing:
                        hub.corrupt[f.name] = corrupting - 1
                if failing:
                    return self._json(500, {"error": "Internal Error"})
                if corrupting:
                    mid = len(data) // 2
                    data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
            start, end = 0, len(data)
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[len("bytes="):].partition("-")
                start = int(a) if a else 0
                end = int(b) + 1 if b else len(data)
            part = start > 0 or end < len(data)
            self.send_response(206 if part else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(end - start))
            if part:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            with hub.lock:
                stall = hub.stall.pop(f.name, 0)      # once: the client's retry then gets the bytes
            if stall:
                time.sleep(stall)
            step = 16384
            try:
                for i in range(start, end, step):
                    chunk = data[i:min(i + step, end)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    with hub.lock:
                        hub.sent[f.name] = hub.sent.get(f.name, 0) + len(chunk)
                    if hub.rate:
                        time.sleep(len(chunk) / hub.rate)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys
        if not isinstance(sys.exc_info()[1], ConnectionError):    # a client killed mid-answer is a test's doing
            super().handle_error(request, client_address)


class HubServer:
    """The server on a free loopback port, in a thread; `endpoint` is its base URL."""

    def __init__(self, hub: Hub):
        self.hub = hub
        self.httpd = _Server(("127.0.0.1", 0), _handler(hub))
        self.httpd.daemon_threads = False        # server_close joins every handler thread
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub-server", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
