"""Command line: parse flags, merge them over the config, and dispatch to the chat UI
or a one-shot answer. Errors are one line on stderr with an exit code: 0 ok, 1 runtime
failure, 2 bad usage or bad input, 130 interrupted."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace

from .argparsing import Parser
from . import __version__
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
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's where the device is fast at it, else float32)")
    p.add_argument("--compile", choices=["auto", "on", "off"],
                   help="compile the decode step in the background and switch to it when ready (resident exact "
                        "weights); auto (default) = in the chat UI, where a session lasts long enough to gain")
    spec = p.add_argument_group("speculative decoding (never changes the answer)")
    spec.add_argument("--drafter", choices=["auto", "ngram", "model", "none"],
                      help="who proposes tokens: ngram (prompt lookup, free), model (--draft-model), none; "
                           "auto = model if --draft-model is given, else ngram")
    spec.add_argument("--draft-model", metavar="PATH_OR_REPO",
                      help="a small model with the same tokenizer as --model, used as the drafter; "
                           "'self' = a quantized copy of the target")
    spec.add_argument("--drafter-weights", choices=["auto", "exact", "int8", "int4"],
                      help="the drafter model's weights (default auto: int4 for --draft-model self, else exact)")
    spec.add_argument("--draft-tokens", type=int, metavar="K",
                      help="draft exactly K tokens per round (default: adapt K to measured acceptance and costs)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", "-s", metavar="TEXT", help="system message")
    p.add_argument("--max-tokens", "-n", type=int, metavar="N", help="most tokens to generate (default 1024)")
    p.add_argument("--temperature", "-t", type=float, metavar="T", help="0 = greedy (default), higher = more random")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass, (0, 1]")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed for sampling")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="localchat",
        description="Chat with a language model on this machine. With no prompt and a terminal, "
                    "opens the chat UI; with a prompt (arguments and/or stdin) prints the answer. "
                    "`localchat setup` picks and fetches a model for this machine; `localchat doctor` shows the hardware and the memory plan; "
                    "`localchat bench --help` measures speculative decoding on this machine; "
                    "`localchat history` lists, shows and exports saved conversations.",
        epilog="examples:  localchat   |   localchat \"Why is the sky blue?\"   |   "
               "echo \"Summarise this\" | localchat --stats")
    p.add_argument("prompt", nargs="*", help="the question (one-shot mode); stdin text comes first")
    add_model_flags(p)
    add_sampling_flags(p)
    conv = p.add_argument_group("saved conversations")
    conv.add_argument("--continue", "-c", dest="resume_last", action="store_true",
                      help="chat UI: resume the most recent conversation")
    conv.add_argument("--cid", type=int, metavar="ID", help="chat UI: resume conversation ID (`localchat history`)")
    conv.add_argument("--no-log", action="store_true",
                      help="save nothing: neither this one-shot prompt nor, in the chat UI, this session")
    conv.add_argument("--data-dir", metavar="DIR", help="where history.db lives (default: the user data dir)")
    p.add_argument("--stats", action="store_true", help="print one line of statistics on stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, finish reason, stats) instead of text")
    p.add_argument("--version", action="version", version=f"localchat {__version__}")
    return p


def settings_from(args: argparse.Namespace, base: config_mod.Settings) -> config_mod.Settings:
    """Flags given on the command line override the configured settings."""
    names = [f.name for f in fields(config_mod.Settings)]
    flags = {name: getattr(args, name, None) for name in names}
    return replace(base, **{k: v for k, v in flags.items() if v is not None})


def check_flags(s: config_mod.Settings) -> str | None:
    from engine.sampling import check as check_sampling
    if s.max_tokens <= 0:
        return f"--max-tokens {s.max_tokens}: must be at least 1"
    problem = check_sampling(s.temperature, s.top_p, s.top_k, s.seed)
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
    if s.draft_tokens is not None and not 0 <= s.draft_tokens <= 64:
        return f"--draft-tokens {s.draft_tokens}: must be between 0 and 64"
    if s.context is not None and s.context < 16:
        return f"--context {s.context}: must be at least 16 tokens"
    if s.compile not in ("auto", "on", "off"):
        return f"compile = {s.compile!r}: choose auto, on or off"
    if s.drafter == "model" and not s.draft_model:
        return "--drafter model needs --draft-model PATH_OR_REPO"
    return None


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
    base, warnings = config_mod.load()
    for w in warnings:
        error(w)
    settings = settings_from(args, base)
    problem = check_flags(settings)
    if problem:
        error(problem)
        return None
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench import bench_main
        return bench_main(argv[1:])
    if argv and argv[0] == "doctor":
        from .doctor import doctor_main
        return doctor_main(argv[1:])
    if argv and argv[0] == "setup":
        from .wizard import setup_main
        return setup_main(argv[1:])
    if argv and argv[0] == "history":
        from .history_cli import history_main
        return history_main(argv[1:])
    # Intermixed: `localchat -n 20 why is the sky blue --stats` reads the words as the prompt.
    args = build_parser().parse_intermixed_args(argv)
    settings = load_settings(args)
    if settings is None:
        return EXIT_USAGE
    if args.resume_last and args.cid is not None:
        error("--continue and --cid both say which conversation to resume: give one")
        return EXIT_USAGE
    quiet_libraries()
    interactive = not args.prompt and sys.stdin.isatty() and sys.stdout.isatty()
    if (args.resume_last or args.cid is not None) and not (interactive and not args.json):
        error("--continue/--cid resume a conversation in the chat UI; run `localchat` in a terminal without a prompt")
        return EXIT_USAGE
    try:
        if interactive and not args.json:
            from .tui.app import run_tui
            if args.no_log and (args.resume_last or args.cid):
                error("--no-log starts an unsaved chat; it cannot resume one (drop --continue/--cid)")
                return EXIT_USAGE
            mode = compile_mode(settings, interactive=True)
            return _leave(run_tui(lambda s, progress=None: open_engine(s, progress, compile=mode), settings,
                                  data_dir=args.data_dir, resume="last" if args.resume_last else args.cid,
                                  save=not args.no_log))
        from .oneshot import run_oneshot
        return _leave(run_oneshot(args, settings))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return _leave(EXIT_INTERRUPTED)


def compile_mode(settings: config_mod.Settings, interactive: bool) -> str:
    """--compile auto compiles for the chat UI, whose sessions last long enough to gain
    from it. A one-shot answer decodes eagerly: it would not live to use a build, and even
    loading a step an earlier start built costs more than it gains unless the answer is
    long. Measured on the demo model, float32, 128 tokens (benchmarks/oneshot_start.py):
    the load during the answer pushed the first token from 0.14 to 0.55 s and stalled the
    stream for 1.1 s, and the answer took 6.6 s against 5.5 s eager; it pays after about
    250-300 tokens. --compile on asks for it anyway."""
    if settings.compile == "auto":
        return "auto" if interactive else "off"
    return settings.compile


def _leave(code: int) -> int:
    """Exit code passthrough, except while a background compile still runs: then flush and
    leave at once (engine.compile_worker.busy says why)."""
    import engine.compile_worker
    if engine.compile_worker.busy():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def open_engine(settings: config_mod.Settings, progress=None, compile: str = "off"):
    """The engine for these settings; `progress(what, done, total)` hears about loading
    where the engine reports it (streamed layers). compile: what `--compile` resolves to
    for this kind of run (the chat UI compiles on auto; a one-shot answer does not wait)."""
    import engine
    return engine.open(settings.model, device=settings.device, dtype=settings.dtype, drafter=settings.drafter,
                       draft_model=settings.draft_model, draft_tokens=settings.draft_tokens,
                       drafter_weights=settings.drafter_weights, profile_dir=config_mod.config_dir() / "profiles",
                       memory_budget=settings.vram, host_memory=settings.ram, profile=settings.profile,
                       context=settings.context, progress=progress, compile=compile)


if __name__ == "__main__":
    sys.exit(main())
