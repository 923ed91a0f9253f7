"""What torch.compile buys our one-token decode step, before it is wired into the engine
(issue 7): the demo model's fast forward (engine/models/llama_family.py) at T = 1, eager
against `torch.compile(fullgraph=True)` with inductor freezing, in the same run: compile
time (the first graph at one position, then the graph with the position symbolic),
median step time at the same positions, and how far the compiled logits are from the
eager ones (and whether the argmax agrees). Writes JSON.

    python benchmarks/compile_probe.py [--mode max-autotune-no-cudagraphs] [--dtype float32] [--reps 30]

Inductor's caches go to a fresh temporary directory, so the compile times are cold.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--cache-dir" in sys.argv:     # warm runs: reuse a directory; default cold: a fresh one
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[sys.argv.index("--cache-dir") + 1]
else:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-probe-")

import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402


def as_parameters(impl) -> None:
    """Inductor freezing folds parameters into the graph as constants (and prepacks the
    GEMM weights); plain tensors reached through Python objects stay graph inputs."""
    def p(t):
        return None if t is None else torch.nn.Parameter(t, requires_grad=False)
    for w in impl.layers:
        for f in fields(w):
            setattr(w, f.name, p(getattr(w, f.name)))
    impl.embed, impl.norm, impl.head = p(impl.embed), p(impl.norm), p(impl.head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (one graph for every position)")
    ap.add_argument("--no-prepack", action="store_true",
                    help="inductor.cpp.weight_prepack = False (what the engine uses: its graphs can be cached)")
    ap.add_argument("--cache-dir", help="inductor's cache directory (default: a fresh one, so compile times are cold)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_probe.json"))
    args = ap.parse_args()

    import torch._inductor.config as inductor_config
    inductor_config.freezing = True
    inductor_config.cpp.weight_prepack = not args.no_prepack
    eng = engine.open(dtype=args.dtype, drafter="none")
    target = eng.target
    impl = target.impl
    as_parameters(impl)

    def step(ids, pos: int):
        return impl(ids, pos, False)

    compiled = torch.compile(step, mode=args.mode, fullgraph=True, dynamic=True if args.dynamic else None)
    chat = eng.chat()
    list(chat.send("Write a short story about a lighthouse keeper.", max_new_tokens=8))
    pos = target.cache.length
    ids = torch.tensor([42])
    out: dict = {"benchmark": "compile_probe", "model": eng.name, "dtype": args.dtype, "mode": args.mode,
                 "dynamic": args.dynamic, "warm_cache": bool(args.cache_dir), "weight_prepack": not args.no_prepack,
                 "machine": machine()}
    with torch.inference_mode():
        t = time.perf_counter()
        compiled(ids, pos)
        out["compile_first_s"] = time.perf_counter() - t
        t = time.perf_counter()
        compiled(ids, pos + 1)                 # a second position: the graph with pos symbolic
        out["compile_dynamic_s"] = time.perf_counter() - t

        def timed(fn, p):
            xs = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn(ids, p)
                xs.append(time.perf_counter() - t)
            return median(xs)

        rows, flips, worst = [], 0, 0.0
        for p in (pos + 2, pos + 40, pos + 200):
            e, c = step(ids, p), compiled(ids, p)
            worst = max(worst, float((e - c).abs().max()))
            flips += int(torch.argmax(e) != torch.argmax(c))
            rows.append({"pos": p, "eager_ms": timed(step, p) * 1000, "compiled_ms": timed(compiled, p) * 1000})
        out["steps"] = rows
        out["eager_ms"] = median([r["eager_ms"] for r in rows])
        out["compiled_ms"] = median([r["compiled_ms"] for r in rows])
        out["speedup"] = out["eager_ms"] / out["compiled_ms"]
        out["max_abs_logit_diff"] = worst
        out["argmax_differs"] = flips
    print({k: v for k, v in out.items() if k != "machine"})
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
