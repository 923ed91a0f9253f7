"""`localchat doctor`: what this machine has, and how each profile would run the model on
it — every term of the memory equation, what fits, what is chosen and why."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from .argparsing import Parser
from .common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, SAMPLING, error, load_settings, quiet_libraries, sampling
from .format import human_bytes


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat doctor", description=__doc__)
    p.add_argument("--model", "-m", metavar="PATH_OR_REPO", help="the model to plan for (default: the configured one)")
    p.add_argument("--draft-model", metavar="PATH_OR_REPO",
                   help="a drafter model to count in the plan ('self': a quantized copy of the model)")
    p.add_argument("--drafter-weights", choices=["auto", "exact", "int8", "int4"],
                   help="the drafter's weights (default auto: int4 for self, else exact)")
    p.add_argument("--device", metavar="DEV", help="cpu, cuda:0, mps (default: the first accelerator, else cpu)")
    p.add_argument("--vram", metavar="SIZE", help="memory the engine may use on the device, e.g. 8GiB")
    p.add_argument("--ram", metavar="SIZE", help="host memory the engine may use, e.g. 32GiB")
    p.add_argument("--profile", metavar="NAME", help="force a profile (says by how much it does not fit)")
    p.add_argument("--context", type=int, metavar="N",
                   help="tokens of context to plan for (default: as a chat does, 4096 to pick the profile, then "
                        "the model's own as far as memory holds it)")
    p.add_argument("--measure", action="store_true", help="time host RAM and disk reads and plan with them")
    p.add_argument("--fidelity", action="store_true",
                   help="measure how close int8 and int4 stay to the exact model on a held text; for a .gguf, "
                        "check that its own logits there are finite and not degenerate (loads the model)")
    p.add_argument("--reference", metavar="PATH_OR_REPO",
                   help="with --fidelity on a .gguf: the safetensors checkpoint the file was made from, to compare "
                        "its answers with (default: the repo its metadata names, where that is downloaded)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def measure_bandwidth(folder: Path, size: int = 256 * 2**20) -> dict:
    """The streamed profile's tiers, in bytes/s: pinned host-to-GPU copies (CUDA) and cold
    disk reads (a file written, evicted from the page cache with posix_fadvise, read back).
    Memory's own read rate is engine.bandwidth's probe."""
    import torch
    out = {}
    if torch.cuda.is_available():
        src = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
        # Host -> device from pinned memory: the rate of the streamed profile's RAM tier.
        host = src.pin_memory()
        dev = torch.empty_like(host, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out["host_to_device"] = 4 * size / (time.perf_counter() - t)
        del host, dev
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as fh:
        fh.write(os.urandom(1 << 20) * (size >> 20))
        name = fh.name
    try:
        fd = os.open(name, os.O_RDONLY)
        os.fsync(fd) if hasattr(os, "fsync") else None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        while os.read(fd, 8 << 20):
            pass
        out["disk"] = size / (time.perf_counter() - t)
        os.close(fd)
    finally:
        os.unlink(name)
    return out


def doctor_main(argv: list[str]) -> int:
    import torch

    import engine
    from engine import bandwidth, checkpoint, hardware, planner, profiles

    args = build_parser().parse_args(argv)
    settings = load_settings(argparse.Namespace(model=args.model, draft_model=args.draft_model))
    if settings is None:
        return EXIT_USAGE
    quiet_libraries()
    from localchat.config import config_dir
    try:
        hw = hardware.detect(checkpoint.default_cache_dir(), vram=args.vram, ram=args.ram,
                             device=args.device or (settings.device if settings.device != "auto" else None))
        profs = profiles.load_all(config_dir() / "profiles")
        ckpt, shape, planned_from = _model_shape(settings.model)
        draft, dweights = None, args.drafter_weights or settings.drafter_weights
        if settings.draft_model:
            if settings.draft_model == "self":
                draft = shape
            else:
                draft = _model_shape(settings.draft_model)[1]
            if dweights == "auto":
                dweights = "int4" if settings.draft_model == "self" else "exact"
        elif settings.drafter == "mtp" and shape.mtp_params:
            draft, dweights = shape.mtp_drafter(args.context or min(4096, shape.max_positions or 4096)), "exact"     # the checkpoint's own layer
        read = bandwidth.measured(checkpoint.default_cache_dir(), hardware.pick_device(hw.device),
                                  refresh=args.measure)
        bw = bandwidth.rates(read)
        if args.measure:     # disk and host-to-device too (the streamed tiers); RAM is the read probe's
            bw.update(measure_bandwidth(checkpoint.default_cache_dir()))
        planned = args.context or min(4096, shape.max_positions or 4096)      # what engine.open plans for
        plan = planner.make_plan(shape, hw, profs, context=planned, drafter=draft, force=args.profile,
                                 bandwidth=bw, runnable=engine.runnable(profs, shape, _gguf_why(ckpt)),
                                 drafter_weights=dweights if draft else "exact",
                                 quant_act_bytes=torch.finfo(engine.quant_act_dtype(
                                     hardware.pick_device(hw.device))).bits // 8,
                                 routing=engine.measured_routing(ckpt.path, shape) if ckpt else None)
        from engine import fidelity
        if args.fidelity and ckpt is None:
            error(f"--fidelity loads the model, and {settings.model} is not downloaded; "
                  f"run `localchat setup --model {settings.model}` first")
            return EXIT_USAGE
        checked = against = None
        if args.reference and not (args.fidelity and ckpt is not None and ckpt.gguf is not None):
            error("--reference goes with --fidelity on a .gguf model (-m FILE.gguf or -m owner/repo:QUANT)")
            return EXIT_USAGE
        if args.fidelity and ckpt.gguf is not None:
            why = _gguf_why(ckpt)
            if why:
                error(f"--fidelity reads a GGUF from its blocks (resident-gguf), which does not run here: {why}")
                return EXIT_USAGE
            reference = _reference(args.reference, ckpt.gguf)
            fid, (checked, against) = {}, _check_gguf(ckpt, reference)
        elif args.fidelity:
            fid = fidelity.measure_formats(ckpt.path, hardware.pick_device(hw.device))
        else:
            fid = fidelity.cached_formats(ckpt.path) if ckpt else {}
    except engine.EngineError as exc:
        error(str(exc))
        return EXIT_USAGE
    leftover = _retired_steps(checkpoint.default_cache_dir())
    if args.json:
        out = {"hardware": _hw_dict(hw), "model": {"name": shape.name, "path": str(ckpt.path) if ckpt else None,
                                                   "params": shape.params, "dtype_bytes": shape.dtype_bytes,
                                                   "planned_from": planned_from},
               "bandwidth": read, "sampling": _sampling_dict(ckpt.path, settings) if ckpt else None,
               "plan": plan.as_dict(), "products": _products(plan, profs, shape, hw, ckpt).as_dict()["products"],
               "fidelity": {k: v.as_dict() for k, v in fid.items()},
               "file_check": checked.as_dict() if checked else None,
               "against_checkpoint": against.as_dict() if against else None,
               "retired_compiled_steps": {"path": str(leftover[0]), "bytes": leftover[1]} if leftover else None}
        print(json.dumps(out, indent=2))
        return EXIT_FAIL if checked and checked.problem() or against and against.problem() else EXIT_OK
    print(_hw_text(hw))
    if hw.device == "cpu":
        print(_kernel_text())
    print(f"\nModel: {shape.name} · {shape.params / 1e6:.1f} M parameters · {shape.layers} layers · "
          f"{shape.kv_bytes_per_token():,} bytes of KV per token · context planned {planned}")
    if ckpt is not None and ckpt.gguf is not None:
        print(_gguf_text(ckpt.gguf))
    elif planned_from != "checkpoint":
        print(f"Planned from {planned_from}: the model is not downloaded "
              f"(`localchat setup --model {settings.model}` fetches it)")
    print(_bandwidth_text(read, bw, hw.device, args.measure))
    print()
    print(planner.format_plan(plan))
    if plan.chosen:
        limit, why = planner.context_limit(plan.row(plan.chosen), shape.max_positions or planned, args.context)
        print(f"Context: a conversation may grow to {limit:,} tokens under {plan.chosen}: {why}. The chat UI "
              "offers to drop or summarise the oldest turns before one would not fit.")
    products = _products_text(plan, profs, shape, hw, ckpt)
    if products:
        print(products)
    if ckpt is not None:
        print(_sampling_text(ckpt.path, settings))
    threads = _streaming_threads_text(plan, shape, hw)
    if threads:
        print(threads)
    replay = _replay_text(plan, shape, profs)
    if replay:
        print(replay)
    if checked is not None:
        if checked.problem():
            error(f"{ckpt.gguf}: {checked.problem()}: the file is damaged or its conversion mis-mapped; "
                  "fetch it again, or another quant of the model")
            return EXIT_FAIL
        print(f"File check on the held texts ({checked.tokens} positions, read from its blocks): logits finite, "
              f"{checked.distinct_top1} different greedy tokens, perplexity {checked.ppl:.2f}: nothing looks "
              "mis-mapped.")
        if against is not None:
            f = against.fidelity
            line = (f"Against {against.reference} ({against.how}): top-1 agreement {f.top1_agreement:.2%}, "
                    f"mean KL {f.mean_kl:.2e} nats, perplexity {f.ppl_reference:.2f} (checkpoint) and "
                    f"{f.ppl_candidate:.2f} (file) over {f.tokens} positions")
            if against.problem():
                error(f"{ckpt.gguf}: {against.problem()}")
                return EXIT_FAIL
            print(line + ": the file answers as its checkpoint does, within its quantization.")
        else:
            print("Against its checkpoint: none named (`--reference DIR_OR_REPO` compares the file's answers with "
                  "the safetensors checkpoint it was made from).")
    elif ckpt is not None and ckpt.gguf is not None:
        print("File check: `localchat doctor --fidelity` reads the held texts from the file's blocks and says "
              "whether its logits look damaged or mis-mapped (loads the model).")
    else:
        print(_fidelity_text(fid))
    hint = _self_drafter_hint(plan, shape, settings)
    if hint:
        print(hint)
    if leftover:
        print(f"Compiled decode steps an earlier localchat built: {human_bytes(leftover[1])} in {leftover[0]}, "
              f"unused now (every step runs the C kernels); `rm -r {leftover[0]}` reclaims it")
    return EXIT_OK


def _sampling_text(path: Path, settings) -> str:
    """What an answer samples with, and why: the model's recommendation, and the user's
    settings where they override it."""
    from engine.sampling import SamplingParams, describe, model_defaults
    model, source = model_defaults(path)
    line = f"Sampling: {describe(model)} ({source})"
    mine = [name for name in SAMPLING if getattr(settings, name) is not None]
    if mine:
        used = SamplingParams(**sampling(settings, model))
        line += f"; your settings ({', '.join(mine)}) make it {describe(used)}"
    elif model.greedy:
        line += "; -t/--temperature samples instead"
    else:
        line += "; -t 0 answers greedy"
    return line


def _sampling_dict(path: Path, settings) -> dict:
    from engine.sampling import model_defaults
    model, source = model_defaults(path)
    return {**sampling(settings, model), "model_recommends": {"temperature": model.temperature, "top_p": model.top_p,
                                                              "top_k": model.top_k, "source": source}}


def _retired_steps(cache: Path) -> tuple[Path, int] | None:
    """The folder of compiled steps earlier versions kept (each a copy of its model's
    weights) and its size, if one is left."""
    folder = Path(cache) / "inductor"
    if not folder.is_dir():
        return None
    return folder, sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _model_shape(model: str | None):
    """(checkpoint or None, shape, where the shape came from). A hub model that is not
    downloaded (offline, or not fetched yet) is planned from the built-in catalog's copy
    of its config.json when the catalog knows it, else from its config.json on the hub."""
    from engine import checkpoint, planner
    from engine.errors import ModelNotFound
    from . import catalog, hub
    # A hub model is looked up in the local cache only: doctor never downloads weights.
    if hub.is_repo_id(model) and hub.cached(model) is None:
        entry = catalog.find(model)
        if entry is not None and entry.repo is not None:
            return None, entry.shape(), "the built-in catalog's copy of its config.json"
        shape, why = hub.config_shape(model)
        if shape is None:
            raise ModelNotFound(f"{model}: not downloaded, and {why}; run `localchat setup --model {model}` "
                                "when online, or give a local path")
        return None, shape, "its config.json on the hub"
    ckpt = checkpoint.resolve(model)
    return ckpt, planner.ModelShape.of(ckpt), "checkpoint"


def _replay_text(plan, shape, profs) -> str | None:
    """For a hybrid: what speculation reserves (the replay buffer, in the state column)
    against what keeping a recurrent state per draft position would take."""
    if not shape.state_bytes or not plan.chosen:
        return None
    from engine import planner, profiles
    k = profiles.find(profs, plan.chosen).max_draft
    replay = shape.replay_bytes(k)
    if not replay:
        return None
    per_position = (k + 1) * shape.state_bytes
    return (f"Speculation: verify passes of up to {k + 1} tokens record {planner.gb(replay)} to replay the accepted "
            f"updates (in the state column); a recurrent state per draft position would take "
            f"{planner.gb(per_position)}, {per_position / replay:.0f}x as much.")


def _streaming_threads_text(plan, shape, hw) -> str | None:
    """For a streamed plan on a CPU: whether one-token steps may leave the prefetch readers a
    core (engine/targets/streamed.py: only where they run in localchat's kernels)."""
    if plan.chosen != "streamed-exact" or hw.device != "cpu":
        return None
    if shape.state_bytes:
        return ("Streamed compute: on all threads (a hybrid streams transformers' own layers, whose bits may "
                "change with the thread count).")
    import torch
    from engine.kernels import layer_kernel
    dtype = torch.float32 if shape.dtype_bytes == 4 else torch.bfloat16
    why = layer_kernel.why_not(dtype)
    if why:
        return f"Streamed compute: on all threads (torch's kernels here: {why}; their bits may change with the thread count)."
    return ("Streamed compute: one-token steps leave the prefetch readers a core (localchat's kernels give the same "
            "bits on any thread count).")


def _bandwidth_text(read: dict, bw: dict, device: str, remeasured: bool) -> str:
    """Which read rate the tok/s bounds rest on, and when it was measured."""
    if not read:
        return "Memory read rate: not measured (no room for the probe); tok/s ≤ uses a default"
    kind = "cpu" if device == "cpu" else device.split(":")[0]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(read["measured_at"]))
    how = "measured now" if remeasured else f"measured {when}; `localchat doctor --measure` measures again"
    extra = " · ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in bw.items() if k in ("disk", "host_to_device"))
    return (f"Memory read rate: {read.get(kind, next(iter(bw.values()))) / 1e9:.1f} GB/s on {device} ({how}); "
            "each tok/s ≤ is the bytes a token reads over it" + (f"\n  ({busy_note(read)})" if read.get("busy") else "")
            + (f"\nMeasured: {extra}" if extra else ""))


