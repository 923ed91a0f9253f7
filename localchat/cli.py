"""Command line: parse the flags and dispatch, to a subcommand (setup, doctor, bench,
history), the chat UI or a one-shot answer. What the commands share (exit codes, the
one-line error, settings, opening the engine) is in common.py, which they import instead
of this module: imports run one way, cli -> commands -> common."""
from __future__ import annotations

import argparse
import sys

from .argparsing import Parser
from . import __version__
from .common import (EXIT_INTERRUPTED, EXIT_USAGE, add_backend_flags, add_model_flags, add_sampling_flags,
                     error, load_settings, open_engine, quiet_libraries)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="localchat",
        description="Chat with a language model on this machine. With no prompt and a terminal, "
                    "opens the chat UI; with a prompt (arguments and/or stdin) prints the answer. "
                    "`localchat setup` picks and fetches a model for this machine; `localchat doctor` shows the hardware and the memory plan; "
                    "`localchat bench --help` measures speculative decoding on this machine; "
                    "`localchat history` lists, shows and exports saved conversations; "
                    "`localchat models` lists, pulls and removes models and the caches derived from them; "
                    "`localchat serve` serves the model over an OpenAI-compatible API.",
        epilog="examples:  localchat   |   localchat \"Why is the sky blue?\"   |   "
               "echo \"Summarise this\" | localchat --stats")
    p.add_argument("prompt", nargs="*", help="the question (one-shot mode); stdin text comes first")
    add_model_flags(p)
    add_backend_flags(p)
    add_sampling_flags(p)
    conv = p.add_argument_group("saved conversations")
    conv.add_argument("--continue", "-c", dest="resume_last", action="store_true",
                      help="resume the most recent conversation: in the chat UI, or with a prompt, as its next turn")
    conv.add_argument("--cid", type=int, metavar="ID",
                      help="resume conversation ID (`localchat history`): in the chat UI, or with a prompt")
    conv.add_argument("--no-log", action="store_true",
                      help="save nothing: neither this one-shot prompt nor, in the chat UI, this session")
    conv.add_argument("--data-dir", metavar="DIR", help="where history.db lives (default: the user data dir)")
    p.add_argument("--stats", action="store_true", help="print one line of statistics on stderr")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="thinking", action="store_const", const=True, default=None,
                       help="a thinking model reasons before it answers (its template's enable_thinking)")
    think.add_argument("--no-think", dest="thinking", action="store_const", const=False,
                       help="a thinking model answers at once")
    p.add_argument("--show-thinking", action="store_true",
                   help="one-shot: print the reasoning too (dimmed on a terminal), not only the answer")
    p.add_argument("--json-schema", metavar="FILE",
                   help="one-shot: the answer is JSON matching the schema in FILE (enforced as it is decoded)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, finish reason, stats) instead of text")
    p.add_argument("--version", action="version", version=f"localchat {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    """The `localchat` command (the console script's entry point)."""
    return run(argv)


def run(argv: list[str] | None = None) -> int:
    """Parse and dispatch; the exit code."""
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
    if argv and argv[0] == "serve":
        from .serve_cli import serve_main
        return serve_main(argv[1:])
    if argv and argv[0] == "models":
        from .models_cli import models_main
        return models_main(argv[1:])
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
    if args.no_log and (args.resume_last or args.cid is not None):
        error("--no-log saves nothing, so it cannot resume a saved conversation (drop --continue/--cid)")
        return EXIT_USAGE
    if args.json_schema and interactive and not args.json:
        error("--json-schema shapes a one-shot answer: pass a prompt (as arguments or on stdin)")
        return EXIT_USAGE
    try:
        if interactive and not args.json:
            from .tui.app import run_tui
            return run_tui(lambda s, progress=None: open_engine(s, progress, api_key=args.api_key,
                                                                resume=not args.no_log, data_dir=args.data_dir),
                           settings, data_dir=args.data_dir, resume="last" if args.resume_last else args.cid,
                           save=not args.no_log, thinking=args.thinking)
        from .oneshot import run_oneshot
        return run_oneshot(args, settings)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
