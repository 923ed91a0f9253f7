"""How exactly each engine reads a GGUF file: ours (resident-gguf) and llama.cpp on the same
quantized file, each against the file's own weights run exactly (the file dequantized by
gguf-py into an F32 GGUF, run by llama.cpp: float32 weights and activations). Teacher-forced
on the held texts (engine/data), the first --tokens of each; mean KL(reference || engine),
top-1 agreement and perplexity. Both engines read the same weights, so whatever they lose is
what their arithmetic loses: llama.cpp rounds activations to 8 bits for its integer dot
products (a step of 1/127 of the largest in 32, or in 256 for the K-quants), ours to 16 bits
(1/32767 of the largest in the weight's block: 32, or 256 for the K-quants and IQ4_XS).

Ours runs the texts in passes of 8 tokens (as verify passes run: the block kernels, every
row a lone row, what a one-token step computes); llama.cpp in batches of --batch.

    python benchmarks/gguf_fidelity.py [--only Q4_1,Q4_K_M,...] [--tokens 512]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

import engine  # noqa: E402
from common import machine, write_json  # noqa: E402
from engine import checkpoint, fidelity  # noqa: E402
from gguf_peers import FORMATS, files, formats  # noqa: E402

PASS = 8           # ours: tokens a pass, as a verify pass


def llama_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(llm.scores[:len(ids)].copy())


def ours_logits(target, ids: list[int]) -> torch.Tensor:
    target.cache.rollback(0)
    with torch.inference_mode():
        out = torch.cat([target.forward(ids[a:a + PASS], all_logits=True).float() for a in range(0, len(ids), PASS)])
    target.cache.rollback(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(FORMATS))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_fidelity.json"))
    args = ap.parse_args()
    try:
        from llama_cpp import Llama, __version__ as llama_version
    except ImportError:
        raise SystemExit("benchmarks/gguf_fidelity.py needs llama-cpp-python: pip install -e .[bench]") from None
    import gguf_formats
    threads = torch.get_num_threads()
    cache = checkpoint.default_cache_dir()
    paths = files([f for f in args.only.split(",") if f], cache)
    rows = []
    for fmt, path in paths.items():
        exact = gguf_formats.write(path, cache / "gguf" / f"{path.stem}-dequantized-F32.gguf", "F32")

        def llama(p):
            return Llama(model_path=str(p), n_ctx=args.tokens + 8, n_batch=args.batch, n_threads=threads,
                         n_threads_batch=threads, logits_all=True, verbose=False)
        ref_llm, peer_llm = llama(exact), llama(path)
        eng = engine.open(str(path), drafter="none", cache_dir=cache)
        assert eng.plan.chosen == "resident-gguf", f"{path}: ran {eng.plan.chosen}"
        texts = fidelity.held_texts(eng.tokenizer, args.tokens)
        ours, peer = fidelity._Sums(), fidelity._Sums()
        for ids in texts:
            nxt = torch.tensor(ids[1:])
            ref = llama_logits(ref_llm, ids)[:-1]
            peer.add(ref, llama_logits(peer_llm, ids)[:-1], nxt)
            ours.add(ref, ours_logits(eng.target, ids)[:-1], nxt)
        o, p = ours.result(), peer.result()
        rows.append({"format": fmt, "formats": formats(path), "ours": o.as_dict(), "llama_cpp": p.as_dict()})
        print(f"{fmt:7s} KL ours {o.mean_kl:.2e} llama.cpp {p.mean_kl:.2e}  top-1 ours {o.top1_agreement:.4f} "
              f"llama.cpp {p.top1_agreement:.4f}  ppl ref {o.ppl_reference:.3f} ours {o.ppl_candidate:.3f} "
              f"llama.cpp {p.ppl_candidate:.3f}")
        del ref_llm, peer_llm, eng
    write_json(args.out, {"benchmark": "gguf_fidelity", "model": checkpoint.DEMO_NAME, "tokens_per_text": args.tokens,
                          "ours_pass": PASS, "llama_batch": args.batch, "threads": threads,
                          "llama_cpp_python": llama_version, "machine": machine(), "rows": rows})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
