"""Settings: defaults < config file (TOML in the user config dir) < environment
(LOCALCHAT_*) < command-line flags.

A malformed config file is reported with its path and line; the program still starts
(with defaults and flags) so a user can fix it from inside."""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    model: str | None = None          # path, .gguf or repo id; None = the demo model
    system: str | None = None
    max_tokens: int = 1024
    # None: the model's recommendation (its generation_config.json), else greedy
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    device: str = "auto"
    vram: str | None = None           # memory the engine may use on the device, e.g. "8GiB"; None = detected
    ram: str | None = None            # host RAM it may hold for streamed layers; None = available
    profile: str | None = None        # None/"auto" = the best that fits; or a profile name
    context: int | None = None        # tokens of conversation to plan memory for; None = auto
    dtype: str | None = None          # None = auto
    drafter: str = "auto"             # auto | ngram | model | mtp | none
    draft_model: str | None = None    # the drafter checkpoint for drafter = model (or auto)
    draft_tokens: int | None = None   # a fixed draft length; None = adaptive
    drafter_weights: str = "auto"     # exact | int8 | int4 | auto (int4 for draft_model = "self")
    theme: str = "textual-dark"
    usable_tps: float = 10.0          # setup recommends models predicted to decode at least this fast
    backend: str | None = None        # an OpenAI-compatible server's URL: answer there, load no model
    backend_model: str | None = None  # which of its models (default: the first it lists)
    chat_template: str | None = None  # a Jinja chat template file used instead of the model's own
    resume_budget: str = "4GiB"       # disk the conversations' kept caches may take (engine/resume.py); 0 = none
    allow_hosts: str | None = None    # serve: Host names served besides loopback's, comma-separated ("*": any)
    allow_origins: str | None = None  # serve: web origins let in besides loopback's, comma-separated


# Settings that hold several names: a TOML list or one comma-separated string.
LISTS = ("allow_hosts", "allow_origins")
# The environment names each setting takes, e.g. LOCALCHAT_MODEL, LOCALCHAT_MAX_TOKENS.
_TYPES = {f.name: f.type for f in fields(Settings)}
# Settings earlier versions wrote that mean nothing now: read with a note, dropped on save.
RETIRED = {"compile": "every decode step runs the C kernels, so there is no step to compile"}


def config_dir() -> Path:
    env = os.environ.get("LOCALCHAT_CONFIG_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_config_dir("localchat"))


def data_dir() -> Path:
    env = os.environ.get("LOCALCHAT_DATA_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_data_dir("localchat"))


def resume_dir(data: str | Path | None = None) -> Path:
    """Where conversations keep their caches to resume warm: beside history.db."""
    return (Path(data) if data else data_dir()) / "resume"


def config_path() -> Path:
    return config_dir() / "config.toml"


def _coerce(name: str, value, source: str):
    kind = _TYPES[name]
    try:
        if value is None or value == "":
            return None if "None" in kind else _default(name)
        if name in LISTS and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)                # a list of names is the same as their comma-separated string
        if isinstance(value, (bool, list, dict)):   # no setting is a flag, a list or a table
            raise TypeError(value)
        if kind.startswith("int"):
            if isinstance(value, float):         # 1.5 tokens is a typo, not 1
                raise TypeError(value)
            return _check_value(name, int(value), source)
        if kind.startswith("float"):
            return _check_value(name, float(value), source)
        return _check_value(name, str(value), source)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name} = {value!r} is not a valid {kind.split(' ')[0]}") from None


# What a setting from a file or the environment may hold (flags are checked by the CLI
# with the same ranges): a value outside is a warning and the default, like a bad type.
_CHOICES = {"drafter": ("auto", "ngram", "model", "mtp", "none"),
            "drafter_weights": ("auto", "exact", "int8", "int4"),
            "dtype": ("auto", "float32", "bfloat16", "float16")}
