"""Hybrid models on this machine: a random-weight Qwen3.5 text model of a realistic width
(hidden 1024, 16 layers: 12 gated delta-net, 4 attention), resident exact, our engine
against transformers' generate() on the same weights, same dtype, same threads, same run,
interleaved; prefill and decode tok/s; and the memory the cache holds against what the
planner predicted for it. Then every profile (resident exact/int8/int4, streamed exact)
on the --profiles-dtype model against generate() in one interleaved run. Writes JSON
(median of --runs runs).

    python benchmarks/hybrid.py [--runs 3] [--tokens 64] [--dtypes float32,bfloat16]
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
sys.path.insert(0, str(ROOT / "tests"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from decode import generate_once, interleaved  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from tiny import build_model, build_tokenizer  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4


def build(path: Path, dtype: torch.dtype) -> Path:
    """A Qwen3.5 text model of Qwen3.5-0.8B-like width with random weights (the tiny
    builder's hybrid, widened), saved with save_pretrained."""
    return build_model(path, "qwen3_5", layers=16, hidden=1024, tokenizer=build_tokenizer(), seed=0, dtype=dtype)


def ours(eng, tokens: int) -> tuple[float, float]:
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=tokens))
    return chat.last_stats.decode_tps, chat.last_stats.prefill_tps


def generate_prefill(model, ids) -> float:
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=1, do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        return ids.shape[1] / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid.json"))
    ap.add_argument("--profiles-dtype", default="bfloat16", help="the dtype whose model also runs every profile")
    args = ap.parse_args()
    profile_rows = []
    from transformers import AutoModelForCausalLM
    rows = []
    for name in [d for d in args.dtypes.split(",") if d]:
        dtype = getattr(torch, name)
        path = build(Path(tempfile.mkdtemp()) / "qwen3_5-1024x16", dtype)
        eng = engine.open(str(path), dtype=name, drafter="none")
        eng.stop_ids = frozenset()                     # random weights: run every answer to length
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": PROMPT}])])
        res = interleaved(args.runs, {"ours": lambda: ours(eng, args.tokens),
                                      "generate": lambda: (generate_once(ref, ids, args.tokens), generate_prefill(ref, ids))})
        ours_tps, ours_prefill = res["ours"] if isinstance(res["ours"], tuple) else (res["ours"], 0.0)
        gen_tps, gen_prefill = res["generate"] if isinstance(res["generate"], tuple) else (res["generate"], 0.0)
        cache = eng.target.cache
        row = eng.plan.row(eng.plan.chosen)
        shape = engine.planner.ModelShape.from_checkpoint(path)
        rows.append({"dtype": name, "params": shape.params, "layers": shape.layers, "attention_layers": shape.attention_layers,
                     "decode_tps": ours_tps, "generate_decode_tps": gen_tps, "decode_vs_generate": ours_tps / gen_tps,
                     "prefill_tps": ours_prefill, "generate_prefill_tps": gen_prefill,
                     "prefill_vs_generate": ours_prefill / gen_prefill if gen_prefill else None,
                     "state_bytes_held": cache.state_bytes(), "state_bytes_planned": 2 * shape.state_bytes,
                     "kv_bytes_per_token": cache.bytes_per_token(), "kv_bytes_per_token_planned":
                         shape.kv_bytes_per_token(torch.finfo(dtype).bits // 8),
                     "planned_total": row.total, "weights_held": eng.target.weight_bytes(), "weights_planned": row.weights})
        print(rows[-1], flush=True)
        if name == args.profiles_dtype:
            profile_rows = profiles(path, name, ref, ids, args)
    print("wrote", write_json(args.out, {"benchmark": "hybrid", "tokens": args.tokens, "runs": args.runs,
                                         "machine": machine(), "rows": rows, "profiles_dtype": args.profiles_dtype,
                                         "profiles": profile_rows}))


def profiles(path: Path, dtype: str, ref, ids, args) -> list[dict]:
    """Every profile on the same model, interleaved with generate() in one run: resident
    exact, int8 and int4 (transformers' modules over packed weights, bf16 activations),
    and streamed exact with a quarter of the weights resident (the rest read from the
    files, from the page cache on a machine with the RAM for it)."""
    from engine.checkpoint import tensor_index
    weights = sum(e.nbytes for e in tensor_index(path).values())
    engines = {}
    for prof in ("resident-exact", "resident-int8", "resident-int4", "streamed-exact"):
        budget = weights // 4 + (64 << 20) if prof == "streamed-exact" else None
        eng = engine.open(str(path), dtype=dtype, drafter="none", profile=prof, memory_budget=budget, context=1024)
        eng.stop_ids = frozenset()
        engines[prof] = eng
    contenders = {p: (lambda e=e: ours(e, args.tokens)[0]) for p, e in engines.items()}
    contenders["generate"] = lambda: generate_once(ref, ids, args.tokens)
    res = interleaved(args.runs, contenders)
    out = []
    for prof, eng in engines.items():
        info = eng.describe()
        out.append({"profile": prof, "decode_tps": res[prof], "generate_decode_tps": res["generate"],
                    "decode_vs_generate": res[prof] / res["generate"], "weights_held": eng.target.weight_bytes(),
                    "streamed_bytes_per_pass": info.get("streaming", {}).get("streamed_bytes_per_pass", 0)})
        print(out[-1], flush=True)
    for eng in engines.values():
        if hasattr(eng.target, "close"):
            eng.target.close()
    return out


if __name__ == "__main__":
    main()
