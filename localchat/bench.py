"""`localchat bench`: measure speculative decoding on this machine, for your model and
your text. For each workload, plain decoding against each available drafter: decode
tok/s, tokens per target pass, acceptance, speed-up, and whether the output was
identical (greedy, so it must be). The `ceiling` column is the speed-up a perfect
prompt-lookup drafter could reach on the answer the model actually gave (free drafts,
this machine's pass times): if it is low, the text does not repeat enough to pay."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from importlib import resources
from pathlib import Path

from .argparsing import Parser
from .common import (EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_backend_flags, add_model_flags, error, load_settings,
                     open_engine, quiet_libraries)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat bench", description=__doc__)
    add_model_flags(p)
    add_backend_flags(p)
    p.add_argument("--workloads", metavar="FILE",
                   help="JSONL, one {\"id\", \"kind\", \"prompt\"} per line (default: a built-in set of "
                        "code, prose and copy-heavy tasks)")
    p.add_argument("--max-tokens", "-n", type=int, default=128, metavar="N", help="tokens per answer (default 128)")
    p.add_argument("--runs", type=int, default=1, metavar="R", help="runs per measurement; the median is kept")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    return p


def load_workloads(path: str | None) -> list[dict]:
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--workloads {path}: cannot read ({exc})") from None
        source = path
    else:
        text = resources.files("localchat").joinpath("data/workloads.jsonl").read_text(encoding="utf-8")
        source = "built-in workloads"
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
                raise ValueError("no \"prompt\" text")
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{source} line {n}: not a workload ({exc}); "
                             "expected {\"id\": ..., \"kind\": ..., \"prompt\": ...}") from None
        items.append({"id": str(item.get("id", f"#{n}")), "kind": str(item.get("kind", "")),
                      "prompt": item["prompt"]})
    if not items:
        raise ValueError(f"{source}: no workloads in it")
    return items


def measure(eng, prompt: str, max_tokens: int, runs: int) -> dict:
    results = []
    for _ in range(runs):
        chat = eng.chat()
        list(chat.send(prompt, max_new_tokens=max_tokens))
        s = chat.last_stats
        results.append({"decode_tps": s.decode_tps, "tokens_per_pass": s.tokens_per_pass,
                        "acceptance": s.acceptance, "predicted_tokens_per_pass": s.predicted_tokens_per_pass,
                        "tokens": s.generated_tokens, "token_ids": list(chat.last_done.token_ids),
                        "context_ids": context_ids(chat)})
    best = sorted(results, key=lambda r: r["decode_tps"])[len(results) // 2]
    best["decode_tps"] = statistics.median(r["decode_tps"] for r in results)
    return best


def context_ids(chat) -> list[int]:
    """The tokens the answer's first pass saw: the prompt (the cache holds the prompt and
    every generated token but the last)."""
    held = chat.cached_ids
    return list(held[:len(held) - max(0, len(chat.last_done.token_ids) - 1)])


def lookup_ceiling(context: list[int], answer: list[int], max_draft: int = 8) -> list[int]:
    """What the best possible prompt-lookup drafter could do for this answer: the tokens
    committed by each target pass if every draft were the longest run of the answer's
    next tokens that occurs anywhere earlier in the conversation (capped at max_draft),
    plus the target's own token. No real drafter knows the answer, so this is an upper
    bound: it tells a user whether a workload's text can pay for speculation at all."""
    rounds, i = [], 0
    while i < len(answer):
        seen = context + answer[:i + 1]       # the pass feeds answer[i]; drafts follow it
        want = answer[i + 1:i + 1 + max_draft]
        best = 0
        for start in range(len(seen) - 1):
            n = 0
            while n < len(want) and start + n < len(seen) - 1 and seen[start + n] == want[n]:
                n += 1
            best = max(best, n)
            if best == len(want):
                break
        rounds.append(best + 1)
        i += best + 1
    return rounds


