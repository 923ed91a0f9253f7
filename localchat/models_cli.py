"""`localchat models`: the models on this machine and what localchat derived from them.

    localchat models                  # list: where each lives, its size, its caches, the profile here
    localchat models pull REPO        # download a hub model, nothing else
    localchat models rm NAME          # the model and every cache derived from it (asks; --yes)
    localchat models prune            # derived caches whose model is gone (asks; --yes)

Models are the Hugging Face cache's model repos, the GGUF files localchat imported, and the
configured model where it is a local folder (its folder is never deleted: `rm` removes
what localchat derived from it). Sizes are what `du` counts."""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import config
from .argparsing import Parser
from .common import EXIT_OK, EXIT_USAGE, error, load_settings
from .format import human_bytes


@dataclass
class Model:
    name: str
    where: str                 # "hf cache", "gguf import", "local folder"
    folder: Path               # what rm deletes (a local folder: nothing of it)
    checkpoint: Path | None    # the folder with config.json and the weights
    size: int
    derived: list[Path] = field(default_factory=list)
    derived_size: int = 0
    last_used: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat models", description="The models on this machine and the caches derived from them.")
    p.add_argument("--model", help=argparse.SUPPRESS)        # the configured model, as elsewhere
    sub = p.add_subparsers(dest="command")
    ls = sub.add_parser("list", help="every model, its size and caches, the profile the planner picks here (default)")
    for q in (p, ls):
        q.add_argument("--json", action="store_true", help="the list as JSON, sizes in bytes")
    pull = sub.add_parser("pull", help="download a hub model (config, tokenizer, safetensors) and nothing else, "
                                       "or one quant of a GGUF repo as REPO:QUANT (its split parts too)")
    pull.add_argument("repo", metavar="REPO[:QUANT]")
    rm = sub.add_parser("rm", help="remove a model and every cache derived from it")
    rm.add_argument("name", metavar="NAME", help="as `localchat models` lists it")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask")
    prune = sub.add_parser("prune", help="remove derived caches whose model is gone")
    prune.add_argument("--yes", "-y", action="store_true", help="do not ask")
    return p


def models_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    settings = load_settings(argparse.Namespace(model=args.model, draft_model=None))
    if settings is None:
        return EXIT_USAGE
    from engine.errors import EngineError
    try:
        if args.command == "pull":
            from .hub import fetch
            path = fetch(args.repo, check_hub=True)
            print(f"{args.repo}: {path}")
            return EXIT_OK
        models = find_models(settings.model)
        if args.command == "rm":
            return remove(models, args.name, args.yes)
        if args.command == "prune":
            return prune(models, args.yes)
        return list_models(models, args.json)
    except EngineError as exc:
        error(str(exc))
        return EXIT_USAGE
    except BrokenPipeError:            # the reader went away (`| head`): not an error of ours
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def find_models(configured: str | None) -> list[Model]:
    from engine import caches
    out = []
    try:
        from huggingface_hub import scan_cache_dir
        repos = [r for r in scan_cache_dir().repos if r.repo_type == "model"]
    except Exception:          # noqa: BLE001 — no cache yet (CacheNotFound), or an unreadable one
        repos = []
    for r in repos:
        snaps = sorted((rev for rev in r.revisions), key=lambda rev: rev.last_modified, reverse=True)
        ckpt = next((Path(s.snapshot_path) for s in snaps if (Path(s.snapshot_path) / "config.json").is_file()), None)
        out.append(Model(r.repo_id, "hf cache", Path(r.repo_path), ckpt, caches.disk_bytes(Path(r.repo_path)),
                         last_used=r.last_accessed))
    for folder, source in caches.imports():
        out.append(Model(Path(source).name, "gguf import", folder, folder, caches.disk_bytes(folder),
                         last_used=caches.last_used(folder)))
    local = Path(configured).expanduser() if configured else None
    if local is not None and (local / "config.json").is_file():
        out.append(Model(str(local), "local folder", local, local, caches.disk_bytes(local),
                         last_used=caches.last_used(local)))
    for m in out:
        if m.checkpoint is not None:
            m.derived = caches.derived(m.checkpoint, resume_dir=config.resume_dir())
            m.derived_size = sum(caches.disk_bytes(p) for p in m.derived)
    return out


def _profile_here(ckpt: Path | None, hw, bw) -> str:
    """The profile engine.open would pick here for a 4096-token context."""
    if ckpt is None:
        return "–"
    import engine
    from engine import checkpoint, planner, profiles
    from engine.errors import EngineError
    from engine.targets.gguf_target import gguf_why_not
    try:
        gguf = checkpoint.gguf_source(ckpt)          # a GGUF import: planned from its file
        if gguf is not None and gguf.is_file():
            shape, why = planner.ModelShape.from_gguf(gguf, ckpt), gguf_why_not(gguf)
        else:
            shape, why = planner.ModelShape.from_checkpoint(ckpt), ""
        every = profiles.builtin()
        plan = planner.make_plan(shape, hw, every, context=4096, runnable=engine.runnable(every, shape, why),
                                 bandwidth=bw)
    except (EngineError, OSError, ValueError) as exc:
        return f"unreadable ({str(exc).splitlines()[0][:40]})"
    return plan.chosen or "does not fit"


