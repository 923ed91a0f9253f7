"""`localchat setup`: the first-run wizard. It shows what this machine has, how each model
of the catalog would run on it (the profile the planner picks and its predicted speed),
recommends one, asks for a drafter, checks the disk, downloads, and writes the config.

    localchat setup                                   # asks
    localchat setup --yes                             # takes the recommendation
    localchat setup --model Qwen/Qwen3-4B --drafter ngram --yes

The questions go through one `ask(question) -> answer` function (a prompt-toolkit
session by default), so a test drives the wizard through a pipe input."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine import RUNNABLE   # the profiles this engine has targets for: only those are offered

from .argparsing import Parser
from . import catalog, hub
from .hub import cached, fetch, is_local, offline
from . import config as config_mod
from .common import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, error
from .format import human_bytes

DISK_HEADROOM = 1.05          # download sizes are approximate; keep 5% spare
SETTING_KEYS = ("model", "drafter", "draft_model", "profile")
# Below this predicted decode speed a chat feels broken: reading speed is ~5 words (~7
# tokens) a second. `localchat setup --min-tps` or `usable_tps` in config.toml moves it.
USABLE_TPS = config_mod.Settings().usable_tps
# A decode step reaches only part of the bound bytes/bandwidth: the C kernels decoded the
# demo model at 0.67-0.94 of it in float32, bf16 and int8, and int4 at 0.43-0.51, in two
# runs of benchmarks/decode.py (int4 ~0.65 on Qwen3-1.7B's shape). A model is called usable
# when that share of its bound is fast enough.
ACHIEVED = 0.75

Ask = Callable[[str], str]
Say = Callable[[str], None]


class Cancelled(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat setup", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "-m", metavar="REPO_OR_PATH",
                   help="the model to set up: a hub repo id, a local directory or .gguf, or 'demo'")
    p.add_argument("--drafter", metavar="REPO_OR_KIND",
                   help="drafter: a hub repo id or path (a drafter model), 'suggested', 'ngram' or 'none'")
    p.add_argument("--yes", "-y", action="store_true",
                   help="ask nothing: take the recommendation for what --model/--drafter leave open")
    p.add_argument("--device", metavar="DEV", help="cpu, cuda:0, mps (default: the first accelerator, else cpu)")
    p.add_argument("--vram", metavar="SIZE", help="memory the engine may use on the device, e.g. 8GiB")
    p.add_argument("--ram", metavar="SIZE", help="host memory the engine may use, e.g. 32GiB")
    p.add_argument("--context", type=int, default=8192, metavar="N", help="tokens of context to plan for (8192)")
    p.add_argument("--no-build", action="store_true",
                   help="do not build the C kernels for this CPU now (the first chat then builds them)")
    p.add_argument("--min-tps", type=float, metavar="T",
                   help="the decode speed a recommendation must reach, in tokens/s (default: usable_tps, 10)")
    return p


# ---------------------------------------------------------------- planning the catalog

@dataclass
class Option:
    model: catalog.CatalogModel
    profile: str | None          # the profile to run it with, None if nothing fits
    placement: str | None        # resident | streamed
    tps: float                   # that profile's predicted decode bound (bytes per token / measured bandwidth)
    params: int
    usable: bool = False         # tps reaches the usable speed
    auto: str | None = None      # what the planner picks on its own (by exactness), if different


def plan_catalog(hw, profiles, context: int = 8192, bandwidth: dict | None = None,
                 usable_tps: float = USABLE_TPS) -> list[Option]:
    """Each catalog model on this machine: the most exact runnable profile that fits and
    is predicted to decode at `usable_tps` or more (ACHIEVED of its bound); if none is
    that fast, the fastest that fits (marked not usable)."""
    from engine.planner import make_plan
    by_name = {p.name: p for p in profiles}
    out = []
    for m in catalog.CATALOG:
        shape = m.shape()
        plan = make_plan(shape, hw, profiles, context=context, runnable=RUNNABLE, bandwidth=bandwidth)
        fitting = [r for r in plan.rows if r.fits and r.profile in RUNNABLE]     # rows are in rank order
        fast = [r for r in fitting if r.tps_bound * ACHIEVED >= usable_tps]
        row = fast[0] if fast else max(fitting, key=lambda r: r.tps_bound, default=None)
        if row is None:
            out.append(Option(m, None, None, 0.0, shape.params))
            continue
        out.append(Option(m, row.profile, by_name[row.profile].placement, row.tps_bound, shape.params,
                          usable=bool(fast), auto=plan.chosen if plan.chosen != row.profile else None))
    return out


def recommend(options: list[Option]) -> Option:
    """The largest model predicted to decode at a usable speed (a profile that fits and
    streaming included: what matters is the speed a person gets); the demo model if none is."""
    usable = [o for o in options if o.usable]
    if not usable:
        return next(o for o in options if o.model.repo is None)
    return max(usable, key=lambda o: (o.params, o.model.repo is not None))


def format_options(options: list[Option], rec: Option) -> str:
    lines = [f"    {'model':<44} {'download':>9} {'profile':<15} {'tok/s ≤':>8}"]
    for i, o in enumerate(options, 1):
        mark = "→" if o is rec else " "
        size = human_bytes(o.model.download_bytes) if o.model.download_bytes else "–"
        profile = o.profile or "does not fit"
        slow = "  too slow here" if o.profile and not o.usable else ""
        lines.append(f"{mark}{i:>2}. {o.model.label[:44]:<44} {size:>9} {profile:<15} {o.tps:>8.1f}{slow}")
    lines.append(f" {len(options) + 1:>2}. another model: type a Hugging Face repo id or a local path")
    return "\n".join(lines)


# ---------------------------------------------------------------- downloads



def remote_size(repo: str) -> int | None:
    """Bytes of the files setup would fetch, from the hub's file list; None if unknown."""
    if offline():
        return None
    try:
        from huggingface_hub import HfApi
        from engine.download import wanted
        info = HfApi().model_info(repo, files_metadata=True, timeout=10)
        return sum(s.size or 0 for s in info.siblings or [] if wanted(s.rfilename))
    except Exception:
        return None


