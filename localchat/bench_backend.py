"""`localchat bench --backend URL`: the same workloads answered by a server. Measured at
the client from chunk arrival: time to the first token and decode tok/s, median of
--runs; the server's own decode figure beside it when it sends one. (Drafters are the
server's business: a backend bench compares servers, not drafters.)"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def bench_backend(eng, workloads: list[dict], max_tokens: int, runs: int, json_path: str | None) -> list[dict]:
    print(f"{eng.name} · {max_tokens} tokens, greedy, median of {runs}", file=sys.stderr)
    print(f"{'workload':<18} {'kind':<6} {'first token s':>13} {'decode tok/s':>12} {'server tok/s':>12} {'tokens':>6}")
    rows = []
    for w in workloads:
        got = []
        for _ in range(runs):
            chat = eng.chat()
            list(chat.send(w["prompt"], max_new_tokens=max_tokens, temperature=0.0))
            if chat.last_done.reason == "error":
                from .remote import BackendError
                raise BackendError(chat.last_done.error)
            s = chat.last_stats
            got.append({"ttft_s": s.ttft_seconds, "decode_tps": s.decode_tps,
                        "server_decode_tps": s.server_decode_tps, "tokens": s.generated_tokens})
        row = {"id": w["id"], "kind": w["kind"], **{k: statistics.median(r[k] for r in got) for k in got[0]},
               "runs": got}
        rows.append(row)
        server = f"{row['server_decode_tps']:>12.1f}" if row["server_decode_tps"] else f"{'-':>12}"
        print(f"{w['id'][:18]:<18} {w['kind'][:6]:<6} {row['ttft_s']:>13.3f} {row['decode_tps']:>12.1f} {server} "
              f"{int(row['tokens']):>6}", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"backend": eng.url, "model": eng.model, "max_tokens": max_tokens,
                                               "runs": runs, "workloads": rows}, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return rows
