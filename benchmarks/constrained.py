"""What a JSON schema costs while decoding (a benchmark, not a test): on the demo model,
each prompt of tests/test_serve_structured.py is answered under its schema, and the same
prompt unconstrained for exactly as many tokens (end-of-turn tokens ignored), in the same
round, with no drafter and with the n-gram drafter. Decode tok/s are medians over rounds;
the ratio is constrained over unconstrained, so the memory's drifting read rate cancels.
The mask's own cost is timed inside the answer: llguidance computing the allowed tokens
and applying them to the logits, per token.

Goal (issue: structured output): constrained >= 0.9x unconstrained.

    flock /tmp/localchat-bench.lock .venv/bin/python benchmarks/constrained.py [--rounds 3]

Writes benchmarks/results/constrained.json."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402
from engine import constrain  # noqa: E402
from engine.drafters import NgramDrafter, NoDrafter  # noqa: E402
from test_serve_structured import SCHEMAS  # noqa: E402


class MaskClock:
    """Seconds spent in the grammar (masks, consuming tokens, checking drafts)."""
    seconds = 0.0

    @classmethod
    def wrap(cls, name):
        inner = getattr(constrain.Constraint, name)

        def timed(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(self, *a, **kw)
            finally:
                cls.seconds += time.perf_counter() - t0
        setattr(constrain.Constraint, name, timed)


def answer(eng, prompt, n, grammar=None):
    MaskClock.seconds = 0.0
    chat = eng.chat()
    events = list(chat.send(prompt, max_new_tokens=n, grammar=grammar))
    stats, done = events[-2], events[-1]
    return done, stats, MaskClock.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "constrained.json"))
    args = ap.parse_args()
    for name in ("mask", "mask_rows", "consume", "allowed_prefix"):
        MaskClock.wrap(name)
    eng = engine.open(drafter="none")
    stops = eng.stop_ids
    grammars = [(p, engine.Grammar.json_schema(s)) for p, s in SCHEMAS]
    answer(eng, "warm up", 16, grammars[0][1])
    rows = []
    for drafter in ("none", "ngram"):
        per = {p: {"constrained": [], "plain": [], "mask_us": [], "tokens": 0, "tpp": []} for p, _ in grammars}
        for _ in range(args.rounds):
            for prompt, g in grammars:
                eng.drafter = NgramDrafter() if drafter == "ngram" else NoDrafter()
                eng.stop_ids = stops
                done, stats, mask_s = answer(eng, prompt, 200, g)
                n = len(done.token_ids)
                eng.stop_ids = frozenset()            # unconstrained: exactly as many tokens
                _, plain, _ = answer(eng, prompt, n)
                eng.stop_ids = stops
                r = per[prompt]
                r["constrained"].append(stats.decode_tps)
                r["plain"].append(plain.decode_tps)
                r["mask_us"].append(mask_s / max(1, n) * 1e6)
                r["tokens"] = n
                r["tpp"].append(stats.tokens_per_pass)
        for prompt, r in per.items():
            c, p = median(r["constrained"]), median(r["plain"])
            rows.append({"drafter": drafter, "prompt": prompt, "tokens": r["tokens"],
                         "constrained_tps": round(c, 1), "unconstrained_tps": round(p, 1),
                         "ratio": round(c / p, 3) if p else None, "grammar_us_per_token": round(median(r["mask_us"]), 1),
                         "tokens_per_pass": round(median(r["tpp"]), 2)})
            print(f"{drafter:6} {r['tokens']:4} tok  constrained {c:6.1f}  plain {p:6.1f} tok/s  "
                  f"x{c / p:.3f}  grammar {median(r['mask_us']):6.1f} us/token  {prompt}", flush=True)
    eng.drafter, eng.stop_ids = NoDrafter(), stops
    summary = {d: round(median([r["ratio"] for r in rows if r["drafter"] == d]), 3) for d in ("none", "ngram")}
    write_json(args.out, {"machine": machine(), "model": eng.name, "dtype": str(eng.target.dtype),
                          "rounds": args.rounds, "median_ratio": summary, "rows": rows})
    print("median constrained/unconstrained:", summary)


if __name__ == "__main__":
    main()