# ---------------------------------------------------------------- the wizard

@dataclass
class Answers:
    model: str | None = None     # repo, path or 'demo'
    drafter: str | None = None   # repo/path, 'suggested', 'ngram', 'none'
    yes: bool = False


def run_wizard(hw, profiles, ask: Ask, say: Say = print, answers: Answers | None = None,
               context: int = 8192, path: Path | None = None, fetch_model: Callable[[str], Path] = fetch,
               bandwidth: dict | None = None, usable_tps: float = USABLE_TPS,
               build_kernels: Callable[[], object] | None = None) -> int:
    """The whole wizard; returns the exit code. `ask` raises EOFError/KeyboardInterrupt to cancel.
    `build_kernels()`, when given, builds the C kernels once the config is written."""
    from engine.errors import EngineError, ModelNotFound
    from .doctor import _hw_text
    answers = answers or Answers()
    try:
        say(_hw_text(hw))
        options = plan_catalog(hw, profiles, context, bandwidth, usable_tps)
        rec = recommend(options)
        # --- the model
        if answers.model:
            choice = answers.model.strip()
        elif answers.yes:
            choice = rec.model.key
        else:
            say(f"\nModels (→ recommended: the largest predicted to decode at {usable_tps:g} tok/s or more "
                "here; tok/s ≤ is the predicted decode bound from this machine's measured memory speed):")
            say(format_options(options, rec))
            choice = _ask_model(ask, say, options, rec)
        entry = catalog.find(choice)
        model = None if choice.lower() == catalog.DEMO_ID else (str(Path(choice).expanduser().resolve())
                                                                 if is_local(choice) else choice)
        if entry is not None and model is not None:
            model = entry.repo
        # A catalog model whose usable profile is not the one the planner picks by
        # exactness (a quantized one, for speed) gets it written down; else auto.
        picked = next((o for o in options if entry is not None and o.model is entry), None)
        profile = picked.profile if picked is not None and picked.auto is not None else None
        # --- the drafter
        suggested = entry.drafter if entry else None
        if answers.drafter:
            drafter_choice = answers.drafter.strip()
        elif answers.yes or model is None:
            drafter_choice = "suggested" if suggested else "ngram"
        else:
            drafter_choice = _ask_drafter(ask, say, suggested)
        drafter, draft_model = _drafter_settings(drafter_choice, suggested)
        # --- a hub model the catalog does not know: planned from its config.json before
        # anything large is fetched
        if entry is None and model is not None and hub.is_repo_id(model) and cached(model) is None:
            shape, why = hub.config_shape(model)
            if shape is None:
                say(f"{model}: {why}; it is planned once downloaded (`localchat doctor`).")
            else:
                from engine.planner import make_plan
                plan = make_plan(shape, hw, profiles, context=context, runnable=RUNNABLE, bandwidth=bandwidth)
                say(f"{model}: {shape.params / 1e9:.2f} B parameters (its config.json): {plan.reason}")
                if plan.chosen is None:
                    error(f"{model} does not fit this machine: {plan.reason} Pick a smaller model; nothing written")
                    return EXIT_FAIL
        # --- the disk
        need = 0
        for name in (model, draft_model):
            if name and not is_local(name) and cached(name) is None:
                known = catalog.find(name)
                size = known.download_bytes if known else remote_size(name)
                if size is None:
                    say(f"The download size of {name} is unknown; make sure there is room for it.")
                need += size or 0
        if need and need * DISK_HEADROOM > hw.disk_free_bytes:
            error(f"not enough disk space: the download needs about {human_bytes(need)}, "
                  f"{human_bytes(hw.disk_free_bytes)} is free at {hw.disk_path}; "
                  "free some space or choose a smaller model")
            return EXIT_FAIL
        # --- confirm
        what = (model or catalog.find(None).label) + (f" ({profile}, for speed)" if profile else "")
        drafting = f"drafter {draft_model}" if draft_model else f"drafter {drafter}"
        if not answers.yes:
            dl = f", download about {human_bytes(need)}" if need else ""
            if not _yes(ask(f"Set up {what} with {drafting}{dl}? [Y/n] ")):
                say("Nothing written.")
                return EXIT_OK
        # --- download
        if model is not None:
            try:
                fetch_model(model)
            except EngineError as exc:
                if answers.yes:
                    error(f"{exc}; nothing written (`localchat setup --model demo --yes` sets up the bundled "
                          "demo model)")
                    return EXIT_USAGE if isinstance(exc, ModelNotFound) else EXIT_FAIL
                say(f"{exc}; the bundled demo model needs no download.")
                if not _yes(ask("Use the demo model instead? [Y/n] ")):
                    say("Nothing written.")
                    return EXIT_FAIL
                model, entry, profile = None, catalog.find(None), None
                if draft_model:
                    drafter, draft_model = "ngram", None
        if draft_model:
            try:
                fetch_model(draft_model)
            except EngineError as exc:
                say(f"{exc}; using the ngram drafter instead.")
                drafter, draft_model = "ngram", None
        # --- the config
        written, backup = write_config(model, drafter, draft_model, path, profile)
        say(f"\nWrote {written}" + (f" (the previous one is kept as {backup})" if backup else ""))
        if build_kernels is not None:
            build_kernels()
        say("Start chatting with: localchat")
        return EXIT_OK
    except (EOFError, KeyboardInterrupt, Cancelled):
        say("\nCancelled; nothing written.")
        return EXIT_INTERRUPTED


