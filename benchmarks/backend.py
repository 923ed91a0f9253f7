"""`--backend` against a server nobody here wrote: llama-cpp-python's OpenAI-compatible
server (llama.cpp, compiled from source: the `bench` extra) and `localchat serve`, on the
same weights, driven the same way: `localchat --backend URL` one-shot answers (a fresh
client process each) and `localchat bench --backend URL`, both servers up at once and
the answers interleaved, one run. Per server: time to the first token and decode tok/s
measured at the client, and the server's own decode tok/s where it reports one.

Weights: the demo model; llama.cpp reads an F32 GGUF written from the demo's Q4_1 file by
dequantizing every tensor (benchmarks/gguf_formats.py), localchat the same dequantized
weights (float32).

    python benchmarks/backend.py [--rounds 5] [--tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine, median, write_json  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read() or b"{}")
    except (OSError, ValueError):
        return None


def start_llama(gguf: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", "2048", "--model_alias", "demo", "--verbose", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 300
    while health(url + "/models") is None:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("llama_cpp.server did not start")
        time.sleep(0.5)
    return proc, url


def start_ours() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "serve", "--port", "0", "--dtype", "float32",
                             "--drafter", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
    if not m:
        raise SystemExit("localchat serve did not start")
    url = f"http://127.0.0.1:{m.group(1)}/v1"
    deadline = time.time() + 900
    while True:
        h = health(url.removesuffix("/v1") + "/health")
        if h and h.get("status") == "ready":
            return proc, url
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("localchat serve did not get ready")
        time.sleep(1)


def oneshot(url: str, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "localchat", "--backend", url, "-n", str(tokens), "--json",
                          "--no-log", PROMPT], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"localchat --backend {url}: {out.stderr.strip()}")
    s = json.loads(out.stdout)["stats"]
    return {k: s[k] for k in ("ttft_seconds", "decode_tps", "server_decode_tps", "generated_tokens")}


def bench(url: str, tokens: int, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "localchat", "bench", "--backend", url, "-n", str(tokens),
                          "--runs", "1", "--json", str(path)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"localchat bench --backend {url}: {out.stderr.strip()}")
    rows = json.loads(path.read_text())["workloads"]
    return {"decode_tps": median([r["decode_tps"] for r in rows]), "ttft_s": median([r["ttft_s"] for r in rows]),
            "workloads": {r["id"]: round(r["decode_tps"], 1) for r in rows}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "backend.json"))
    args = ap.parse_args()
    import torch
    import gguf_formats
    from engine import checkpoint
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("benchmarks/backend.py needs llama-cpp-python[server]: pip install -e .[bench]") from None
    f32 = gguf_formats.write_all(checkpoint.demo_gguf_path(), checkpoint.default_cache_dir() / "peers")["F32"]
    servers = {}
    try:
        servers["localchat serve"] = start_ours()
        servers["llama-cpp-python server"] = start_llama(f32, torch.get_num_threads())
        for _, url in servers.values():       # warm-up: first requests load pages and caches
            oneshot(url, 16)
        samples = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                samples[name].append(oneshot(url, args.tokens))
        benches = {name: bench(url, args.tokens, Path(f"/tmp/localchat-backend-bench-{os.getpid()}.json"))
                   for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    res = {name: {k: median([r[k] for r in v]) for k in v[0]} for name, v in samples.items()}
    ours, peer = res["localchat serve"], res["llama-cpp-python server"]
    out = {"benchmark": "backend", "machine": machine(), "llama_cpp_python": llama_cpp.__version__,
           "weights": "demo model, F32 (dequantized from the Q4_1 file) for both", "rounds": args.rounds,
           "tokens": args.tokens, "oneshot": res, "bench": benches,
           "ratios": {"oneshot_decode_ours_vs_llama_cpp": ours["decode_tps"] / peer["decode_tps"],
                      "oneshot_ttft_ours_vs_llama_cpp": ours["ttft_seconds"] / peer["ttft_seconds"],
                      "bench_decode_ours_vs_llama_cpp": benches["localchat serve"]["decode_tps"]
                      / benches["llama-cpp-python server"]["decode_tps"]},
           "samples": samples}
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "samples")}, indent=1))
    print("wrote", write_json(args.out, out))


if __name__ == "__main__":
    main()