def pass_seconds(eng, max_positions: int = 9, reps: int = 3) -> dict[int, float]:
    """Median seconds of one target pass over n positions (n = 1..max_positions) at the
    end of whatever the cache holds; the cache is left as it was."""
    import time
    target = eng.target
    start = target.cache.length
    max_positions = min(max_positions, eng.max_draft + 1)      # what a verify pass may record
    tokens = [eng.tokenizer.eos_token_id or 0] * max_positions
    out = {}
    for n in range(1, max_positions + 1):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            # recorded as a verify pass is: a hybrid's recurrent state goes back only so
            with target.cache.record():
                target.forward(tokens[:n], all_logits=True)
            times.append(time.perf_counter() - t0)
            target.cache.rollback(start)
        out[n] = statistics.median(times)
    return out


def ceiling_speedup(rounds: list[int], seconds: dict[int, float]) -> float:
    """The speed-up those ceiling rounds would give, drafting for free, at these pass times."""
    if not rounds:
        return 1.0
    return sum(rounds) * seconds[1] / sum(seconds[min(n, max(seconds))] for n in rounds)


def bench_main(argv: list[str]) -> int:
    import engine

    args = build_parser().parse_args(argv)
    if args.max_tokens <= 1 or args.runs < 1:
        error("--max-tokens must be at least 2 and --runs at least 1")
        return EXIT_USAGE
    try:
        workloads = load_workloads(args.workloads)
    except ValueError as exc:
        error(str(exc))
        return EXIT_USAGE
    settings = load_settings(args)
    if settings is None:
        return EXIT_USAGE
    quiet_libraries()
    try:
        eng = open_engine(settings, api_key=args.api_key)
    except engine.EngineError as exc:
        error(str(exc))
        return EXIT_USAGE
    try:
        if settings.backend:
            from .bench_backend import bench_backend
            bench_backend(eng, workloads, args.max_tokens, args.runs, args.json)
            return EXIT_OK
        drafters = ["ngram"] + (["model"] if settings.draft_model else []) + (["mtp"] if eng.has_mtp() else [])
        rows = bench_local(eng, settings, workloads, drafters, args)
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except engine.EngineError as exc:
        error(str(exc))
        return EXIT_FAIL
    if args.json:
        out = {"model": eng.name, "engine": eng.describe(), "max_tokens": args.max_tokens, "runs": args.runs,
               "workloads": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return EXIT_OK if all(r[d]["identical"] for r in rows for d in drafters) else EXIT_FAIL


def bench_local(eng, settings, workloads: list[dict], drafters: list[str], args) -> list[dict]:
    """Each workload decoded plain and with each drafter, a line each as it is measured."""
    rows = []
    print(f"{eng.name} · {eng.describe()['dtype']} · {eng.device} · {args.max_tokens} tokens, greedy, "
          f"median of {args.runs}", file=sys.stderr)
    header = f"{'workload':<18} {'kind':<6} {'plain tok/s':>11} {'ceiling':>7}"
    for d in drafters:
        header += f" │ {d + ' tok/s':>12} {'speed-up':>8} {'tok/pass':>8} {'accept':>6} {'same':>4}"
    print(header)
    for w in workloads:
        eng.set_drafter("none")
        plain = measure(eng, w["prompt"], args.max_tokens, args.runs)
        rounds = lookup_ceiling(plain["context_ids"], plain["token_ids"])
        ceiling = ceiling_speedup(rounds, pass_seconds(eng))
        row = {"id": w["id"], "kind": w["kind"], "plain": _public(plain),
               "lookup_ceiling": {"tokens_per_pass": len(plain["token_ids"]) / len(rounds),
                                  "speedup": ceiling}}
        line = f"{w['id'][:18]:<18} {w['kind'][:6]:<6} {plain['decode_tps']:>11.1f} {ceiling:>6.2f}×"
        for d in drafters:
            eng.set_drafter(d, settings.draft_model, dtype=settings.dtype)
            r = measure(eng, w["prompt"], args.max_tokens, args.runs)
            r["speedup"] = r["decode_tps"] / plain["decode_tps"] if plain["decode_tps"] else 0.0
            r["identical"] = r["token_ids"] == plain["token_ids"]
            row[d] = _public(r)
            line += (f" │ {r['decode_tps']:>12.1f} {r['speedup']:>7.2f}× {r['tokens_per_pass']:>8.2f} "
                     f"{r['acceptance']:>6.0%} {'yes' if r['identical'] else 'NO':>4}")
        print(line, flush=True)
        rows.append(row)
    return rows


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("token_ids", "context_ids")}
