"""What localchat's commands share: exit codes, the one-line error, the flags that choose
a model and sampling, settings merged from the config and the flags and checked, and
opening the engine. cli.py dispatches to the commands; they all import this, never cli.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad input, 130 interrupted."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from dataclasses import fields, replace

from . import config as config_mod

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say which model runs and how: shared by chat, one-shot and bench."""
    p.add_argument("--model", "-m", metavar="PATH_OR_REPO",
                   help="model directory, .gguf file or Hugging Face repo id (default: the demo model)")
    p.add_argument("--device", metavar="DEV", help="cpu, cuda, cuda:1, mps (default: auto)")
    p.add_argument("--vram", metavar="SIZE",
                   help="memory the engine may use on the device, e.g. 8GiB (default: what is free)")
    p.add_argument("--ram", metavar="SIZE",
                   help="host RAM the engine may hold for streamed layers, e.g. 32GiB (default: what is available)")
    p.add_argument("--profile", metavar="NAME",
                   help="how to run the model: auto (default: the best that fits), resident-exact, resident-int8, "
                        "resident-int4, streamed-exact")
    p.add_argument("--context", type=int, metavar="N",
                   help="tokens of conversation to plan memory for (default: 4096 when streaming)")
    p.add_argument("--resume-budget", metavar="SIZE",
                   help="disk the kept caches of conversations may take, so they resume without prefilling "
                        "again (default 4GiB; 0 = keep none)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own (one that has tool calls, say)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's where the device is fast at it, else float32)")
    spec = p.add_argument_group("speculative decoding (never changes the answer)")
    spec.add_argument("--drafter", choices=["auto", "ngram", "model", "mtp", "none"],
                      help="who proposes tokens: ngram (prompt lookup, free), model (--draft-model), mtp (the "
                           "checkpoint's own multi-token-prediction layer: Qwen3.5, Qwen3-Next), none; "
                           "auto = model if --draft-model is given, else ngram")
    spec.add_argument("--draft-model", metavar="PATH_OR_REPO",
                      help="a small model with the same tokenizer as --model, used as the drafter; "
                           "'self' = a quantized copy of the target")
    spec.add_argument("--drafter-weights", choices=["auto", "exact", "int8", "int4"],
                      help="the drafter model's weights (default auto: int4 for --draft-model self, else exact)")
    spec.add_argument("--draft-tokens", type=int, metavar="K",
                      help="draft exactly K tokens per round (default: adapt K to measured acceptance and costs)")