def busy_note(read: dict) -> str:
    """Why a read rate measured among other processes' work may be low, and what happens next."""
    from engine.bandwidth import RETRY_S
    return (f"other processes kept {read['busy']:.1f} cores busy while it was measured, so it may be low: it is "
            f"measured again after {RETRY_S // 60} minutes, or now with `localchat doctor --measure` on an idle machine")


def _fidelity_text(fid: dict) -> str:
    """The quantized profiles' measured closeness to the exact model, or how to measure it."""
    if not fid:
        return ("Fidelity of int8/int4 against the exact weights: not measured for this model yet; "
                "`localchat doctor --fidelity` measures it (loads the model).")
    parts = [f"{fmt} top-1 {f.top1_agreement:.1%}, KL {f.mean_kl:.4f}, perplexity {f.ppl_reference:.2f} -> "
             f"{f.ppl_candidate:.2f}" for fmt, f in fid.items()]
    tokens = max(f.tokens for f in fid.values())
    return f"Fidelity against the exact weights (held text, {tokens} tokens): " + "; ".join(parts) + "."


def _self_drafter_hint(plan, shape, settings) -> str | None:
    """With no drafter model configured, say whether an int4 copy of the model itself fits
    beside the chosen profile as its drafter (when no small model shares its tokenizer)."""
    if settings.draft_model or not plan.chosen or shape.state_bytes:
        return None          # a hybrid drafts once its state can be rolled back by replay
    row = plan.row(plan.chosen)
    need = shape.weight_bytes("int4") + shape.kv_bytes_per_token() * row.context
    if row.budget - row.total < need:
        return None
    from engine import planner
    return (f"Drafter: an int4 copy of this model ({planner.gb(need)} with its KV cache) fits beside "
            f"{plan.chosen}: `--drafter model --draft-model self` drafts with it.")


