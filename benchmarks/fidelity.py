"""Fidelity of the quantized targets on the demo model, against the exact (float32) model,
teacher-forced on the held texts in engine/data (public-domain prose, simple Python), and on
the exact model's own greedy answers to a few prompts (the text a chat actually produces).
Top-1 agreement, mean KL(exact || candidate) and perplexity. Writes JSON.

    python benchmarks/fidelity.py [--out benchmarks/results/fidelity.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from engine import fidelity  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from engine.targets.quantized import load_quantized  # noqa: E402
from engine.targets.resident import load_resident  # noqa: E402

HELD = {"prose": "held_prose.txt", "code": "held_code.py.txt"}
PROMPTS = ["Why is the sky blue?", "Write a Python function that checks whether a string is a palindrome.",
           "Tell me a short story about a lighthouse keeper."]
# (name, weights, group, embeddings, activations): bf16 where native (None, the default);
# the float32 rows isolate what the weight format costs from what bf16 activations cost.
# name, weights, group, embeddings, head, activations (None: bf16 where the CPU has it)
VARIANTS = [("int8", "int8", 32, False, "int8", None), ("int8 head-exact", "int8", 32, False, "exact", None),
            ("int8+emb", "int8", 32, True, "int8", None),
            ("int4-g32", "int4", 32, False, "int8", None), ("int4-g32 head-exact", "int4", 32, False, "exact", None),
            ("int4-g32+emb", "int4", 32, True, "int8", None), ("int4-g64", "int4", 64, False, "int8", None),
            ("int8 fp32-act", "int8", 32, False, "int8", torch.float32),
            ("int4-g32 fp32-act", "int4", 32, False, "int8", torch.float32),
            ("int4-g32 head-exact fp32-act", "int4", 32, False, "exact", torch.float32)]


def greedy_answers(eng, tokens: int) -> list[list[int]]:
    """Prompt + the exact model's greedy answer, as token ids."""
    eng.stop_ids = frozenset()
    out = []
    for p in PROMPTS:
        chat = eng.chat()
        done = list(chat.send(p, max_new_tokens=tokens))[-1]
        out.append(render_prompt(eng.tokenizer, [{"role": "user", "content": p}]) + list(done.token_ids))
    return out


def simulated_int8(path, group: int | None):
    """An exact float32 target whose decoder matrices are replaced by symmetric int8
    round-trips with one scale per `group` inputs (None: per output channel, the shipped
    format). No kernel runs int8 with group scales; this measures only what such a format
    would cost in fidelity, to tell the format's error from the model's sensitivity."""
    t = load_resident(path, torch.device("cpu"), torch.float32)
    for lw in t.impl.layers:
        for field in ("qkv", "o", "gate_up", "down"):
            w_t = getattr(lw, field)                     # [in, out] view of the [out, in] weight
            w = w_t.t()
            rows = w.reshape(w.shape[0], -1, group or w.shape[1])
            s = (rows.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
            with torch.no_grad():
                w.copy_((torch.round(rows / s).clamp(-128, 127) * s).view_as(w))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fidelity.json"))
    args = ap.parse_args()
    eng = engine.open(dtype="float32", drafter="none")
    path, cpu = eng.checkpoint.path, torch.device("cpu")
    texts = {k: [eng.tokenizer((ROOT / "engine" / "data" / f).read_text())["input_ids"]] for k, f in HELD.items()}
    texts["own answers"] = greedy_answers(eng, args.answer_tokens)
    exact = eng.target
    candidates = {"exact-bf16": load_resident(path, cpu, torch.bfloat16)}
    for group in (None, 64, 32):
        candidates[f"sim int8 {'g' + str(group) if group else 'per-channel'} fp32-act"] = simulated_int8(path, group)
    loads = {}
    for name, fmt, group, emb, head, act in VARIANTS:
        t = time.perf_counter()
        candidates[name] = load_quantized(path, cpu, fmt, group_size=group, embeddings=emb, head=head, act_dtype=act)
        loads[name] = {"seconds": time.perf_counter() - t, "cache_hit": candidates[name].quant.cache_hit}
    rows = []
    for text, ids in texts.items():
        res = fidelity.compare(exact, candidates, ids)
        for name, f in res.items():
            row = {"text": text, "variant": name, **f.as_dict()}
            rows.append(row)
            print(f"{text:12} {name:30} top1 {f.top1_agreement:.4f}  KL {f.mean_kl:.5f}  "
                  f"ppl {f.ppl_candidate:.3f} (exact {f.ppl_reference:.3f})  n={f.tokens}", flush=True)
    out = {"benchmark": "fidelity", "model": eng.name, "reference": "exact float32",
           "activations": str(candidates["int8"].dtype).replace("torch.", ""),
           "texts": {k: sum(len(i) for i in v) for k, v in texts.items()},
           "loads": loads, "machine": machine(), "rows": rows}
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
