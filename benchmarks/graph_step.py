"""The graph step (engine/models/graph_step.py) against the eager forward, on a GPU.

The model: Qwen3-1.7B's layers (peers_shape.SHAPE, random bf16 weights, seeded) with the
tests' small BPE tokenizer (tests/tiny.py), whose 400 entries set the vocabulary: nothing
is fetched or carried, and the 1.4 B parameters a step reads are the layers' (Qwen3's
151,936-entry embedding is left out). Two engines on the same checkpoint, one opened with
LOCALCHAT_GRAPH_STEP=off (the eager forward: torch operations per layer) and one with it on
(the graph engine's first step compiles and captures it; its time is reported apart).
Greedy, the same prompt, each engine once per round, rounds interleaved, medians of the
decode tok/s, plain and with the n-gram drafter. Checked in the same run: each engine's
speculative answer is its plain one, token for token.

    python benchmarks/graph_step.py [--device cuda] [--rounds 5] [--tokens 128] [--layers N]

On a lent machine with transformers older than pyproject's range, carry the wheels of
transformers and its `kernels` dependency (see the device tool's notes), then:
    PYTHONPATH=/tmp/site:. python3 benchmarks/graph_step.py --out $OUT/graph_step.json
`--device cpu --layers 2 --hidden 64` runs it here as a check (torch.compile without CUDA
graphs: the figures say nothing of a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402
from peers_shape import SHAPE  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def build(folder: Path, layers: int, hidden: int | None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny import build_tokenizer
    hf = folder / f"graph-{layers}-{hidden or SHAPE['hidden_size']}"
    if (hf / "config.json").is_file():
        return hf
    tok = build_tokenizer()
    shape = dict(SHAPE, num_hidden_layers=layers)
    if hidden:      # a small model for a check off a GPU
        shape.update(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=hidden // 4)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = folder / (hf.name + ".partial")
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.replace(hf)
    return hf


def open_engine(path: Path, device: str, graph: bool):
    os.environ["LOCALCHAT_GRAPH_STEP"] = "on" if graph else "off"     # read as the engine opens
    try:
        return engine.open(str(path), device=device, dtype="bfloat16", drafter="ngram")
    finally:
        del os.environ["LOCALCHAT_GRAPH_STEP"]


def answer(eng, drafter: str, tokens: int) -> tuple[float, list[int], float]:
    """(decode tok/s, the answer's token ids, tokens per pass) of one greedy answer."""
    eng.set_drafter(drafter)
    chat = eng.chat()
    last = list(chat.send(PROMPT, max_new_tokens=tokens))[-1]
    s = chat.last_stats
    return s.decode_tps, list(last.token_ids), round(s.tokens_per_pass, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--hidden", type=int, default=None, help="a small width, for a check off a GPU")
    ap.add_argument("--folder", default="/tmp/localchat-graph-step")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "graph_step.json"))
    args = ap.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = build(folder, args.layers, args.hidden)
    engines = {"eager": open_engine(path, args.device, False), "graph": open_engine(path, args.device, True)}
    note = engines["graph"].describe().get("graph_step", "")
    if not note.startswith("compiled"):
        sys.exit(f"the graph step does not run: {note or 'not asked for'}")
    t0 = time.perf_counter()
    answer(engines["graph"], "none", 2)              # its first steps compile and capture
    compile_s = time.perf_counter() - t0
    for eng in engines.values():                     # warm-up
        answer(eng, "none", args.tokens)
    samples = {f"{name} {d}": [] for name in engines for d in ("none", "ngram")}
    answers: dict[str, list[int]] = {}
    per_pass: dict[str, list[float]] = {k: [] for k in samples}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            for d in ("none", "ngram"):
                tps, ids, tpp = answer(eng, d, args.tokens)
                samples[f"{name} {d}"].append(tps)
                per_pass[f"{name} {d}"].append(tpp)
                answers.setdefault(f"{name} {d}", ids)
    figs = {k: round(median(v), 2) for k, v in samples.items()}
    same = {name: answers[f"{name} ngram"] == answers[f"{name} none"] for name in engines}
    out = {"benchmark": "graph_step", "device": args.device, "machine": machine(),
           "model": f"Qwen3-1.7B's layers ({args.layers}), random bf16, vocabulary 400" if not args.hidden
           else f"a small Llama ({args.layers} layers, hidden {args.hidden}), random bf16",
           "graph_step": note, "compile_s": round(compile_s, 1), "rounds": args.rounds, "max_new_tokens": args.tokens,
           "decode_tps": figs, "tokens_per_pass": {k: median(v) for k, v in per_pass.items()},
           "graph_over_eager": {d: round(figs[f"graph {d}"] / figs[f"eager {d}"], 3) for d in ("none", "ngram")},
           "speculation_is_plain_greedy": same,
           "graph_answer_is_eager_answer": answers["graph none"] == answers["eager none"],
           "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()}}
    write_json(args.out, out)
    for k, v in figs.items():
        print(f"{k:12s} decode {v:8.2f} tok/s")
    print(f"graph/eager: {out['graph_over_eager']}; compile {out['compile_s']} s; speculation = plain: {same}")
    print("wrote", args.out)
    if not all(same.values()):
        sys.exit("speculation changed an answer")


if __name__ == "__main__":
    main()
