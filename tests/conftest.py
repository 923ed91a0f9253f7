import os
import sys
import time
from pathlib import Path

import pytest

import engine.openmp  # noqa: F401  (before tiny imports torch: the spin setting the CLI gets)

sys.path.insert(0, str(Path(__file__).parent))
from tiny import build_model, build_tokenizer  # noqa: E402


def _children() -> list[str]:
    """This process's live child processes (not zombies), as "pid cmdline"."""
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if state != "Z":
                out.append(f"{pid} {cmd[:120]}")
    return out


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind():
    """After a module's tests and fixtures: no child process still running, and no thread
    that would keep the interpreter alive, so nothing of one module slows or blocks the next."""
    import threading
    threads = set(threading.enumerate())
    yield
    if not Path("/proc/self/task").is_dir():
        return
    deadline = time.monotonic() + 10          # a child being stopped gets a moment to go
    while (left := _children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    import gc
    gc.collect()           # an engine only a reference cycle holds is freed here, and its reader pool ends
    new = [t for t in threading.enumerate() if t not in threads and t.is_alive() and not t.daemon]
    end = time.monotonic() + 10
    while new and time.monotonic() < end:
        time.sleep(0.1)
        new = [t for t in new if t.is_alive()]
    assert not left, f"child processes left running: {left}"
    assert not new, f"threads left running: {[t.name for t in new]}"


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory):
    """Every test run gets its own cache/config/data dirs: nothing of the user's is read or written.
    The demo model's one-time GGUF import lands in the shared cache below (kept across runs)."""
    base = tmp_path_factory.mktemp("localchat")
    cache = os.environ.get("LOCALCHAT_TEST_CACHE") or str(Path(__file__).parent.parent / ".test-cache")
    env = {"LOCALCHAT_CACHE_DIR": cache, "LOCALCHAT_CONFIG_DIR": str(base / "config"),
           "LOCALCHAT_DATA_DIR": str(base / "data"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer=tokenizer)


@pytest.fixture(scope="session")
def tiny_deep(tmp_path_factory, tokenizer):
    """24 layers: deep enough that streaming two layers at a time needs less memory than
    even int4 weights, so the planner picks streaming on a small budget."""
    return build_model(tmp_path_factory.mktemp("tiny-deep"), "llama", layers=24, tie=True, tokenizer=tokenizer, seed=7)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", tokenizer=tokenizer)


@pytest.fixture(scope="session")
def demo_engine():
    import engine
    return engine.open()


