"""What a chat completion request asks for, read from its JSON body and checked field by
field: every mistake is an ApiError naming the field, in OpenAI's error shape, before
anything runs. Fields this engine does not implement are refused when they would change
the answer (images, n > 1, penalties) and ignored when they would not (user,
metadata...): a client written for OpenAI sends those by default."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_STOPS = 4                       # OpenAI's limit
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error answered as {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]             # role + string content, the last one the user's
    max_tokens: int | None = None
    temperature: float | None = None  # None: the server's settings, else the model's recommendation
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None        # /v1/completions: plain text to continue (messages unused)
    thinking: bool | None = None     # chat_template_kwargs.enable_thinking (None: the template's default)
    grammar: object = None           # engine.Grammar the answer must match (response_format), or None
    tools: list | None = None        # engine.tools.Tool the model may call
    tool_choice: str = "auto"        # auto | none | required | a tool's name
    parallel_tool_calls: bool = True


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(name, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise _bad(name, f"must be between {lo:g} and {hi:g}, got {v!r}")
    return v


def _content(i: int, m: dict) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return ""
    if isinstance(c, list):
        parts = []
        for part in c:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image_url", "input_image", "image"):
                raise ApiError(400, f"messages[{i}]: images are not supported: this model reads text only",
                               param="messages")
            else:
                raise ApiError(400, f"messages[{i}]: content part {kind!r} is not supported (text only)",
                               param="messages")
        return "".join(parts)
    raise ApiError(400, f"messages[{i}]: content must be a string or a list of text parts", param="messages")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}]: must be an object with role and content", param="messages")
        role = m.get("role")
        if role == "developer":               # OpenAI's newer name for the system role
            role = "system"
        if role == "function":
            raise ApiError(400, f"messages[{i}]: the function role is OpenAI's old form; send role tool with "
                           "tool_call_id", param="messages")
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}]: role must be system, user, assistant or tool, got {role!r}",
                           param="messages")
        msg = {"role": role, "content": _content(i, m)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _calls(i, m["tool_calls"])
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    if out[-1]["role"] not in ("user", "tool"):
        raise ApiError(400, "messages: the last message must be the user's or a tool result (the answer to write "
                       "is the next one)", param="messages")
    if out[-1]["role"] == "user" and not out[-1]["content"].strip():
        raise ApiError(400, "messages: the last user message is empty", param="messages")
    return out


def _calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls as the engine keeps them: name, arguments as a mapping."""
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls: must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}]: needs function.name and function.arguments",
                           param="messages")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments: must be a JSON object "
                           "(as a string)", param="messages")
        out.append({"id": str(c.get("id", "")), "name": fn["name"], "arguments": args})
    return out


def _tools(body: dict) -> dict:
    """tools, tool_choice and parallel_tool_calls (OpenAI's, and `functions` refused by name)."""
    if body.get("functions"):
        raise _bad("functions", "OpenAI's old form: send tools (type function) instead")
    raw = body.get("tools")
    if not raw:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "names a tool, but the request has no tools")
        return {}
    import engine.tools
    try:
        tools = engine.tools.read_tools(raw)
    except engine.BadRequest as exc:
        raise ApiError(400, str(exc), param="tools") from None
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", 'must be auto, none, required or {"type": "function", "function": {"name": ...}}')
        choice = fn["name"]
        if choice not in {t.name for t in tools}:
            raise _bad("tool_choice", f"no tool named {choice!r} among the tools")
    elif choice not in ("auto", "none", "required"):
        raise _bad("tool_choice", f"must be auto, none, required or a named function, got {choice!r}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be true or false")
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise _bad("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise _bad("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return stops


def parse_chat(body) -> ChatRequest:
    _common(body)
    tools = _tools(body)
    req = _request(body, messages=_messages(body))
    for name, value in tools.items():
        setattr(req, name, value)
    return req


def _grammar(body: dict):
    """response_format as a grammar the answer is decoded under, or None for text. Every
    schema is enforced (`strict` or not): a schema constrained decoding cannot enforce is
    refused naming the feature, never answered as if it were absent."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    import engine
    try:
        if kind == "json_object":
            return engine.Grammar.json_object("response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise _bad("response_format", "json_schema must be an object with a schema object: "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            return engine.Grammar.json_schema(spec.get("schema", {}), "response_format")
    except engine.BadRequest as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    raise _bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")


def parse_completion(body) -> ChatRequest:
    """POST /v1/completions: `prompt` (a string, or a list holding one) continued as plain
    text. OpenAI's default of 16 tokens applies where max_tokens is not given."""
    _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise _bad("prompt", "one prompt per request is supported")
    if not isinstance(prompt, str) or not prompt:
        raise _bad("prompt", "required: the text to continue")
    for name in ("suffix", "echo"):
        if body.get(name):
            raise _bad(name, "not supported")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "only 1 is supported")
    req = _request(body, messages=[], prompt=prompt)
    req.max_tokens = req.max_tokens or 16
    return req


def _common(body) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "required: one of GET /v1/models")
    if body.get("n") not in (None, 1):
        raise _bad("n", "only 1 answer per request is supported")


def _request(body: dict, messages: list[dict], prompt: str | None = None) -> ChatRequest:
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(name, "not supported (only 0): speculative decoding keeps the model's own distribution")
    if body.get("logprobs"):
        raise _bad("logprobs", "not supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be true or false")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 30, integer=True)
    max_tokens = _number(body, "max_tokens", max_tokens, 1, 1 << 30, integer=True)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise _bad("chat_template_kwargs", f"only enable_thinking is supported, not {', '.join(unknown)}")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise _bad("chat_template_kwargs.enable_thinking", "must be true or false")
    return ChatRequest(thinking=thinking, grammar=_grammar(body),
        model=body["model"], messages=messages, prompt=prompt, max_tokens=max_tokens,
        temperature=_float(_number(body, "temperature", None, 0, 2)),
        top_p=_top_p(body),
        top_k=_number(body, "top_k", None, 0, 1 << 20, integer=True),
        seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        stop=_stop(body), stream=stream, include_usage=bool(opts.get("include_usage", False)))


def _float(v):
    return None if v is None else float(v)


def _top_p(body: dict) -> float | None:
    v = _number(body, "top_p", None, 0, 1)
    if v == 0:
        raise _bad("top_p", "must be above 0")
    return _float(v)
