"""`--backend URL`: the chat UI, one-shot mode and bench driving any OpenAI-compatible
server (vLLM, SGLang, llama-server, Ollama, `localchat serve`) instead of a local model.

RemoteEngine and RemoteChat stand where engine.Engine and engine.Chat stand, and answer
with the same events (TextDelta, Stats, Done), so every front end works unchanged. Time
to first token and decode tok/s are measured here, from chunk arrival times; the server's
own figures are added when it sends them (our `timings`, llama-server's `timings`, the
`usage` every server sends at the end of a stream when asked).

Plain http.client, no SDK: a stream is a socket another thread can close (Esc stops the
answer at once, the request closed, the partial answer kept), and one error line per
failure names what went wrong: refused, wrong key, unknown model, not an OpenAI API."""
from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import engine
from engine.events import Done, Stats, TextDelta
from engine.session import Messages


@dataclass(frozen=True)
class RemoteStats(Stats):
    """Stats of an answer a backend wrote: what the client measured, and the server's own
    figures when it sent them (0 when not)."""
    ttft_seconds: float = 0.0
    server_prefill_tps: float = 0.0
    server_decode_tps: float = 0.0
    backend: str = ""


class BackendError(engine.EngineError):
    pass


def api_key(flag: str | None) -> str | None:
    return flag or os.environ.get("LOCALCHAT_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


class _Http:
    def __init__(self, url: str, key: str | None, timeout: float):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(f"--backend {url}: not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path.rstrip("/")
        self.key, self.timeout = key, timeout

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        return h

    def open(self, method: str, path: str, body: dict | None = None):
        conn = self.connect()
        try:
            conn.request(method, self.base + path, body=json.dumps(body) if body is not None else None,
                         headers=self.headers())
            resp = conn.getresponse()
        except (ConnectionRefusedError, socket.gaierror, socket.timeout, OSError) as exc:
            conn.close()
            why = "connection refused" if isinstance(exc, ConnectionRefusedError) else \
                (exc.strerror or str(exc) or type(exc).__name__)
            raise BackendError(f"--backend {self.url}: {why}; is the server running?") from None
        if resp.status >= 400:
            data = resp.read()
            conn.close()
            raise BackendError(self._why(resp.status, data))
        return conn, resp

    def get_json(self, path: str) -> dict:
        conn, resp = self.open("GET", path)
        try:
            data = resp.read()
        finally:
            conn.close()
        try:
            return json.loads(data)
        except ValueError:
            raise BackendError(f"--backend {self.url}: {path} did not answer JSON; is this an OpenAI-compatible "
                               "API (the URL usually ends in /v1)?") from None

    def _why(self, status: int, data: bytes) -> str:
        try:
            err = json.loads(data).get("error")
            message = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            message = ""
        message = " ".join((message or "").split())[:300]
        if status == 401 or status == 403:
            return f"--backend {self.url}: the server refused the API key ({status}); give it with --api-key, " \
                   "LOCALCHAT_API_KEY or OPENAI_API_KEY"
        if status == 404 and not message:
            return f"--backend {self.url}: not found (404); is this an OpenAI-compatible API (the URL usually " \
                   "ends in /v1)?"
        return f"--backend {self.url}: {status} {message or http.client.responses.get(status, '')}".rstrip()


class RemoteEngine:
    """A backend's model, in engine.Engine's place."""
    kind = "backend"
    plan = None
    target = None

    def __init__(self, url: str, model: str | None = None, key: str | None = None, timeout: float = 600.0):
        self.http = _Http(url, key, timeout)
        listed = self.http.get_json("/models")
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        ids = [i for i in ids if isinstance(i, str)]
        if not ids:
            raise BackendError(f"--backend {self.http.url}: GET /models lists no model; is this an OpenAI-compatible "
                               "API?")
        if model is not None and model not in ids:
            raise BackendError(f"--backend-model {model}: {self.http.url} serves {', '.join(ids[:8])}")
        self.model = model or ids[0]
        self.url = self.http.url
        self.name = f"{self.model} @ {self.url}"
        self.tokenizer = None

    def chat(self, system: str | None = None) -> "RemoteChat":
        return RemoteChat(self, system)

    def describe(self) -> dict:
        return {"model": self.model, "path": self.url, "device": self.url, "dtype": "", "forward": "backend",
                "weights_bytes": 0, "context_max": 0, "drafter": "the server's", "draft_tokens": "",
                "profile": "backend", "weights": "", "backend": self.url}

    def set_drafter(self, *args, **kwargs) -> None:
        raise engine.BadRequest("the backend chooses its own decoding; /drafter needs a local model")

    def new_controller(self):
        return None


class RemoteChat(Messages):
    """engine.Chat's interface over chat completion requests: the whole conversation is
    sent each turn (the server keeps what it caches)."""

    def __init__(self, eng: RemoteEngine, system: str | None = None):
        super().__init__(system)
        self.engine = eng
        self.last_stats: RemoteStats | None = None
        self.last_done: Done | None = None
        self.thinking: bool | None = None     # sent as chat_template_kwargs.enable_thinking
        self.controller = None
        self._cancel = threading.Event()
        self._conn: http.client.HTTPConnection | None = None

    def cancel(self) -> None:
        self._cancel.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)    # the reading thread wakes at once
            except OSError:
                pass

    def send(self, text: str, max_new_tokens: int = 512, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, seed: int | None = None, grammar=None):
        """As engine.Chat.send. A sampling value left None is not sent: the server applies its
        own default (vLLM and SGLang the model's generation_config.json, llama-server and
        Ollama theirs)."""
        if not text or not text.strip():
            raise engine.BadRequest("the prompt is empty; type a question")
        # the same checks as a local answer
        engine.SamplingParams(temperature or 0.0, top_k or 0, 1.0 if top_p is None else top_p, seed)
        body = {"model": self.engine.model, "messages": self.messages + [{"role": "user", "content": text}],
                "max_tokens": max_new_tokens, "stream": True, "stream_options": {"include_usage": True}}
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
            if value is not None:
                body[name] = value
        if seed is not None:
            body["seed"] = seed
        if self.thinking is not None:          # vLLM, SGLang, llama-server and localchat take it
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        if grammar is not None:                # the server enforces it (or refuses it with a 400)
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": grammar.schema, "strict": True}}
        self._cancel.clear()
        self.messages.append({"role": "user", "content": text})
        answer = {"role": "assistant", "content": ""}
        self.messages.append(answer)
        return self._answer(body, answer)

    def _answer(self, body: dict, answer: dict):
        # Lazy, as engine.Chat.send's events are: the request goes out when the first event
        # is asked for, on the consumer's thread (the chat UI's engine thread, not its UI).
        t0 = time.monotonic()
        st = _Tally(self.engine.url, t0)
        try:
            conn, resp = self.engine.http.open("POST", "/chat/completions", body)
        except BackendError as exc:
            self.last_stats, self.last_done = st.stats(), Done("error", (), "", str(exc))
            yield self.last_stats
            yield self.last_done
            return
        self._conn = conn
        reason, error = "length", ""
        reasoning: list[str] = []
        try:
            for obj in _events(resp, self._cancel):
                if "error" in obj and "choices" not in obj:
                    err = obj["error"]
                    reason, error = "error", (err.get("message") if isinstance(err, dict) else str(err)) or "error"
                    break
                st.server(obj)
                for choice in obj.get("choices") or []:
                    d = choice.get("delta") or {}
                    thought = d.get("reasoning_content") or d.get("reasoning")
                    if thought:                     # a thinking model's reasoning, kept apart
                        st.token()
                        reasoning.append(thought)
                        yield TextDelta(thought, True)
                    delta = d.get("content")
                    if delta:
                        st.token()
                        answer["content"] += delta
                        yield TextDelta(delta)
                    if choice.get("finish_reason"):
                        reason = "stop" if choice["finish_reason"] == "stop" else "length"
                if st.due():
                    yield st.stats()
            if self._cancel.is_set():
                reason = "cancelled"
        except (OSError, http.client.HTTPException) as exc:
            if self._cancel.is_set():
                reason = "cancelled"
            else:
                reason, error = "error", f"--backend {self.engine.url}: the stream broke ({exc or type(exc).__name__})"
        except (GeneratorExit, KeyboardInterrupt):
            reason = "cancelled"
            raise
        finally:
            self._conn = None
            conn.close()
            self.last_stats = st.stats()
            self.last_done = Done(reason, (), answer["content"], error, reasoning="".join(reasoning).strip())
        yield self.last_stats
        yield self.last_done


def _events(resp, cancel: threading.Event):
    """The JSON objects of a server-sent event stream, until `data: [DONE]` or its end."""
    if "text/event-stream" not in (resp.getheader("Content-Type") or ""):
        data = resp.read()
        try:
            obj = json.loads(data)                   # a server that ignored "stream": one whole answer
        except ValueError:
            raise http.client.HTTPException("the server did not answer with an event stream") from None
        if "choices" in obj:
            for c in obj["choices"]:
                c["delta"] = c.get("message") or {}
        yield obj
        return
    while not cancel.is_set():
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            continue


class _Tally:
    """Client-side figures from chunk arrival times, plus the server's when sent."""

    def __init__(self, url: str, t0: float):
        self.url, self.t0 = url, t0
        self.first = self.last = None
        self.n = 0
        self._shown = t0
        self.usage: dict = {}
        self.timings: dict = {}

    def token(self) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.n += 1

    def server(self, obj: dict) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._shown >= 0.25:
            self._shown = now
            return True
        return False

    def stats(self) -> RemoteStats:
        t, u = self.timings, self.usage
        ttft = (self.first - self.t0) if self.first else 0.0
        decode_s = (self.last - self.first) if self.first and self.last else 0.0
        generated = int(u.get("completion_tokens") or t.get("predicted_n") or self.n)
        prompt = int(u.get("prompt_tokens") or t.get("prompt_n") or 0)
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or t.get("prompt_cached") or 0)
        server_prefill = float(t.get("prefill_per_second") or t.get("prompt_per_second") or 0)
        server_decode = float(t.get("decode_per_second") or t.get("predicted_per_second") or 0)
        return RemoteStats(
            prompt_tokens=prompt, prefill_tokens=max(0, prompt - cached), prefill_seconds=ttft,
            prefill_tps=server_prefill or ((prompt - cached) / ttft if ttft and prompt else 0.0),
            generated_tokens=generated, decode_seconds=decode_s,
            decode_tps=(self.n - 1) / decode_s if decode_s > 0 and self.n > 1 else 0.0,
            tokens_per_pass=float(t.get("tokens_per_pass") or 0), acceptance=float(t.get("acceptance") or 0),
            draft_k=int(t.get("draft_k") or 0), ttft_seconds=ttft, server_prefill_tps=server_prefill,
            server_decode_tps=server_decode, backend=self.url)
