"""The HTTP API, in OpenAI's shapes: POST /v1/chat/completions (streamed as server-sent
events ending in `data: [DONE]`, or whole), /v1/completions, GET /v1/models, GET /health;
and as translations onto the same path, the Responses API (responses.py) and Ollama's
(ollama.py).

FastAPI on uvicorn, as vLLM and SGLang serve: async request handling (a client waiting in
the queue or reading a stream costs no thread), the event loop apart from the engine's
thread (engine/... runs on runner.Runner's). Every response carries `usage` and, like
llama-server's `timings`, the engine's own figures for the answer."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import ollama, responses
from .guard import Guard
from .jobs import error_response as _error, first_event as _first, log as _log, next_event as _next, openai_calls
from .requests import ApiError, parse_chat, parse_completion
from .runner import Job, Runner


def timings(stats, profile: str | None, note: str = "") -> dict:
    if stats is None:
        return {}
    return {**({"note": note} if note else {}),
            "prompt_n": stats.prompt_tokens, "prompt_cached": stats.prompt_tokens - stats.prefill_tokens,
            "prefill_tokens": stats.prefill_tokens, "prefill_per_second": round(stats.prefill_tps, 2),
            "predicted_n": stats.generated_tokens, "decode_per_second": round(stats.decode_tps, 2),
            "tokens_per_pass": round(stats.tokens_per_pass, 3), "acceptance": round(stats.acceptance, 3),
            "draft_k": stats.draft_k, "profile": profile}


def usage(stats) -> dict:
    p, c = (stats.prompt_tokens, stats.generated_tokens) if stats is not None else (0, 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": (stats.prompt_tokens - stats.prefill_tokens) if stats else 0}}


def make_app(runner: Runner, api_key: str | None = None, host: str = "127.0.0.1", allow_hosts=(),
             allow_origins=()) -> Guard:
    """The API behind its checks (guard.py): `host` is the address listened on."""
    app = FastAPI(title="localchat", docs_url=None, redoc_url=None, openapi_url=None)
    models = runner.models
    model_id = models.default.name

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.get("/health")
    async def health():
        body = {"status": runner.state, "model": model_id, "queued": runner.queued(),
                "loaded": [s.name for s in models.slots.values() if s.state == "ready"],
                "loading": [s.name for s in models.slots.values() if s.state == "loading"]}
        if runner.error:
            body["error"] = runner.error
        return JSONResponse(body, status_code=200 if runner.state == "ready" else 503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.listing()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, parse_chat, False)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, parse_completion, True)

    @app.post("/v1/responses")
    async def responses_api(request: Request):
        return await answer(request, lambda body: parse_chat(responses.chat_body(body)), "responses")

    # Ollama's API, for the tools that speak only it (server/ollama.py)
    @app.post("/api/chat")
    async def ollama_chat(request: Request):
        return await answer(request, lambda body: parse_chat(ollama.chat_body(body)), "ollama-chat",
                            ollama.error_response)

    @app.post("/api/generate")
    async def ollama_generate(request: Request):
        def parse(body):
            chat, raw = ollama.generate_body(body)
            if not raw:
                return parse_chat(chat)
            req = parse_completion(chat)
            req.max_tokens = chat.get("max_tokens")        # Ollama's default: the server's, not 16
            return req
        return await answer(request, parse, "ollama-generate", ollama.error_response)

    @app.get("/api/version")
    async def ollama_version():
        return {"version": ollama.API_VERSION}

    @app.get("/api/tags")
    async def ollama_tags():
        return {"models": [ollama.model_entry(s.engine, s.name) if s.engine is not None else ollama.listed(s)
                           for s in models.slots.values()]}

    @app.get("/api/ps")
    async def ollama_ps():
        out = []
        for s in models.slots.values():
            if s.engine is not None:
                entry = ollama.model_entry(s.engine, s.name)
                out.append({**entry, "size_vram": entry["size"] if s.engine.device.type != "cpu" else 0,
                            "expires_at": "2999-01-01T00:00:00Z", "context_length": s.engine.target.max_positions})
        return {"models": out}

    @app.post("/api/show")
    async def ollama_show(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = {}
        slot = models.resolve(body.get("model") or body.get("name") if isinstance(body, dict) else None)
        if slot is None:
            return ollama.error_response(ApiError(404, "model not found; /api/tags lists them"))
        if slot.engine is None:
            return ollama.error_response(ApiError(503, f"the model {slot.name!r} is {slot.state}; a request "
                                                  "for it loads it"))
        return ollama.show(slot.engine, slot.name)

    async def answer(request: Request, parse, text, error=_error):
        """A chat completion, (`text` True) a plain-text completion of a prompt, (`text`
        "responses") a Responses API answer, or Ollama's chat or generate; `error` shapes a
        refusal."""
        t0 = time.monotonic()
        try:
            raw = await request.body()          # its size and type checked before (guard.py)
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ApiError(400, f"the request body is not JSON ({exc})") from None
            req = parse(body)
            if text == "responses" and req.model is None:
                raise ApiError(400, "model: required: one of GET /v1/models", param="model")
            slot = models.resolve(req.model)
            if slot is None:
                listed = ", ".join(repr(n) for n in list(models.slots)[:5]) + (", ..." if len(models.slots) > 5 else "")
                raise ApiError(404, f"model {req.model!r} is not served here; GET /v1/models lists {listed}",
                               param="model", code="model_not_found")
            loop = asyncio.get_running_loop()
            job = Job(req, loop, asyncio.Queue(), slot=slot)
            runner.submit(job)
        except ApiError as exc:
            _log(exc.status, request.url.path, t0, note=exc.message)
            return error(exc)
        cid, created = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        eng = slot.engine or runner.engine
        profile = eng.plan.chosen if eng is not None and eng.plan else None
        if text == "responses":
            return await responses.answer(job, body, request, t0)
        if text in ("ollama-chat", "ollama-generate"):
            return await ollama.answer(job, request, t0, text == "ollama-generate")
        if req.stream:
            first, refused = await _first(job, request, t0)
            if refused is not None:
                return refused
            return StreamingResponse(_stream(job, first, cid, created, slot.name, profile, request, t0, text),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(job, cid, created, slot.name, profile, request, t0, text)

    return Guard(app, host, allow_hosts, allow_origins, api_key)


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
    _log(200, request.url.path, t0, stats, "; ".join(filter(None, [value["note"],
                                                                   call_error and f"not a tool call: {call_error}"])))
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
            "usage": usage(stats), "timings": timings(stats, profile, value["note"])}


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
                    yield chunk({}, value["finish_reason"], timings=timings(stats, profile, value["note"]))
                    if job.request.include_usage:
                        yield _sse({"id": cid, "object": kind_of, "created": created,
                                    "model": model, "choices": [], "usage": usage(stats)})
                _log(200, request.url.path, t0, stats, "; ".join(filter(None, [
                    "streamed", value and value["note"], call_error and f"not a tool call: {call_error}"])))
                break
        yield b"data: [DONE]\n\n"
        done = True
    finally:
        if not done:                         # the client closed the stream: stop the answer
            job.cancelled.set()
            _log(499, request.url.path, t0, note="the client left mid-stream; the answer was stopped")
