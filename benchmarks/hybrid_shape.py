"""Ours against llama.cpp on a dense hybrid of a real shape: Qwen3.5-2B's text layers (or,
with --size 9b, Qwen3.5-9B's, in 4-bit: its bf16 weights would not fit twice in 24 GB).

The model: Qwen3.5-2B's published text config (shared/models/qwen-hybrid-configs.json:
hidden 2048, 24 layers, three gated delta-net layers to one gated attention layer, MLP
width 6144, 8 query and 2 key/value heads of 256, 16 delta-net heads of 128, tied
embeddings), random bf16 weights (seeded), the demo model's tokenizer (49152 entries: no
Qwen3.5 tokenizer can be fetched here; 1.47 B parameters with it), saved with
`save_pretrained` as Qwen3_5ForCausalLM. llama.cpp reads GGUFs written from it by its own
converter (arch qwen35) and quantizer (Q4_1), as benchmarks/moe_shape.py makes them. Ours
reads the checkpoint in bf16, and int4 in groups of 32 quantized from it; in the gguf-*
rows (gguf-q4km, gguf-q6k, gguf-iq4xs, gguf-q8) the same file llama.cpp reads, from its
blocks (resident-gguf). Same prompt,
greedy, 2 threads each; one row (a format) at a time; rounds interleaved within a row,
medians; the read bound from the read rate measured around each row.

    python benchmarks/hybrid_shape.py [--size 2b|9b] [--layers N] [--rounds 3] [--tokens 48] [--only bf16,q4]

The 9B checkpoint (7.3 B parameters with the demo vocabulary, 14.6 GB in bf16) is written a
tensor at a time (build_by_tensor), since building it whole in float32 would take 29 GB.
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

# Qwen3.5-9B's text config (the shared file, "Qwen/Qwen3.5-9B"): untied, MLP width 12288
SHAPE_9B = dict(SHAPE, hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
                linear_num_value_heads=32, tie_word_embeddings=False)
SIZES = {"2b": (SHAPE, 24, "bf16,q4"), "9b": (SHAPE_9B, 32, "q4")}


def build_by_tensor(folder: Path, layers: int, shape: dict, family: str = "Qwen3_5",
                    shard_bytes: int = 2 << 30) -> Path:
    """As moe_shape.build (vectors as transformers initialises them, matrices normal(0, 0.02),
    bf16, seeded), but written one tensor at a time into shards, never the whole model in
    memory: the vectors of a 4-layer copy stand for every layer of the same kind."""
    hf = folder / "hf"
    if (hf / "config.json").is_file():
        return hf
    import transformers
    from safetensors.torch import save_file
    from common import demo_tokenizer
    tok = demo_tokenizer()
    make = lambda n: getattr(transformers, f"{family}TextConfig")(  # noqa: E731
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, num_hidden_layers=n,
        **shape)
    cfg = make(layers)
    cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    small = make(4)
    small.vocab_size = 8                       # the vectors only: no tables worth building
    small = cls(small).to(torch.bfloat16).state_dict()
    with torch.device("meta"):
        names = cls(cfg).state_dict()
    gen = torch.Generator().manual_seed(0)
    tmp = folder / "hf.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, tmp / name, metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard.clear()
    for name, meta in names.items():
        if meta.dim() > 1:
            t = torch.empty(meta.shape, dtype=torch.float32).normal_(0, 0.02, generator=gen).to(torch.bfloat16)
        else:
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                parts[2] = str(int(parts[2]) % 4)
            t = small[".".join(parts)].clone()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
            size = 0
    if shard:
        flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(m.numel() * 2 for m in names.values())}, "weight_map": weight_map}))
    cfg.architectures = [cls.__name__]
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(hf)
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="2b")
    ap.add_argument("--layers", type=int, help="of the shape's own (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--only", help="rows (default: bf16,q4 for 2b, q4 for 9b)")
    ap.add_argument("--modules", action="store_true",
                    help="also ours with LOCALCHAT_HYBRID_KERNEL=off (transformers' modules), interleaved")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_shape.json"))
    args = ap.parse_args()
    shape, all_layers, rows = SIZES[args.size]
    args.layers = args.layers or all_layers
    args.only = args.only or rows
    if args.size != "2b" and args.out == ap.get_default("out"):
        args.out = str(ROOT / "benchmarks" / "results" / f"hybrid_shape_{args.size}.json")
    from engine import hardware
    amx = "amx_tile" in hardware.cpu_flags()
    if amx:
        no_extra_buffers()
    from llama_cpp import __version__ as llama_version
    cache = checkpoint.default_cache_dir()
    folder = cache / f"hybrid-shape-{args.size}-{args.layers}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf = build(folder, args.layers, shape, "Qwen3_5") if args.size == "2b" else \
        build_by_tensor(folder, args.layers, shape)
    only = [r for r in args.only.split(",") if r]
    files = ggufs(hf, folder, [ROWS[r][1] for r in only], name="hybrid")
    print(f"model and GGUFs ready in {time.perf_counter() - t0:.0f} s", flush=True)
    out_rows, samples, rates = race(hf, files, only, cache, args.rounds, args.tokens, args.modules)
    write_json(args.out, {
        "benchmark": "hybrid_shape", "model": f"Qwen3.5-{args.size.upper()} text shape, {args.layers} of "
                                              f"{all_layers} layers, random bf16, demo tokenizer",
        "shape": shape, "layers": args.layers,
        "params": ModelShape.from_checkpoint(hf).params, "prompt": PROMPT, "max_new_tokens": args.tokens,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "llama_cpp_python": llama_version,
        "llama_cpp_extra_buffers": not amx, "bandwidth_gbps": rates, "machine": machine(), "rows": out_rows,
        "samples": samples, "config": json.loads((hf / "config.json").read_text())})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
