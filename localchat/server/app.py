"""The HTTP API, in OpenAI's shapes: POST /v1/chat/completions (streamed as server-sent
events ending in `data: [DONE]`, or whole), GET /v1/models, GET /health.

FastAPI on uvicorn, as vLLM and SGLang serve: async request handling (a client waiting in
the queue or reading a stream costs no thread), the event loop apart from the engine's
thread (engine/... runs on runner.Runner's). Every response carries `usage` and, like
llama-server's `timings`, the engine's own figures for the answer."""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import responses
from .requests import ApiError, parse_chat, parse_completion
from .runner import Job, Runner

MAX_BODY = 4 << 20                      # bytes: a conversation, not an upload


def timings(stats, profile: str | None) -> dict:
    if stats is None:
        return {}
    return {"prompt_n": stats.prompt_tokens, "prompt_cached": stats.prompt_tokens - stats.prefill_tokens,
            "prefill_tokens": stats.prefill_tokens, "prefill_per_second": round(stats.prefill_tps, 2),
            "predicted_n": stats.generated_tokens, "decode_per_second": round(stats.decode_tps, 2),
            "tokens_per_pass": round(stats.tokens_per_pass, 3), "acceptance": round(stats.acceptance, 3),
            "draft_k": stats.draft_k, "profile": profile}