def _hw_dict(hw) -> dict:
    from dataclasses import asdict
    from engine import kernels

    return {**asdict(hw), "kernels": {name: why or "ready" for name, why in kernels.status().items()},
            "kernel_isa": kernels.instruction_sets()}


ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}


def _gguf_why(ckpt) -> str:
    """Why resident-gguf cannot run this model ('' where it can), as engine.open decides it."""
    if ckpt is None or getattr(ckpt, "gguf", None) is None:
        return "not a .gguf model"
    from engine.targets.gguf_target import gguf_why_not
    return gguf_why_not(ckpt.gguf)


def _check_gguf(ckpt, reference: tuple[Path, str] | None):
    """(the file's own logits on the held texts, read from its blocks; and, given a
    reference checkpoint (path, how it was found), the file's predictions against it, or
    None): engine/fidelity.py."""
    import engine
    from engine import fidelity
    eng = engine.open(str(ckpt.gguf), profile="resident-gguf", drafter="none")
    texts = fidelity.held_texts(eng.tokenizer, 256)
    checked = fidelity.check_file(eng.target, texts)
    if reference is None or checked.problem():
        return checked, None
    return checked, fidelity.against_checkpoint(eng.target, texts, *reference)


def _reference(named: str | None, gguf: Path) -> tuple[Path, str] | None:
    """The safetensors checkpoint a GGUF is compared with, and how it was found: the one
    named with --reference, else the first repo the file's metadata names (its source, then
    its base models) that is downloaded; None when there is none. Never downloads."""
    from engine import checkpoint
    from engine.errors import EngineError
    from engine.gguf_reader import read
    from . import hub
    if named:
        if hub.is_repo_id(named):
            path = hub.cached(named)
            if path is None:
                raise EngineError(f"--reference {named}: not downloaded; `localchat models pull {named}` fetches it "
                                  "(doctor never downloads)")
            return path, "named with --reference"
        if not Path(named).expanduser().exists():
            raise EngineError(f"--reference {named}: no such file or directory, nor a downloaded repo id")
        ckpt = checkpoint.resolve(named)
        if ckpt.source != "dir":
            raise EngineError(f"--reference {named}: give the safetensors checkpoint (a directory with config.json "
                              "and *.safetensors) the file was made from, not another GGUF")
        return ckpt.path, "named with --reference"
    meta, _ = read(gguf)
    for key, repo in _named_repos(meta):
        path = hub.cached(repo)
        if path is not None:
            return path, f"the repo its metadata names ({key})"
    return None


