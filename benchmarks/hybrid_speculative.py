"""Speculative decoding on a hybrid (engine/models/replay.py): the random-weight Qwen3.5 text
model of benchmarks/hybrid.py (hidden 1024, 16 layers, 12 of them gated delta-nets), the
workloads of ../shared/bench/workloads.jsonl, interleaved in one run:

- plain decoding (no drafter);
- n-gram drafting (what `auto` gives a hybrid);
- an int4 copy of the model drafting for it (`--draft-model self`: a hybrid drafter, its own
  state replayed too);
- a scripted drafter that proposes plain decoding's own answer (always right): the ceiling
  the verify-and-replay machinery allows at k = 4, since a random-weight model gives an
  n-gram drafter little to find.

For each: decode tok/s (median of --runs), tokens per target pass, acceptance, and whether
every output equals plain decoding's. Then the memory speculation reserves: the replay
buffer allocated on this model against one recurrent state per draft position, and the
same computed for the catalog's Qwen3-Next-80B-A3B and transformers' default Qwen3.5 text
config, as ratios. Writes JSON.

    python benchmarks/hybrid_speculative.py [--runs 3] [--tokens 64] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, median, write_json  # noqa: E402
from engine.drafters import ModelDrafter, NgramDrafter, NoDrafter  # noqa: E402
from engine.planner import ModelShape  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from hybrid import build  # noqa: E402

WORKLOADS = ROOT.parent / "shared" / "bench" / "workloads.jsonl"


class Oracle:
    """Proposes the known plain answer: every draft is accepted."""
    kind = "oracle"

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, history, k, params=None, gen=None):
        at = len(history) - self.prompt_len
        return list(self.answer[at:at + k]), None


def run(eng, prompt: str, tokens: int) -> tuple[list[int], object]:
    chat = eng.chat()
    done = list(chat.send(prompt, max_new_tokens=tokens))[-1]
    return list(done.token_ids), chat.last_stats


def reserve(shape: ModelShape, k: int, act_bytes: int) -> dict:
    replay = shape.replay_bytes(k, act_bytes)
    per_position = (k + 1) * shape.state_bytes
    return {"max_draft": k, "replay_bytes": replay, "state_per_position_bytes": per_position,
            "ratio": per_position / replay if replay else None}


def drafters(eng, prompts: list[str], args) -> list[dict]:
    """Plain, n-gram and the always-right scripted drafter, interleaved over the workloads."""
    plain = {p: run(eng, p, args.tokens)[0] for p in prompts}
    # an int4 copy of the hybrid drafting for it (its own state replayed as the target's is)
    from engine.targets.quantized import load_quantized
    cache_dir = Path(tempfile.mkdtemp())
    self_int4 = ModelDrafter(load_quantized(eng.checkpoint.path, eng.device, "int4", cache_dir=cache_dir),
                             "self (int4)", eng.target.vocab_size)
    self_int4.target.cache.replay_capacity = eng.max_draft + 2
    kinds = {"plain": lambda p: (NoDrafter(), None), "ngram": lambda p: (NgramDrafter(), None),
             "self int4": lambda p: (self_int4, None),
             "oracle k=4": lambda p: (Oracle(plain[p], len(render_prompt(eng.tokenizer, [
                 {"role": "user", "content": p}]))), 4)}
    samples = {k: {"tps": [], "per_pass": [], "acceptance": [], "identical": True} for k in kinds}
    for _ in range(args.runs):
        for name, make in kinds.items():           # interleaved: drift biases none of them
            tps, per_pass, acc = [], [], []
            for p in prompts:
                eng.drafter, eng.draft_tokens = make(p)
                got, stats = run(eng, p, args.tokens)
                samples[name]["identical"] &= got == plain[p]
                tps.append(stats.decode_tps)
                per_pass.append(stats.tokens_per_pass)
                acc.append(stats.acceptance)
            samples[name]["tps"].append(median(tps))
            samples[name]["per_pass"].append(median(per_pass))
            samples[name]["acceptance"].append(median(acc))
    eng.drafter, eng.draft_tokens = NoDrafter(), None
    base = median(samples["plain"]["tps"])
    return [{"drafter": name, "decode_tps": median(s["tps"]), "vs_plain": median(s["tps"]) / base,
             "tokens_per_pass": median(s["per_pass"]), "acceptance": median(s["acceptance"]),
             "identical_to_plain": s["identical"]} for name, s in samples.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_speculative.json"))
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in WORKLOADS.read_text().splitlines() if line.strip()]
    rows = []
    for name in [d for d in args.dtypes.split(",") if d]:
        dtype = getattr(torch, name)
        path = build(Path(tempfile.mkdtemp()) / "qwen3_5-1024x16", dtype)
        eng = engine.open(str(path), dtype=name, drafter="none")
        eng.stop_ids = frozenset()                 # random weights: every answer runs its length
        rows += [dict(r, dtype=name) for r in drafters(eng, prompts, args)]
        for r in rows[-4:]:
            print(r, flush=True)
    # memory: measured on the last model (the widest verify pass, k = max_draft), computed for published shapes
    dtype = getattr(torch, name)
    t, cache = eng.target, eng.target.cache
    eng.cache_owner = None
    cache.rollback(0)
    t.forward(list(range(5, 40)))
    with cache.record():
        t.forward(list(range(40, 40 + eng.max_draft + 1)), all_logits=True)
    cache.rollback(35)
    shape = ModelShape.from_checkpoint(path)
    act = torch.finfo(dtype).bits // 8
    measured = dict(reserve(shape, eng.max_draft, act), allocated_bytes=cache.replay_bytes(),
                    state_bytes=shape.state_bytes)
    from localchat import catalog
    from transformers import Qwen3_5TextConfig
    published = {
        "Qwen3-Next-80B-A3B (catalog)": [reserve(catalog.find("Qwen/Qwen3-Next-80B-A3B-Instruct").shape(), k, 2)
                                         for k in (8, 16)],
        "Qwen3.5 (transformers' Qwen3_5TextConfig defaults)": [
            reserve(ModelShape.from_config(Qwen3_5TextConfig().to_dict()), k, 2) for k in (8, 16)],
    }
    print(measured, published, flush=True)
    print("wrote", write_json(args.out, {"benchmark": "hybrid_speculative", "tokens": args.tokens, "runs": args.runs,
                                         "measured_dtype": name, "workloads": len(prompts), "machine": machine(),
                                         "rows": rows, "reserve_measured": measured,
                                         "reserve_published": published}))


if __name__ == "__main__":
    main()
