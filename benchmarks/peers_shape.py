"""Ours against llama.cpp on a model of a real shape: the demo model's 135 M
shapes are dominated by per-operator overhead, and people run models 10-100x larger.

The model: Qwen3-1.7B's published shape (hidden 2048, 28 layers, 16 query and 8 key/value
heads of 128, feed-forward 6144, tied embeddings, rope theta 1e6) as a Llama-family
checkpoint with random bf16 weights (seeded), built with transformers and saved with
`save_pretrained`; its vocabulary is the demo model's tokenizer (49152 entries, against
Qwen3's 151936: no Qwen3 tokenizer can be fetched here), so it has 1.5 B parameters rather
than 1.7 B. llama.cpp reads GGUFs written from it: F32 (tests/gguf_writer.py: gguf-py's
own tensor names), then BF16, Q8_0 and Q4_1 from that (benchmarks/gguf_formats.py); ours the
checkpoint itself in bf16, and int8 per channel and int4 in groups of 32 quantized from it. Same prompt token
ids, greedy, 2 threads each, interleaved rounds, medians.

    python benchmarks/peers_shape.py [--rounds 3] [--tokens 64] [--only bf16,q8,q4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

from common import demo_tokenizer, machine, write_json  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from peers import PROMPT, decoded_by, interleaved, llama_once, open_ours, ours_once  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=1e6,
             rms_norm_eps=1e-6, tie_word_embeddings=True)
ROWS = {"bf16": ({"dtype": "bfloat16"}, "BF16"), "q8": ({"profile": "resident-int8"}, "Q8_0"),
        "q4": ({"profile": "resident-int4"}, "Q4_1")}


def build(folder: Path) -> Path:
    """The checkpoint, once (its config.json is written last: a half-built one is redone)."""
    hf = folder / "hf"
    if (hf / "config.json").is_file():
        return hf
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = demo_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      **SHAPE)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = folder / "hf.partial"
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.replace(hf)
    return hf


def ggufs(hf: Path, folder: Path) -> dict[str, Path]:
    import gguf_formats
    from gguf_writer import write_gguf
    f32 = folder / "shape-F32.gguf"
    if not f32.exists():
        write_gguf(hf, folder / "shape-F32.partial.gguf").replace(f32)
    return {fmt: gguf_formats.write(f32, folder / f"shape-{fmt}.gguf", fmt) for fmt in ("BF16", "Q8_0", "Q4_1")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers_shape.json"))
    args = ap.parse_args()
    from llama_cpp import Llama, __version__ as llama_version
    cache = checkpoint.default_cache_dir()
    folder = cache / "peers-shape"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf = build(folder)
    files = ggufs(hf, folder)
    print(f"model and GGUFs ready in {time.perf_counter() - t0:.0f} s", flush=True)
    threads = torch.get_num_threads()
    rows = [r for r in args.only.split(",") if r]
    contenders = {}
    for r in rows:
        kw, fmt = ROWS[r]
        t0 = time.perf_counter()
        contenders[f"ours {r}"] = (ours_once, open_ours({"model": str(hf), **kw}, cache))
        print(f"ours {r}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        contenders[f"llama.cpp {fmt}"] = (llama_once, Llama(model_path=str(files[fmt]), n_ctx=1024, n_batch=512,
                                                            n_threads=threads, n_threads_batch=threads,
                                                            verbose=False))
    tok = next(e for f, e in contenders.values() if f is ours_once).tokenizer
    ids = render_prompt(tok, [{"role": "user", "content": PROMPT}])

    samples, (bw_before, bw_after), fig = interleaved(contenders, ids, args.tokens, -1, args.rounds)
    out_rows = []
    for r in rows:
        fmt = ROWS[r][1]
        ours, peer = fig(f"ours {r}"), fig(f"llama.cpp {fmt}")
        row = {"row": r, "llama_format": fmt, "ours": ours, "llama_cpp": peer,
               "decode_ratio": round(ours["decode_tps"] / peer["decode_tps"], 3),
               "prefill_ratio": round(ours["prefill_tps"] / peer["prefill_tps"], 3),
               **decoded_by(contenders[f"ours {r}"][1])}
        out_rows.append(row)
        print(f"{r:5s} ({row['ours_decodes']}) decode ours {ours['decode_tps']:6.2f} llama.cpp {peer['decode_tps']:6.2f} "
              f"({row['decode_ratio']:.2f}x)  prefill ours {ours['prefill_tps']:6.0f} "
              f"llama.cpp {peer['prefill_tps']:6.0f} ({row['prefill_ratio']:.2f}x)", flush=True)
    write_json(args.out, {
        "benchmark": "peers_shape", "model": "Qwen3-1.7B shape, Llama family, random bf16, demo tokenizer",
        "shape": SHAPE, "prompt": PROMPT, "prompt_tokens": len(ids), "max_new_tokens": args.tokens,
        "rounds": args.rounds, "threads": threads, "llama_cpp_python": llama_version,
        "bandwidth_gbps": [round(bw_before / 1e9, 1), round(bw_after / 1e9, 1)], "machine": machine(),
        "rows": out_rows, "samples": {k: [list(map(lambda v: round(v, 2), x)) for x in s] for k, s in samples.items()}})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
