import os
import sys
from pathlib import Path

import pytest

import engine.openmp  # noqa: F401  (before tiny imports torch: the spin setting the CLI gets)

sys.path.insert(0, str(Path(__file__).parent))
from tiny import build_model, build_tokenizer  # noqa: E402


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


