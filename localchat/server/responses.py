"""POST /v1/responses, OpenAI's Responses API, stateless, as a translation onto the chat
path: the request becomes a chat completion request (its input items as messages, its
flat tools as function tools, text.format as response_format), and the answer's events
become the API's output items (reasoning, message, function_call) and, streamed, its
semantic events (`event: response.output_text.delta` ...; no [DONE]). Codex CLI and the
Agents SDK speak only this API. `previous_response_id` needs state a stateless server
does not keep: refused, naming it."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from .jobs import first_event, log, next_event, openai_calls
from .requests import ApiError


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("input_image", "input_file"):
                raise _bad(where, f"{kind} is not supported: this model reads text only")
            else:
                raise _bad(where, f"content part {kind!r} is not supported (input_text, output_text)")
        return "".join(parts)
    raise _bad(where, "content must be a string or a list of input_text parts")


def _messages(body: dict) -> list[dict]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "required: a string or a list of items")
    out: list[dict] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise _bad("instructions", "must be a string")
        out.append({"role": "system", "content": body["instructions"]})
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(where, f"role must be user, system, developer or assistant, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)          # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue                 # earlier reasoning: the templates drop it from past turns
        else:
            raise _bad(where, f"item type {kind!r} is not supported (message, function_call, "
                       "function_call_output, reasoning)")
    return out


def chat_body(body) -> dict:
    """The chat completions request a Responses request means."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("previous_response_id"):
        raise _bad("previous_response_id", "this server keeps no responses: send the whole conversation as input")
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": body.get("stream", False)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("chat_template_kwargs", "chat_template_kwargs"),
                     ("top_k", "top_k"), ("seed", "seed")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        flat = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise _bad(f"tools[{i}]", f"only function tools are supported, not {t.get('type') if isinstance(t, dict) else t!r}")
            flat.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                          if k in t}})
        chat["tools"] = flat
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "answer"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("text.format", "type must be text, json_object or json_schema")
    return chat


class Builder:
    """The output items of one response, as the answer's events arrive; `events()` of each
    step are the streamed form (with sequence numbers)."""

    def __init__(self, rid: str, model: str, created: int, request: dict):
        self.rid, self.model, self.created = rid, model, created
        self.request = request
        self.output: list[dict] = []
        self.seq = 0
        self._open: dict | None = None       # the item text is being added to (reasoning or message)

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        r = self.request
        return {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": self.output, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": r.get("instructions"), "tools": r.get("tools") or [],
                "tool_choice": r.get("tool_choice", "auto"), "parallel_tool_calls": r.get("parallel_tool_calls", True),
                "temperature": r.get("temperature"), "top_p": r.get("top_p"),
                "max_output_tokens": r.get("max_output_tokens"), "metadata": r.get("metadata") or {},
                "text": r.get("text") or {"format": {"type": "text"}}, "usage": usage}

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        ev = (kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return ev

    def start(self) -> list:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def _close(self) -> list:
        item, self._open = self._open, None
        if item is None:
            return []
        at = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        if item["type"] == "reasoning":
            done = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"])]
        else:
            done = [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                part=part)]
        return done + [self._event("response.output_item.done", output_index=at, item=item)]

    def text(self, kind: str, delta: str) -> list:
        """More reasoning (`kind` reasoning) or answer text."""
        evs = []
        want = "reasoning" if kind == "reasoning" else "message"
        if self._open is None or self._open["type"] != want:
            evs += self._close()
            if want == "reasoning":
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            else:
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                        "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.output.append(item)
            self._open = item
            at = len(self.output) - 1
            evs.append(self._event("response.output_item.added", output_index=at,
                                   item={**item, "content": [] if want == "message" else item["content"]}))
            if want == "message":
                evs.append(self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        item = self._open
        item["content"][0]["text"] += delta
        at = self.output.index(item)
        name = "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
        evs.append(self._event(name, item_id=item["id"], output_index=at, content_index=0, delta=delta,
                               **({} if want == "reasoning" else {"logprobs": []})))
        return evs

    def calls(self, calls: list[dict]) -> list:
        """The answer's tool calls (OpenAI's chat shape, from app.openai_calls)."""
        evs = self._close()
        for c in calls:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
            self.output.append(item)
            at = len(self.output) - 1
            evs += [self._event("response.output_item.added", output_index=at,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                arguments=item["arguments"], name=item["name"]),
                    self._event("response.output_item.done", output_index=at, item=item)]
        return evs

    def finish(self, finish_reason: str, usage: dict) -> list:
        evs = self._close()
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        return evs + [self._event(f"response.{status}", response=self.response(status, usage, incomplete))]


def usage(stats, reasoning_tokens: int = 0) -> dict:
    p, c = (stats.prompt_tokens, stats.generated_tokens) if stats is not None else (0, 0)
    cached = (stats.prompt_tokens - stats.prefill_tokens) if stats is not None else 0
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": p + c}


def new_id() -> tuple[str, int]:
    return f"resp_{uuid.uuid4().hex[:24]}", int(time.time())


async def answer(job, body: dict, request, t0):
    """A Responses API answer, whole or as its semantic events."""
    rid, created = new_id()
    build = Builder(rid, job.request.model, created, body)
    first, refused = await first_event(job, request, t0)
    if refused is not None:
        return refused

    async def events():
        nonlocal first
        yield build.start()
        while True:
            kind, value = first if first is not None else await next_event(job, request)
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
                yield build.finish(value["finish_reason"], usage(stats, value.get("reasoning_tokens", 0)))
                log(200, request.url.path, t0, stats, "; ".join(filter(None, ["responses", value["note"]])))
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