_RANGES = {"max_tokens": (lambda v: v >= 1, "at least 1"),
           "temperature": (lambda v: math.isfinite(v) and v >= 0, "0 (greedy) or a finite positive number"),
           "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "top_k": (lambda v: v >= 0, "0 (off) or more"),
           "seed": (lambda v: 0 <= v < 2 ** 63, "from 0 to 2^63 - 1"),
           "context": (lambda v: v >= 16, "at least 16 tokens"),
           "draft_tokens": (lambda v: 0 <= v <= 64, "between 0 and 64"),
           "usable_tps": (lambda v: math.isfinite(v) and v > 0, "a positive speed in tokens/s")}


def _check_value(name: str, value, source: str):
    rule = _RANGES.get(name)
    if value is not None and rule and not rule[0](value):
        raise ConfigError(f"{source}: {name} = {value!r} must be {rule[1]}")
    choices = _CHOICES.get(name)
    if value is not None and choices and value not in choices:
        raise ConfigError(f"{source}: {name} = {value!r} is not one of {', '.join(choices)}")
    return value


def _default(name: str):
    return getattr(Settings(), name)


class ConfigError(Exception):
    pass


def load(path: Path | None = None, environ: dict | None = None) -> tuple[Settings, list[str]]:
    """Settings from file and environment, and a list of warnings (a bad file is a warning)."""
    path = path or config_path()
    environ = os.environ if environ is None else environ
    settings, warnings = Settings(), []
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            values = {}
            for key, value in data.items():
                if key in RETIRED:
                    warnings.append(f"{path}: {key!r} is no longer used ({RETIRED[key]}); delete the line, "
                                    "or `localchat setup` drops it")
                    continue
                if key not in _TYPES:
                    warnings.append(f"{path}: unknown setting {key!r} ignored "
                                    f"(known: {', '.join(sorted(_TYPES))})")
                    continue
                try:
                    values[key] = _coerce(key, value, str(path))
                except ConfigError as exc:
                    # One bad value costs that setting only, not the rest of the file.
                    warnings.append(f"{exc}; using the default ({_default(key)!r}) until it is fixed")
            settings = replace(settings, **values)
        except tomllib.TOMLDecodeError as exc:
            warnings.append(f"{path}: not valid TOML ({exc}); using defaults")
        except (OSError, UnicodeDecodeError) as exc:
            warnings.append(f"{path}: unreadable ({exc}); using defaults")
    values = {}
    for name in _TYPES:
        env = environ.get(f"LOCALCHAT_{name.upper()}")
        if env is not None:
            try:
                values[name] = _coerce(name, env, f"LOCALCHAT_{name.upper()}")
            except ConfigError as exc:
                warnings.append(f"{exc}; ignored")
    return replace(settings, **values), warnings


def save(settings: Settings, path: Path | None = None, keys: tuple[str, ...] | None = None) -> Path:
    """Write settings to the config file atomically, keeping the keys already there.
    Only non-default values (or the given keys) are written."""
    path = path or config_path()
    existing = {}
    if path.is_file():
        try:
            existing = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
            backup = path.with_suffix(".toml.bak")
            path.replace(backup)   # never lose a file we cannot parse
    for key in RETIRED:
        existing.pop(key, None)
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if (keys and f.name in keys) or (not keys and value != _default(f.name)):
            if value is None:
                existing.pop(f.name, None)
            else:
                existing[f.name] = value
    tmp = path.with_suffix(".toml.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(_dump(existing), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"{path.parent}: cannot write the config file there ({exc.strerror or exc}); "
                          "set LOCALCHAT_CONFIG_DIR to a writable directory") from None
    return path


def _dump(data: dict) -> str:
    lines = ["# localchat settings (see README: Configuration)"]
    for key, value in data.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{key} = {value}")
        else:
            text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            lines.append(f'{key} = "{text}"')
    return "\n".join(lines) + "\n"
