"""One-shot mode: the prompt from stdin and/or arguments, the answer to stdout as it is
generated, statistics to stderr on request (--stats) or everything as JSON (--json)."""
from __future__ import annotations

import json
import sys

from .format import human_bytes
from .common import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, error, open_engine, sampling


def read_prompt(args_prompt: list[str], stdin=None) -> tuple[str, bool]:
    """stdin text first (when stdin is not a terminal), then the arguments, joined by a
    blank line. Returns the prompt and whether stdin had bytes that are not UTF-8."""
    stdin = stdin or sys.stdin
    parts, replaced = [], False
    if not stdin.isatty():
        raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        text = raw.decode("utf-8", errors="replace")
        replaced = "\ufffd" in text and "\ufffd".encode() not in raw
        if text.strip():
            parts.append(text.strip("\n"))
    if args_prompt:
        parts.append(" ".join(args_prompt))
    return "\n\n".join(parts), replaced


def format_stats(s) -> str:
    if getattr(s, "backend", ""):
        return remote_line(s)
    peak = s.peak_host_bytes or s.host_bytes
    restored = (f", {s.restored_tokens} restored in {s.restore_seconds:.2f} s" if getattr(s, "restored_tokens", 0)
                else "")
    line = (f"{s.prompt_tokens} prompt tokens ({s.prefill_tokens} prefilled{restored}) · prefill {s.prefill_tps:.1f} tok/s · "
            f"decode {s.decode_tps:.1f} tok/s · {s.generated_tokens} tokens · {s.tokens_per_pass:.2f} tok/pass")
    if s.drafted_tokens:
        line += (f" · drafted {s.drafted_tokens}, accepted {s.accepted_tokens} ({s.acceptance:.0%}) · "
                 f"k {s.draft_k}")
    if s.streamed_bytes:
        # Streamed profile: how fast weights came in, against what the tiers allow, and how
        # much of that reading the compute hid.
        line += (f" · streamed {human_bytes(s.streamed_bytes)} at {s.stream_gbps:.1f} GB/s, "
                 f"{s.stream_hidden:.0%} hidden · pass {s.pass_seconds * 1e3:.0f} ms "
                 f"(transfer bound {s.bound_pass_seconds * 1e3:.0f} ms)")
        if s.compute_threads:
            line += f" · {s.compute_threads}"
    if s.expert_bytes:
        line += f" · routed experts read {human_bytes(s.expert_bytes)}"
    return line + f" · peak memory {human_bytes(peak)}"


class ThinkingOutput:
    """With --show-thinking: the reasoning as it comes (dimmed on a terminal), then a blank
    line, then the answer."""

    DIM, RESET = "\033[2m", "\033[0m"

    def __init__(self, tty: bool):
        self.tty, self.in_reasoning, self.any_reasoning = tty, False, False

    def reasoning(self, text: str) -> str:
        start = "" if self.in_reasoning else (self.DIM if self.tty else "")
        self.in_reasoning = self.any_reasoning = True
        return start + text

    def end(self) -> str:
        """What ends an answer that stopped within its reasoning (the terminal's colour back)."""
        if not self.in_reasoning:
            return ""
        self.in_reasoning = False
        return self.RESET if self.tty else ""

    def answer(self, text: str) -> str:
        if not self.in_reasoning:
            return text
        self.in_reasoning = False
        return (self.RESET if self.tty else "") + "\n\n" + text


class PrefillProgress:
    """With --stats on a terminal: a long prompt's prefill as it runs, on one stderr line
    that the answer's first text replaces."""

    def __init__(self, on: bool):
        self.on, self.shown = on, False

    def show(self, s) -> None:
        if self.on and s.prefill_pending:
            print(f"\rprefill {s.prefill_tokens - s.prefill_pending}/{s.prefill_tokens} tokens · {s.prefill_tps:.0f} tok/s",
                  end="", file=sys.stderr, flush=True)
            self.shown = True
        elif self.shown:
            self.clear()

    def clear(self) -> None:
        if self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            self.shown = False


def remote_line(s) -> str:
    """An answer a backend wrote: measured here, and the server's own figures if it sent them."""
    line = (f"backend {s.backend} · first token {s.ttft_seconds:.2f} s · decode {s.decode_tps:.1f} tok/s "
            f"(measured here) · {s.prompt_tokens} prompt tokens · {s.generated_tokens} tokens")
    if s.server_decode_tps or s.server_prefill_tps:
        line += f" · server: prefill {s.server_prefill_tps:.1f}, decode {s.server_decode_tps:.1f} tok/s"
    if s.tokens_per_pass:
        line += f" · {s.tokens_per_pass:.2f} tok/pass"
    return line


def partial_answer(chat) -> str:
    last = chat.messages[-1] if chat.messages else None
    return last["content"] if last and last["role"] == "assistant" else ""


def earlier_turns(data_dir: str | None, resume: int | str):
    """The saved conversation a one-shot prompt continues (--continue: the most recent, of
    the chat UI or a one-shot; --cid ID), or None where there is none to continue (said
    here); a --cid that names no conversation, or a history that cannot be read, raises
    HistoryError."""
    from . import history
    db = history.History.open(history.default_path(data_dir))
    try:
        cid = db.last_id(source=None) if resume == "last" else int(resume)
        conv = db.get(cid) if cid is not None else None
    finally:
        db.close()
    if conv is None and resume != "last":
        raise history.HistoryError(f"--cid {resume}: no such conversation (see `localchat history`)")
    if conv is None:
        error("--continue: no saved conversation yet; this is a new one")
    return conv


