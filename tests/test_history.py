"""Conversations in SQLite (localchat/history.py) and `localchat history`: what is
committed when, migrations from every earlier schema, a locked or corrupt database,
one-shot logging, and a real process SIGKILLed in the middle of an answer."""
from __future__ import annotations

import io
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from localchat import history as hist
from localchat.history_cli import history_main


@pytest.fixture
def db(tmp_path):
    d = hist.History.open(tmp_path / "history.db")
    yield d
    d.close()


def test_messages_are_committed_and_read_back_in_order(db, tmp_path):
    """A conversation's messages come back in order, with the finish reason and stats of
    the answer, from a second connection (so they were committed); the file is in WAL mode."""
    cid = db.new_conversation(hist.title_from("\n  Why is the sky blue?\nmore"), model="tiny", system="Be brief.")
    db.add_message(cid, "user", "Why is the sky blue?")
    db.add_message(cid, "assistant", "Rayleigh", finish_reason="cancelled", stats={"decode_tps": 3.5})
    other = hist.History.open(tmp_path / "history.db")
    conv = other.get(cid)
    assert conv.title == "Why is the sky blue?" and conv.system == "Be brief." and conv.model == "tiny"
    assert [(m.role, m.content, m.finish_reason) for m in conv.messages] == [
        ("user", "Why is the sky blue?", None), ("assistant", "Rayleigh", "cancelled")]
    assert conv.messages[1].stats == {"decode_tps": 3.5}
    assert conv.engine_messages()[0] == {"role": "system", "content": "Be brief."}
    mode = sqlite3.connect(tmp_path / "history.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    other.close()


def test_list_search_rename_delete_and_replace(db):
    """Listing is most recent first; search matches titles and message text (with LIKE's
    wildcards taken literally); rename and delete work; `replaces` drops the superseded
    message and everything after it in the same transaction."""
    a = db.new_conversation("rust lifetimes")
    db.add_message(a, "user", "explain borrowck")
    b = db.new_conversation("tea")
    u = db.add_message(b, "user", "green or black? 100%")
    db.add_message(b, "assistant", "green")
    assert [c.id for c in db.conversations()] == [b, a]
    assert [c.id for c in db.conversations("BORROW")] == [a]
    assert [c.id for c in db.conversations("100%")] == [b]
    assert db.conversations("1_0") == []
    db.rename(a, "ownership")
    assert db.get(a).title == "ownership"
    db.add_message(b, "user", "oolong?", replaces=u)
    assert [m.content for m in db.get(b).messages] == ["oolong?"]
    assert db.prompts() == ["explain borrowck", "oolong?"]
    assert db.delete(a) and db.get(a) is None and not db.delete(a)
    assert db.last_id() == b


def build_at_version(path, version: int) -> None:
    """A database as an older localchat left it: migrations 1..version, with data."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for v in range(1, version + 1):
        for statement in hist.MIGRATIONS[v]:
            conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
    conn.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (7, 'old', 1, 2)")
    conn.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (7, 'user', 'hi', 1)")
    conn.close()


@pytest.mark.parametrize("version", range(1, hist.SCHEMA_VERSION))
def test_migrates_forward_from_each_earlier_version(tmp_path, version):
    """A database written at any earlier schema version opens, is brought to the current
    version, keeps its conversations, and takes the newer columns."""
    path = tmp_path / "history.db"
    build_at_version(path, version)
    db = hist.History.open(path)
    conv = db.get(7)
    assert conv.title == "old" and [m.content for m in conv.messages] == ["hi"]
    assert conv.source == "chat"
    db.add_message(7, "assistant", "hello", finish_reason="stop", error=None, stats={"x": 1})
    db.set_model(7, "tiny")
    assert db.get(7).messages[-1].finish_reason == "stop"
    db.close()
    found = sqlite3.connect(path).execute("SELECT version FROM schema_version").fetchall()
    assert found == [(hist.SCHEMA_VERSION,)]


def test_an_empty_file_and_a_newer_schema(tmp_path):
    """An empty file is a new database; one written by a newer localchat is refused with
    a message that says to upgrade (its data is left alone)."""
    empty = tmp_path / "empty.db"
    empty.touch()
    hist.History.open(empty).close()
    newer = tmp_path / "newer.db"
    build_at_version(newer, hist.SCHEMA_VERSION)
    sqlite3.connect(newer, isolation_level=None).execute("UPDATE schema_version SET version = 99")
    with pytest.raises(hist.HistoryError, match="newer than this localchat"):
        hist.History.open(newer)


def test_a_corrupt_file_is_reported_and_left_untouched(tmp_path):
    """A file that is not a SQLite database gives one line naming it and saying it is
    corrupt; the bytes on disk are unchanged (never 'repaired' away)."""
    path = tmp_path / "history.db"
    junk = b"this is not sqlite " * 300
    path.write_bytes(junk)
    with pytest.raises(hist.HistoryError) as info:
        hist.History.open(path)
    assert str(path) in str(info.value) and "corrupt" in str(info.value) and "\n" not in str(info.value)
    assert path.read_bytes() == junk


def test_a_locked_file_is_reported(tmp_path):
    """Another process holding an exclusive lock: opening gives up after the timeout with
    one line that says the database is locked."""
    path = tmp_path / "history.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(hist.HistoryError, match="locked by another process"):
            hist.History.open(path, timeout=0.1)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_markdown_export_and_history_command(db, tmp_path, capsys):
    """`localchat history` lists, shows and exports; an unknown id is one line, exit 2."""
    cid = db.new_conversation("fib", model="tiny")
    db.add_message(cid, "user", "write fib")
    db.add_message(cid, "assistant", "```py\ndef fib(n): ...\n```", finish_reason="cancelled")
    data = str(tmp_path)
    assert history_main(["--data-dir", data]) == 0
    assert "fib" in capsys.readouterr().out
    assert history_main(["--data-dir", data, "show", str(cid)]) == 0
    shown = capsys.readouterr().out
    assert "[user]\nwrite fib" in shown and "(stopped)" in shown
    out = tmp_path / "fib.md"
    assert history_main(["--data-dir", data, "export", str(cid), "-o", str(out)]) == 0
    md = out.read_text()
    capsys.readouterr()
    assert md.startswith("# fib\n") and "## You\n\nwrite fib" in md and "```py\ndef fib(n): ...\n```" in md
    assert history_main(["--data-dir", data, "show", "999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "999" in err


class TerminalStdin(io.StringIO):
    def isatty(self):
        return True


def oneshot(args, data_dir, monkeypatch, capsys) -> tuple[int, str, str]:
    """The CLI in this process (a subprocess costs seconds of imports): exit code, stdout, stderr."""
    from localchat import cli
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(data_dir))
    monkeypatch.setattr(sys, "stdin", TerminalStdin())
    capsys.readouterr()
    code = cli.run(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_oneshot_prompts_are_logged_unless_no_log(tiny_llama, tmp_path, monkeypatch, capsys):
    """A one-shot prompt and its answer are saved as a conversation from 'oneshot';
    with --no-log nothing is saved; --data-dir moves the database."""
    code, out, err = oneshot(["--model", str(tiny_llama), "-n", "6", "hello there"], tmp_path / "env",
                             monkeypatch, capsys)
    assert code == 0, err
    db = hist.History.open(tmp_path / "env" / "history.db")
    [info] = db.conversations()
    conv = db.get(info.id)
    assert info.source == "oneshot" and conv.title == "hello there"
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[1].content == out.rstrip("\n") and conv.messages[1].finish_reason in ("stop", "length")
    code, _, _ = oneshot(["--model", str(tiny_llama), "-n", "6", "--no-log", "again"], tmp_path / "env",
                         monkeypatch, capsys)
    assert code == 0 and len(db.conversations()) == 1
    code, _, _ = oneshot(["--model", str(tiny_llama), "-n", "6", "--data-dir", str(tmp_path / "flag"), "x"],
                         tmp_path / "env", monkeypatch, capsys)
    assert code == 0 and (tmp_path / "flag" / "history.db").is_file()
    db.close()


def test_oneshot_with_a_corrupt_database_still_answers(tiny_llama, tmp_path, monkeypatch, capsys):
    """A corrupt history database is one warning on stderr; the answer still comes."""
    (tmp_path / "history.db").write_bytes(b"garbage" * 100)
    code, out, err = oneshot(["--model", str(tiny_llama), "-n", "4", "hi"], tmp_path, monkeypatch, capsys)
    assert code == 0 and out.strip()
    assert "corrupt" in err and err.count("\n") == 1


# The real CLI in a child process, with the tiny model's end-of-turn tokens removed so
# the answer runs until the process is killed.
KILLABLE = textwrap.dedent("""
    import sys, engine.engine
    engine.engine._stop_ids = lambda path, tok: frozenset()
    from localchat.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_mid_answer_keeps_the_prompt_and_earlier_turns(tiny_llama, tmp_path, monkeypatch, capsys):
    """A one-shot process SIGKILLed while its answer streams: the database opens cleanly
    afterwards, the prompt was committed before generation started, the answer in flight
    is lost (it is committed only when it ends), and an earlier finished run is intact."""
    assert oneshot(["--model", str(tiny_llama), "-n", "4", "first prompt"], tmp_path, monkeypatch, capsys)[0] == 0
    env = dict(os.environ, LOCALCHAT_DATA_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, "--model", str(tiny_llama), "-n", "4000",
                             "second prompt"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.read(8), "no answer text before the kill"   # the answer is streaming
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    db = hist.History.open(tmp_path / "history.db")
    convs = {db.get(c.id).title: db.get(c.id) for c in db.conversations()}
    assert [(m.role, m.finish_reason) for m in convs["first prompt"].messages] == [
        ("user", None), ("assistant", convs["first prompt"].messages[1].finish_reason)]
    assert [(m.role, m.content) for m in convs["second prompt"].messages] == [("user", "second prompt")]
    db.close()


def test_resume_flags_are_checked(tmp_path, monkeypatch, capsys):
    """--continue with --cid, either with --no-log, or a --cid no conversation has, is one
    line and exit 2 (nothing is loaded: the model named does not exist)."""
    from localchat import cli
    assert cli.run(["--continue", "--cid", "3"]) == 2
    assert "give one" in capsys.readouterr().err
    assert cli.run(["--cid", "3", "--no-log", "a prompt"]) == 2
    assert "--no-log" in capsys.readouterr().err
    code, _, err = oneshot(["--model", "/nonexistent/model", "--cid", "3", "a prompt"], tmp_path, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "--cid 3: no such conversation" in err


def test_a_oneshot_prompt_continues_a_saved_conversation(tiny_llama, tmp_path, monkeypatch, capsys):
    """`-c "follow-up"` answers as the next turn of the most recent conversation, with its
    earlier turns in the prompt, and saves the turn there (as `llm -c` does); `--cid ID`
    continues that one; with nothing saved yet, -c says so and starts one."""
    import engine
    model = ["--model", str(tiny_llama), "-n", "8"]
    code, _, err = oneshot([*model, "-c", "first question"], tmp_path, monkeypatch, capsys)
    assert code == 0 and "no saved conversation yet" in err
    code, _, _ = oneshot([*model, "another topic"], tmp_path, monkeypatch, capsys)
    code, second, err = oneshot([*model, "-c", "and then?"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    db = hist.History.open(tmp_path / "history.db")
    first_id, other_id = sorted(c.id for c in db.conversations())
    turns = db.get(other_id).messages
    assert [(m.role, m.content) for m in turns][::2] == [("user", "another topic"), ("user", "and then?")]
    # the answer is the engine's to the whole saved conversation (its text, as saved)
    chat = engine.open(str(tiny_llama), drafter="none").chat()
    chat.restore([{"role": m.role, "content": m.content} for m in turns[:2]])
    assert turns[3].content == second.rstrip("\n") == list(chat.send("and then?", max_new_tokens=8))[-1].text
    code, _, _ = oneshot([*model, "--cid", str(first_id), "more on the first"], tmp_path, monkeypatch, capsys)
    assert code == 0 and [m.content for m in db.get(first_id).messages][2] == "more on the first"
    assert len(db.get(first_id).messages) == 4 and len(db.conversations()) == 2
    db.close()


def test_history_delete_asks_on_a_terminal_and_needs_yes_without_one(db, tmp_path, monkeypatch, capsys):
    """`localchat history delete ID`: --yes deletes; on a terminal it asks (n keeps, y
    deletes); with no terminal and no --yes it refuses in one line, exit 2."""
    data = str(tmp_path)
    keep, gone, asked = (db.new_conversation(t) for t in ("keep", "gone", "asked"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert history_main(["--data-dir", data, "delete", str(keep)]) == 2
    assert "--yes" in capsys.readouterr().err and db.get(keep) is not None
    assert history_main(["--data-dir", data, "delete", str(gone), "--yes"]) == 0
    assert db.get(gone) is None
    monkeypatch.setattr(sys, "stdin", TerminalStdin("n\n"))
    assert history_main(["--data-dir", data, "delete", str(asked)]) == 0
    assert db.get(asked) is not None
    monkeypatch.setattr(sys, "stdin", TerminalStdin("y\n"))
    assert history_main(["--data-dir", data, "delete", str(asked)]) == 0
    assert db.get(asked) is None


WRITER = """
import sys
from localchat import history
db = history.History.open(sys.argv[1])
cid = db.new_conversation("writer " + sys.argv[2], source="oneshot")
print(cid, flush=True)
for i in range(int(sys.argv[3])):
    db.add_message(cid, "user" if i % 2 == 0 else "assistant", f"{sys.argv[2]} turn {i}")
"""


def _writer(path, name: str, turns: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(turns)], stdout=subprocess.PIPE,
                            text=True)


def test_writers_at_once_lose_no_turn_and_a_kill_mid_write_leaves_the_file_whole(tmp_path):
    """Two one-shot processes and the chat UI's store (this process) append to one
    history.db at the same time: every turn of each is there, in order. A writer killed
    with SIGKILL in the middle of its writes leaves a database that passes SQLite's
    integrity check, holding a gapless prefix of its turns."""
    path = tmp_path / "history.db"
    hist.History.open(path).close()
    procs = [_writer(path, name, 150) for name in ("a", "b")]
    db = hist.History.open(path)
    cid = db.new_conversation("ui")
    for i in range(150):
        db.add_message(cid, "user", f"ui {i}")
    try:
        assert [p.wait(timeout=240) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    convs = {c.title: db.get(c.id) for c in db.conversations()}
    for name in ("a", "b"):
        assert [m.content for m in convs[f"writer {name}"].messages] == [f"{name} turn {i}" for i in range(150)]
    assert [m.content for m in convs["ui"].messages] == [f"ui {i}" for i in range(150)]
    killed = _writer(path, "k", 1_000_000)
    try:
        kid = int(killed.stdout.readline())
        while len(db.get(kid).messages) < 50:         # well into its writes, then SIGKILL
            db.add_message(cid, "user", "meanwhile")
        killed.kill()
        assert killed.wait(timeout=60) == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
    db.close()
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    con.close()
    db = hist.History.open(path)
    kept = [m.content for m in db.get(kid).messages]
    assert kept == [f"k turn {i}" for i in range(len(kept))] and len(kept) >= 50
    db.close()