def _named_repos(meta: dict) -> list[tuple[str, str]]:
    """(key, "owner/name") of each Hugging Face repo a GGUF's metadata names: where it was
    converted from, then its base models."""
    keys = ["general.source.repo_url", "general.source.url", "general.repo_url"]
    keys += [f"general.base_model.{i}.{f}" for i in range(int(meta.get("general.base_model.count") or 0))
             for f in ("repo_url", "url")]
    out = []
    for key in keys:
        value = meta.get(key)
        if isinstance(value, str) and value.startswith("https://huggingface.co/"):
            repo = "/".join(value.removeprefix("https://huggingface.co/").split("/")[:2])
            if repo.count("/") == 1 and repo not in [r for _, r in out]:
                out.append((key, repo))
    return out


def _gguf_text(gguf) -> str:
    """What a .gguf model's file holds: its size and its matrices' block formats, and
    whether they run as stored here."""
    from collections import Counter

    from engine.gguf_file import CONVERT_TO, converted_kinds, held_bytes
    from engine.gguf_reader import read
    from engine.targets.gguf_target import gguf_why_not
    _, tensors = read(gguf)
    kinds = Counter(t.kind for t in tensors.values() if len(t.shape) >= 2)
    mix = ", ".join(f"{k} ({n})" for k, n in kinds.most_common())
    why = gguf_why_not(gguf)
    runs = "its blocks run as stored (resident-gguf)" if not why else f"resident-gguf does not run it: {why}"
    line = f"File: {gguf} · {human_bytes(gguf.stat().st_size)} · matrices in {mix}; {runs}"
    odd = converted_kinds(tensors)
    if odd and not why:
        grown = sum(held_bytes(t) - t.data.numel() for t in tensors.values() if t.kind in odd)
        line += (f"\nConverted at load: {', '.join(odd)} blocks have no kernel here yet, so they are decoded and "
                 f"held as {CONVERT_TO} (within 8-bit rounding of the file's values; {human_bytes(grown)} more "
                 "memory than the file, counted in the plan)")
    return line


