"""GGUF files run as stored: ours (the resident-gguf profile, engine/targets/gguf_target.py)
against llama.cpp on the same file, same prompt tokens, same threads, one interleaved run.
(Not named gguf.py: a script's folder comes first on sys.path, and `import gguf` must find
gguf-py.)

The files: the demo's own Q4_1, and the same weights re-quantized by llama.cpp's own
quantizer (llama_model_quantize, from an F32 copy written by benchmarks/gguf_formats.py)
to Q4_K_M, Q6_K, Q8_0 and IQ4_XS. The demo's rows are 576 long, not a multiple of 256:
llama.cpp writes most of a K-quant file's matrices in a legacy format then (Q4_K_M is
mostly Q5_0); `formats` in the JSON says what each file holds.

Each contender answers once per round (after a warm-up), rounds interleaved; medians of
--rounds. Greedy, up to --tokens new tokens, both stop at EOS. Prefill tok/s is prompt
tokens over the time to the first logits, decode tok/s the rest.

    python benchmarks/gguf_peers.py [--rounds 5] [--tokens 128] [--only Q4_1,Q4_K_M,...]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.gguf_reader import read  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from peers import PROMPT, interleaved, llama_once, ours_once  # noqa: E402

FORMATS = ("Q4_1", "Q4_K_M", "Q6_K", "Q8_0", "IQ4_XS")


def quantized(f32: Path, fmt: str, out: Path) -> Path:
    """`f32` quantized to `fmt` by llama.cpp's own quantizer (kept while newer than f32)."""
    import llama_cpp
    if out.exists() and out.stat().st_mtime >= f32.stat().st_mtime:
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.nthread = torch.get_num_threads()
    tmp = out.with_name(out.name + ".partial")
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f32} to {fmt}")
    tmp.replace(out)
    return out


def files(only: list[str], cache: Path) -> dict[str, Path]:
    import gguf_formats
    demo = checkpoint.demo_gguf_path()
    out = {}
    f32 = None
    for fmt in only:
        if fmt == "Q4_1":
            out[fmt] = demo
            continue
        (cache / "peers").mkdir(parents=True, exist_ok=True)
        (cache / "gguf").mkdir(parents=True, exist_ok=True)
        f32 = f32 or gguf_formats.write(demo, cache / "peers" / f"{demo.stem}-F32.gguf", "F32")
        out[fmt] = quantized(f32, fmt, cache / "gguf" / f"{checkpoint.DEMO_NAME}.{fmt}.gguf")
    return out


def formats(path: Path) -> dict[str, int]:
    _, tensors = read(path)
    return dict(Counter(t.kind for t in tensors.values() if len(t.shape) >= 2).most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", default=",".join(FORMATS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_peers.json"))
    args = ap.parse_args()
    try:
        from llama_cpp import Llama, __version__ as llama_version
    except ImportError:
        raise SystemExit("benchmarks/gguf_peers.py needs llama-cpp-python: pip install -e .[bench]") from None
    threads = torch.get_num_threads()
    cache = checkpoint.default_cache_dir()
    paths = files([f for f in args.only.split(",") if f], cache)
    contenders = {}
    for fmt, path in paths.items():
        eng = engine.open(str(path), drafter="none", cache_dir=cache)
        assert eng.plan.chosen == "resident-gguf", f"{path}: ran {eng.plan.chosen}"
        contenders[f"ours {fmt}"] = (ours_once, eng)
        contenders[f"llama.cpp {fmt}"] = (llama_once, Llama(model_path=str(path), n_ctx=1024, n_batch=512,
                                                            n_threads=threads, n_threads_batch=threads,
                                                            verbose=False))
    tok = next(e for f, e in contenders.values() if f is ours_once).tokenizer
    ids = render_prompt(tok, [{"role": "user", "content": PROMPT}])
    samples, (bw_before, bw_after), fig = interleaved(contenders, ids, args.tokens, tok.eos_token_id, args.rounds)
    rows = []
    for fmt, path in paths.items():
        ours, peer = fig(f"ours {fmt}"), fig(f"llama.cpp {fmt}")
        eng = contenders[f"ours {fmt}"][1]
        row = {"format": fmt, "file_bytes": path.stat().st_size, "formats": formats(path),
               "ours_weight_bytes": eng.target.weight_bytes(), "ours": ours, "llama_cpp": peer,
               "decode_ratio": round(ours["decode_tps"] / peer["decode_tps"], 3),
               "prefill_ratio": round(ours["prefill_tps"] / peer["prefill_tps"], 3),
               "layer_kernel": eng.target.impl.layer_kernel_note or "yes"}
        rows.append(row)
        print(f"{fmt:7s} decode ours {ours['decode_tps']:6.1f} llama.cpp {peer['decode_tps']:6.1f} "
              f"({row['decode_ratio']:.2f}x)  prefill ours {ours['prefill_tps']:6.0f} llama.cpp "
              f"{peer['prefill_tps']:6.0f} ({row['prefill_ratio']:.2f}x)")
    write_json(args.out, {
        "benchmark": "gguf", "model": checkpoint.DEMO_NAME, "prompt": PROMPT, "prompt_tokens": len(ids),
        "max_new_tokens": args.tokens, "rounds": args.rounds, "threads": threads,
        "llama_cpp_python": llama_version, "bandwidth_gbps": [round(bw_before / 1e9, 1), round(bw_after / 1e9, 1)],
        "machine": machine(), "rows": rows,
        "samples": {k: [[round(v, 2) for v in x] for x in s] for k, s in samples.items()}})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
