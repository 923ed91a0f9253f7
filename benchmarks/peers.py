"""Ours against llama.cpp on the same weights, same prompt tokens, same threads, one run
(the README's table, reproducible): the demo model in float32, bf16, 8-bit and 4-bit.

- llama.cpp: llama-cpp-python (the `bench` extra; it compiles llama.cpp from source) on
  the demo's own Q4_1 GGUF and on F32/BF16 GGUFs written from it by dequantizing every
  tensor (benchmarks/gguf_formats.py), so every row reads the same weights;
- ours: the engine API on the same Q4_1 file, float32 / bf16 (the same dequantized
  weights), resident-int8 (per channel) and resident-int4 (groups of 32), quantized from
  them, as a chat runs
  them; and each with its layers run as torch operations (the layer kernel's share:
  engine/kernels/layer.c).

llama.cpp on a CPU with AMX: llama-cpp-python's default (native) build died with SIGILL in
its AMX int8 path on the Q4_1 model on the 2-core VM. Build it without AMX there:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" pip install --no-cache-dir llama-cpp-python

The prompt is the fibonacci workload with the chat template, tokenized once and fed to
both as the same token ids; greedy; up to --tokens new tokens (both stop at EOS). Prefill
tok/s is prompt tokens over the time to the first logits, decode tok/s the rest. Every
contender runs once per round, rounds interleaved; medians of --rounds.

    python benchmarks/peers.py [--rounds 6] [--tokens 128] [--only f32,bf16,q8,q4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, median, read_bandwidth, write_json  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.session import render_prompt  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."     # workloads.jsonl: fibonacci
# (our engine, its llama.cpp peer): what each row compares
ROWS = {
    "f32": ({"dtype": "float32"}, "F32"),
    "bf16": ({"dtype": "bfloat16"}, "BF16"),
    "q8": ({"profile": "resident-int8"}, "Q8_0"),
    "q4": ({"profile": "resident-int4"}, "Q4_1"),
}


def llama_once(llm, ids: list[int], tokens: int, eos: int) -> tuple[float, float, int]:
    """(prefill tok/s, decode tok/s, tokens) of one greedy answer from llama.cpp."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n = 0
    for _ in range(tokens):
        tok = llm.sample(temp=0.0, top_k=1)
        n += 1
        if tok == eos:
            break
        llm.eval([tok])
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), (n - 1) / (t2 - t1) if n > 1 else 0.0, n


def ours_once(eng, tokens: int) -> tuple[float, float, int]:
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=tokens))
    s = chat.last_stats
    assert s.prefill_tokens == s.prompt_tokens, "a fresh chat prefills its whole prompt"
    return s.prefill_tps, s.decode_tps, s.generated_tokens


def open_ours(kw: dict, cache_dir: Path):
    return engine.open(drafter="none", cache_dir=cache_dir, **kw)


def decoded_by(eng) -> dict:
    """Which kernels ran our decode steps."""
    impl = eng.target.impl
    return {"ours_decodes": "layer kernel" if getattr(impl, "_stack", None) is not None
            else "row kernel" if getattr(getattr(impl, "rows", None), "kernel", False) else "torch"}


