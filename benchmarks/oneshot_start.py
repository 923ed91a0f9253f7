"""A one-shot answer on a start that finds a built compiled step in the cache: decoded
eagerly (what `localchat "question"` does) against loading the step during the answer
(`--compile cached`, what it did before), demo model, each run a fresh process, runs
alternated, median of --runs. Per answer: time to the first token, the whole answer, the
longest gap between two tokens, and the decode rate after the first 3 s. Writes JSON.

The cached mode needs the step built once: `localchat` (the chat UI) builds it, or
`python -c "import engine; engine.open(compile='on').target.compiled.wait()"`.

    python benchmarks/oneshot_start.py [--runs 3] [--tokens 128] [--drafter none]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine, median, write_json  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import engine
mode, drafter, tokens, prompt = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
eng = engine.open(compile=mode, drafter=drafter)
t0 = time.perf_counter()
times = []
chat = eng.chat()
for ev in chat.send(prompt, max_new_tokens=tokens):
    if isinstance(ev, engine.TextDelta):
        times.append(time.perf_counter() - t0)
late = [t for t in times if t >= 3.0]
print(json.dumps({"ttft_s": times[0], "total_s": times[-1], "tokens": chat.last_stats.generated_tokens,
                  "longest_gap_s": max(b - a for a, b in zip(times, times[1:])),
                  "tps_after_3s": (len(late) - 1) / (late[-1] - late[0]) if len(late) > 2 else None,
                  "compile_state": chat.last_stats.compile_state}))
sys.stdout.flush()
import os; os._exit(0)
"""


def once(mode: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), mode, args.drafter, str(args.tokens), PROMPT],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "oneshot_start.json"))
    args = ap.parse_args()
    runs = {"eager": [], "load_during_answer": []}
    for _ in range(args.runs):
        runs["eager"].append(once("off", args))
        runs["load_during_answer"].append(once("cached", args))
    res = {k: {f: median([r[f] for r in v if r[f] is not None]) for f in ("ttft_s", "total_s", "longest_gap_s",
                                                                          "tps_after_3s")}
           for k, v in runs.items()}
    res["load_during_answer"]["states"] = [r["compile_state"] for r in runs["load_during_answer"]]
    out = {"benchmark": "oneshot_start", "model": "SmolLM2-135M-Instruct (demo)", "machine": machine(),
           "runs": args.runs, "tokens": args.tokens, "drafter": args.drafter, **res,
           "total_load_vs_eager": res["load_during_answer"]["total_s"] / res["eager"]["total_s"], "samples": runs}
    print({k: v for k, v in out.items() if k not in ("machine", "samples")}, flush=True)
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
