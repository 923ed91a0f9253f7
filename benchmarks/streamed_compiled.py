"""Streamed layers, eager against compiled without freezing (issue 7: streamed weights
change under every pass, so they cannot be frozen into a step; compiling the layer's
arithmetic with the weights as inputs is the other way). Demo model, float32, a quarter
of the weights resident, warm, one-token steps, greedy, median of --runs interleaved.

The compiled variant runs each layer's arithmetic before and after attention as two
`torch.compile` graphs (inductor, default mode, no freezing, dynamic shapes; the cache
write and attention stay the eager calls), which is what a compiled streamed layer could
be. Writes JSON.

    python benchmarks/streamed_compiled.py [--runs 3] [--tokens 32] [--share 0.25]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import machine, median, write_json  # noqa: E402
from engine.compile import exported  # noqa: E402
from streamed import resident_and_streamed  # noqa: E402

PROMPT = "Explain in a few sentences why the sky is blue."


def _before_attention(h, ln1, qkv, cos, sin, eps: float, heads: int, kv_heads: int):
    T, D = h.shape[0], cos.shape[-1]
    x = torch.rms_norm(h, (h.shape[-1],), ln1, eps)
    y = torch.mm(x, qkv).view(T, heads + 2 * kv_heads, D)
    qk = y[:, :heads + kv_heads].transpose(0, 1)
    half = D // 2
    qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), -1) * sin
    return qk, y[:, heads + kv_heads:].transpose(0, 1)


def _after_attention(h, o, o_w, ln2, gate_up, down, eps: float, inter: int):
    h = h + torch.mm(o, o_w)
    gu = torch.mm(torch.rms_norm(h, (h.shape[-1],), ln2, eps), gate_up)
    return h + torch.mm(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def compiled_layers(impl):
    """Replace the forward's layer with one whose arithmetic runs compiled (one-token
    plain layers of the Llama forward; anything else runs the eager layer)."""
    import torch._inductor.config as inductor_config
    inductor_config.cpp.min_chunk_size = exported.SERIAL_BELOW
    before = torch.compile(_before_attention, dynamic=True, fullgraph=True)
    after = torch.compile(_after_attention, dynamic=True, fullgraph=True)
    eager = impl._layer

    def layer(i, w, h, pos, cos, sin, mask, causal, rowwise):
        if h.shape[0] != 1 or w.qkv_bias is not None or w.q_norm is not None or w.o_bias is not None \
                or not isinstance(w.qkv, torch.Tensor):
            return eager(i, w, h, pos, cos, sin, mask, causal, rowwise)
        H, KV, D = impl.heads, impl.kv_heads, impl.head_dim
        qk, v = before(h, w.ln1, w.qkv, cos, sin, impl.eps, H, KV)
        keys, values = impl.cache.write(i, pos, qk[H:], v)
        o = F.scaled_dot_product_attention(qk[None, :H], keys, values, scale=impl.scaling, enable_gqa=impl.gqa)
        return after(h, o[0].transpose(0, 1).reshape(1, H * D), w.o, w.ln2, w.gate_up, w.down, impl.eps,
                     impl.intermediate)
    return layer


def answer(eng, tokens: int) -> dict:
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=tokens))
    s = chat.last_stats
    return {"tps": s.decode_tps, "pass_ms": (s.pass_seconds or 0) * 1e3, "hidden": s.stream_hidden,
            "ids": list(chat.last_done.token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--share", type=float, default=0.25, help="share of the weights kept resident")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "streamed_compiled.json"))
    args = ap.parse_args()

    resident, streamed, budget, total = resident_and_streamed(args.share)
    impl = streamed.target.impl
    eager_layer, fast_layer = impl._layer, compiled_layers(impl)
    t = time.perf_counter()
    impl._layer = fast_layer
    answer(streamed, 4)                       # compiles (one graph each, then the symbolic one)
    answer(streamed, 4)
    compile_s = time.perf_counter() - t
    runs = {"resident": [], "eager": [], "compiled": []}
    for i in range(args.runs + 1):            # the first round warms up
        runs["resident"].append(answer(resident, args.tokens))
        impl._layer = eager_layer
        runs["eager"].append(answer(streamed, args.tokens))
        impl._layer = fast_layer
        runs["compiled"].append(answer(streamed, args.tokens))
        print(i, {k: round(v[-1]["tps"], 2) for k, v in runs.items()}, flush=True)
    impl._layer = eager_layer
    res = {k: {m: median([r[m] for r in v[1:]]) for m in ("tps", "pass_ms", "hidden")} for k, v in runs.items()}
    out = {"benchmark": "streamed_compiled", "model": "SmolLM2-135M-Instruct (demo)", "machine": machine(),
           "runs": args.runs, "tokens": args.tokens, "weight_budget": budget, "weights": total,
           "compile_s": compile_s, **res,
           "compiled_vs_eager": res["compiled"]["tps"] / res["eager"]["tps"],
           "identical_eager": all(r["ids"] == runs["resident"][0]["ids"] for r in runs["eager"]),
           "identical_compiled": all(r["ids"] == runs["resident"][0]["ids"] for r in runs["compiled"])}
    print({k: v for k, v in out.items() if k != "machine"}, flush=True)
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