def interleaved(contenders: dict, ids: list[int], tokens: int, eos: int, rounds: int):
    """Each contender once per round (after one warm-up each), rounds interleaved: the
    samples by name, each (prefill tok/s, decode tok/s, tokens), and the memory's read
    rate before and after; and fig(name), the medians of one contender."""
    def run(name):
        fn, obj = contenders[name]
        return fn(obj, ids, tokens, eos) if fn is llama_once else fn(obj, tokens)

    bw_before = read_bandwidth()
    for name in contenders:              # warm-up
        run(name)
    samples = {name: [] for name in contenders}
    for _ in range(rounds):
        for name in contenders:
            samples[name].append(run(name))
    bw_after = read_bandwidth()

    def fig(name):
        s = samples[name]
        return {"prefill_tps": round(median([x[0] for x in s]), 1), "decode_tps": round(median([x[1] for x in s]), 2),
                "tokens": median([x[2] for x in s])}
    return samples, (bw_before, bw_after), fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", default=",".join(ROWS), help="rows: f32,bf16,q8,q4")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "peers.json"))
    args = ap.parse_args()
    try:
        from llama_cpp import Llama, __version__ as llama_version
    except ImportError:
        raise SystemExit("benchmarks/peers.py needs llama-cpp-python: pip install -e .[bench]") from None
    import gguf_formats

    threads = torch.get_num_threads()
    demo = checkpoint.demo_gguf_path()
    cache = checkpoint.default_cache_dir()
    files = {"Q4_1": demo, **gguf_formats.write_all(demo, cache / "peers")}
    rows = [r for r in args.only.split(",") if r]
    contenders = {}
    for r in rows:
        kw, fmt = ROWS[r]
        contenders[f"ours {r}"] = (ours_once, open_ours(kw, cache))
        llm = Llama(model_path=str(files[fmt]), n_ctx=1024, n_batch=512, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        contenders[f"llama.cpp {fmt}"] = (llama_once, llm)
    for r in rows:
        # The layer kernel's share, in the same run: the step with every layer run as torch
        # operations (around the same row, int8 and int4 kernels).
        eng = open_ours(ROWS[r][0], cache)
        if getattr(eng.target.impl, "_stack", None) is not None:
            eng.target.impl._stack = None
            contenders[f"ours {r} torch ops"] = (ours_once, eng)
    if "q8" in rows:
        # int8 through aten's kernel, one torch operation a product, as before q8.c: its share.
        from engine.kernels import q8_kernel
        saved = list(q8_kernel._state)
        q8_kernel._state[:] = ["off (benchmark)"]
        try:
            contenders["ours q8 aten"] = (ours_once, open_ours(ROWS["q8"][0], cache))
        finally:
            q8_kernel._state[:] = saved
    tok = next(e for f, e in contenders.values() if f is ours_once).tokenizer
    ids = render_prompt(tok, [{"role": "user", "content": PROMPT}])
    eos = tok.eos_token_id

    samples, (bw_before, bw_after), fig = interleaved(contenders, ids, args.tokens, eos, args.rounds)
    out_rows = []
    for r in rows:
        fmt = ROWS[r][1]
        ours, peer = fig(f"ours {r}"), fig(f"llama.cpp {fmt}")
        eng = contenders[f"ours {r}"][1]
        row = {"row": r, "llama_format": fmt, "ours": ours, "llama_cpp": peer,
               "decode_ratio": round(ours["decode_tps"] / peer["decode_tps"], 3),
               "prefill_ratio": round(ours["prefill_tps"] / peer["prefill_tps"], 3),
               **decoded_by(eng)}
        if f"ours {r} torch ops" in contenders:
            ops = fig(f"ours {r} torch ops")
            row["ours_torch_ops"] = ops
            row["torch_ops_decode_ratio"] = round(ops["decode_tps"] / peer["decode_tps"], 3)
        if r == "q8" and "ours q8 aten" in contenders:
            aten = fig("ours q8 aten")
            row["ours_aten_int8"] = aten
            row["aten_int8_decode_ratio"] = round(aten["decode_tps"] / peer["decode_tps"], 3)
        out_rows.append(row)
        print(f"{r:5s} ({row['ours_decodes']}) decode ours {ours['decode_tps']:6.1f} llama.cpp {peer['decode_tps']:6.1f} "
              f"({row['decode_ratio']:.2f}x)  prefill ours {ours['prefill_tps']:6.0f} "
              f"llama.cpp {peer['prefill_tps']:6.0f} ({row['prefill_ratio']:.2f}x)")
    write_json(args.out, {
        "benchmark": "peers", "model": checkpoint.DEMO_NAME, "prompt": PROMPT, "prompt_tokens": len(ids),
        "max_new_tokens": args.tokens, "rounds": args.rounds, "threads": threads,
        "llama_cpp_python": llama_version, "bandwidth_gbps": [round(bw_before / 1e9, 1), round(bw_after / 1e9, 1)],
        "machine": machine(), "rows": out_rows,
        "samples": {k: [list(map(lambda v: round(v, 2), x)) for x in s] for k, s in samples.items()}})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
