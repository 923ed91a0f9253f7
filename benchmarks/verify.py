"""Compiled verify passes on the demo model (issue 7): with the compiled decode step live,
n-gram speculative decoding with the verify passes compiled (buckets of 2/4/8 positions)
against the same with eager verify passes and against plain compiled decoding, over
../shared/bench/workloads.jsonl (or the built-in set), greedy, same run, median of --runs,
interleaved. Also the cost of one target pass over n = 1..9 positions both ways: what the
adaptive controller weighs drafts against. Writes JSON.

The step and the passes are built once into the cache dir (minutes, the first time) and
loaded from it afterwards; the build time is in the JSON when this run built them.

    python benchmarks/verify.py [--runs 3] [--tokens 128] [--dtype float32] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from engine.compile import exported  # noqa: E402
from common import machine, write_json  # noqa: E402
from engine.speculative import PassCosts  # noqa: E402
from localchat.bench import load_workloads, measure, pass_seconds  # noqa: E402


class Verify:
    """Switches the target's compiled verify passes off and on again (the step stays).
    Every built bucket is run here, raced winner or not: the figures say what each gives."""

    def __init__(self, step):
        self.step = step
        self.live = {r: exported.Package(step.cache_dir / f"verify-{r}.pt2", r, weights_of=step.target.impl)
                     for r in step.rows if (step.cache_dir / f"verify-{r}.pt2").exists()}

    def eager(self) -> None:
        self.step.passes = {}

    def compiled(self) -> None:
        self.step.passes = dict(self.live)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-dir", default=None, help="where the packages are built and kept (default: localchat's)")
    ap.add_argument("--workloads", default=str(ROOT.parent / "shared" / "bench" / "workloads.jsonl"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify.json"))
    args = ap.parse_args()

    workloads = load_workloads(args.workloads if Path(args.workloads).is_file() else None)
    t0 = time.perf_counter()
    eng = engine.open(dtype=args.dtype, drafter="ngram", compile="on", cache_dir=args.cache_dir)
    step = eng.target.compiled
    if step is None or not step.wait(3600):
        sys.exit(f"no compiled step: {eng.compile_note or step.error}")
    step.wait_passes(3600)
    # Buckets that lost their race against the eager pass stay eager (their notes say so).
    ready = {"seconds": round(time.perf_counter() - t0, 1), "step_source": step.source,
             "buckets": sorted(step.passes), "race_ms": {r: {"eager": e, "compiled": c}
                                                        for r, (e, c) in step.pass_ms.items()},
             "notes": step.notes, "error": step.passes_error}
    print(ready, flush=True)
    verify = Verify(step)

    # The pass-cost curve, at the end of a short conversation, both ways, interleaved.
    chat = eng.chat()
    list(chat.send(workloads[0]["prompt"], max_new_tokens=16))
    curves = {"eager": [], "compiled": []}
    for _ in range(args.runs):
        for name in curves:
            getattr(verify, name)()
            curves[name].append(pass_seconds(eng))
    curve = {name: {n: round(statistics.median(c[n] for c in runs) * 1e3, 2) for n in runs[0]}
             for name, runs in curves.items()}

    # Each way keeps its own measured costs across chats, as a session does (switching
    # the passes would otherwise make every chat learn the cost curve again).
    costs = {name: PassCosts() for name in ("plain", "eager", "compiled")}
    rows = []
    for w in workloads:
        samples = {"plain": [], "eager": [], "compiled": []}
        results = {}
        for _ in range(args.runs):
            for name in samples:
                eng.draft_tokens = 0 if name == "plain" else None
                eng.costs = costs[name]
                getattr(verify, "compiled" if name == "plain" else name)()
                r = measure(eng, w["prompt"], args.tokens, 1)
                samples[name].append(r["decode_tps"])
                results[name] = r
        plain_ids = results["plain"]["token_ids"]
        row = {"id": w["id"], "kind": w["kind"]}
        for name, xs in samples.items():
            r = results[name]
            row[name] = {"tps": round(statistics.median(xs), 2), "tokens_per_pass": round(r["tokens_per_pass"], 2),
                         "acceptance": round(r["acceptance"], 3), "identical": r["token_ids"] == plain_ids}
        row["compiled_vs_eager_verify"] = round(row["compiled"]["tps"] / row["eager"]["tps"], 3)
        row["compiled_vs_plain"] = round(row["compiled"]["tps"] / row["plain"]["tps"], 3)
        rows.append(row)
        print(row, flush=True)
    out = {"benchmark": "verify", "model": eng.name, "dtype": args.dtype, "tokens": args.tokens, "runs": args.runs,
           "ready": ready, "pass_ms": curve, "machine": machine(), "rows": rows,
           "median_compiled_vs_eager_verify": statistics.median(r["compiled_vs_eager_verify"] for r in rows),
           "median_compiled_vs_plain": statistics.median(r["compiled_vs_plain"] for r in rows)}
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
