"""Print the Markdown tables of the README from benchmarks/results/*.json."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def decode_table(d: dict) -> str:
    """One row per exact dtype and per quantized format, against float32 (or same-dtype)
    generate() and the bandwidth bound of the same run."""
    lines = ["| weights | `generate()` tok/s | localchat tok/s | vs `generate()` | bound tok/s (GB/s) | vs bound |",
             "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        if "drafted_tps" in r:
            continue
        name = r.get("dtype") or f"{r['weights']} ({r['act_dtype']} act.; vs float32 `generate()`)"
        gen = r.get("generate_tps") or r["generate_float32_tps"]
        ours, share = r["ours_tps"], r["ours_vs_bound"]
        lines.append(f"| {name} | {gen:.1f} | **{ours:.1f}** | {ours / gen:.2f}× | "
                     f"{r['bound_tps']:.1f} ({r['bandwidth_gbps']:.1f}) | {share:.2f}× |")
    ttft = next((r["ttft"] for r in d["rows"] if "ttft" in r), None)
    if ttft:
        lines.append("")
        lines.append(f"Time to first token, same-length messages: turn 1 {ttft['turn1_s'] * 1000:.0f} ms, "
                     f"turn 5 {ttft['turn5_s'] * 1000:.0f} ms (**{ttft['ratio']:.2f}×**; turn 5 prefilled "
                     f"{ttft['turn5_prefill_tokens']} of its {ttft['turn5_prompt_tokens']} prompt tokens).")
    return "\n".join(lines)


def speculative_table(d: dict) -> str:
    drafters = [k for k in ("ngram", "model") if k in d["rows"][0]]
    ceiling = "lookup_ceiling" in d["rows"][0]
    head = "| workload | kind | plain tok/s |" + (" lookup ceiling: tok/pass | speed-up |" if ceiling else "")
    sep = "|---|---|---|" + ("---|---|" if ceiling else "")
    for k in drafters:
        head += f" {k}: tok/s | speed-up | tok/pass (predicted) | acceptance | identical |"
        sep += "---|---|---|---|---|"
    lines = [head, sep]
    for r in d["rows"]:
        line = f"| {r['id']} | {r['kind']} | {r['plain_tps']:.1f} |"
        if ceiling:
            c = r["lookup_ceiling"]
            line += f" {c['tokens_per_pass']:.2f} | {c['speedup']:.2f}× |"
        for k in drafters:
            x = r[k]
            line += (f" {x['tps']:.1f} | {x['speedup']:.2f}× | {x['tokens_per_pass']:.2f} "
                     f"({x['predicted_tokens_per_pass']:.2f}) | {x['acceptance']:.0%} | "
                     f"{'yes' if x['identical'] else 'NO'} |")
        lines.append(line)
    return "\n".join(lines)


def streamed_table(d: dict) -> str:
    p, r = d["placement"], d["decode"]
    lines = [f"Weight budget {d['weight_budget'] / 1e6:.0f} MB of {d['model_bytes'] / 1e6:.0f} MB "
             f"({p['resident_layers']} of 30 layers resident, {p['streamed_bytes_per_pass'] / 1e6:.0f} MB streamed "
             f"a pass); pread alone: warm {d['read_rate']['warm_gbps']:.1f} GB/s, cold {d['read_rate']['cold_gbps']:.1f} GB/s.",
             "",
             "| mode | tok/s | vs resident | pass ms | transfer bound ms | target: 1.25×bound + resident pass | "
             "achieved GB/s | hidden | identical |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| resident (all held) | {r['resident']['tps']:.1f} | 1.00× | {r['resident']['pass_ms']:.0f} | – | – | – | – | – |"]
    for mode in ("warm", "cold"):
        x = r[mode]
        lines.append(f"| streamed, {mode} | {x['tps']:.1f} | {x['vs_resident']:.2f}× | {x['pass_ms']:.0f} | "
                     f"{x['transfer_bound_ms']:.0f} | {x['target_ms']:.0f} ({'met' if x['within_target'] else 'missed'}) | "
                     f"{x['achieved_gbps']:.1f} | {x['hidden']:.0%} | {'yes' if x['identical_to_resident'] else 'NO'} |")
    a = d.get("airllm") or {}
    if "tok_per_s" in a:
        lines += ["", f"AirLLM {a['airllm_version']} on the same model and prompt: {a['tok_per_s']:.3f} tok/s; "
                      f"streamed warm is **{a['streamed_warm_vs_airllm']:.0f}×** and cold "
                      f"**{a['streamed_cold_vs_airllm']:.0f}×** that."]
    if d.get("copy_workloads"):
        lines += ["", "| copy workload (streamed) | plain tok/s | + n-gram tok/s | speed-up | tok/pass | acceptance | identical |",
                  "|---|---|---|---|---|---|---|"]
        for c in d["copy_workloads"]:
            lines.append(f"| {c['id']} | {c['plain_tps']:.1f} | {c['ngram_tps']:.1f} | {c['speedup']:.2f}× | "
                         f"{c['tokens_per_pass']:.2f} | {c['acceptance']:.0%} | {'yes' if c['identical'] else 'NO'} |")
    return "\n".join(lines)


def peers_table(d: dict) -> str:
    """Ours against llama.cpp on the same weights (benchmarks/peers.py): the README's headline."""
    names = {"f32": "float32", "bf16": "bfloat16", "q8": "8-bit (ours int8 per channel, llama.cpp Q8_0)",
             "q4": "4-bit (ours int4 g32, llama.cpp Q4_1)"}
    lines = ["| weights | decode tok/s: localchat | llama.cpp | **ratio** | prefill tok/s: localchat | llama.cpp "
             "| **ratio** |", "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        o, p = r["ours"], r["llama_cpp"]
        lines.append(f"| {names.get(r['row'], r['row'])} | {o['decode_tps']:.1f} | {p['decode_tps']:.1f} | "
                     f"**{r['decode_ratio']:.2f}×** | {o['prefill_tps']:.0f} | {p['prefill_tps']:.0f} | "
                     f"**{r['prefill_ratio']:.2f}×** |")
    return "\n".join(lines)


def gguf_table(d: dict) -> str:
    """GGUF files run as stored, ours against llama.cpp on the same file (benchmarks/gguf_peers.py)."""
    lines = ["| file | its matrices | decode tok/s: localchat | llama.cpp | **ratio** | prefill tok/s: localchat "
             "| llama.cpp | **ratio** |", "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        o, p = r["ours"], r["llama_cpp"]
        mix = ", ".join(f"{k} {n}" for k, n in r["formats"].items())
        lines.append(f"| {r['format']} | {mix} | {o['decode_tps']:.1f} | {p['decode_tps']:.1f} | "
                     f"**{r['decode_ratio']:.2f}×** | {o['prefill_tps']:.0f} | {p['prefill_tps']:.0f} | "
                     f"**{r['prefill_ratio']:.2f}×** |")
    return "\n".join(lines)


def gguf_fidelity_table(d: dict) -> str:
    """Each engine against the file's own weights run exactly (benchmarks/gguf_fidelity.py)."""
    lines = ["| file | tokens | KL: localchat | llama.cpp | top-1: localchat | llama.cpp |", "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        o, p = r["ours"], r["llama_cpp"]
        lines.append(f"| {r['format']} | {o['tokens']} | {o['mean_kl']:.1e} | {p['mean_kl']:.1e} | "
                     f"{o['top1_agreement']:.2%} | {p['top1_agreement']:.2%} |")
    return "\n".join(lines)


def main() -> None:
    for name, render in (("peers.json", peers_table), ("peers-xeon.json", peers_table), ("decode.json", decode_table),
                         ("speculative.json", speculative_table), ("speculative-bf16.json", speculative_table),
                         ("speculative-self-int4.json", speculative_table), ("streamed.json", streamed_table),
                         ("gguf_peers.json", gguf_table), ("gguf_fidelity.json", gguf_fidelity_table)):
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
