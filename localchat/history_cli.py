"""`localchat history`: the saved conversations from the command line.

    localchat history                   # list, most recent first
    localchat history list --search rust
    localchat history show 12           # the conversation as text
    localchat history export 12 -o chat.md   # as Markdown (stdout without -o)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .argparsing import Parser
from . import history as hist

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat history",
               description="List, show and export the conversations localchat saved.")
    p.add_argument("--data-dir", metavar="DIR", help="where history.db lives (default: the user data dir)")
    sub = p.add_subparsers(dest="command")
    ls = sub.add_parser("list", help="conversations, most recent first (the default)")
    ls.add_argument("--search", "-q", default="", metavar="TEXT", help="only those whose title or text has TEXT")
    ls.add_argument("--limit", type=int, default=50, metavar="N", help="at most N (default 50)")
    show = sub.add_parser("show", help="print one conversation")
    show.add_argument("id", type=int, metavar="ID")
    export = sub.add_parser("export", help="one conversation as Markdown")
    export.add_argument("id", type=int, metavar="ID")
    export.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of stdout")
    delete = sub.add_parser("delete", help="delete one conversation (asks first unless --yes)")
    delete.add_argument("id", type=int, metavar="ID")
    delete.add_argument("--yes", "-y", action="store_true", help="do not ask")
    return p


def history_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        db = hist.History.open(hist.default_path(args.data_dir))
    except hist.HistoryError as exc:           # the file's state is for the user to fix: bad input
        return fail(str(exc), EXIT_USAGE)
    try:
        if args.command in (None, "list"):
            return list_conversations(db, getattr(args, "search", ""), getattr(args, "limit", 50))
        conv = db.get(args.id)
        if conv is None:
            return fail(f"history {args.command} {args.id}: no such conversation (see `localchat history list`)",
                        EXIT_USAGE)
        if args.command == "show":
            sys.stdout.write(as_text(conv))
            return EXIT_OK
        if args.command == "delete":
            return delete_conversation(db, conv, args.yes)
        markdown = hist.to_markdown(conv)
        if args.output:
            try:
                Path(args.output).write_text(markdown, encoding="utf-8")
            except OSError as exc:
                return fail(f"--output {args.output}: cannot write ({exc.strerror or exc})", EXIT_USAGE)
            print(f"wrote {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(markdown)
        return EXIT_OK
    except hist.HistoryError as exc:
        return fail(str(exc), EXIT_FAIL)
    finally:
        db.close()


def delete_conversation(db: hist.History, conv: hist.Conversation, yes: bool) -> int:
    """Deleting is for good: ask on a terminal, and refuse to guess when nobody can answer."""
    if not yes:
        if not sys.stdin.isatty():
            return fail(f"history delete {conv.id}: add --yes to delete without a terminal to confirm", EXIT_USAGE)
        answer = input(f"Delete conversation {conv.id} \"{conv.title}\" ({len(conv.messages)} messages)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return EXIT_OK
    db.delete(conv.id)
    print(f"deleted conversation {conv.id}", file=sys.stderr)
    return EXIT_OK


def list_conversations(db: hist.History, search: str, limit: int) -> int:
    rows = db.conversations(search=search, limit=limit)
    if not rows:
        print("no saved conversations" + (f" matching {search!r}" if search else ""), file=sys.stderr)
        return EXIT_OK
    print(f"{'id':>5}  {'updated':16}  {'msgs':>4}  {'from':7}  title")
    for c in rows:
        print(f"{c.id:>5}  {when(c.updated_at):16}  {c.messages:>4}  {c.source:7}  {c.title or '(untitled)'}")
    return EXIT_OK


def as_text(conv: hist.Conversation) -> str:
    out = [f"# {conv.id}: {conv.title or '(untitled)'} — {when(conv.created_at)}"
           + (f" · {conv.model}" if conv.model else "")]
    if conv.system:
        out.append(f"[system] {conv.system}")
    for m in conv.messages:
        note = " (stopped)" if m.finish_reason == "cancelled" else f" (failed: {m.error})" if m.finish_reason == "error" else ""
        out.append(f"\n[{m.role}]{note}\n{m.content}")
    return "\n".join(out) + "\n"


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def fail(message: str, code: int) -> int:
    print(f"localchat: {message}", file=sys.stderr)
    return code
