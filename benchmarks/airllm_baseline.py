"""AirLLM baseline: decode speed of AirLLM (PyPI `airllm`, 4.0.0) on CPU, on a local
Hugging Face-format checkpoint, so the streamed-weights benchmark can compare against it
in the same run. Prints one JSON line (the last line of stdout; also written to --out).

    python benchmarks/airllm_baseline.py --model DIR --work-dir DIR \
        [--prompt-ids 1,2,3 | --prompt TEXT] [--new-tokens 4] [--check] [--out FILE]
        [--stop-at-eos] [--raw-prompt] [--fresh-split] [--threads N]

What is timed:
  split_seconds   AirLLM's one-time split of the checkpoint into per-layer files under
                  WORK_DIR/splitted_model (0-ish and split_cached=true when already there;
                  --fresh-split redoes it). Not part of the decode figures.
  init_seconds    AirLLM model construction (meta model, resident embedding, hooks).
  seconds         wall time of one `model.generate(ids, max_new_tokens=N)` call (greedy,
                  use_cache as AirLLM/transformers default, min_new_tokens=N unless
                  --stop-at-eos), prefill included;
                  tok_per_s = new_tokens / seconds.
  ttft_seconds    generate() start -> first new token (prefill + 1 step), from a streamer.
  decode_tok_per_s  (new_tokens - 1) / (last token time - first token time): the
                  per-token rate with prefill removed (null when new_tokens < 2).
With --check, the same ids are also decoded greedily by plain transformers
(AutoModelForCausalLM, float32, do_sample=False) and "matches_greedy" says whether the
new token ids are identical.

AirLLM and transformers print progress to stdout; all of it is redirected to stderr so
stdout carries only the JSON line. The model directory is only read: AirLLM's per-layer
files go to --work-dir (default: a temporary directory, removed afterwards).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

# AirLLM's own layer naming for standard *ForCausalLM models (AirLLMBaseModel.set_layer_names_dict).
LAYER_NAMES = {"embed": "model.embed_tokens", "layer_prefix": "model.layers",
               "norm": "model.norm", "lm_head": "lm_head"}


class _TimingStreamer:
    """transformers streamer that records when each generated token arrives.
    generate() calls put() once with the prompt, then once per new token."""

    def __init__(self, t0_ref):
        self._t0_ref = t0_ref
        self._seen_prompt = False
        self.times: list[float] = []

    def put(self, value):
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text, as a user message in the model's chat template "
                                      "(see --raw-prompt); default: 'Tell me a fact about the sea.' "
                                      "(38 tokens with the SmolLM2 template)")
    p.add_argument("--new-tokens", type=int, default=4, help="max_new_tokens (default 4: AirLLM on CPU is slow)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="let generation stop at EOS (default: min_new_tokens=N, so exactly N tokens are "
                        "timed; applied to both AirLLM and --check)")
    p.add_argument("--raw-prompt", action="store_true",
                   help="encode --prompt as plain text (default: wrap it in the model's chat template)")
    p.add_argument("--work-dir", help="where AirLLM writes its per-layer split (kept for reuse); "
                                      "default: a temporary directory removed at exit")
    p.add_argument("--fresh-split", action="store_true", help="delete an existing split in --work-dir first")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--check", action="store_true",
                   help="also run plain transformers greedy decoding and report matches_greedy")
    p.add_argument("--out", help="also write the JSON object to this file")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    return args


def _reference_ids(model_dir, input_ids, gen_kwargs):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, **gen_kwargs)
    return out[0, input_ids.shape[1]:].tolist()


def run(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = str(Path(args.model).resolve())
    tmp = None
    if args.work_dir:
        work_dir = Path(args.work_dir).resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="airllm-baseline-")
        work_dir = Path(tmp)
    try:
        import importlib.metadata as md
        import airllm
        from airllm.utils import split_and_save_layers

        split_dir = work_dir / "splitted_model"
        if args.fresh_split and split_dir.exists():
            shutil.rmtree(split_dir)
        split_cached = split_dir.exists() and any(split_dir.glob("*.safetensors.done"))

        # 1. One-time split, timed on its own. AirLLM's constructor runs the same call with the
        #    same arguments and then finds every layer file already there.
        t = time.perf_counter()
        split_and_save_layers(model_dir, str(work_dir), layer_names=LAYER_NAMES)
        split_seconds = time.perf_counter() - t

        # 2. Construct the AirLLM model (CPU, no compression: that needs bitsandbytes + CUDA).
        t = time.perf_counter()
        model = airllm.AutoModel.from_pretrained(model_dir, device="cpu", compression=None,
                                                 layer_shards_saving_path=str(work_dir))
        init_seconds = time.perf_counter() - t
        if not isinstance(model, airllm.AirLLMBaseModel):
            raise RuntimeError(f"unexpected AirLLM model class {type(model).__name__}")

        if args.prompt_ids:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        else:
            text = args.prompt if args.prompt is not None else "Tell me a fact about the sea."
            tok = model.tokenizer
            if not args.raw_prompt and getattr(tok, "chat_template", None):
                ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                ids = list(ids)
            else:
                ids = tok(text, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids], dtype=torch.long)

        gen_kwargs = {"max_new_tokens": args.new_tokens}
        if not args.stop_at_eos:
            gen_kwargs["min_new_tokens"] = args.new_tokens

        # 3. The timed generate() call: greedy (generation_config has no sampling), use_cache left
        #    at AirLLM's / transformers' default.
        t0 = [0.0]
        streamer = _TimingStreamer(t0)
        with torch.inference_mode():
            t0[0] = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 do_sample=False, streamer=streamer, **gen_kwargs)
            seconds = time.perf_counter() - t0[0]
        output_ids = out[0, input_ids.shape[1]:].tolist()
        n = len(output_ids)
        times = streamer.times
        ttft = times[0] - t0[0] if times else None
        decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 2 else None
        per_token = [round(b - a, 4) for a, b in zip([t0[0]] + times[:-1], times)]

        result = {
            "airllm_version": md.version("airllm"),
            "torch_version": torch.__version__,
            "transformers_version": md.version("transformers"),
            "model": model_dir,
            "device": "cpu",
            "dtype": str(model.running_dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "prompt_tokens": len(ids),
            "new_tokens": n,
            "seconds": round(seconds, 4),
            "tok_per_s": round(n / seconds, 4),
            "ttft_seconds": None if ttft is None else round(ttft, 4),
            "decode_tok_per_s": None if decode_tps is None else round(decode_tps, 4),
            "per_token_seconds": per_token,
            "split_seconds": round(split_seconds, 4),
            "split_cached": split_cached,
            "init_seconds": round(init_seconds, 4),
            "output_ids": output_ids,
        }
        del model
        if args.check:
            ref = _reference_ids(model_dir, input_ids, gen_kwargs)
            result["reference_ids"] = ref
            result["matches_greedy"] = ref == output_ids
        result["notes"] = (
            "AirLLM streams every decoder layer + final norm from its per-layer safetensors files "
            "for every forward (prefill and each decode step), moves the module back to meta and runs "
            "clean_memory() (gc.collect + malloc_trim) after each one; the tied embedding/lm_head stays "
            "resident. seconds = one generate() call incl. prefill; split/init excluded."
        )
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    args = _parse_args(argv)
    real_stdout = sys.stdout
    # AirLLM prints (and may tqdm) on stdout; keep stdout for the JSON line only.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    line = json.dumps(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    real_stdout.write(line + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
