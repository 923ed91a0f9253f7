"""Conversations kept in SQLite: `history.db` in the data dir (`config.data_dir()`,
`--data-dir` or LOCALCHAT_DATA_DIR move it).

What is committed when, so that a crash, a `kill -9` or a full disk loses at most the
tokens of the answer in flight:

- a user message is committed before its answer is generated (`add_message`);
- an answer is committed once, when it ends, is stopped or fails (`add_message` with
  its finish reason), never token by token: a half-written row is worth nothing and
  costs a write per token.

The database runs in WAL mode (readers never block the writer, and a killed writer leaves
the last committed state). Its layout is versioned in `schema_version`; `MIGRATIONS`
brings any earlier version forward, one step at a time, each in its own transaction.
A database that cannot be opened (locked by another process, corrupt, unwritable)
raises `HistoryError` with one line saying which file and what to do; the caller
decides to go on without saving. The file is never deleted or rewritten to "repair" it.

A `History` may be used from several threads (the chat UI saves an answer from its
generation thread): one connection, one lock."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DB_NAME = "history.db"
TITLE_CHARS = 80          # a title is the first prompt's first line, cut here

# Each entry takes the database from version N-1 to N. Never edit a released step:
# add a new one, so every database in the wild walks the same path.
MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE conversations (
               id INTEGER PRIMARY KEY,
               title TEXT NOT NULL DEFAULT '',
               created_at REAL NOT NULL,
               updated_at REAL NOT NULL)""",
        """CREATE TABLE messages (
               id INTEGER PRIMARY KEY,
               conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
               role TEXT NOT NULL,
               content TEXT NOT NULL,
               created_at REAL NOT NULL)""",
        "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
    ],
    # How an answer ended (stop, length, cancelled, error), the error text and its stats.
    2: [
        "ALTER TABLE messages ADD COLUMN finish_reason TEXT",
        "ALTER TABLE messages ADD COLUMN error TEXT",
        "ALTER TABLE messages ADD COLUMN stats TEXT",
    ],
    # Which model answered, the system message, and where the conversation came from
    # (the chat UI or a one-shot prompt); listing by recency needs an index.
    3: [
        "ALTER TABLE conversations ADD COLUMN model TEXT",
        "ALTER TABLE conversations ADD COLUMN system TEXT",
        "ALTER TABLE conversations ADD COLUMN source TEXT NOT NULL DEFAULT 'chat'",
        "CREATE INDEX conversations_by_update ON conversations(updated_at)",
    ],
    # A thinking model's reasoning, kept apart from its answer.
    4: [
        "ALTER TABLE messages ADD COLUMN reasoning TEXT",
    ],
}
SCHEMA_VERSION = max(MIGRATIONS)


class HistoryError(Exception):
    """The history database cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Message:
    id: int
    role: str
    content: str
    created_at: float
    finish_reason: str | None = None
    error: str | None = None
    stats: dict | None = None
    reasoning: str | None = None      # a thinking model's reasoning before this answer


@dataclass(frozen=True)
class ConversationInfo:
    id: int
    title: str
    created_at: float
    updated_at: float
    messages: int
    model: str | None = None
    source: str = "chat"


@dataclass
class Conversation:
    id: int
    title: str
    created_at: float
    updated_at: float
    model: str | None
    system: str | None
    source: str
    messages: list[Message] = field(default_factory=list)

    def engine_messages(self) -> list[dict]:
        """The conversation as the engine's chat takes it: system first, then the turns."""
        turns = [{"role": m.role, "content": m.content} for m in self.messages]
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns


def default_path(data_dir: str | Path | None = None) -> Path:
    from .config import data_dir as configured
    return Path(data_dir) / DB_NAME if data_dir else configured() / DB_NAME


def title_from(prompt: str) -> str:
    """The first non-blank line of the prompt, cut to TITLE_CHARS."""
    line = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "")
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"


