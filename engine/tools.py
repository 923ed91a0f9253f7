"""Tool calls: the format a model's chat template teaches it, the grammar that makes it
write a valid call, and the calls read back out of what it wrote.

Three families cover the models people run (each as its published template writes it):
- `hermes`: Qwen3, Qwen2.5, Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `qwen-xml`: Qwen3.5, Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...`,
  a string value as it is, any other as JSON;
- `llama3`: Llama 3.1-3.3: the answer is one bare JSON object `{"name": ..., "parameters": {...}}`.
A template that describes no tools has no family: a request with tools is refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .constrain import Grammar, closed, json_rule
from .errors import BadRequest

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MARK = "<tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict           # a JSON schema of the arguments object
    description: str = ""

    def as_template(self) -> dict:
        """As chat templates take it: OpenAI's shape."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def family(tokenizer) -> str | None:
    """The tool-call format the model's chat template asks for, or None."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default") or ""
    if not isinstance(t, str) or "tools" not in t:
        return None
    if MARK in t and "<function=" in t and "<parameter=" in t:
        return "qwen-xml"
    if MARK in t:
        return "hermes"
    if '"parameters": dictionary of argument name' in t or "<|python_tag|>" in t:
        return "llama3"
    return None


def read_tools(tools, what: str = "tools") -> list[Tool]:
    """OpenAI's `tools` list, checked entry by entry."""
    if not isinstance(tools, list):
        raise BadRequest(f"{what}: must be a list of {{type: function, function: {{name, parameters}}}}")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise BadRequest(f"{what}[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequest(f"{what}[{i}].function.name: 1 to 64 letters, digits, _ . or -, got {name!r}")
        if name in names:
            raise BadRequest(f"{what}[{i}].function.name: {name!r} is listed twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise BadRequest(f"{what}[{i}].function.parameters: must be a JSON schema of an object")
        names.add(name)
        out.append(Tool(name, params, fn.get("description") or ""))
    return out


# ---------------------------------------------------------------- the grammar of a call

def grammar(fam: str, tools: list[Tool], parallel: bool = True, what: str = "tool_choice") -> Grammar:
    """The model's answer (after any reasoning) is one call of one of `tools`, or several
    when `parallel` (not for llama3, whose format has one)."""
    if fam == "llama3":
        one = {"anyOf": [_call_schema(t, "parameters") for t in tools]}
        return Grammar.lark(f"start: {json_rule(one)}\n", what)
    rules = []
    if fam == "hermes":
        body = {"anyOf": [_call_schema(t, "arguments") for t in tools]}
        rules.append(f'call: "<tool_call>\\n" {json_rule(body)} "\\n</tool_call>"')
    else:
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        for i, t in enumerate(tools):
            rules += _xml_rules(i, t)
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Grammar.lark("\n".join([start] + rules) + "\n", what)


def _call_schema(t: Tool, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": t.name}, key: closed(t.parameters)},
            "required": ["name", key], "additionalProperties": False}


def _strings(schema) -> list[str] | None:
    """The values a schema allows when it lists strings (enum, const), else None."""
    if not isinstance(schema, dict):
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    return values if values and all(isinstance(v, str) for v in values) else None


def _text_rule(schema: dict) -> str:
    """A string value on one line without '<' (the format has no escaping), its length bounded as the schema says."""
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    return "/[^<\\n]{%d,%s}/" % (lo, "" if hi is None else int(hi)) if lo or hi is not None else "/[^<\\n]*/"


def _is_text(schema) -> bool:
    """Whether Qwen3.5's template writes this parameter's value as it is (a string) rather than as JSON."""
    return isinstance(schema, dict) and (_strings(schema) is not None or
                                         (schema.get("type") == "string" and "enum" not in schema))


def _xml_rules(i: int, t: Tool) -> list[str]:
    """Qwen3.5's form: the parameters in the schema's order, the required ones always; a
    string value on one line without '<' (the format has no escaping), others as JSON."""
    props = t.parameters.get("properties") or {}
    required = set(t.parameters.get("required") or [])
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not _NAME.match(key):
            raise BadRequest(f"tools: parameter {key!r} of {t.name}: the XML call format takes names of "
                             "letters, digits, _ . or - only")
        words = _strings(schema)
        value = (_text_rule(schema) if words is None else "(" + " | ".join(json.dumps(w) for w in words) + ")") \
            if _is_text(schema) else json_rule(schema)
        rules.append(f'p_{i}_{j}: "<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
        parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
    head = f'call_{i}: "<tool_call>\\n<function={t.name}>\\n" '
    return [head + " ".join(parts) + ' "</function>\\n</tool_call>"'] + rules


# ---------------------------------------------------------------- reading calls back

@dataclass(frozen=True)
class Parsed:
    content: str               # the answer's text without its calls (all of it when a call failed to parse)
    calls: tuple = ()          # ({"name": str, "arguments": dict}, ...)
    error: str = ""            # why text that began a call is not one


def parse(fam: str | None, text: str, tools: list[Tool]) -> Parsed:
    if fam is None or not tools:
        return Parsed(text)
    by_name = {t.name: t for t in tools}
    if fam == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed(text)
        try:
            call = json.loads(body)
            args = call.get("parameters", call.get("arguments"))
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, AttributeError) as exc:
            return Parsed(text, (), f"the answer looks like a call but is not JSON ({exc})")
        return _checked(text, "", [(call.get("name"), args)], by_name)
    at = text.find(MARK)
    if at < 0:
        return Parsed(text)
    calls = []
    for block in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text[at:], re.S):
        try:
            calls.append(_hermes(block.group(1)) if fam == "hermes" else _xml(block.group(1), by_name))
        except ValueError as exc:
            return Parsed(text, (), f"a call did not parse: {exc}")
    return _checked(text, text[:at].strip(), calls, by_name)


def _checked(text: str, content: str, calls: list, by_name: dict) -> Parsed:
    for name, args in calls:
        if name not in by_name:
            return Parsed(text, (), f"the model called {name!r}, which is not among the tools")
        if not isinstance(args, dict):
            return Parsed(text, (), f"the arguments of {name!r} are not a JSON object")
    return Parsed(content, tuple({"name": n, "arguments": a} for n, a in calls))


def _hermes(body: str):
    call = json.loads(body.strip())
    if not isinstance(call, dict):
        raise ValueError("not a JSON object")
    args = call.get("arguments", call.get("parameters", {}))
    return call.get("name"), json.loads(args) if isinstance(args, str) else args


def _xml(body: str, by_name: dict):
    m = re.match(r"\s*<function=([^>\n]+)>(.*?)(?:</function>|$)", body, re.S)
    if not m:
        raise ValueError("no <function=NAME> in <tool_call>")
    name = m.group(1).strip()
    props = by_name[name].parameters.get("properties", {}) if name in by_name else {}
    args = {}
    for p in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
        key, raw = p.group(1).strip(), p.group(2)
        args[key] = raw if _is_text(props.get(key)) else _value(raw)
    return name, args


def _value(raw: str):
    """A non-string parameter as the template wrote it: JSON, or Python's True/False/None."""
    try:
        return json.loads(raw)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(raw.strip(), raw)


# ---------------------------------------------------------------- streaming

class CallWatch:
    """Feed the answer's text as it streams; get the part to show as text now. From the
    point a call begins, text is held (it is parsed whole at the end): a client sees the
    calls as tool_calls, not as text. Text that might be the start of the marker waits
    until the next piece tells."""

    def __init__(self, fam: str | None):
        self.fam = fam
        self.held = ""
        self.in_call = False
        self._started = False          # llama3: the first non-blank character was seen

    def push(self, text: str) -> str:
        if self.fam is None:
            return text
        if self.in_call:
            self.held += text
            return ""
        buf = self.held + text
        self.held = ""
        if self.fam == "llama3":
            if self._started:
                return buf
            body = buf.lstrip()
            if not body or "<|python_tag|>".startswith(body):
                self.held = buf
                return ""
            self._started = True
            if body.startswith("{") or body.startswith("<|python_tag|>"):
                self.in_call, self.held = True, buf
                return ""
            return buf
        at = buf.find(MARK)
        if at >= 0:
            self.in_call, self.held = True, buf[at:]
            return buf[:at]
        keep = next((n for n in range(min(len(MARK) - 1, len(buf)), 0, -1) if MARK.startswith(buf[-n:])), 0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end: held text that never became a call is text after all."""
        if self.in_call:
            return ""
        out, self.held = self.held, ""
        return out
