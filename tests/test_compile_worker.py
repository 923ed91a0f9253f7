"""The background compile's thread and child process (engine/compile/worker.py,
engine/compile/builder.py): it parks while an answer runs, ends when it has nothing queued, and
a package built in a child process is stopped with it, says why it failed in one line, and
leaves with the chat."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import engine
from engine.compile import builder
from engine.compile import step as compiled
from engine.compile import worker as compile_worker
from waiting import wait_until


@pytest.fixture(autouse=True)
def _idle_worker():
    """These tests watch the one compile thread: what earlier tests queued on it (their
    steps' races, engine/compile/proof.py) finishes first."""
    wait_until(lambda: not compile_worker.busy(), 300)


class BusyCompile(compiled.CompiledStep):
    """Stands in for the compiler's Python work (allocating all the time) on the real
    compile thread, counting how far it got."""

    def __init__(self):
        super().__init__(None, None, "busy")
        self.count = 0
        self.stop = threading.Event()

    def _try_builds(self):
        kept = []
        while not self.stop.is_set():
            # Like a compiler building graphs, it keeps what it allocates, so collections
            # come every few rounds (objects freed at once would not count towards one).
            kept.append([[] for _ in range(100)])
            if len(kept) > 1000:
                kept = []
            self.count += 1


def test_the_compile_thread_parks_while_an_answer_runs():
    step = BusyCompile()
    compile_worker.submit(step._compile, step._done)
    wait_until(lambda: step.count > 0)
    compile_worker.pause()
    try:
        time.sleep(0.2)                      # it parks at its next collection
        before = step.count
        time.sleep(0.3)
        assert step.count == before and compile_worker.busy()
    finally:
        compile_worker.resume()
    wait_until(lambda: step.count > before)  # and goes on once the answers are done
    step.stop.set()
    assert step.wait(10) and not compile_worker.busy()


def test_the_compile_worker_ends_when_its_queue_is_empty():
    """An idle worker must not stay: a thread that ran a parallel torch op keeps its OpenMP
    team while it lives, and a second team makes libgomp sleep between parallel regions of
    the thread that decodes. A job queued by a job runs on the same worker; a job submitted
    later starts a new one."""
    seen, first, second = [], threading.Event(), threading.Event()

    def job():
        seen.append(threading.current_thread())
        torch.randn(512, 512) @ torch.randn(512, 512)       # a team for this thread
        compile_worker.submit(lambda: seen.append(threading.current_thread()), first)

    compile_worker.submit(job, threading.Event())
    assert first.wait(10)
    worker = seen[0]
    worker.join(10)
    assert seen[1] is worker and not worker.is_alive() and not compile_worker.busy()
    compile_worker.submit(lambda: seen.append(threading.current_thread()), second)
    assert second.wait(10)
    assert seen[2] is not worker and seen[2].name == "localchat-compile"
    seen[2].join(10)
    assert not seen[2].is_alive()


def _state(pid: int) -> str:
    """A process's state letter (T: stopped), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def test_a_child_build_stops_while_an_answer_runs(tiny_llama, tmp_path):
    """A package built in a child process: the whole child is stopped (not slowed) while an
    answer runs and goes on after, and the package it leaves loads and checks out."""
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    step = compiled.CompiledStep(eng.target, tmp_path, "child")
    assert step._in_child()
    built = {}
    worker = threading.Thread(target=lambda: built.setdefault("fn", step._build_aot(
        step.cache_dir / "verify-2.so", 2, "default")))
    worker.start()
    wait_until(lambda: builder.running(), 30)
    pid = builder.running()[0]
    compile_worker.pause()
    try:
        wait_until(lambda: _state(pid) == "T")
        time.sleep(0.5)
        assert _state(pid) == "T" and worker.is_alive()
    finally:
        compile_worker.resume()
    wait_until(lambda: _state(pid) not in ("T", ""), 10)
    worker.join(600)
    assert step.built_in == "child" and (step.cache_dir / "verify-2.so").exists()
    assert built["fn"].rows == 2 and step.check_error < 1e-3
    assert not builder.running()


def test_a_failed_child_build_says_why_in_one_line(tiny_llama, tmp_path):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    recipe = dict(eng.target.recipe, path=str(tmp_path / "gone"))
    with pytest.raises(RuntimeError) as err:
        builder.build(recipe, tmp_path / "step.so", "default", 1, private_cache=True)
    assert "gone" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "step.so").exists() and not builder.running()


def test_a_child_build_ends_with_the_chat(tiny_llama, tmp_path):
    """A process that leaves without cleaning up (os._exit) takes its build with it: no
    compiler keeps a core busy after the chat is gone."""
    script = f"""
import os, sys, threading, time
sys.path.insert(0, {str(Path(engine.__file__).parent.parent)!r})
import engine
from engine.compile import builder
eng = engine.open({str(tiny_llama)!r}, dtype="float32", drafter="none")
from pathlib import Path
threading.Thread(target=builder.build, args=(eng.target.recipe, Path({str(tmp_path)!r}) / "step.so", "default", 1, True),
                 daemon=True).start()
while not builder.running():
    time.sleep(0.05)
print(builder.running()[0], flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    child = int(out.stdout.split()[-1])
    wait_until(lambda: _state(child) in ("", "Z"), 15)
