"""The real chat UI in a pseudo-terminal: closing the terminal (with or without a hangup
signal) or SIGTERM stops the answer, saves the conversation, and ends the process."""
from __future__ import annotations

import fcntl
import os
import pty
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

PROMPT = "Tell me a long story about the sea."


def _rows(db):
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return con.execute("select role, content, finish_reason from messages order by id").fetchall()
    except sqlite3.OperationalError:           # the schema is not there yet
        return []
    finally:
        con.close()


def _wait(condition, timeout=120.0, what="condition"):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Terminal:
    """The app on the slave side of a pty that is not its controlling terminal (as after
    `make chat` in tmux: the hangup signal goes to make, not to us), the master drained."""

    def __init__(self, args, env):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "localchat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, start_new_session=True, close_fds=True)
        os.close(slave)
        self.screen = bytearray()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.screen += data

    def type(self, text: str):
        os.write(self.master, text.encode())

    def hang_up(self):
        os.close(self.master)


@pytest.mark.parametrize("how", ["close-terminal", "sighup", "sigterm"])
def test_the_app_leaves_when_its_terminal_goes_and_keeps_the_conversation(tiny_llama, tmp_path, how):
    env = dict(os.environ, TERM="xterm-256color", LOCALCHAT_DATA_DIR=str(tmp_path / "data"),
               LOCALCHAT_CONFIG_DIR=str(tmp_path / "config"), HF_HUB_OFFLINE="1")
    db = tmp_path / "data" / "history.db"
    term = Terminal(["--model", str(tiny_llama), "--max-tokens", "3000"], env)
    try:
        _wait(lambda: b"tok/s" in term.screen or b"ready" in term.screen.lower() or len(term.screen) > 4000,
              what="the chat UI to draw")
        _wait(lambda: term.proc.poll() is not None or b"ctx" in term.screen, what="the model to load")
        time.sleep(0.5)
        term.type(PROMPT + "\r")
        _wait(lambda: any(r[0] == "user" for r in _rows(db)), what="the prompt to be saved")
        if how == "close-terminal":
            term.hang_up()
        else:
            term.proc.send_signal(signal.SIGHUP if how == "sighup" else signal.SIGTERM)
        try:
            code = term.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the app is still running after {how}")
        assert code == 128 + (signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
        rows = _rows(db)
        assert rows[0][:2] == ("user", PROMPT)
        assert rows[1][0] == "assistant" and rows[1][2] in ("cancelled", "length", "stop"), rows
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
        if how != "close-terminal":
            try:
                os.close(term.master)
            except OSError:
                pass