def write_config(model: str | None, drafter: str, draft_model: str | None,
                 path: Path | None = None, profile: str | None = None) -> tuple[Path, Path | None]:
    """Save the three settings (other keys already in the file stay); an existing file is
    first copied to config.toml.bak. The write itself is atomic (config.save)."""
    path = path or config_mod.config_path()
    backup = None
    if path.is_file():
        backup = path.with_suffix(".toml.bak")
        shutil.copy2(path, backup)
    written = config_mod.save(config_mod.Settings(model=model, drafter=drafter, draft_model=draft_model,
                                                  profile=profile), path, keys=SETTING_KEYS)
    return written, backup


def _ask_model(ask: Ask, say: Say, options: list[Option], rec: Option) -> str:
    default = options.index(rec) + 1
    for _ in range(5):
        answer = ask(f"Model [1-{len(options) + 1}, Enter = {default}]: ").strip()
        if not answer:
            return rec.model.key
        if answer.isdigit():
            n = int(answer)
            if 1 <= n <= len(options):
                return options[n - 1].model.key
            if n == len(options) + 1:
                typed = ask("Hugging Face repo id (owner/name) or local path: ").strip()
                if typed:
                    return typed
                continue
            say(f"Pick a number from 1 to {len(options) + 1}.")
            continue
        return answer             # a repo id or a path typed straight away
    raise Cancelled


