"""Profiles: how to run a model, declared in small TOML files (profiles/*.toml, shipped in
the wheel; users add their own in the config dir's `profiles/`).

    name = "streamed-exact"
    summary = "..."
    rank = 4                 # preference when several fit: lower first
    [target]
    placement = "streamed"   # resident | streamed
    weights = "exact"        # exact | int8 | int4 | gguf (a .gguf model's own blocks)
    group_size = 32          # int4 only
    head = "int8"            # int8/int4: the output head in int8 (per channel), or "exact"
    embeddings = false       # int8/int4: quantize the embeddings and output head as the layers
    [drafter]
    kind = "auto"            # auto | ngram | model | none
    max_draft = 16
    [memory]
    margin_mib = 512

Validation names the file, the key and the allowed values."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import BadRequest

PLACEMENTS = ("resident", "streamed")
WEIGHTS = ("exact", "int8", "int4", "gguf")
HEADS = ("int8", "exact")
DRAFTER_KINDS = ("auto", "ngram", "model", "mtp", "none")


@dataclass(frozen=True)
class Profile:
    name: str
    summary: str
    placement: str
    weights: str
    drafter: str = "auto"
    max_draft: int = 8
    margin_mib: int = 512
    group_size: int = 32
    embeddings: bool = False
    head: str = "int8"
    rank: int = 100
    source: str = ""

    @property
    def head_format(self) -> str:
        """How the output head is held: exact beside exact weights, as the layers with
        `embeddings`, else `head`."""
        if self.weights in ("exact", "gguf"):
            return self.weights
        return self.weights if self.embeddings else self.head


# key -> (type, allowed values or None, required)
_SCHEMA = {
    "": {"name": (str, None, True), "summary": (str, None, False), "rank": (int, None, False)},
    "target": {"placement": (str, PLACEMENTS, True), "weights": (str, WEIGHTS, True),
               "group_size": (int, (32, 64, 128, 256), False), "embeddings": (bool, None, False),
               "head": (str, HEADS, False)},
    "drafter": {"kind": (str, DRAFTER_KINDS, False), "max_draft": (int, None, False)},
    "memory": {"margin_mib": (int, None, False)},
}


def parse(text: str, source: str) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest(f"{source}: not valid TOML ({exc})") from None
    values = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in _SCHEMA or key == "":
                raise BadRequest(f"{source}: unknown table [{key}] (allowed: target, drafter, memory)")
            for sub, v in value.items():
                values[(key, sub)] = _check(source, key, sub, v)
        else:
            values[("", key)] = _check(source, "", key, value)
    for table, keys in _SCHEMA.items():
        for key, (_, _, required) in keys.items():
            if required and (table, key) not in values:
                where = f"[{table}] " if table else ""
                raise BadRequest(f"{source}: missing {where}{key}")
    get = lambda t, k, d: values.get((t, k), d)  # noqa: E731
    max_draft = get("drafter", "max_draft", 8)
    if not 0 <= max_draft <= 64:
        raise BadRequest(f"{source}: [drafter] max_draft = {max_draft}: must be between 0 and 64")
    margin = get("memory", "margin_mib", 512)
    if margin < 0:
        raise BadRequest(f"{source}: [memory] margin_mib = {margin}: must be 0 or more")
    return Profile(name=get("", "name", ""), summary=get("", "summary", ""), rank=get("", "rank", 100),
                   placement=get("target", "placement", ""), weights=get("target", "weights", ""),
                   group_size=get("target", "group_size", 32), embeddings=get("target", "embeddings", False),
                   head=get("target", "head", "int8"),
                   drafter=get("drafter", "kind", "auto"),
                   max_draft=max_draft, margin_mib=margin, source=source)


def _check(source: str, table: str, key: str, value):
    where = f"[{table}] {key}" if table else key
    if key not in _SCHEMA[table]:
        allowed = ", ".join(_SCHEMA[table])
        raise BadRequest(f"{source}: unknown key {where} (allowed: {allowed})")
    kind, allowed, _ = _SCHEMA[table][key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        what = {int: "a number", bool: "true or false"}.get(kind, "text")
        raise BadRequest(f"{source}: {where} = {value!r} must be {what}")
    if allowed is not None and value not in allowed:
        raise BadRequest(f"{source}: {where} = {value!r} is not allowed (use one of: "
                         f"{', '.join(map(str, allowed))})")
    return value


def builtin() -> list[Profile]:
    """The shipped profiles, in order of preference (rank)."""
    folder = resources.files("engine.builtin_profiles")
    found = [parse(f.read_text(encoding="utf-8"), f"profiles/{f.name}")
             for f in folder.iterdir() if f.name.endswith(".toml")]
    return sorted(found, key=lambda p: (p.rank, p.name))


def load_all(user_dir: Path | None = None) -> list[Profile]:
    """Built-in profiles, then the user's (a user profile with a built-in's name replaces it)."""
    by_name = {p.name: p for p in builtin()}
    if user_dir and Path(user_dir).is_dir():
        for f in sorted(Path(user_dir).glob("*.toml")):
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise BadRequest(f"{f}: unreadable ({exc})") from None
            p = parse(text, str(f))
            by_name[p.name] = p
    return sorted(by_name.values(), key=lambda p: (p.rank, p.name))


def find(profiles: list[Profile], name: str) -> Profile:
    for p in profiles:
        if p.name == name:
            return p
    raise BadRequest(f"--profile {name}: no such profile (have: {', '.join(p.name for p in profiles)})")