def _format(ckpt: Path | None) -> str:
    """How a model's weights are stored: a GGUF file's block formats (the most used first),
    or the dtype of a safetensors checkpoint."""
    if ckpt is None:
        return "–"
    from collections import Counter

    from engine import checkpoint
    gguf = checkpoint.gguf_source(ckpt)
    try:
        if gguf is not None:
            from engine.gguf_reader import read
            _, tensors = read(gguf)
            kinds = Counter(t.kind for t in tensors.values() if len(t.shape) >= 2)
            return "GGUF " + "+".join(k for k, _ in kinds.most_common(2))
        from engine.targets.resident import checkpoint_dtype
        return str(checkpoint_dtype(ckpt)).removeprefix("torch.")
    except (OSError, ValueError) as exc:
        return f"unreadable ({str(exc).splitlines()[0][:30]})"


def list_models(models: list[Model], as_json: bool = False) -> int:
    from engine import bandwidth, caches, checkpoint, hardware
    if as_json:
        import json
        hw = hardware.detect(checkpoint.default_cache_dir())
        bw = bandwidth.rates(bandwidth.measured(checkpoint.default_cache_dir(), hardware.pick_device(hw.device)))
        print(json.dumps([{"name": m.name, "where": m.where, "folder": str(m.folder), "bytes": m.size,
                           "derived": {str(p): caches.disk_bytes(p) for p in m.derived},
                           "derived_bytes": m.derived_size, "last_used": m.last_used, "format": _format(m.checkpoint),
                           "profile": _profile_here(m.checkpoint, hw, bw)} for m in models], indent=1))
        return EXIT_OK
    if not models:
        print("no models yet: `localchat setup` recommends one, `localchat models pull REPO` downloads one",
              file=sys.stderr)
        return EXIT_OK
    hw = hardware.detect(checkpoint.default_cache_dir())
    bw = bandwidth.rates(bandwidth.measured(checkpoint.default_cache_dir(), hardware.pick_device(hw.device)))
    width = max(24, *(len(m.name) for m in models))
    formats = [_format(m.checkpoint) for m in models]
    fw = max(14, *(len(f) for f in formats))
    print(f"{'model':{width}}  {'where':12}  {'format':{fw}}  {'size':>8}  {'derived':>8}  {'last used':16}  profile here")
    for m, fmt in zip(models, formats):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(m.last_used)) if m.last_used else "–"
        print(f"{m.name:{width}}  {m.where:12}  {fmt:{fw}}  {human_bytes(m.size):>8}  "
              f"{human_bytes(m.derived_size):>8}  {used:16}  {_profile_here(m.checkpoint, hw, bw)}")
    kernels = checkpoint.default_cache_dir() / "kernels"
    total = sum(m.size + m.derived_size for m in models if m.where != "local folder")
    print(f"\n{len(models)} models; {human_bytes(total)} in the caches, and {human_bytes(caches.disk_bytes(kernels))} of "
          "kernel builds shared by all (`localchat models rm NAME`, `localchat models prune`)")
    return EXIT_OK


def _remove_after_asking(question: str, yes: bool, command: str, paths: list[Path], done: str) -> int:
    """Removing is for good: ask on a terminal (unless --yes), refuse where nobody can answer."""
    if not yes:
        if not sys.stdin.isatty():
            error(f"{command}: add --yes to remove without a terminal to confirm")
            return EXIT_USAGE
        if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return EXIT_OK
    _delete(paths)
    print(done, file=sys.stderr)
    return EXIT_OK


def _delete(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def remove(models: list[Model], name: str, yes: bool) -> int:
    match = [m for m in models if name in (m.name, str(m.folder), str(m.checkpoint))]
    if not match:
        error(f"models rm {name}: no such model here (`localchat models` lists them)")
        return EXIT_USAGE
    m = match[0]
    paths = list(m.derived) + ([] if m.where == "local folder" else [m.folder])
    size = m.derived_size + (0 if m.where == "local folder" else m.size)
    what = "its derived caches (the folder itself stays)" if m.where == "local folder" else "it and its caches"
    return _remove_after_asking(f"Remove {m.name} ({m.where}): {what}, {human_bytes(size)}?", yes,
                                f"models rm {name}", paths, f"removed {m.name}: {human_bytes(size)} freed")


def prune(models: list[Model], yes: bool) -> int:
    from engine import caches
    stale = caches.orphans([m.checkpoint for m in models if m.checkpoint is not None], resume_dir=config.resume_dir())
    if not stale:
        print("nothing to prune: every derived cache belongs to a model here", file=sys.stderr)
        return EXIT_OK
    size = sum(caches.disk_bytes(p) for p in stale)
    for p in stale:
        print(f"  {p}  {human_bytes(caches.disk_bytes(p))}")
    return _remove_after_asking(f"Remove these {len(stale)} caches, {human_bytes(size)}?", yes, "models prune",
                                stale, f"pruned {len(stale)} caches: {human_bytes(size)} freed")
