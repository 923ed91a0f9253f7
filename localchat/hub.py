"""A hub model's shape before its weights are downloaded: its config.json alone (a few
KB through huggingface-hub, from the cache when offline), enough for the planner
(engine.planner.ModelShape.from_config counts Llama-family, hybrid and MoE parameters)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def is_repo_id(name: str | None) -> bool:
    return bool(name) and name.count("/") == 1 and not name.startswith((".", "/", "~")) \
        and not name.endswith(".gguf") and not Path(name).expanduser().exists()


def cached(repo: str):
    """The repo's complete snapshot in the Hugging Face cache (a Path), or None."""
    from engine.checkpoint import split_quant, validate_dir
    from engine.download import cached as in_cache
    from engine.download import cached_gguf
    try:
        name, quant = split_quant(repo)
        if quant:                               # one quant of a GGUF repo: its file, all parts there
            return cached_gguf(name, quant)
        path = in_cache(repo)
        if path is None:
            return None
        validate_dir(path)
        return path
    except Exception:           # noqa: BLE001 — not cached, incomplete (engine.CheckpointError), no hub library
        return None


def config_shape(repo: str):
    """(ModelShape, None) planned from the repo's config.json, or (None, why not)."""
    from engine.errors import EngineError
    from engine.planner import ModelShape
    try:
        from huggingface_hub import hf_hub_download
        path = hf_hub_download(repo, "config.json")
    except Exception as exc:   # noqa: BLE001 — offline and not cached, no such repo, gated: say which
        return None, f"its config.json could not be fetched ({type(exc).__name__})"
    try:
        cfg = json.loads(open(path, encoding="utf-8").read())
        return ModelShape.from_config(cfg, repo, where=f"{repo}/config.json"), None
    except (OSError, ValueError) as exc:
        return None, f"its config.json is unreadable ({exc})"
    except EngineError as exc:
        return None, str(exc)


def is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(name: str, check_hub: bool = False, progress=None) -> Path:
    """A local model is validated; a hub repo comes from the cache or is downloaded with one
    progress line on stderr, or `progress(done, total)` (a partial download resumes). Raises
    engine.ModelNotFound offline."""
    from engine import checkpoint
    from engine.errors import ModelNotFound
    from .download_bar import DownloadBar
    if is_local(name):
        return checkpoint.resolve(name).path
    repo, quant = checkpoint.split_quant(name)
    if quant:                                   # one quant of a GGUF repo: its file
        bar = progress or DownloadBar(name)
        try:
            return checkpoint.download_gguf(repo, quant, progress=bar, check_hub=check_hub and not offline())
        finally:
            if progress is None:
                bar.close()
    hit = cached(name) if offline() or not check_hub else None
    if hit:
        return hit
    if offline():
        raise ModelNotFound(f"{name}: not downloaded yet and HF_HUB_OFFLINE is set (offline)")
    # not in the cache (just checked): straight to the hub, whose per-file check keeps what is there
    if progress is not None:
        return checkpoint.download(name, progress=progress, check_hub=True)
    bar = DownloadBar(name)
    try:
        return checkpoint.download(name, progress=bar, check_hub=True)
    finally:
        bar.close()
