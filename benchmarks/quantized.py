"""Resident weight bytes and decode speed of the quantized targets on the demo model, against
Hugging Face generate() in float32 and our exact (float32) target, in the same run:
plain decoding and with the n-gram drafter, greedy, interleaved runs, median of --runs.
Writes JSON.

    python benchmarks/quantized.py [--runs 3] [--tokens 128]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from decode import PROMPT, generate_once, interleaved, ours_once  # noqa: E402
from engine.drafters import NgramDrafter, NoDrafter  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from engine.targets.quantized import load_quantized  # noqa: E402

# name -> (weights, embeddings quantized too)
VARIANTS = {"int8": ("int8", False), "int4": ("int4", False), "int8+emb": ("int8", True), "int4+emb": ("int4", True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    exact = engine.open(dtype="float32", drafter="none")
    ckpt, tok, cpu = exact.checkpoint, exact.tokenizer, torch.device("cpu")
    engines, loads = {"exact": exact}, {}
    scratch = tempfile.TemporaryDirectory(prefix="qcache-")    # an empty cache: the first load quantizes
    for name, (fmt, emb) in VARIANTS.items():
        cold = load_quantized(ckpt.path, cpu, fmt, embeddings=emb, cache_dir=Path(scratch.name))
        t = time.perf_counter()
        target = load_quantized(ckpt.path, cpu, fmt, embeddings=emb, cache_dir=Path(scratch.name))
        loads[name] = {"cold_quantize_s": cold.quant.load_seconds, "cache_hit_s": time.perf_counter() - t,
                       "cold_was_miss": not cold.quant.cache_hit, "second_was_hit": target.quant.cache_hit}
        del cold
        engines[name] = engine.Engine(ckpt, tok, target, drafter=NoDrafter())
    scratch.cleanup()
    for eng in engines.values():
        eng.stop_ids = frozenset()                          # always decode the full length
    ref = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    ids = torch.tensor([render_prompt(tok, [{"role": "user", "content": PROMPT}])])

    def run(eng, drafter):
        def once():
            eng.drafter = drafter()
            try:
                return ours_once(eng, args.tokens)
            finally:
                eng.drafter = NoDrafter()
        return once

    contenders = {"generate-float32": lambda: generate_once(ref, ids, args.tokens)}
    for name, eng in engines.items():
        contenders[name] = run(eng, NoDrafter)
        contenders[name + " ngram"] = run(eng, NgramDrafter)
    tps = interleaved(args.runs, contenders)
    base_bytes = exact.target.weight_bytes()
    rows = []
    for name, eng in engines.items():
        for drafter in ("plain", "ngram"):
            key = name if drafter == "plain" else name + " ngram"
            rows.append({"target": name, "drafter": drafter, "decode_tps": tps[key],
                         "vs_generate_float32": tps[key] / tps["generate-float32"],
                         "weight_bytes": eng.target.weight_bytes(),
                         "bytes_vs_float32": eng.target.weight_bytes() / base_bytes})
            print(rows[-1], flush=True)
    out = {"benchmark": "quantized", "model": exact.name, "tokens": args.tokens, "runs": args.runs,
           "activations": str(engines["int8"].target.dtype).replace("torch.", ""),
           "generate_float32_tps": tps["generate-float32"], "loads": loads, "machine": machine(), "rows": rows}
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
