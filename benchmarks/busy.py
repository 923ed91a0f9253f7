"""Decode beside a busy core: the demo model, greedy, alone and with one busy-loop process
running beside it, under libgomp's default spin (GOMP_SPINCOUNT=300000) and under the one
the engine sets (engine/openmp.py). Prefill is timed too, for the same answers.

libgomp reads its spin count once, when torch loads it, so every measurement is a fresh
process (benchmarks/busy.py --worker). Rounds interleave every contender, so the drifting
memory read rate touches all alike; medians of --rounds; the ratios are ours over the
default in the same condition.

    python benchmarks/busy.py [--rounds 3] [--tokens 96] [--profiles resident-exact,resident-int4]

Writes benchmarks/results/busy.json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_SPIN = "300000"        # libgomp's own, when no more threads run than there are cores
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def worker(profile: str, tokens: int) -> None:
    import engine
    import torch
    eng = engine.open(None, profile=profile, dtype="bfloat16", drafter="none")
    chat = eng.chat()
    with torch.inference_mode():
        for _ in chat.send(PROMPT, max_new_tokens=8):        # warm: first-call allocations
            pass
        chat = eng.chat()
        for _ in chat.send(PROMPT, max_new_tokens=tokens):
            pass
    s = chat.last_stats
    print(json.dumps({"decode_tps": s.decode_tps, "prefill_tps": s.prefill_tps, "tokens": s.generated_tokens,
                      "spin": os.environ.get("GOMP_SPINCOUNT"), "threads": torch.get_num_threads()}))


def run_one(profile: str, tokens: int, spin: str | None, busy: bool) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", profile, "--tokens", str(tokens)],
                             env=env, capture_output=True, text=True, check=True)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--profiles", default="resident-exact,resident-int4")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/busy.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.tokens)
    from common import machine, median, write_json
    from engine import openmp
    contenders = [(p, name, spin, busy) for p in args.profiles.split(",")
                  for busy in (False, True) for name, spin in (("libgomp default", DEFAULT_SPIN), ("ours", None))]
    runs: dict[tuple, list[dict]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for c in contenders:
            p, name, spin, busy = c
            got = run_one(p, args.tokens, spin, busy)
            runs[c].append(got)
            print(f"round {r + 1} {p:15s} {'busy' if busy else 'quiet'} {name:16s} "
                  f"decode {got['decode_tps']:6.1f} prefill {got['prefill_tps']:7.1f} tok/s", flush=True)
    rows = []
    for p in args.profiles.split(","):
        for busy in (False, True):
            cell = {}
            for name in ("libgomp default", "ours"):
                got = runs[next(c for c in contenders if c[0] == p and c[1] == name and c[3] == busy)]
                cell[name] = {"decode_tps": round(median([g["decode_tps"] for g in got]), 1),
                              "prefill_tps": round(median([g["prefill_tps"] for g in got]), 1),
                              "runs": got}
            rows.append({"profile": p, "beside": "a busy core" if busy else "nothing", **cell,
                         "decode_ratio": round(cell["ours"]["decode_tps"] / cell["libgomp default"]["decode_tps"], 2),
                         "prefill_ratio": round(cell["ours"]["prefill_tps"] / cell["libgomp default"]["prefill_tps"], 2)})
            print(f"{p:15s} beside {rows[-1]['beside']:12s} decode {rows[-1]['decode_ratio']:5.2f}x  "
                  f"prefill {rows[-1]['prefill_ratio']:5.2f}x")
    write_json(args.out, {"machine": machine(), "ours_spin": openmp.SPIN, "default_spin": DEFAULT_SPIN,
                          "tokens": args.tokens, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M"),
                          "rows": rows})


if __name__ == "__main__":
    main()
