"""Speculative decoding on the demo model over ../shared/bench/workloads.jsonl (or the
built-in set): plain decoding vs the n-gram drafter vs a model drafter (the demo model
drafting for itself: every draft is right, but it costs a full step — the upper bound on
acceptance and the lower bound on drafter cost), greedy, median of --runs, same run.
Reports tokens per pass and acceptance next to the formula's prediction. Writes JSON.

    python benchmarks/speculative.py [--runs 3] [--tokens 128] [--dtype float32] [--no-model-drafter]
                                     [--drafter-weights exact|int8|int4]   (int4: a quantized copy drafts)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from localchat.bench import ceiling_speedup, load_workloads, lookup_ceiling, measure, pass_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workloads", default=str(ROOT.parent / "shared" / "bench" / "workloads.jsonl"))
    ap.add_argument("--no-model-drafter", action="store_true")
    ap.add_argument("--drafter-weights", default="exact", choices=["exact", "int8", "int4"],
                    help="the model drafter: the demo model itself (exact) or its quantized copy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "speculative.json"))
    args = ap.parse_args()

    workloads = load_workloads(args.workloads if Path(args.workloads).is_file() else None)
    eng = engine.open(dtype=args.dtype, drafter="none")
    drafters = ["ngram"] + ([] if args.no_model_drafter else ["model"])
    rows = []
    for w in workloads:
        eng.set_drafter("none")
        plain = measure(eng, w["prompt"], args.tokens, args.runs)
        # What any prompt-lookup drafter could reach at best on this answer: the longest
        # run of the answer's next tokens found earlier in the conversation, every pass.
        rounds = lookup_ceiling(plain["context_ids"], plain["token_ids"])
        seconds = pass_seconds(eng)
        row = {"id": w["id"], "kind": w["kind"], "plain_tps": plain["decode_tps"],
               "answer_tokens": len(plain["token_ids"]),
               "pass_ms": {n: round(t * 1000, 2) for n, t in seconds.items()},
               "lookup_ceiling": {"tokens_per_pass": len(plain["token_ids"]) / len(rounds),
                                  "speedup": ceiling_speedup(rounds, seconds)}}
        for d in drafters:
            if d == "model" and args.drafter_weights != "exact":
                eng.set_drafter("model", "self", dtype=args.dtype, weights=args.drafter_weights)
            elif d == "model":
                eng.set_drafter("model", str(eng.checkpoint.path), dtype=args.dtype)
            else:
                eng.set_drafter(d)
            r = measure(eng, w["prompt"], args.tokens, args.runs)
            row[d] = {"tps": r["decode_tps"], "speedup": r["decode_tps"] / plain["decode_tps"],
                      "tokens_per_pass": r["tokens_per_pass"], "acceptance": r["acceptance"],
                      "predicted_tokens_per_pass": r["predicted_tokens_per_pass"],
                      "identical": r["token_ids"] == plain["token_ids"]}
        rows.append(row)
        print(row, flush=True)
    out = {"benchmark": "speculative", "model": eng.name, "dtype": args.dtype, "tokens": args.tokens,
           "drafter_weights": args.drafter_weights,
           "runs": args.runs, "machine": machine(), "rows": rows}
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
