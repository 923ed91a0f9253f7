"""A hub model's shape before its weights are downloaded: its config.json alone (a few
KB through huggingface-hub, from the cache when offline), enough for the planner
(engine.planner.ModelShape.from_config counts Llama-family, hybrid and MoE parameters)."""
from __future__ import annotations

import json


def is_repo_id(name: str | None) -> bool:
    from pathlib import Path
    return bool(name) and name.count("/") == 1 and not name.startswith((".", "/", "~")) \
        and not name.endswith(".gguf") and not Path(name).expanduser().exists()


def cached(repo: str):
    """The repo's complete snapshot in the Hugging Face cache (a Path), or None."""
    from pathlib import Path

    from engine.checkpoint import HUB_PATTERNS, validate_dir
    try:
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_files_only=True))
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
