"""`localchat serve`: the engine behind an OpenAI-compatible HTTP API (localchat/server/).

    localchat serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue 4]
                    [--allow-host NAME] [--allow-origin ORIGIN]
                    [every model, profile and drafter flag of the chat]

Loopback only unless --host says otherwise; --host 0.0.0.0 without --api-key warns. Web pages
are kept out (server/guard.py) unless --allow-origin lets them in. The
engine loads once, after the port is open (GET /health: loading, then ready). One line per
request on stderr."""
from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import sys

from .argparsing import Parser
from .common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_model_flags, error, load_settings, open_engine


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat serve",
               description="Serve models over an OpenAI-compatible API: POST /v1/chat/completions (streamed "
                           "or not; tools, response_format), /v1/completions, /v1/responses, GET /v1/models, "
                           "GET /health, and Ollama's /api/chat and /api/generate. The --model loads at start; any "
                           "model `localchat models` lists loads on its first request. One answer at a time; "
                           "requests wait in a bounded queue.",
               epilog="example:  localchat serve --port 8000   then   "
                      "OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none <any OpenAI client>")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("LOCALCHAT_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $LOCALCHAT_API_KEY, else none)")
    p.add_argument("--allow-host", action="append", metavar="NAME",
                   help="also serve requests addressed to this host name (repeatable; for a reverse proxy or a LAN "
                        "name; '*' any). Loopback names and the --host address are always served")
    p.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="let web pages from this origin use the server, e.g. http://example.com:3000 (repeatable; "
                        "'*' any page; globs like 'chrome-extension://*'). Loopback origins are always let in")
    p.add_argument("--max-queue", type=int, default=4, metavar="N",
                   help="requests that may wait while one is answered (default 4); more get 503 and Retry-After")
    p.add_argument("--queue-timeout", type=float, default=120.0, metavar="S",
                   help="seconds a request may wait in the queue (default 120)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients ask for (default: the model's name)")
    p.add_argument("--keep-alive", type=float, metavar="S",
                   help="unload a model idle this many seconds (default: keep it until its memory is needed)")
    p.add_argument("--only", action="store_true",
                   help="serve the --model alone, not every model `localchat models` lists")
    p.add_argument("--max-tokens", "-n", type=int, metavar="N",
                   help="tokens an answer may have when a request does not say (default: the config's, 1024)")
    add_model_flags(p)
    return p


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for flag, value, ok in (("--port", args.port, 0 <= args.port <= 65535), ("--max-queue", args.max_queue,
                            args.max_queue >= 0), ("--queue-timeout", args.queue_timeout, args.queue_timeout > 0),
                            ("--keep-alive", args.keep_alive, args.keep_alive is None or args.keep_alive > 0)):
        if not ok:
            error(f"{flag} {value}: out of range")
            return EXIT_USAGE
    settings = load_settings(args)
    if settings is None:
        return EXIT_USAGE
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        error(f"warning: --host {args.host} without --api-key: anyone who can reach this machine can use the model")
    try:
        import uvicorn
        from .server.app import make_app
        from .server.models import Models
        from .server.runner import Runner
    except ImportError as exc:
        error(f"localchat serve needs fastapi and uvicorn ({exc.name} is missing): pip install fastapi uvicorn")
        return EXIT_FAIL
    try:
        sock = socket.create_server((args.host, args.port), family=socket.AF_INET6 if ":" in args.host
                                    else socket.AF_INET, reuse_port=False)
    except OSError as exc:
        error(f"--host {args.host} --port {args.port}: cannot listen there ({exc.strerror or exc})")
        return EXIT_USAGE
    name = args.served_model_name or _model_id(settings.model)
    models = Models(name, settings, aliases=tuple(filter(None, [settings.model])), keep_alive=args.keep_alive,
                    discover=not args.only and not settings.backend)
    runner = Runner(functools.partial(open_engine, resume=True), models, max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
                    max_tokens=settings.max_tokens)
    runner.start()
    app = make_app(runner, api_key=args.api_key, host=args.host,
                   allow_hosts=[settings.allow_hosts, *(args.allow_host or [])],
                   allow_origins=[settings.allow_origins, *(args.allow_origin or [])])
    host, port = sock.getsockname()[:2]
    more = f" (and {len(models.slots) - 1} more on demand)" if len(models.slots) > 1 else ""
    print(f"localchat serve: http://{host if ':' not in host else f'[{host}]'}:{port}/v1 · model {name!r}{more} · "
          f"loading (GET /health)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    # uvicorn stops gracefully on SIGTERM, then raises it again for the handler before it: a
    # KeyboardInterrupt here, so SIGTERM (a service manager, `kill`) ends as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop(wait_s=30)        # the conversations' caches kept, an answer in flight stopped
    print("localchat serve: stopped", file=sys.stderr, flush=True)
    # The engine thread may be inside an answer: leave without tearing it down.
    sys.stderr.flush()
    os._exit(EXIT_OK)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _model_id(model: str | None) -> str:
    if not model:
        return "SmolLM2-135M-Instruct"
    from pathlib import Path
    p = Path(model)
    return (p.stem if p.suffix == ".gguf" else p.name) if p.exists() else model
