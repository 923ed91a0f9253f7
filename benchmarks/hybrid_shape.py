"""Ours against llama.cpp on a dense hybrid of a real shape: Qwen3.5-2B's text layers.

The model: Qwen3.5-2B's published text config (shared/models/qwen-hybrid-configs.json:
hidden 2048, 24 layers, three gated delta-net layers to one gated attention layer, MLP
width 6144, 8 query and 2 key/value heads of 256, 16 delta-net heads of 128, tied
embeddings), random bf16 weights (seeded), the demo model's tokenizer (49152 entries: no
Qwen3.5 tokenizer can be fetched here; 1.47 B parameters with it), saved with
`save_pretrained` as Qwen3_5ForCausalLM. llama.cpp reads GGUFs written from it by its own
converter (arch qwen35) and quantizer (Q4_1), as benchmarks/moe_shape.py makes them. Ours
reads the checkpoint in bf16, and int4 in groups of 32 quantized from it. Same prompt,
greedy, 2 threads each; one row (a format) at a time; rounds interleaved within a row,
medians; the read bound from the read rate measured around each row.

    python benchmarks/hybrid_shape.py [--layers 24] [--rounds 3] [--tokens 48] [--only bf16,q4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

from common import machine, write_json  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.planner import ModelShape  # noqa: E402
from moe_shape import ROWS, build, ggufs, no_extra_buffers, race  # noqa: E402
from peers import PROMPT  # noqa: E402

# Qwen3.5-2B's text config (shared/models/qwen-hybrid-configs.json, "Qwen/Qwen3.5-2B")
SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
             max_position_embeddings=4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--only", default="bf16,q4")
    ap.add_argument("--modules", action="store_true",
                    help="also ours with LOCALCHAT_HYBRID_KERNEL=off (transformers' modules), interleaved")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_shape.json"))
    args = ap.parse_args()
    from engine import hardware
    amx = "amx_tile" in hardware.cpu_flags()
    if amx:
        no_extra_buffers()
    from llama_cpp import __version__ as llama_version
    cache = checkpoint.default_cache_dir()
    folder = cache / f"hybrid-shape-2b-{args.layers}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf = build(folder, args.layers, SHAPE, "Qwen3_5")
    only = [r for r in args.only.split(",") if r]
    files = ggufs(hf, folder, [ROWS[r][1] for r in only], name="hybrid")
    print(f"model and GGUFs ready in {time.perf_counter() - t0:.0f} s", flush=True)
    out_rows, samples, rates = race(hf, files, only, cache, args.rounds, args.tokens, args.modules)
    write_json(args.out, {
        "benchmark": "hybrid_shape", "model": f"Qwen3.5-2B text shape, {args.layers} of 24 layers, random bf16, "
                                              "demo tokenizer", "shape": SHAPE, "layers": args.layers,
        "params": ModelShape.from_checkpoint(hf).params, "prompt": PROMPT, "max_new_tokens": args.tokens,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "llama_cpp_python": llama_version,
        "llama_cpp_extra_buffers": not amx, "bandwidth_gbps": rates, "machine": machine(), "rows": out_rows,
        "samples": samples, "config": json.loads((hf / "config.json").read_text())})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
