"""Reopening a conversation warm against cold (a benchmark, not a test): on the demo model,
a conversation of N tokens (a long document and a question, then the model's answer) is
kept in a resume store; its next turn is then answered by a new chat, as a user reopening
it gets it, once with the store (its cache loaded, only the new turn prefilled) and once
without (the whole conversation prefilled), alternately in the same run. Time to first
token is the turn's restore and prefill times as Stats gives them and, beside it, the wall clock to the first text. Medians over rounds; the ratio is
cold over warm. The entry is read from the page cache (it was just written, as when a
conversation is reopened soon); its size is in the JSON, so a disk's own read rate gives the
worst case.

Goal (issue: day to day): warm >= 10x faster to the first token at 4k tokens.

    flock /tmp/localchat-bench.lock .venv/bin/python benchmarks/resume.py [--rounds 3] [--profile NAME]

Writes benchmarks/results/resume.json."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
NEXT = "Summarise that in one sentence."


def document(tokenizer, tokens: int) -> str:
    """The project's own docs, cut to about `tokens` tokens: real prose, no repetition for
    the n-gram drafter to exploit."""
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def next_turn(eng, messages, store):
    """Answer NEXT in a new chat of `messages`: (seconds to first text, Stats, token ids)."""
    eng.resume = None
    eng.claim_cache(eng.chat())      # an empty chat holds the cache: the last one's is not kept again
    eng.resume = store
    chat = eng.chat()
    chat.restore(messages)
    t0 = time.perf_counter()
    first = None
    for ev in chat.send(NEXT, max_new_tokens=8):
        if first is None and isinstance(ev, engine.TextDelta):
            first = time.perf_counter() - t0
    return first, chat.last_stats, chat.last_done.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "resume.json"))
    args = ap.parse_args()
    eng = engine.open(drafter="none", profile=args.profile, context=8192)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = engine.ResumeStore(Path(tmp), 8 << 30)
        for n in args.tokens:
            eng.resume = store
            chat = eng.chat()
            doc = document(eng.tokenizer, n)
            list(chat.send(f"Read this document.\n\n{doc}\n\nWhat is it about?", max_new_tokens=32))
            assert chat.keep(), store.problem
            messages = [dict(m) for m in chat.messages]
            [entry] = [e for e in store.entries() if e.tokens == len(chat.cached_ids)]
            timings = {"warm": [], "cold": [], "warm_wall": [], "cold_wall": []}
            answers = set()
            for _ in range(args.rounds):
                for mode in ("cold", "warm"):
                    wall, stats, ids = next_turn(eng, messages, store if mode == "warm" else None)
                    assert (stats.restored_tokens > 0) == (mode == "warm"), (mode, stats)
                    timings[mode].append(stats.restore_seconds + stats.prefill_seconds)
                    timings[mode + "_wall"].append(wall)
                    answers.add(ids)
            cold, warm = median(timings["cold"]), median(timings["warm"])
            row = {"conversation_tokens": stats.prompt_tokens, "restored_tokens": len(chat.cached_ids),
                   "entry_bytes": entry.path.stat().st_size,
                   "cold_ttft_s": round(cold, 4), "warm_ttft_s": round(warm, 4), "ratio": round(cold / warm, 1),
                   "cold_first_text_s": round(median(timings["cold_wall"]), 4),
                   "warm_first_text_s": round(median(timings["warm_wall"]), 4),
                   "same_answer": len(answers) == 1}
            rows.append(row)
            print(f"{row['conversation_tokens']:5} tokens  cold {cold:7.3f} s  warm {warm:6.3f} s  x{cold / warm:5.1f}  "
                  f"entry {row['entry_bytes'] / 1e6:.1f} MB  same answer: {row['same_answer']}", flush=True)
    write_json(args.out, {"machine": machine(), "model": eng.name, "profile": eng.plan.chosen,
                          "dtype": str(eng.target.dtype), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