class History:
    def __init__(self, conn: sqlite3.Connection, path: Path):
        self._conn = conn
        self._lock = threading.Lock()
        self.path = path

    # -- opening

    @classmethod
    def open(cls, path: str | Path | None = None, timeout: float = 2.0) -> "History":
        """Open (creating or migrating) the database; HistoryError if it cannot be used."""
        path = Path(path) if path else default_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryError(f"{path.parent}: cannot create the data directory ({exc.strerror or exc}); "
                               "--data-dir or LOCALCHAT_DATA_DIR moves it") from None
        try:
            # isolation_level=None: we open transactions ourselves (BEGIN IMMEDIATE), so
            # a migration or a replacement is all-or-nothing.
            conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise HistoryError(describe(path, exc)) from None
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise sqlite3.OperationalError(f"journal mode is {mode}, not WAL")
            conn.execute("PRAGMA synchronous = NORMAL")   # WAL + NORMAL: durable at each checkpoint, safe against corruption
            migrate(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise HistoryError(describe(path, exc)) from None
        return cls(conn, path)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _run(self, fn):
        """Run fn(conn) in one transaction under the lock; HistoryError on failure."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(self._conn)
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
                return result
            except sqlite3.Error as exc:
                raise HistoryError(describe(self.path, exc)) from None

    def _read(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise HistoryError(describe(self.path, exc)) from None

    # -- writing

    def new_conversation(self, title: str = "", model: str | None = None, system: str | None = None,
                         source: str = "chat") -> int:
        now = time.time()
        return self._run(lambda c: c.execute(
            "INSERT INTO conversations (title, created_at, updated_at, model, system, source) "
            "VALUES (?, ?, ?, ?, ?, ?)", (title, now, now, model, system, source)).lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str, finish_reason: str | None = None,
                    error: str | None = None, stats: dict | None = None, replaces: int | None = None,
                    reasoning: str | None = None) -> int:
        """Append a message, committed on return. `replaces`: a message id that this one
        supersedes (a retried answer, an edited prompt): it and every later message of the
        conversation are deleted in the same transaction, so a crash keeps one or the other."""
        now = time.time()

        def write(c):
            if replaces is not None:
                c.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, replaces))
            row = c.execute(
                "INSERT INTO messages (conversation_id, role, content, created_at, finish_reason, error, stats, "
                "reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, finish_reason, error or None,
                 json.dumps(stats) if stats else None, reasoning or None)).lastrowid
            c.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            return row
        return self._run(write)

    def rename(self, conversation_id: int, title: str) -> None:
        self._run(lambda c: c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)))

    def set_system(self, conversation_id: int, system: str | None) -> None:
        self._run(lambda c: c.execute("UPDATE conversations SET system = ? WHERE id = ?", (system, conversation_id)))

    def set_model(self, conversation_id: int, model: str | None) -> None:
        self._run(lambda c: c.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id)))

    def delete(self, conversation_id: int) -> bool:
        return self._run(lambda c: c.execute("DELETE FROM conversations WHERE id = ?",
                                             (conversation_id,)).rowcount > 0)

    # -- reading

    def conversations(self, search: str = "", limit: int = 200) -> list[ConversationInfo]:
        """Most recently updated first. `search` matches the title or any message's text
        (case-insensitive substring)."""
        sql = ("SELECT c.id, c.title, c.created_at, c.updated_at, "
               "(SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id), c.model, c.source "
               "FROM conversations c")
        args: list = []
        if search.strip():
            pattern = f"%{escape_like(search.strip())}%"
            sql += (" WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
                    "WHERE m.conversation_id = c.id AND m.content LIKE ? ESCAPE '\\')")
            args = [pattern, pattern]
        sql += " ORDER BY c.updated_at DESC, c.id DESC LIMIT ?"
        return [ConversationInfo(*row) for row in self._read(sql, (*args, limit))]

    def get(self, conversation_id: int) -> Conversation | None:
        rows = self._read("SELECT id, title, created_at, updated_at, model, system, source "
                          "FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            return None
        conv = Conversation(*rows[0])
        for (mid, role, content, created, reason, error, stats, thought) in self._read(
                "SELECT id, role, content, created_at, finish_reason, error, stats, reasoning FROM messages "
                "WHERE conversation_id = ? ORDER BY id", (conversation_id,)):
            conv.messages.append(Message(mid, role, content, created, reason, error,
                                         json.loads(stats) if stats else None, thought))
        return conv

    def last_id(self, source: str | None = "chat") -> int | None:
        """The most recently updated conversation (of the chat UI by default)."""
        where, args = ("WHERE source = ?", (source,)) if source else ("", ())
        rows = self._read(f"SELECT id FROM conversations {where} ORDER BY updated_at DESC, id DESC LIMIT 1", args)
        return rows[0][0] if rows else None

    def prompts(self, limit: int = 500) -> list[str]:
        """The user's earlier prompts, oldest first, without repeats (for the up arrow)."""
        rows = self._read("SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit,))
        seen, out = set(), []
        for (text,) in rows:
            if text not in seen:
                seen.add(text)
                out.append(text)
        return out[::-1]


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema to SCHEMA_VERSION; returns the version found. A database newer
    than this program is refused (its columns may mean something we would break)."""
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    found = row[0] if row else 0
    if found > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"schema version {found} is newer than this localchat "
                                    f"(knows {SCHEMA_VERSION}); upgrade localchat")
    for version in range(found + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    return found


def describe(path: Path, exc: sqlite3.Error) -> str:
    """One line for the user: which file, what is wrong, what to do."""
    text = str(exc)
    low = text.lower()
    if "locked" in low or "busy" in low:
        return f"{path}: the history database is locked by another process; conversations are not saved this session"
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return (f"{path}: the history database is corrupt ({text}); conversations are not saved — "
                f"move the file aside to start a new one")
    if "readonly" in low or "read-only" in low or "unable to open" in low or "disk i/o" in low:
        return f"{path}: cannot write the history database ({text}); conversations are not saved"
    if "full" in low:
        return f"{path}: the disk is full; the last message was not saved"
    return f"{path}: history database error ({text})"


def escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


# -- Markdown export (the `/export` command and `localchat history export`)

def to_markdown(conv: Conversation) -> str:
    lines = [f"# {conv.title or f'Conversation {conv.id}'}", ""]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created_at))
    lines.append(f"*{when}" + (f" · {conv.model}" if conv.model else "") + "*")
    lines.append("")
    if conv.system:
        lines += ["**System:** " + conv.system, ""]
    for m in conv.messages:
        lines.append("## You" if m.role == "user" else "## Assistant" if m.role == "assistant" else f"## {m.role}")
        if m.reasoning:
            lines += ["", "<details><summary>Reasoning</summary>", "", m.reasoning, "", "</details>"]
        lines += ["", m.content, ""]
        if m.finish_reason == "cancelled":
            lines += ["*(stopped)*", ""]
        elif m.finish_reason == "error":
            lines += [f"*(failed: {m.error or 'error'})*", ""]
    return "\n".join(lines).rstrip() + "\n"