def add_backend_flags(p: argparse.ArgumentParser) -> None:
    """--backend: answer on an OpenAI-compatible server instead of a local model."""
    g = p.add_argument_group("a server instead of a local model")
    g.add_argument("--backend", metavar="URL",
                   help="an OpenAI-compatible API to answer with (vLLM, SGLang, llama-server, Ollama, localchat "
                        "serve), e.g. http://127.0.0.1:8000/v1; no model is loaded here")
    g.add_argument("--backend-model", metavar="NAME", help="which of the backend's models (default: the first listed)")
    g.add_argument("--api-key", metavar="KEY",
                   help="the backend's API key (default: $LOCALCHAT_API_KEY, else $OPENAI_API_KEY)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", "-s", metavar="TEXT", help="system message")
    p.add_argument("--max-tokens", "-n", type=int, metavar="N", help="most tokens to generate (default 1024)")
    p.add_argument("--temperature", "-t", type=float, metavar="T",
                   help="0 = greedy, higher = more random (default: the model's recommendation from its "
                        "generation_config.json, else greedy)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass, (0, 1] (default: the model's, else 1)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="sample among the K most likely tokens (0 = off; default: the model's, else off)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed for sampling")


def settings_from(args: argparse.Namespace, base: config_mod.Settings) -> config_mod.Settings:
    """Flags given on the command line override the configured settings."""
    names = [f.name for f in fields(config_mod.Settings)]
    flags = {name: getattr(args, name, None) for name in names}
    return replace(base, **{k: v for k, v in flags.items() if v is not None})


SAMPLING = ("temperature", "top_p", "top_k")


def _neutral(name: str, value):
    """A sampling setting's value, or where it is unset, greedy's (SamplingParams' default)."""
    from engine.sampling import SamplingParams
    return getattr(SamplingParams(), name) if value is None else value


def sampling(settings: config_mod.Settings, eng, request: dict | None = None) -> dict:
    """temperature, top_p and top_k for an answer: each from `request` (an API request's
    fields), else the user's settings (flag, environment, config file), else what the
    model recommends (`eng.sampling`, from its generation_config.json; greedy where it
    recommends nothing). A remote engine has no recommendation: an unset value stays None,
    and the server applies its own (vLLM, for one, the model's). `eng` may also be that
    recommendation itself (engine.SamplingParams)."""
    model = eng if hasattr(eng, "greedy") else getattr(eng, "sampling", None)
    out = {}
    for name in SAMPLING:
        value = (request or {}).get(name)
        if value is None:
            value = getattr(settings, name)
        if value is None and model is not None:
            value = getattr(model, name)
        out[name] = value
    return out


def check_flags(s: config_mod.Settings) -> str | None:
    from engine.sampling import check as check_sampling
    if s.max_tokens <= 0:
        return f"--max-tokens {s.max_tokens}: must be at least 1"
    problem = check_sampling(*(_neutral(name, getattr(s, name)) for name in SAMPLING), s.seed)
    if problem:
        return problem
    from engine.errors import BadRequest
    from engine.hardware import parse_size
    for flag, size in (("--vram", s.vram), ("--ram", s.ram)):
        try:
            if size is not None and parse_size(size, flag) <= 0:
                return f"{flag} {size}: must be more than 0"
        except BadRequest as exc:
            return str(exc)
    try:
        parse_size(s.resume_budget, "--resume-budget")
    except BadRequest as exc:
        return str(exc)
    if s.draft_tokens is not None and not 0 <= s.draft_tokens <= 64:
        return f"--draft-tokens {s.draft_tokens}: must be between 0 and 64"
    if s.context is not None and s.context < 16:
        return f"--context {s.context}: must be at least 16 tokens"
    if s.drafter == "model" and not s.draft_model:
        return "--drafter model needs --draft-model PATH_OR_REPO"
    if s.chat_template is not None:
        try:
            read_template(s.chat_template)
        except ValueError as exc:
            return str(exc)
    return None


def resume_store(settings: config_mod.Settings, data_dir: str | None = None):
    """Where conversations keep their caches: `resume/` beside history.db; None where
    --resume-budget is 0."""
    import engine
    from engine.hardware import parse_size
    budget = parse_size(settings.resume_budget, "--resume-budget")
    if budget <= 0:
        return None
    return engine.ResumeStore(config_mod.resume_dir(data_dir), budget)


def read_template(path: str) -> str:
    """--chat-template FILE's text, or ValueError saying what is wrong in one line."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"--chat-template {path}: not a Jinja chat template (no {{% or {{{{ in it)")
    return text


def error(msg: str) -> None:
    print(f"localchat: {msg}", file=sys.stderr)


def quiet_libraries() -> None:
    """Library chatter (transformers' warnings, progress bars) is not for our users' stderr."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def load_settings(args: argparse.Namespace) -> config_mod.Settings | None:
    """Config file and environment, then flags; None (after saying why) if a flag is bad."""
    quiet_libraries()          # before check_flags imports the engine (and with it transformers)
    base, warnings = config_mod.load()
    for w in warnings:
        error(w)
    settings = settings_from(args, base)
    problem = check_flags(settings)
    if problem:
        error(problem)
        return None
    return settings


def open_engine(settings: config_mod.Settings, progress=None, api_key: str | None = None, resume: bool = False,
                data_dir: str | None = None):
    """The engine for these settings; `progress(what, done, total)` hears about loading
    where the engine reports it (streamed layers). With a backend, its model in the engine's place (localchat/remote.py).
    resume: conversations keep their caches in the data dir (`data_dir`, else the user's) to resume warm."""
    if settings.backend:
        from . import remote
        return remote.RemoteEngine(settings.backend, settings.backend_model, remote.api_key(api_key))
    from . import hub
    if hub.is_repo_id(settings.model):
        # fetched first (from the cache when it is there), so a download shows: one stderr
        # line, or the TUI's loading line
        hub.fetch(settings.model, progress=None if progress is None else
                  (lambda done, total: progress("downloaded", done, total)))
    import engine
    eng = engine.open(settings.model, device=settings.device, dtype=settings.dtype, drafter=settings.drafter,
                      draft_model=settings.draft_model, draft_tokens=settings.draft_tokens,
                      drafter_weights=settings.drafter_weights, profile_dir=config_mod.config_dir() / "profiles",
                      memory_budget=settings.vram, host_memory=settings.ram, profile=settings.profile,
                      context=settings.context, progress=progress)
    if settings.chat_template:
        eng.tokenizer.chat_template = read_template(settings.chat_template)
    if resume:
        eng.resume = resume_store(settings, data_dir)
    note = eng.describe().get("kernels", "")          # "none (why): torch's kernels" where none runs
    if "cannot build the kernels there" in note:       # it answers, several times slower: say why
        error(f"{note[note.index('(') + 1:note.rindex(')')]}; answering with torch's kernels")
    return eng
