"""Where compiled bfloat16 decoding leaves eager bfloat16 decoding, and how close the call
was (issue 7): other kernels round bf16 differently, so greedy answers may part at a token
whose two best candidates were nearly tied. For each prompt, greedy answers from the eager
step and from the compiled step (engine/compile/step.py, waited for), the first token where
they differ, and the eager model's top-2 logit margin there (teacher-forced on the shared
prefix). Float32 eager against bf16 eager is reported the same way, for scale. Writes JSON.

    python benchmarks/compiled_divergence.py [--tokens 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from engine.session import render_prompt  # noqa: E402

PROMPTS = ["Why is the sky blue?", "Write a Python function that checks whether a string is a palindrome.",
           "Tell me a short story about a lighthouse keeper.", "List three uses of copper.",
           "Explain recursion to a child."]


def greedy(eng, prompt: str, tokens: int) -> list[int]:
    chat = eng.chat()
    return list(list(chat.send(prompt, max_new_tokens=tokens))[-1].token_ids)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(eng, prompt_ids: list[int], prefix: list[int]) -> dict:
    """The eager target's logits after prompt + prefix: its best two tokens and their gap."""
    t = eng.target
    eng.cache_owner = None
    t.cache.rollback(0)
    logits = t.forward(prompt_ids + prefix)[-1].float()
    t.cache.rollback(0)
    top = torch.topk(logits, 2)
    return {"top2_margin": float(top.values[0] - top.values[1]), "top2_ids": top.indices.tolist()}


def compare(ref_eng, a: list[int], b: list[int], prompt_ids: list[int]) -> dict:
    d = first_difference(a, b)
    row = {"first_difference": d, "identical": d is None, "tokens": min(len(a), len(b))}
    if d is not None and d < min(len(a), len(b)):
        row.update(margin(ref_eng, prompt_ids, a[:d]), reference_token=a[d], other_token=b[d])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_divergence.json"))
    args = ap.parse_args()
    f32 = engine.open(dtype="float32", drafter="none")
    eager = engine.open(dtype="bfloat16", drafter="none")
    comp = engine.open(dtype="bfloat16", drafter="none", compile="on")
    step = comp.target.compiled
    step.wait()
    for e in (f32, eager, comp):
        e.stop_ids = frozenset()            # the full length: a stop token would hide later divergences
    rows = []
    for p in PROMPTS:
        ids = render_prompt(eager.tokenizer, [{"role": "user", "content": p}])
        a32, a, c = greedy(f32, p, args.tokens), greedy(eager, p, args.tokens), greedy(comp, p, args.tokens)
        row = {"prompt": p, "compiled_vs_eager_bf16": compare(eager, a, c, ids),
               "eager_bf16_vs_float32": compare(f32, a32, a, ids)}
        rows.append(row)
        print(row, flush=True)
    out = {"benchmark": "compiled_divergence", "model": eager.name, "tokens": args.tokens,
           "compile_state": step.state, "compile_mode": step.mode, "compile_source": step.source,
           "compile_error": step.error,
           "machine": machine(), "rows": rows}
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