def _kernel_text() -> str:
    from engine import kernels
    st = kernels.status()

    def by_dtype(kind: str) -> dict[str, str]:
        return {name.removeprefix(kind + " "): why for name, why in st.items() if name.startswith(kind + " ")}
    rows = by_dtype("rows")
    ready = [d for d, why in rows.items() if not why]
    lines = []
    if ready:
        isa = kernels.instruction_sets()
        built = ", ".join(f"{d} {ISA_NAMES[isa[d]]}" for d in ready)
        lines.append(f"Row kernels ({built}): one-token steps and verify passes run localchat's own "
                     "products, built here")
    lines += [f"Row kernel ({d}): not used, {why}; torch's kernels instead" for d, why in rows.items() if why]
    layers = by_dtype("layers")
    ready = [d for d, why in layers.items() if not why]
    if ready:
        lines.append(f"Layer kernels ({', '.join(ready)}): a Llama-family model's one-token steps and "
                     "verify passes run in one call, token ids to logits, a Qwen3.5 model's one layer at a time")
    lines += [f"Layer kernel ({d}): not used, {why}" for d, why in layers.items() if why and not rows.get(d)]
    for name, ready_text, instead in (
            ("int8", "int8 weights are read as stored, whole layers in one call", "aten's int8 kernel"),
            ("int4", "int4 weights are read in their own form, whole layers in one call", "aten's int4 kernel"),
            ("gated delta-net", "a hybrid's conv and recurrence steps run in C (with the layer kernels, "
             "Qwen3.5's whole layers)", "transformers' functions"),
            ("GGUF blocks", "a .gguf model's Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL and IQ4_XS blocks are read as stored, "
             "multiplied in integers with activations rounded to 16 bits, whole layers in one call",
             "its float32 import")):
        why = st[name]
        title = name[0].upper() + name[1:]
        lines.append(f"{title} kernel: {ready_text}" if not why else f"{title} kernel: not used, {why}; {instead} instead")
    from engine import openmp
    lines.append(openmp.describe())
    return "\n".join(lines)


