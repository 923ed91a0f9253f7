"""Decode speed on the demo model: our engine against Hugging Face generate(), same
weights, same dtype, same threads, same run; plus time to first token on turn 1 and
turn 5 of a chat. Rows per dtype for the exact weights (the engine's step, and its
generic forward), and per quantized format (int8, int4 g32; bf16 activations where
native), against float32 generate() in the same run. Writes JSON (median of --runs runs).

    python benchmarks/decode.py [--runs 5] [--tokens 128] [--dtypes float32,bfloat16]
                                [--formats int8,int4] [--drafter]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, median, read_bandwidth, write_json  # noqa: E402
from engine.session import render_prompt  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TURNS = ["Tell me a fact about the sea.", "Tell me a fact about the moon.", "Tell me a fact about stars.",
         "Tell me a fact about trees.", "Tell me a fact about birds."]


def ours_once(eng, tokens: int) -> float:
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=tokens))
    return chat.last_stats.decode_tps


def generate_once(model, ids, tokens: int) -> float:
    """Decode tok/s of generate(): (tokens - 1) / (time(tokens) - time(1 token)),
    i.e. prefill removed, as our decode figure is."""
    def timed(n):
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t
    with torch.inference_mode():
        t1 = median([timed(1) for _ in range(3)])
        return (tokens - 1) / (timed(tokens) - t1)


def interleaved(runs: int, contenders: dict) -> dict:
    """Median of `runs` for each contender, run in turn (A, B, C, A, B, C, ...), so a
    machine that speeds up or slows down during the benchmark biases none of them."""
    for fn in contenders.values():      # warm-up
        fn()
    samples = {name: [] for name in contenders}
    for _ in range(runs):
        for name, fn in contenders.items():
            samples[name].append(fn())
    return {name: median(xs) for name, xs in samples.items()}


def ttft_turns(eng, runs: int) -> dict:
    """Time to first token of turn 1 and turn 5 (same-length user messages, 32-token answers)."""
    eng.stop_ids = frozenset()
    first, fifth = [], []
    for _ in range(runs):
        chat = eng.chat()
        times = []
        for q in TURNS:
            t = time.perf_counter()
            events = chat.send(q, max_new_tokens=32)
            for ev in events:
                if isinstance(ev, engine.TextDelta):
                    times.append(time.perf_counter() - t)
                    break
            for _ in events:      # finish the answer so it becomes history
                pass
        first.append(times[0])
        fifth.append(times[-1])
    return {"turn1_s": median(first), "turn5_s": median(fifth), "ratio": median(fifth) / median(first),
            "turn5_prefill_tokens": chat.last_stats.prefill_tokens,
            "turn5_prompt_tokens": chat.last_stats.prompt_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--formats", default="int8,int4",
                    help="quantized formats to measure ('' for none), against float32 generate()")
    ap.add_argument("--drafter", action="store_true",
                    help="also the float32 target with its int4 self-drafter, against the same target alone")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    result = {"benchmark": "decode", "model": "SmolLM2-135M-Instruct (demo)", "tokens": args.tokens,
              "runs": args.runs, "machine": machine(), "rows": []}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        eng = engine.open(dtype=dtype, drafter="none")     # plain decoding: the speculative rows are elsewhere
        eng.stop_ids = frozenset()                          # always decode the full length
        generic = engine.open(dtype=dtype, fast=False, drafter="none")
        generic.stop_ids = frozenset()
        ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": PROMPT}])])
        ref = AutoModelForCausalLM.from_pretrained(eng.checkpoint.path, dtype=eng.dtype).eval()
        contenders = {
            "generate": lambda: generate_once(ref, ids, args.tokens),
            "ours": lambda: ours_once(eng, args.tokens),
            "generic": lambda: ours_once(generic, args.tokens),
        }
        bw = read_bandwidth()
        m = interleaved(args.runs, contenders)
        bw = median([bw, read_bandwidth()])
        ref = generic = contenders = None     # free their weights before the next dtype
        row = {"dtype": dtype, **bound_fields(bw, eng.target.weight_bytes(), m),
               "generate_tps": m["generate"], "ours_tps": m["ours"],
               "ours_generic_forward_tps": m["generic"], "speedup_vs_generate": m["ours"] / m["generate"],
               "generic_speedup_vs_generate": m["generic"] / m["generate"]}
        if dtype == "float32":
            row["ttft"] = ttft_turns(eng, max(1, args.runs // 2))
        result["rows"].append(row)
        print(row, flush=True)
    for fmt in [f for f in args.formats.split(",") if f]:
        row = quantized_row(fmt, args)
        result["rows"].append(row)
        print(row, flush=True)
    if args.drafter:
        row = drafter_row(args)
        result["rows"].append(row)
        print(row, flush=True)
    print("wrote", write_json(args.out, result))


def spec_once(eng, tokens: int) -> tuple[float, float, float]:
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=tokens))
    s = chat.last_stats
    return s.decode_tps, s.tokens_per_pass, s.acceptance


def drafter_row(args) -> dict:
    """The float32 target drafted for by its own int4 copy, against the same target alone
    and float32 generate()."""
    from transformers import AutoModelForCausalLM
    eng = engine.open(dtype="float32", drafter="model", draft_model="self")
    plain = engine.open(dtype="float32", drafter="none")
    for e in (eng, plain):
        e.stop_ids = frozenset()
    ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": PROMPT}])])
    ref = AutoModelForCausalLM.from_pretrained(eng.checkpoint.path, dtype=torch.float32).eval()
    samples = {"generate": [], "drafted": [], "plain": []}
    for _ in range(args.runs + 1):                     # the first round warms up
        samples["generate"].append((generate_once(ref, ids, args.tokens), 1.0, 0.0))
        samples["drafted"].append(spec_once(eng, args.tokens))
        samples["plain"].append(spec_once(plain, args.tokens))
    m = {k: [median([x[i] for x in v[1:]]) for i in range(3)] for k, v in samples.items()}
    return {"weights": "float32 target + int4 self-drafter", "generate_float32_tps": m["generate"][0],
            "drafted_tps": m["drafted"][0], "tokens_per_pass": m["drafted"][1], "acceptance": m["drafted"][2],
            "plain_tps": m["plain"][0], "drafted_vs_plain": m["drafted"][0] / m["plain"][0],
            "drafted_vs_generate_float32": m["drafted"][0] / m["generate"][0]}


def quantized_row(fmt: str, args) -> dict:
    """A quantized target (bf16 activations where native) against float32 generate() in
    the same interleaved run."""
    from transformers import AutoModelForCausalLM
    eng = engine.open(profile=f"resident-{fmt}", drafter="none")
    eng.stop_ids = frozenset()
    ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": PROMPT}])])
    ref = AutoModelForCausalLM.from_pretrained(eng.checkpoint.path, dtype=torch.float32).eval()
    contenders = {"generate": lambda: generate_once(ref, ids, args.tokens),
                  "ours": lambda: ours_once(eng, args.tokens)}
    bw = read_bandwidth()
    m = interleaved(args.runs, contenders)
    bw = median([bw, read_bandwidth()])
    q = eng.target.quant
    row = {"weights": fmt + (f" g{q.group_size}" if q.group_size else ""),
           **bound_fields(bw, eng.target.weight_bytes(), m),
           "act_dtype": str(q.act_dtype).replace("torch.", ""),
           "generate_float32_tps": m["generate"], "ours_tps": m["ours"],
           "ours_vs_generate_float32": m["ours"] / m["generate"]}
    return row


def bound_fields(bandwidth: float, weight_bytes: int, m: dict) -> dict:
    """The bandwidth bound (a step reads every weight once: bytes / measured read
    bandwidth, before and after the run) and each contender of ours as a fraction of it."""
    bound = bandwidth / weight_bytes
    out = {"bandwidth_gbps": bandwidth / 1e9, "weight_bytes": weight_bytes, "bound_tps": bound}
    out.update({f"{k}_vs_bound": v / bound for k, v in m.items() if k != "generate"})
    return out


if __name__ == "__main__":
    main()