def usage(stats) -> dict:
    p, c = (stats.prompt_tokens, stats.generated_tokens) if stats is not None else (0, 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": (stats.prompt_tokens - stats.prefill_tokens) if stats else 0}}


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _log(status: int, path: str, t0: float, stats=None, note: str = "") -> None:
    line = f"localchat serve: {status} {path} {time.monotonic() - t0:.2f}s"
    if stats is not None:
        line += (f" · {stats.prompt_tokens} prompt ({stats.prefill_tokens} prefilled) + {stats.generated_tokens} tokens"
                 f" · prefill {stats.prefill_tps:.0f} tok/s · decode {stats.decode_tps:.1f} tok/s")
    print(line + (f" · {note}" if note else ""), file=sys.stderr, flush=True)


def make_app(runner: Runner, model_id: str, aliases: tuple[str, ...] = (), api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="localchat", docs_url=None, redoc_url=None, openapi_url=None)
    names = {model_id, *aliases}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        t0 = time.monotonic()
        if api_key and request.url.path != "/health":
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.removeprefix("Bearer ").strip().encode(), api_key.encode()):
                _log(401, request.url.path, t0)
                return _error(ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                                       kind="authentication_error", code="invalid_api_key"))
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            _log(413, request.url.path, t0)
            return _error(ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        body = {"status": runner.state, "model": model_id, "queued": runner.queued()}
        if runner.error:
            body["error"] = runner.error
        return JSONResponse(body, status_code=200 if runner.state == "ready" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "localchat"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, parse_chat, False)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, parse_completion, True)

    @app.post("/v1/responses")
    async def responses_api(request: Request):
        return await answer(request, lambda body: parse_chat(responses.chat_body(body)), "responses")

    async def answer(request: Request, parse, text):
        """A chat completion, (`text` True) a plain-text completion of a prompt, or (`text`
        "responses") a Responses API answer."""
        t0 = time.monotonic()
        try:
            raw = await request.body()
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ApiError(400, f"the request body is not JSON ({exc})") from None
            req = parse(body)
            if text == "responses" and req.model is None:
                raise ApiError(400, "model: required: one of GET /v1/models", param="model")
            if req.model not in names:
                raise ApiError(404, f"model {req.model!r} is not served here; GET /v1/models lists {model_id!r}",
                               param="model", code="model_not_found")
            loop = asyncio.get_running_loop()
            job = Job(req, loop, asyncio.Queue())
            runner.submit(job)
        except ApiError as exc:
            _log(exc.status, request.url.path, t0, note=exc.message)
            return _error(exc)
        cid, created = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        profile = runner.engine.plan.chosen if runner.engine is not None and runner.engine.plan else None
        if text == "responses":
            return await _responses(job, body, request, t0)
        if req.stream:
            first, refused = await _first(job, request, t0)
            if refused is not None:
                return refused
            return StreamingResponse(_stream(job, first, cid, created, model_id, profile, request, t0, text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(job, cid, created, model_id, profile, request, t0, text)

    return app


async def _next(job: Job, request: Request):
    """The job's next event; cancels the job when the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), 0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()


def openai_calls(calls) -> list[dict]:
    """The engine's calls in OpenAI's shape: an id each, the arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


async def _first(job, request, t0):
    """The job's first event, and the response refusing the request if that is an error.
    Headers wait for it: a request refused in the queue (or a conversation the context
    cannot hold) still gets its status, not a 200 stream."""
    try:
        first = await _next(job, request)
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    if first[0] == "error":
        _log(first[1].status, request.url.path, t0, note=first[1].message)
        return first, _error(first[1])
    return first, None


async def _whole(job, cid, created, model, profile, request, t0, text: bool = False):
    parts, thought, calls, call_error = [], [], [], ""
    try:
        while True:
            kind, value = await _next(job, request)
            if kind == "text":
                parts.append(value)
            elif kind == "reasoning":
                thought.append(value)
            elif kind == "tool_calls":
                calls = openai_calls(value)
            elif kind == "tool_error":
                call_error = value
            elif kind == "error":
                _log(value.status, request.url.path, t0, note=value.message)
                return _error(value)
            else:
                break
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    if value is None or value.get("cancelled"):
        _log(499, request.url.path, t0, value and value["stats"], "the client left; the answer was stopped")
        return JSONResponse({}, status_code=499)
    stats = value["stats"]
    _log(200, request.url.path, t0, stats, call_error and f"not a tool call: {call_error}")
    message = {"role": "assistant", "content": "".join(parts)}
    if calls:            # as OpenAI answers a call: content null unless the model wrote text first
        message["content"] = message["content"] or None
        message["tool_calls"] = calls
    if call_error:       # the text stays in content; why it is not a call, said beside it
        message["tool_call_error"] = call_error
    if thought:         # both names: vLLM and llama-server say reasoning_content, OpenRouter reasoning
        message["reasoning_content"] = message["reasoning"] = "".join(thought).strip()
    choice = {"text": "".join(parts)} if text else {"message": message}
    return {"id": cid, "object": "text_completion" if text else "chat.completion", "created": created,
            "model": model, "choices": [{"index": 0, **choice, "finish_reason": value["finish_reason"],
                                         "logprobs": None}],
            "usage": usage(stats), "timings": timings(stats, profile)}


async def _responses(job, body: dict, request, t0):
    """A Responses API answer, whole or as its semantic events."""
    rid, created = responses.new_id()
    build = responses.Builder(rid, model_of(job), created, body)
    first, refused = await _first(job, request, t0)
    if refused is not None:
        return refused

    async def events():
        nonlocal first
        yield build.start()
        while True:
            kind, value = first if first is not None else await _next(job, request)
            first = None
            if kind in ("text", "reasoning"):
                yield build.text(kind, value)
            elif kind == "tool_calls":
                yield build.calls(openai_calls(value))
            elif kind == "error":
                yield [build._event("error", code=value.code, message=value.message, param=value.param)]
                return
            elif kind == "done":
                if value is None or value.get("cancelled"):
                    return
                stats = value["stats"]
                yield build.finish(value["finish_reason"], responses.usage(stats, value.get("reasoning_tokens", 0)))
                _log(200, request.url.path, t0, stats, "responses")
                return

    if not job.request.stream:
        last = None
        try:
            async for evs in events():
                last = evs[-1] if evs else last
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if last is None or last[0] not in ("response.completed", "response.incomplete"):
            err = last[1] if last is not None and last[0] == "error" else {"message": "the client left", "code": None}
            return JSONResponse({"error": {"message": err["message"], "type": "server_error", "param": None,
                                           "code": err.get("code")}}, status_code=500 if last else 499)
        return last[1]["response"]

    async def stream():
        done = False
        try:
            async for evs in events():
                for kind, data in evs:
                    yield f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
            done = True
        finally:
            if not done:
                job.cancelled.set()
    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def model_of(job) -> str:
    return job.request.model


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(job, first, cid, created, model, profile, request, t0, text: bool = False):
    kind_of = "text_completion" if text else "chat.completion.chunk"

    def chunk(delta: dict, finish=None, **more):
        part = {"text": delta.get("content", "")} if text else {"delta": delta}
        return _sse({"id": cid, "object": kind_of, "created": created, "model": model,
                     "choices": [{"index": 0, **part, "finish_reason": finish, "logprobs": None}], **more})
    done, call_error = False, ""
    try:
        if not text:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = first if first is not None else await _next(job, request)
            first = None
            if kind == "text":
                yield chunk({"content": value})
            elif kind == "reasoning":
                yield chunk({"reasoning_content": value, "reasoning": value})
            elif kind == "tool_calls":
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(openai_calls(value))]})
            elif kind == "tool_error":
                call_error = value
                yield chunk({"tool_call_error": value})
            elif kind == "error":
                _log(value.status, request.url.path, t0, note=value.message)
                yield _sse(value.body())
                break
            else:
                stats = value["stats"] if value else None
                if value is not None:
                    yield chunk({}, value["finish_reason"], timings=timings(stats, profile))
                    if job.request.include_usage:
                        yield _sse({"id": cid, "object": kind_of, "created": created,
                                    "model": model, "choices": [], "usage": usage(stats)})
                _log(200, request.url.path, t0, stats, "streamed" + (f"; not a tool call: {call_error}"
                                                                      if call_error else ""))
                break
        yield b"data: [DONE]\n\n"
        done = True
    finally:
        if not done:                         # the client closed the stream: stop the answer
            job.cancelled.set()
            _log(499, request.url.path, t0, note="the client left mid-stream; the answer was stopped")