class OneshotLog:
    """One-shot prompts are saved as one-turn conversations (source "oneshot"), like
    `llm` logs them, or as the next turn of the conversation they continue (--continue,
    --cid): the prompt before the answer starts, the answer when it ends. A history that
    cannot be opened or written is one warning line, never a failure."""

    def __init__(self, db, cid: int | None):
        self.db, self.cid = db, cid

    @classmethod
    def open(cls, enabled: bool, data_dir: str | None, prompt: str, model: str,
             system: str | None, cid: int | None = None) -> "OneshotLog":
        if not enabled:               # --no-log
            return cls(None, None)
        from . import history
        try:
            db = history.History.open(history.default_path(data_dir))
            if cid is None:
                cid = db.new_conversation(history.title_from(prompt), model=model, system=system, source="oneshot")
            db.add_message(cid, "user", prompt)
            return cls(db, cid)
        except history.HistoryError as exc:
            error(f"{exc} (--no-log skips saving)")
            return cls(None, None)

    def answer(self, done, stats) -> None:
        if self.db is None:
            return
        from . import history
        try:
            self.db.add_message(self.cid, "assistant", done.text, finish_reason=done.reason, error=done.error,
                                stats=stats.as_dict() if stats else None, reasoning=done.reasoning)
        except history.HistoryError as exc:
            error(str(exc))
        self.db.close()
        self.db = None


def read_schema(path: str):
    """--json-schema FILE as a grammar, or BadRequest naming the file and what is wrong."""
    import engine
    from engine.constrain import loads_schema
    what = f"--json-schema {path}"
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise engine.BadRequest(f"{what}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    return engine.Grammar.json_schema(loads_schema(text, what), what)


def run_oneshot(args, settings) -> int:
    import engine

    prompt, replaced = read_prompt(args.prompt)
    if replaced:
        error("stdin is not valid UTF-8; undecodable bytes were replaced with U+FFFD")
    if not prompt.strip():
        error("the prompt is empty: pass a question as arguments or on stdin (or run `localchat` in a terminal for the chat UI)")
        return EXIT_USAGE
    try:
        grammar = read_schema(args.json_schema) if getattr(args, "json_schema", None) else None
    except engine.BadRequest as exc:
        error(str(exc))
        return EXIT_USAGE
    earlier = None
    if args.resume_last or args.cid is not None:        # before the model loads: a bad --cid fails fast
        from . import history
        try:
            earlier = earlier_turns(args.data_dir, "last" if args.resume_last else args.cid)
        except history.HistoryError as exc:
            error(str(exc))
            return EXIT_USAGE
    try:
        eng = open_engine(settings, api_key=args.api_key, resume=not args.no_log, data_dir=args.data_dir)
    except engine.EngineError as exc:
        error(str(exc))
        return EXIT_USAGE
    chat = eng.chat(system=settings.system)
    chat.thinking = getattr(args, "thinking", None)
    if earlier is not None:
        chat.restore(earlier.engine_messages())        # its own system prompt and turns
    log = OneshotLog.open(not args.no_log, args.data_dir, prompt, eng.name, settings.system,
                          cid=earlier.id if earlier is not None else None)
    out = sys.stdout
    stream = not args.json
    done, stats, wrote_newline = None, None, True
    progress = PrefillProgress(args.stats and sys.stderr.isatty())
    show_thinking = getattr(args, "show_thinking", False)
    thinking = ThinkingOutput(show_thinking and out.isatty())
    used = sampling(settings, eng)
    try:
        for ev in chat.send(prompt, max_new_tokens=settings.max_tokens, seed=settings.seed, grammar=grammar, **used):
            if isinstance(ev, engine.TextDelta):
                if stream and ev.reasoning and show_thinking:
                    out.write(thinking.reasoning(ev.text))
                    out.flush()
                    wrote_newline = ev.text.endswith("\n")
                elif stream and not ev.reasoning:
                    out.write(thinking.answer(ev.text))
                    out.flush()
                    wrote_newline = ev.text.endswith("\n")
            elif isinstance(ev, engine.Stats):
                stats = ev
                progress.show(ev)
            elif isinstance(ev, engine.Done):
                done = ev
    except engine.BadRequest as exc:
        error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        log.answer(chat.last_done or engine.Done("cancelled", text=partial_answer(chat)), stats)
        # What was generated is already on stdout; end the line and say so.
        if stream:
            out.write(thinking.end())
        if stream and not wrote_newline:
            out.write("\n")
            out.flush()
        error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error of ours.
        log.answer(chat.last_done or engine.Done("cancelled", text=partial_answer(chat)), stats)
        sys.stderr.close()
        return EXIT_OK
    progress.clear()
    if stream:
        out.write(thinking.end())
    log.answer(done, stats)
    chat.keep()              # the next --continue prefills only its own prompt
    if args.json:
        record = {"model": eng.name, "text": done.text, "token_ids": list(done.token_ids),
                  "finish_reason": done.reason, "stats": stats.as_dict() if stats else {},
                  "sampling": {**used, "seed": settings.seed}}
        if done.reasoning:
            record["reasoning"] = done.reasoning
        if done.error:
            record["error"] = done.error
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif not wrote_newline:
        out.write("\n")
    out.flush()
    if args.stats and stats:
        print(format_stats(stats), file=sys.stderr)
    if done.reason == "error":
        error(done.error)
        return EXIT_USAGE if done.bad_weights else EXIT_FAIL
    if done.reason == "length" and done.error:      # the answer stopped where the context is full
        error(done.error)
    if done.reasoning and not done.text.strip() and not show_thinking:     # never a silent empty answer
        why = "its --max-tokens ran out" if done.reason == "length" else f"it ended ({done.reason})"
        error(f"the answer ended within the model's reasoning ({why}); raise --max-tokens, pass --no-think, "
              "or --show-thinking to see it")
    return EXIT_OK
