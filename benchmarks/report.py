"""Print the Markdown tables of the README from benchmarks/results/*.json."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def decode_table(d: dict) -> str:
    lines = ["| dtype | `generate()` tok/s | localchat tok/s | speed-up | generic forward tok/s |",
             "|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['dtype']} | {r['generate_tps']:.1f} | **{r['ours_tps']:.1f}** | "
                     f"**{r['speedup_vs_generate']:.2f}×** | {r['ours_generic_forward_tps']:.1f} "
                     f"({r['generic_speedup_vs_generate']:.2f}×) |")
    ttft = next((r["ttft"] for r in d["rows"] if "ttft" in r), None)
    if ttft:
        lines.append("")
        lines.append(f"Time to first token, same-length messages: turn 1 {ttft['turn1_s'] * 1000:.0f} ms, "
                     f"turn 5 {ttft['turn5_s'] * 1000:.0f} ms (**{ttft['ratio']:.2f}×**; turn 5 prefilled "
                     f"{ttft['turn5_prefill_tokens']} of its {ttft['turn5_prompt_tokens']} prompt tokens).")
    return "\n".join(lines)


def speculative_table(d: dict) -> str:
    drafters = [k for k in ("ngram", "model") if k in d["rows"][0]]
    head = "| workload | kind | plain tok/s |"
    sep = "|---|---|---|"
    for k in drafters:
        head += f" {k}: tok/s | speed-up | tok/pass (predicted) | acceptance | identical |"
        sep += "---|---|---|---|---|"
    lines = [head, sep]
    for r in d["rows"]:
        line = f"| {r['id']} | {r['kind']} | {r['plain_tps']:.1f} |"
        for k in drafters:
            x = r[k]
            line += (f" {x['tps']:.1f} | {x['speedup']:.2f}× | {x['tokens_per_pass']:.2f} "
                     f"({x['predicted_tokens_per_pass']:.2f}) | {x['acceptance']:.0%} | "
                     f"{'yes' if x['identical'] else 'NO'} |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    for name, render in (("decode.json", decode_table), ("speculative.json", speculative_table),
                         ("speculative-bf16.json", speculative_table)):
        path = RESULTS / name
        if path.is_file():
            d = json.loads(path.read_text())
            m = d.get("machine", {})
            print(f"### {name} — {m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, "
                  f"{d.get('dtype', '')} {d.get('date', m.get('date', ''))}\n")
            print(render(d))
            print()


if __name__ == "__main__":
    main()
