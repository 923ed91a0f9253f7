"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) as
a translation onto the chat path, for the tools that speak only it (VS Code Copilot's
Ollama mode, Open WebUI's Ollama connection, the `ollama` Python client): its options
become sampling fields, `format` a response_format, `think` the template's
enable_thinking; its answers stream as NDJSON lines ending in one with `done: true` and
the durations in nanoseconds. Errors are its shape: {"error": "..."}."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi.responses import JSONResponse, StreamingResponse

from .jobs import first_event, log, next_event
from .requests import ApiError

# The Ollama API version whose shapes are served (clients check it before using /api/chat).
API_VERSION = "0.12.0"


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


def _sampling(body: dict) -> dict:
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise _bad("options: must be an object")
    out = {}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                     ("stop", "stop")):
        if opts.get(src) is not None:
            out[dst] = opts[src]
    n = opts.get("num_predict")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:    # -1 and -2: as long as it takes
        out["max_tokens"] = n
    think = body.get("think")
    if think is not None:              # true, false, or an effort ("low"...): on
        out["chat_template_kwargs"] = {"enable_thinking": think is not False and think != "none"}
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt}}
    elif fmt not in (None, ""):
        raise _bad("format: must be \"json\" or a JSON schema")
    return out


def chat_body(body) -> dict:
    """The chat completions request an /api/chat request means."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]: must be an object")
        if m.get("images"):
            raise _bad(f"messages[{i}]: images are not supported: this model reads text only")
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": json.dumps((c.get("function") or {}).get("arguments") or {})}}
                for c in m["tool_calls"] if isinstance(c, dict)]
            msg["content"] = msg["content"] or None
        out.append(msg)
    chat = {"model": body.get("model"), "messages": out, "stream": body.get("stream", True), **_sampling(body)}
    if body.get("tools"):
        chat["tools"] = body["tools"]          # OpenAI's shape: {"type": "function", "function": {...}}
    return chat


def generate_body(body) -> tuple[dict, bool]:
    """The request an /api/generate request means: a chat turn, or with `raw` a plain
    completion of the prompt (True: use the completions path)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt: required")
    if body.get("images"):
        raise _bad("images are not supported: this model reads text only")
    if body.get("context"):
        raise _bad("context: not supported; send the conversation to /api/chat instead")
    common = {"model": body.get("model"), "stream": body.get("stream", True), **_sampling(body)}
    if body.get("raw"):
        return {**common, "prompt": prompt}, True
    msgs = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
        [{"role": "user", "content": prompt}]
    return {**common, "messages": msgs}, False


def now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def final(model: str, stats, reason: str, t0: float) -> dict:
    """The closing fields: done, why, and the durations in nanoseconds."""
    ns = lambda s: int(s * 1e9)        # noqa: E731
    return {"model": model, "created_at": now(), "done": True,
            "done_reason": {"stop": "stop", "length": "length", "tool_calls": "stop"}.get(reason, "stop"),
            "total_duration": ns(time.monotonic() - t0), "load_duration": 0,
            "prompt_eval_count": stats.prefill_tokens if stats else 0,
            "prompt_eval_duration": ns(stats.prefill_seconds) if stats else 0,
            "eval_count": stats.generated_tokens if stats else 0,
            "eval_duration": ns(stats.decode_seconds) if stats else 0}


def calls(tool_calls: list[dict]) -> list[dict]:
    """The engine's calls in Ollama's shape: arguments a mapping."""
    return [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in tool_calls]


def entry(name: str, size: int, arch: str, params: str = "", quantization: str = "") -> dict:
    """A model as /api/tags and /api/show describe it."""
    details = {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch] if arch else None,
               "parameter_size": params, "quantization_level": quantization}
    return {"name": name, "model": name, "modified_at": now(), "size": size, "digest": "", "details": details}


def model_entry(eng, name: str) -> dict:
    """A loaded model: its weights as the engine holds them."""
    d = eng.describe()
    return entry(name, int(d.get("weights_bytes") or 0), getattr(eng.target.config, "model_type", "") or "",
                 _params(eng), d.get("weights", ""))


def listed(slot) -> dict:
    """A model not loaded: what its files say."""
    from engine import caches
    size = caches.disk_bytes(slot.checkpoint) if slot.checkpoint is not None else 0
    return entry(slot.name, size, slot.config().get("model_type", ""))


def _params(eng) -> str:
    try:
        n = sum(t.numel() for t in eng.target.impl.weight_tensors())
    except Exception:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def show(eng, name: str) -> dict:
    from engine import reasoning, tools
    entry = model_entry(eng, name)
    tok = eng.tokenizer
    caps = ["completion"] + (["tools"] if tools.family(tok) else []) + (["thinking"] if reasoning.thinks(tok) else [])
    arch = entry["details"]["family"] or "model"
    template = tok.chat_template if isinstance(getattr(tok, "chat_template", None), str) else ""
    return {"modelfile": "", "parameters": "", "template": template, "details": entry["details"],
            "model_info": {"general.architecture": arch, f"{arch}.context_length": eng.target.max_positions},
            "capabilities": caps, "modified_at": entry["modified_at"]}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


async def answer(job, request, t0, generate: bool):
    """An answer in Ollama's shapes: NDJSON lines as it comes (the default), or one object."""
    model = job.request.model
    first, refused = await first_event(job, request, t0, error_response)
    if refused is not None:
        return refused

    def piece(content: str = "", **more) -> dict:
        if generate:
            return {"model": model, "created_at": now(), "response": content, **more, "done": False}
        return {"model": model, "created_at": now(),
                "message": {"role": "assistant", "content": content, **more}, "done": False}

    async def pieces():
        nonlocal first
        while True:
            kind, value = first if first is not None else await next_event(job, request)
            first = None
            if kind == "text":
                yield piece(value)
            elif kind == "reasoning":
                yield piece(thinking=value)
            elif kind == "tool_calls":
                yield piece(tool_calls=calls(value))
            elif kind == "error":
                yield {"error": value.message}
                return
            elif kind == "done":
                if value is not None and not value.get("cancelled"):
                    log(200, request.url.path, t0, value["stats"], "; ".join(filter(None, ["ollama", value["note"]])))
                    yield {**piece(), **final(model, value["stats"], value["finish_reason"], t0)}
                return

    if job.request.stream:
        async def lines():
            done = False
            try:
                async for p in pieces():
                    yield (json.dumps(p) + "\n").encode()
                done = True
            finally:
                if not done:
                    job.cancelled.set()
        return StreamingResponse(lines(), media_type="application/x-ndjson")
    text, thought, calls, last = [], [], [], None
    try:
        async for p in pieces():
            part = p if generate else p.get("message", {})
            text.append(part.get("response" if generate else "content", "") or "")
            thought.append(part.get("thinking", "") or "")
            calls += part.get("tool_calls", [])
            last = p
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    if last is None or "error" in last or not last.get("done"):
        return JSONResponse({"error": (last or {}).get("error", "the client left")}, status_code=500)
    thinking = "".join(thought).strip()
    out = {"thinking": thinking} if thinking else {}
    if generate:
        return {**last, "response": "".join(text), **out}
    message = {"role": "assistant", "content": "".join(text), **out, **({"tool_calls": calls} if calls else {})}
    return {**last, "message": message}
