"""`localchat models` as a user runs it (the CLI as a subprocess) over a Hugging Face cache
laid out as huggingface_hub lays it out (blobs, snapshots of symbolic links, refs) and a
localchat cache with a model's quantized copy and a stale one, and a kept conversation's cache (and a
stale one) in the resume store: the list names each model,
where it lives, its size and its caches' as `du` counts them, and the profile the planner
picks; `rm` removes a model with its caches and asks first; `prune` removes what no model
owns."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine


def _hf_cache(root: Path, repo: str, src: Path) -> Path:
    """src's files as the snapshot of `repo` in a hub cache at root; the snapshot folder."""
    folder = root / ("models--" + repo.replace("/", "--"))
    rev = hashlib.sha1(repo.encode()).hexdigest()
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(rev)
    snap = folder / "snapshots" / rev
    snap.mkdir(parents=True)
    (folder / "blobs").mkdir()
    for f in src.iterdir():
        blob = folder / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def _du(path: Path) -> int:
    return int(subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _cli(env, *args, stdin=subprocess.DEVNULL):
    return subprocess.run([sys.executable, "-m", "localchat", "models", *args], capture_output=True, text=True,
                          env=env, stdin=stdin, timeout=300)


@pytest.fixture
def setup(tmp_path, tiny_llama):
    hub, cache = tmp_path / "hub", tmp_path / "cache"
    snap = _hf_cache(hub, "someone/tiny", tiny_llama)
    eng = engine.open(str(snap), profile="resident-int4", drafter="none", cache_dir=cache)     # its quantized copy
    eng.resume = engine.ResumeStore(tmp_path / "data" / "resume", 1 << 30)        # and a conversation's cache
    chat = eng.chat()
    list(chat.send("the cat sat on the mat " * 12, max_new_tokens=4))
    assert chat.keep()
    (tmp_path / "data" / "resume" / "0123456789abcdef-01234567-00000100-0123.safetensors").write_bytes(b"\0" * 50_000)
    stale = cache / "quantized" / "gone-0123456789ab-int4-g32-bfloat16"
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text(json.dumps({"settings": {"source": "no such model"}, "files": {}}))
    (stale / "layer-0000.safetensors").write_bytes(b"\0" * 100_000)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), LOCALCHAT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1",
               LOCALCHAT_CONFIG_DIR=str(tmp_path / "config"), LOCALCHAT_DATA_DIR=str(tmp_path / "data"))
    return env, hub / "models--someone--tiny", cache, stale


def test_list_names_each_model_with_its_size_and_caches_as_du_counts_them(setup):
    env, repo, cache, stale = setup
    got = _cli(env, "--json")
    assert got.returncode == 0, got.stderr
    [m] = [m for m in json.loads(got.stdout) if m["name"] == "someone/tiny"]
    assert m["where"] == "hf cache" and m["bytes"] == _du(repo)
    [quantized, kept] = m["derived"]
    assert "int4" in quantized and "/resume/" in kept
    assert m["derived_bytes"] == _du(Path(quantized)) + _du(Path(kept)) > _du(Path(quantized))
    assert m["profile"] == "resident-exact" and m["format"] == "float32"
    table = _cli(env)
    assert table.returncode == 0 and "someone/tiny" in table.stdout and "hf cache" in table.stdout


def test_rm_asks_first_and_removes_the_model_with_its_caches_and_prune_the_rest(setup):
    env, repo, cache, stale = setup
    quantized = [p for p in (cache / "quantized").iterdir() if p != stale]
    resume = cache.parent / "data" / "resume"
    [kept] = [p for p in resume.iterdir() if not p.name.startswith("0123")]
    [stale_kept] = [p for p in resume.iterdir() if p.name.startswith("0123")]
    no_terminal = _cli(env, "rm", "someone/tiny")
    assert no_terminal.returncode == 2 and "--yes" in no_terminal.stderr and len(no_terminal.stderr.splitlines()) == 1
    assert repo.is_dir()
    assert _cli(env, "rm", "nobody/else", "--yes").returncode == 2
    done = _cli(env, "rm", "someone/tiny", "--yes")
    assert done.returncode == 0 and "removed someone/tiny" in done.stderr, done.stderr
    assert not repo.exists() and not any(p.exists() for p in quantized) and not kept.exists() and stale.is_dir()
    pruned = _cli(env, "prune", "--yes")
    assert pruned.returncode == 0 and str(stale) in pruned.stdout and not stale.exists()
    assert str(stale_kept) in pruned.stdout and not stale_kept.exists()
    again = _cli(env, "prune", "--yes")
    assert again.returncode == 0 and "nothing to prune" in again.stderr


def test_pull_offline_is_one_line(setup):
    env, *_ = setup
    got = _cli(env, "pull", "someone/not-here")
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1 and "someone/not-here" in got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.demo
def test_a_gguf_import_lists_its_block_formats_and_runs_as_stored(tmp_path):
    from engine import checkpoint
    cache = tmp_path / "cache"
    checkpoint.import_gguf(checkpoint.demo_gguf_path(), cache)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), LOCALCHAT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1",
               LOCALCHAT_CONFIG_DIR=str(tmp_path / "config"), LOCALCHAT_DATA_DIR=str(tmp_path / "data"))
    got = _cli(env, "--json")
    assert got.returncode == 0, got.stderr
    [m] = [m for m in json.loads(got.stdout) if m["where"] == "gguf import"]
    assert m["format"] == "GGUF Q4_1+Q8_0" and m["profile"] == "resident-gguf"