def _ask_drafter(ask: Ask, say: Say, suggested: str | None) -> str:
    choices = ([("suggested", f"{suggested} (same tokenizer; speeds up decoding)")] if suggested else []) + [
        ("ngram", "ngram: prompt lookup, free, no extra memory"), ("none", "none: no speculative decoding")]
    say("\nDrafter (proposes tokens the model verifies; never changes the answer):")
    for i, (_, text) in enumerate(choices, 1):
        say(f"  {i}. {text}")
    for _ in range(5):
        answer = ask(f"Drafter [1-{len(choices)} or a repo id, Enter = 1]: ").strip()
        if not answer:
            return choices[0][0]
        if answer.isdigit() and 1 <= int(answer) <= len(choices):
            return choices[int(answer) - 1][0]
        if answer.isdigit():
            say(f"Pick a number from 1 to {len(choices)}.")
            continue
        return answer
    raise Cancelled


def _drafter_settings(choice: str, suggested: str | None) -> tuple[str, str | None]:
    kind = choice.lower()
    if kind in ("ngram", "none"):
        return kind, None
    if kind in ("suggested", "auto", "model"):
        return ("model", suggested) if suggested else ("ngram", None)
    known = catalog.find(choice)
    name = known.repo if known and known.repo else (str(Path(choice).expanduser().resolve())
                                                    if is_local(choice) else choice)
    return "model", name


def _yes(answer: str) -> bool:
    return answer.strip().lower() in ("", "y", "yes")


def prompt_asker(session=None) -> Ask:
    """An `ask` on a prompt-toolkit session (a test passes one with a pipe input)."""
    if session is None:
        from prompt_toolkit import PromptSession
        session = PromptSession()
    return lambda question: session.prompt(question)


def setup_main(argv: list[str]) -> int:
    from engine import EngineError, hardware, profiles

    args = build_parser().parse_args(argv)
    base, warnings = config_mod.load()
    for w in warnings:
        error(w)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from huggingface_hub import constants
        hub_cache = Path(constants.HF_HUB_CACHE)
    except Exception:
        hub_cache = None
    try:
        hw = hardware.detect(hub_cache, vram=args.vram, ram=args.ram,
                             device=args.device or (base.device if base.device != "auto" else None))
        profs = profiles.load_all(config_mod.config_dir() / "profiles")
    except EngineError as exc:
        error(str(exc))
        return EXIT_USAGE
    answers = Answers(args.model, args.drafter, args.yes)
    interactive = not args.yes and sys.stdin.isatty()
    if not args.yes and not interactive:
        error("setup asks questions: run it in a terminal, or pass --yes (with --model/--drafter to choose)")
        return EXIT_USAGE
    ask = prompt_asker() if interactive else _no_questions
    from engine import bandwidth
    from engine.checkpoint import default_cache_dir
    measured = bandwidth.measured(default_cache_dir(), hardware.pick_device(hw.device))
    if measured.get("busy"):
        from .doctor import busy_note
        print(f"Memory read rate: {measured['cpu'] / 1e9:.1f} GB/s ({busy_note(measured)}); "
              "the predicted speeds below rest on it")
    read = bandwidth.rates(measured)
    usable = args.min_tps if args.min_tps is not None else base.usable_tps
    if not usable > 0:
        error(f"--min-tps {usable}: must be a positive speed")
        return EXIT_USAGE
    try:
        return run_wizard(hw, profs, ask, print, answers, context=args.context, bandwidth=read, usable_tps=usable,
                          build_kernels=None if args.no_build else _build_kernels)
    except (EngineError, config_mod.ConfigError) as exc:
        error(str(exc))
        return EXIT_USAGE


def _build_kernels() -> None:
    from . import prebuild
    prebuild.build()


def _no_questions(question: str) -> str:
    raise Cancelled
