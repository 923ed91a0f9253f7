"""Building a compiled package in a child process (issue 7), on a CPU.

A build takes minutes, and the chat goes on meanwhile. Built in the chat's own process it
competed with the answers three ways: for the GIL (the compiler is Python most of the
time), for the cores (inductor's C++ compiler runs in subprocesses nothing could park),
and through OpenMP (the thread that builds keeps a team of its own, and with two teams on
a two-core machine libgomp sleeps between parallel regions instead of spinning). Measured
on the demo model, two cores, float32, while a build was under way: eager decoding at
19-22 tok/s and the first token after 120-140 ms, against 37 tok/s and 67 ms with no build.

A child process loads the same checkpoint the same way (the target's `recipe`), builds the
package at the path it is given, and exits. While an answer runs the whole child process
group is stopped (SIGSTOP: every compiler process with it) and continued after, so an
answer gets the machine the build would otherwise share, and the child runs at a lower
priority so the chat's screen stays quick. The parent loads and checks the package as
before (engine/compile/step.py). The child leaves when the parent does: a stopped child is sent
SIGHUP by the kernel when its group is orphaned, a running one watches its parent.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_children: set[subprocess.Popen] = set()
_stopped = False                       # answers are running: children are kept stopped
_lock = threading.Lock()
NICE = 10


def room_needed(weight_bytes: int) -> int:
    """Memory a child build needs besides the chat's: its own copy of the weights, and the
    folded (repacked) copy it builds into the package."""
    return int(weight_bytes * 2.2) + (512 << 20)


def build(recipe: dict, path: Path, mode: str, rows: int, private_cache: bool, against: Path | None = None) -> dict:
    """Build the package of a pass of `rows` positions at `path` in a child process; returns
    when it is there, with how its timings went (quiet.Record.as_dict) and, for a step,
    the child's race of it ("race": race.quietly's figures of [eager, the new step, and
    the package `against` when given and there is room for both]; None when never quiet),
    and raises RuntimeError with the child's reason when it is not."""
    from . import exported
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = {"recipe": recipe, "path": str(path), "mode": mode, "rows": rows, "private_cache": private_cache,
            "parent": os.getpid(), "against": str(against) if against else None}
    fd, err_name = tempfile.mkstemp(prefix=f"localchat-build-{os.getpid()}-", suffix=".err")
    os.close(fd)
    spec["error_file"] = err_name
    spec["report_file"] = err_name + ".json"
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)    # where `engine` is importable from
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        with open(os.devnull, "wb") as null:
            proc = subprocess.Popen([sys.executable, "-m", "engine.compile.builder", json.dumps(spec)],
                                    stdin=subprocess.DEVNULL, stdout=null, stderr=null, env=env,
                                    process_group=0)   # its own group (signals reach its compilers), same session
            _adopt(proc)
            try:
                rc = proc.wait()
            finally:
                _disown(proc)
        if rc != 0:
            why = Path(err_name).read_text().strip() if os.path.getsize(err_name) else ""
            raise RuntimeError(why or f"the build process ended with status {rc}")
        if not path.exists():
            raise RuntimeError("the build process left no package")
        try:
            return json.loads(Path(spec["report_file"]).read_text())
        except (OSError, ValueError):
            return {}
    finally:
        os.unlink(err_name)
        Path(spec["report_file"]).unlink(missing_ok=True)
        exported._sweep(path.parent)              # what a killed child left


def _adopt(proc: subprocess.Popen) -> None:
    with _lock:
        _children.add(proc)
        if _stopped:
            _signal(proc, signal.SIGSTOP)


def _disown(proc: subprocess.Popen) -> None:
    with _lock:
        _children.discard(proc)
    if proc.poll() is None:                       # the parent gave up on it: the whole group goes
        _signal(proc, signal.SIGKILL)
        proc.wait()


def stop() -> None:
    """Stop every build (an answer starts)."""
    _hold(True, signal.SIGSTOP)


def go_on() -> None:
    """Continue every build (no answer runs)."""
    _hold(False, signal.SIGCONT)


def _hold(stopped: bool, sig: int) -> None:
    global _stopped
    with _lock:
        _stopped = stopped
        for proc in _children:
            _signal(proc, sig)


def running() -> list[int]:
    """Process ids of the builds under way."""
    with _lock:
        return [p.pid for p in _children]


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _kill_all() -> None:
    with _lock:
        for proc in _children:
            _signal(proc, signal.SIGKILL)


# ---------------------------------------------------------------- the child

def load(recipe: dict):
    """The target a recipe describes (what load_resident / load_quantized recorded)."""
    import torch
    device = torch.device(recipe["device"])
    if recipe["loader"] == "quantized":
        from ..targets.quantized import load_quantized
        return load_quantized(Path(recipe["path"]), device, recipe["weights"], group_size=recipe["group_size"],
                              act_dtype=getattr(torch, recipe["act_dtype"]), embeddings=recipe["embeddings"],
                              cache_dir=Path(recipe["cache_dir"]) if recipe["cache_dir"] else None)
    from ..targets.resident import load_resident
    return load_resident(Path(recipe["path"]), device, getattr(torch, recipe["dtype"]), fast=recipe["fast"])


def _watch_parent(pid: int) -> None:
    def watch():
        while os.getppid() == pid:
            time.sleep(0.5)
        os._exit(3)                               # the chat is gone: nobody waits for this build
    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    _watch_parent(spec["parent"])
    os.nice(NICE)
    try:
        from . import exported, quiet
        target = load(spec["recipe"])
        impl = target.impl
        exported.as_parameters(impl)
        impl._rope(0, target.cache.capacity, impl.norm)
        # The chat that started this build is not "others": its answers stop the build.
        with quiet.steady_timings(exclude=(spec["parent"],)) as record:
            exported.build(impl, target.cache.k + target.cache.v, Path(spec["path"]), spec["mode"],
                           private_cache=spec["private_cache"], rows=spec["rows"])
        report = record.as_dict()
        if spec["rows"] == 1:
            try:
                report["race"] = _race(target, spec)
            except Exception as exc:          # the package is built: only its proof is missing
                report["race"], report["race_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
        Path(spec["report_file"]).write_text(json.dumps(report))
    except BaseException as exc:              # the parent reports it (one line) and falls back
        text = str(exc).strip()
        Path(spec["error_file"]).write_text(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
        return 1
    return 0


def _race(target, spec: dict) -> dict | None:
    """Race the step just built (and the live one it may replace, if there is room for
    both) against the eager step, here, where this main thread is the only OpenMP team
    (engine/compile/race.py says why that matters)."""
    from . import exported, quiet, race
    from .. import hardware
    fns = [None, exported.Package(Path(spec["path"]), 1)]
    old = Path(spec["against"]) if spec.get("against") else None
    free = hardware.available_memory(target.device)
    if old is not None and old.exists() and (free is None or free > target.weight_bytes() * 1.2):
        fns.append(exported.Package(old, 1))
    try:
        with quiet.counting_stops():
            # A few tries: a child that finds no quiet moment leaves the step unproven (a build
            # under load is rebuilt anyway) rather than keep the chat waiting for its package.
            return race.quietly(target.impl, fns, target.weight_bytes(), exclude=(spec["parent"],), tries=3)
    finally:
        for f in fns[1:]:
            f.release_files()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