def _products(plan, profs, shape, hw, ckpt):
    """The kernel policy (engine/kernels/dispatch.py) for the weights the chosen profile holds:
    what multiplies each format in steps, verify passes and a prefill, on this machine."""
    from collections import Counter

    import torch

    import engine
    from engine import hardware, kernels
    from engine.kernels import dispatch
    device = hardware.pick_device(hw.device)
    prof = next((p for p in profs if p.name == plan.chosen), None)
    if prof is None:
        return dispatch.Kernels.of([], device, torch.float32)
    if prof.weights == "gguf" and ckpt is not None and ckpt.gguf is not None:
        from engine.gguf_file import CONVERT_TO, converted
        from engine.gguf_reader import read
        kinds = Counter("float32" if t.kind == "F32" else CONVERT_TO if converted(t.kind) else t.kind
                        for t in read(ckpt.gguf)[1].values() if len(t.shape) >= 2)
        return dispatch.Kernels.of([k for k, _ in kinds.most_common()], device, torch.float32)
    if prof.weights == "exact":
        act = kernels.default_dtype(device, torch.bfloat16 if shape.dtype_bytes == 2 else torch.float32)
        return dispatch.Kernels.of([str(act).removeprefix("torch.")], device, act)
    act = engine.quant_act_dtype(device)
    layers = prof.weights
    if layers == "int4" and dispatch.int4_layout(256, 256, prof.group_size, device, act) != "int4":
        layers = "int4 packed"
    head = prof.head_format if prof.head_format != "exact" else str(act).removeprefix("torch.")
    return dispatch.Kernels.of(list(dict.fromkeys([layers, head])), device, act)


def _products_text(plan, profs, shape, hw, ckpt) -> str:
    lines = _products(plan, profs, shape, hw, ckpt).lines()
    if not lines:
        return ""
    return "\n".join([f"Products under {plan.chosen} (engine/kernels/dispatch.py, the one kernel policy):"]
                     + [f"  {line}" for line in lines])


def _hw_text(hw) -> str:
    lines = [f"CPU: {hw.cpu_name} · {hw.cpu_cores} cores · bf16 instructions: {'yes' if hw.bf16 else 'no'}",
             f"RAM: {human_bytes(hw.host_available_bytes)} available of {human_bytes(hw.host_total_bytes)}",
             f"Disk: {human_bytes(hw.disk_free_bytes)} free at {hw.disk_path}"]
    if hw.accelerators:
        for a in hw.accelerators:
            lines.append(f"GPU {a.device}: {a.name} · {human_bytes(a.free_bytes)} free of {human_bytes(a.total_bytes)}")
    else:
        lines.append("GPU: none found (the CPU is the device; its budget is host RAM or --vram)")
    given = f" (given: {', '.join('--' + o for o in hw.overrides)})" if hw.overrides else ""
    lines.append(f"Device: {hw.device} · budget {human_bytes(hw.budget_bytes)}{given}")
    return "\n".join(lines)
