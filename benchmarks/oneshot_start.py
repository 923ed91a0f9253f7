"""A one-shot answer (`localchat "question"`) on a start that finds a built compiled step
in the cache, each run a fresh process, modes alternated, median of --runs:

- eager: the step is not used (`--compile off`);
- oneshot: what a one-shot answer does (`--compile auto`: the cached step is loaded
  beside the prefill and decodes from the first token it is ready for);
- preloaded: the step loaded and waited for before the question is sent: the compiled
  step's own speed, what the one-shot decode is measured against.

Per answer: time to the first token (from sending the question, and from the process's
start), the whole answer, the longest gap between two tokens, and the decode rate after
the first token. Writes JSON; the figures that matter are the ratios, each from this run.

The step must have been built once: `localchat setup` or the chat UI builds it, or
`python -c "import engine; engine.open(compile='on').target.compiled.wait()"`.

    python benchmarks/oneshot_start.py [--runs 3] [--tokens 128] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine, median, write_json  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
MODES = {"eager": "off", "oneshot": "auto-oneshot", "preloaded": "cached"}
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import engine
from localchat import common
mode, dtype, tokens, prompt = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
compile = common.ONESHOT_COMPILE if mode == "auto-oneshot" else mode
eng = engine.open(compile=compile, dtype=dtype, drafter="none")
if mode == "cached":
    eng.target.compiled.wait(120)
times = []
chat = eng.chat()
t0 = time.time()
for ev in chat.send(prompt, max_new_tokens=tokens):
    if isinstance(ev, engine.TextDelta):
        times.append(time.time())
s = chat.last_stats
print(json.dumps({"sent": t0, "first": times[0], "end": times[-1], "tokens": s.generated_tokens,
                  "longest_gap_s": max(b - a for a, b in zip(times, times[1:])),
                  "compile_state": s.compile_state}))
sys.stdout.flush()
import os; os._exit(0)
"""


def once(mode: str, args) -> dict:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), MODES[mode], args.dtype, str(args.tokens), PROMPT],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"ttft_s": r["first"] - r["sent"], "ttft_from_start_s": r["first"] - start,
            "total_from_start_s": r["end"] - start, "answer_s": r["end"] - r["sent"],
            "decode_tps": (r["tokens"] - 1) / (r["end"] - r["first"]), "longest_gap_s": r["longest_gap_s"],
            "tokens": r["tokens"], "compile_state": r["compile_state"]}


FIELDS = ("ttft_s", "ttft_from_start_s", "total_from_start_s", "answer_s", "decode_tps", "longest_gap_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "oneshot_start.json"))
    args = ap.parse_args()
    runs = {m: [] for m in MODES}
    for _ in range(args.runs):
        for m in MODES:
            runs[m].append(once(m, args))
    res = {m: {f: median([r[f] for r in v]) for f in FIELDS} for m, v in runs.items()}
    for m in ("oneshot", "preloaded"):
        res[m]["states"] = [r["compile_state"] for r in runs[m]]
    ratios = {"oneshot_ttft_vs_eager": res["oneshot"]["ttft_s"] / res["eager"]["ttft_s"],
              "oneshot_decode_vs_compiled_step": res["oneshot"]["decode_tps"] / res["preloaded"]["decode_tps"],
              "oneshot_decode_vs_eager": res["oneshot"]["decode_tps"] / res["eager"]["decode_tps"],
              "oneshot_total_vs_eager": res["oneshot"]["total_from_start_s"] / res["eager"]["total_from_start_s"]}
    out = {"benchmark": "oneshot_start", "model": "SmolLM2-135M-Instruct (demo)", "machine": machine(),
           "runs": args.runs, "tokens": args.tokens, "dtype": args.dtype, **res, "ratios": ratios, "samples": runs}
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "samples")}, indent=1), flush=True)
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
