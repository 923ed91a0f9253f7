"""Ours against llama.cpp on a mixture of experts of a real shape: Qwen3.5-35B-A3B's layers.

The model: Qwen3.5-35B-A3B's published text config (shared/models/qwen-hybrid-configs.json:
hidden 2048, 256 experts of width 512 with 8 a token and a shared expert, gated delta-net
layers with one full-attention layer in four, head dim 256) with `--layers` of its 40
layers (default 4: three gated delta-net, one attention), random bf16 weights (seeded),
the demo model's tokenizer (49152 entries: no Qwen3.5 tokenizer can be fetched here), saved
with `save_pretrained` as Qwen3_5MoeForCausalLM. llama.cpp reads GGUFs written from it by its
own converter (convert_hf_to_gguf.py from the llama-cpp-python source distribution, with
--no-mtp and the demo tokenizer's pre-tokenizer, smollm) and its own quantizer (Q4_1). Ours
reads the checkpoint in bf16, and int4 in groups of 32 quantized from it. Same prompt, greedy,
2 threads each; one row (a format) at a time, so one pair of models is in memory; rounds
interleaved within a row, medians.

    python benchmarks/moe_shape.py [--layers 4] [--rounds 3] [--tokens 48] [--only bf16,q8,q4]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine.openmp  # noqa: E402,F401  (before torch loads libgomp: the spin localchat runs with)
import torch  # noqa: E402

from common import demo_tokenizer, machine, write_json  # noqa: E402
from engine import checkpoint  # noqa: E402
from engine.planner import ModelShape  # noqa: E402
from engine.session import render_prompt  # noqa: E402
from peers import PROMPT, interleaved, llama_once, open_ours, ours_once  # noqa: E402

# Qwen3.5-35B-A3B's text config (shared/models/qwen-hybrid-configs.json: a verbatim copy,
# alibaba/InferSim hf_configs/qwen3.5-35B-A3B_config.json)
SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
             moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
             tie_word_embeddings=False, max_position_embeddings=4096)
# row: (how ours opens the model, the GGUF llama.cpp reads); {"gguf": True}: ours opens that
# same file too, and runs its blocks (resident-gguf)
ROWS = {"bf16": ({"dtype": "bfloat16"}, "BF16"), "q8": ({"profile": "resident-int8"}, "Q8_0"),
        "q4": ({"profile": "resident-int4"}, "Q4_1"),
        "gguf-q4km": ({"gguf": True}, "Q4_K_M"), "gguf-q6k": ({"gguf": True}, "Q6_K"),
        "gguf-iq4xs": ({"gguf": True}, "IQ4_XS"), "gguf-q8": ({"gguf": True}, "Q8_0")}
LLAMA_VERSION = "0.3.36"


def build(folder: Path, layers: int, shape: dict = SHAPE, family: str = "Qwen3_5Moe") -> Path:
    """The checkpoint of `family` (transformers' <family>ForCausalLM and <family>TextConfig)
    with `shape`, once (renamed into place when whole: a half-built one is redone)."""
    hf = folder / "hf"
    if (hf / "config.json").is_file():
        return hf
    import transformers
    tok = demo_tokenizer()
    cfg = getattr(transformers, f"{family}TextConfig")(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                                       eos_token_id=tok.eos_token_id, num_hidden_layers=layers,
                                                       **shape)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).to(torch.bfloat16)
    with torch.no_grad():                 # a spread that keeps the random activations finite and varied
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    tmp = folder / "hf.partial"
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp)
    del model
    gc.collect()
    tmp.replace(hf)
    return hf


def llama_source(folder: Path) -> Path:
    """llama.cpp's tree from the llama-cpp-python source distribution (its converter)."""
    src = folder / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(folder)], check=True)
        subprocess.run(["tar", "xzf", str(folder / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"), "-C", str(folder)],
                       check=True)
    return src


# The converter names a tokenizer's pre-tokenizer by a hash of how it splits a test text;
# the demo tokenizer saved by transformers is SmolLM's, under a hash the converter does not list.
CONVERT = """
import runpy, sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", {hf!r}, "--outfile", {out!r}, "--outtype", "bf16", "--no-mtp"]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def ggufs(hf: Path, folder: Path, formats: list[str], name: str = "moe") -> dict[str, Path]:
    """The BF16 GGUF by llama.cpp's converter, and the quantized ones `formats` name by its quantizer."""
    bf16 = folder / f"{name}-BF16.gguf"
    if not bf16.exists():
        src = llama_source(folder)
        part = folder / f"{name}-BF16.partial.gguf"
        subprocess.run([sys.executable, "-c", CONVERT.format(src=str(src), hf=str(hf), out=str(part))], check=True)
        part.replace(bf16)
    files = {"BF16": bf16}
    for fmt in formats:
        if fmt == "BF16":
            continue
        files[fmt] = out = folder / f"{name}-{fmt}.gguf"
        if out.exists():
            continue
        import llama_cpp
        part = folder / f"{name}-{fmt}.partial.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
        params.nthread = torch.get_num_threads()
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(part).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {bf16} to {fmt}")
        part.replace(out)
    return files


def no_extra_buffers() -> None:
    """llama.cpp without its extra weight buffers (AMX tiles, repacking): on a Xeon with AMX,
    llama-cpp-python 0.3.36 built here dies of a general protection fault in libggml-cpu on
    this model's Q4_1 GGUF with them (its BF16 runs either way)."""
    import llama_cpp
    import llama_cpp.llama as module
    plain = llama_cpp.llama_model_default_params

    def params():
        p = plain()
        p.use_extra_bufts = False
        return p
    module.llama_cpp.llama_model_default_params = params


def race(hf: Path, files: dict, only: list[str], cache: Path, rounds: int, tokens: int,
         modules: bool = False) -> tuple[list, dict, list]:
    """One row a format: ours against llama.cpp (and, with `modules`, ours with
    LOCALCHAT_HYBRID_KERNEL=off: transformers' modules), interleaved; the rows, the samples
    and the read rates measured around each row."""
    from llama_cpp import Llama
    threads = torch.get_num_threads()
    out_rows, samples_all, rates = [], {}, []
    for r in only:
        kw, fmt = ROWS[r]
        kw = {"model": str(files[fmt])} if kw.get("gguf") else {"model": str(hf), **kw}
        eng = open_ours(kw, cache)
        llm = Llama(model_path=str(files[fmt]), n_ctx=1024, n_batch=512, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        ids = render_prompt(eng.tokenizer, [{"role": "user", "content": PROMPT}])
        contenders = {f"ours {r}": (ours_once, eng), f"llama.cpp {fmt}": (llama_once, llm)}
        if modules:
            os.environ["LOCALCHAT_HYBRID_KERNEL"] = "off"
            contenders[f"modules {r}"] = (ours_once, open_ours(kw, cache))
            del os.environ["LOCALCHAT_HYBRID_KERNEL"]
        samples, bw, fig = interleaved(contenders, ids, tokens, -1, rounds)
        ours, peer = fig(f"ours {r}"), fig(f"llama.cpp {fmt}")
        planned = eng.plan.row(eng.plan.chosen)          # what the engine reads and holds, as planned
        read = planned.read_per_token
        desc = eng.describe()
        row = {"row": r, "llama_format": fmt, "ours": ours, "llama_cpp": peer,
               "decode_ratio": round(ours["decode_tps"] / peer["decode_tps"], 3),
               "prefill_ratio": round(ours["prefill_tps"] / peer["prefill_tps"], 3),
               "read_per_token_gb": round(read / 1e9, 3),
               "weights_gb": round(planned.weights / 1e9, 3),
               **{k: desc[k] for k in ("experts", "hybrid_layers") if k in desc},
               # the read bound: bytes a token reads over the read rate measured around the row
               "ours_of_read_bound": round(ours["decode_tps"] * read / min(bw), 3),
               "llama_cpp_of_read_bound": round(peer["decode_tps"] * read / min(bw), 3)}
        if modules:
            mods = fig(f"modules {r}")
            row |= {"modules": mods, "decode_vs_modules": round(ours["decode_tps"] / mods["decode_tps"], 3),
                    "prefill_vs_modules": round(ours["prefill_tps"] / mods["prefill_tps"], 3)}
        out_rows.append(row)
        rates += [round(b / 1e9, 1) for b in bw]
        samples_all.update({k: [list(map(lambda v: round(v, 2), x)) for x in s] for k, s in samples.items()})
        print(f"{r:5s} decode ours {ours['decode_tps']:6.2f} llama.cpp {peer['decode_tps']:6.2f} "
              f"({row['decode_ratio']:.2f}x, ours {row['ours_of_read_bound']:.2f} of the read bound)  "
              f"prefill ours {ours['prefill_tps']:6.1f} llama.cpp {peer['prefill_tps']:6.1f} "
              f"({row['prefill_ratio']:.2f}x)" + (f"  against the modules: decode {row['decode_vs_modules']:.2f}x"
                                                  if modules else ""), flush=True)
        del eng, llm, contenders
        gc.collect()
    return out_rows, samples_all, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--modules", action="store_true",
                    help="also ours with LOCALCHAT_HYBRID_KERNEL=off (transformers' modules), interleaved")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_shape.json"))
    args = ap.parse_args()
    from engine import hardware
    amx = "amx_tile" in hardware.cpu_flags()
    if amx:
        no_extra_buffers()
    from llama_cpp import __version__ as llama_version
    cache = checkpoint.default_cache_dir()
    folder = cache / f"moe-shape-{args.layers}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf = build(folder, args.layers)
    only = [r for r in args.only.split(",") if r]
    files = ggufs(hf, folder, [ROWS[r][1] for r in only])
    print(f"model and GGUFs ready in {time.perf_counter() - t0:.0f} s", flush=True)
    shape = ModelShape.from_checkpoint(hf)
    threads = torch.get_num_threads()
    out_rows, samples_all, rates = race(hf, files, only, cache, args.rounds, args.tokens, args.modules)
    write_json(args.out, {
        "benchmark": "moe_shape", "model": f"Qwen3.5-35B-A3B layer shape, {args.layers} of 40 layers, random bf16, "
                                           "demo tokenizer", "shape": SHAPE, "layers": args.layers,
        "params": shape.params, "prompt": PROMPT, "max_new_tokens": args.tokens, "rounds": args.rounds,
        "threads": threads, "llama_cpp_python": llama_version,
        "llama_cpp_extra_buffers": not amx, "bandwidth_gbps": rates, "machine": machine(),
        "rows": out_rows, "samples": samples_all, "config": json.loads((hf / "config.json").read_text())})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
