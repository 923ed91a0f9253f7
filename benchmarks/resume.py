"""Reopening a conversation warm against cold (a benchmark, not a test): a conversation of N
tokens (a long document and a question, then the model's answer) is kept in a resume store;
its next turn is then answered by a new chat, as a user reopening it gets it, once with the
store (its cache loaded, only the new turn prefilled) and once without (the whole
conversation prefilled), alternately in the same run. Time to first token is the turn's
restore and prefill times as Stats gives them and, beside it, the wall clock to the first
text. Medians over rounds; the ratio is cold over warm. The entry is read from the page
cache (it was just written, as when a conversation is reopened soon); its size is in the
JSON, so a disk's own read rate gives the worst case. Each answer is compared with the
answer of the conversation never closed: warm must equal it (the entry holds the very bits
decoding left). Cold may not on a hybrid: its prefill runs the chunked delta rule over the
earlier answer, which the chat decoded token by token, and the two forms of the rule differ
in the last bits of the state.

Two models: the demo (its context holds 8,192 tokens: no 16k row), and a hybrid of
Qwen3.5-0.8B's published text shape (24 layers, 18 gated delta-net and 6 gated attention,
hidden 1024; random bf16 weights, seeded, with the demo tokenizer, as
benchmarks/hybrid_shape.py builds its models), whose entry holds the recurrent states too.

Goal (issue: day to day): warm >= 10x faster to the first token at 4k tokens.

    flock /tmp/localchat-bench.lock .venv/bin/python benchmarks/resume.py [--rounds 3] [--models demo,hybrid]

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


# Qwen3.5-0.8B's text config (shared/models/qwen-hybrid-configs.json, "Qwen/Qwen3.5-0.8B"), its
# context cut to what the benchmark needs
HYBRID = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
              max_position_embeddings=20480)
MODELS = {"demo": (None, [1024, 4096]), "hybrid": ("hybrid", [1024, 4096, 16384])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="demo,hybrid")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "resume.json"))
    args = ap.parse_args()
    runs = []
    for name in args.models.split(","):
        model, sizes = MODELS[name]
        if model == "hybrid":
            from hybrid_shape import build_by_tensor
            model = str(build_by_tensor(Path(tempfile.gettempdir()) / "localchat-resume-hybrid", 24, HYBRID))
        eng = engine.open(model, drafter="none", context=max(sizes) + 512)
        runs.append({"model": name, "checkpoint": eng.name, "profile": eng.plan.chosen,
                     "dtype": str(eng.target.dtype), "rows": measure(name, eng, sizes, args.rounds)})
        del eng
    write_json(args.out, {"machine": machine(), "rounds": args.rounds, "runs": runs})


def measure(name: str, eng, sizes: list[int], rounds: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = engine.ResumeStore(Path(tmp), 8 << 30)
        for n in sizes:
            eng.resume = store
            chat = eng.chat()
            doc = document(eng.tokenizer, n)
            list(chat.send(f"Read this document.\n\n{doc}\n\nWhat is it about?", max_new_tokens=32))
            assert chat.keep(), store.problem
            messages = [dict(m) for m in chat.messages]
            kept = len(chat.cached_ids)
            [entry] = [e for e in store.entries() if e.tokens == kept]
            eng.resume = None
            list(chat.send(NEXT, max_new_tokens=8))      # the conversation never closed
            never = chat.last_done.token_ids
            timings = {"warm": [], "cold": [], "warm_wall": [], "cold_wall": []}
            answers = {"warm": set(), "cold": set()}
            for _ in range(rounds):
                for mode in ("cold", "warm"):
                    wall, stats, ids = next_turn(eng, messages, store if mode == "warm" else None)
                    assert (stats.restored_tokens > 0) == (mode == "warm"), (mode, stats)
                    timings[mode].append(stats.restore_seconds + stats.prefill_seconds)
                    timings[mode + "_wall"].append(wall)
                    answers[mode].add(ids)
            cold, warm = median(timings["cold"]), median(timings["warm"])
            row = {"conversation_tokens": stats.prompt_tokens, "restored_tokens": kept,
                   "entry_bytes": entry.path.stat().st_size,
                   "cold_ttft_s": round(cold, 4), "warm_ttft_s": round(warm, 4), "ratio": round(cold / warm, 1),
                   "cold_first_text_s": round(median(timings["cold_wall"]), 4),
                   "warm_first_text_s": round(median(timings["warm_wall"]), 4),
                   "warm_as_never_closed": answers["warm"] == {never},
                   "cold_as_never_closed": answers["cold"] == {never}}
            rows.append(row)
            print(f"{name:8} {row['conversation_tokens']:6} tokens  cold {cold:7.3f} s  warm {warm:6.3f} s  "
                  f"x{cold / warm:5.1f}  entry {row['entry_bytes'] / 1e6:.1f} MB  answer as never closed: "
                  f"warm {row['warm_as_never_closed']}, cold {row['cold_as_never_closed']}", flush=True)
            store.forget()
    return rows


if __name__ == "__main__":
    main()
