"""End to end on the demo model (SmolLM2-135M-Instruct, imported from its Q4_1 GGUF):
greedy output against transformers' generate(), multi-turn prefix reuse, and the CLI
as a user runs it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.session import render_prompt

pytestmark = pytest.mark.demo

PROMPTS = [
    "Why is the sky blue?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Describe, step by step, how to make a good cup of tea.",
    "What is the capital of France? Answer in one word.",
    "Rename the variable `x` to `count`:\n\ndef tally(items):\n    x = 0\n    for i in items:\n        x += 1\n    return x",
]


@pytest.fixture(scope="module")
def reference(demo_engine):
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import import_weights
    import_weights(demo_engine.checkpoint.path)     # the import's float32 copy, what transformers reads
    return AutoModelForCausalLM.from_pretrained(demo_engine.checkpoint.path, dtype=demo_engine.dtype).eval()


def test_demo_runs_its_gguf_blocks_in_float32(demo_engine):
    assert demo_engine.plan.chosen == "resident-gguf"
    assert demo_engine.target.kind == "gguf"        # the file's Q4_1 blocks, read by the layer kernel
    assert demo_engine.dtype == torch.float32       # activations in float32, as a dequantized GGUF is exact


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_generate(demo_engine, reference, prompt):
    chat = demo_engine.chat()
    done = list(chat.send(prompt, max_new_tokens=64))[-1]
    ids = torch.tensor([render_prompt(demo_engine.tokenizer, [{"role": "user", "content": prompt}])])
    with torch.inference_mode():
        want = reference.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
    assert list(done.token_ids) == want
    assert done.text == demo_engine.tokenizer.decode(
        [t for t in done.token_ids if t not in demo_engine.stop_ids], skip_special_tokens=True)


def test_second_turn_prefills_only_the_new_message(demo_engine):
    chat = demo_engine.chat()
    list(chat.send("Why is the sky blue?", max_new_tokens=24))
    first = chat.last_done
    turn1 = chat.last_stats.prompt_tokens + len(first.token_ids)
    list(chat.send("And why are sunsets red?", max_new_tokens=24))
    new = demo_engine.tokenizer("<|im_end|>\n<|im_start|>user\nAnd why are sunsets red?<|im_end|>\n"
                                "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    stopped = 1 if first.reason == "stop" else 0
    assert chat.last_stats.prompt_tokens == turn1 + len(new) - stopped
    assert chat.last_stats.prefill_tokens == len(new) + 1 - stopped


def run_cli(*args, stdin=b"", timeout=300):
    return subprocess.run([sys.executable, "-m", "localchat", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=os.environ.copy())


def test_cli_pipe_matches_the_engine(demo_engine):
    prompt = "What is the capital of France? Answer in one word."
    want = list(demo_engine.chat().send(prompt, max_new_tokens=16))[-1].text
    proc = run_cli("-n", "16", "--stats", stdin=prompt.encode())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == want + "\n"
    assert "decode" in proc.stderr.decode() and "tok/s" in proc.stderr.decode()


def test_cli_json_text_equals_streamed_text():
    # Plain decoding: with a drafter the float32 verify passes round differently from single
    # steps on MKL (see README, Exactness), and k depends on timing, so two runs could split
    # at a near-tie; this test is about --json carrying the same text, not about drafting.
    streamed = run_cli("-n", "24", "--drafter", "none", "Why is the sky blue?")
    as_json = run_cli("-n", "24", "--drafter", "none", "--json", "Why is the sky blue?")
    assert streamed.returncode == as_json.returncode == 0
    record = json.loads(as_json.stdout)
    assert record["text"] + "\n" == streamed.stdout.decode()
    assert record["finish_reason"] in ("stop", "length") and len(record["token_ids"]) <= 24
    assert record["stats"]["decode_tps"] > 0 and record["stats"]["prompt_tokens"] > 0


def test_cli_ctrl_c_keeps_what_was_printed():
    # Ctrl-C as a terminal delivers it: to a process whose SIGINT is not ignored. A suite run
    # in the background by a non-interactive shell (`pytest &`) ignores SIGINT itself, and
    # children inherit that (the CLI then rightly ignores it too, as `nohup localchat` should).
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "-n", "2000",
                             "Write a long story about a lighthouse keeper."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.set_blocking(proc.stdout.fileno(), False)
    got, deadline = b"", time.time() + 120
    while len(got) < 40 and time.time() < deadline:
        chunk = proc.stdout.read() or b""
        got += chunk
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    got += out or b""
    assert proc.returncode == 130, (len(got), got[-120:], err[-400:])
    assert len(got) >= 40 and b"interrupted" in err and b"Traceback" not in err


@pytest.mark.parametrize("k", [1, 2, 4, 8, None])
def test_speculative_greedy_equals_plain_on_the_demo_model(demo_engine, k):
    """n-gram drafts on a copy-heavy prompt, for fixed k and adaptive k: same tokens as plain."""
    prompt = PROMPTS[4]
    eng = demo_engine
    saved = eng.drafter, eng.draft_tokens
    try:
        eng.set_drafter("none")
        plain = list(eng.chat().send(prompt, max_new_tokens=64))[-1]
        eng.set_drafter("ngram")
        eng.draft_tokens = k
        chat = eng.chat()
        spec = list(chat.send(prompt, max_new_tokens=64))[-1]
        assert spec.token_ids == plain.token_ids
        assert chat.last_stats.drafted_tokens > 0 and chat.last_stats.accepted_tokens > 0
    finally:
        eng.drafter, eng.draft_tokens = saved


def test_demo_model_drafting_for_itself_accepts_everything(demo_engine):
    eng = demo_engine
    saved = eng.drafter, eng.draft_tokens
    try:
        eng.set_drafter("none")
        plain = list(eng.chat().send(PROMPTS[0], max_new_tokens=40))[-1]
        eng.set_drafter("model", str(eng.checkpoint.path))
        eng.draft_tokens = 4
        chat = eng.chat()
        spec = list(chat.send(PROMPTS[0], max_new_tokens=40))[-1]
        assert spec.token_ids == plain.token_ids
        assert chat.last_stats.acceptance == 1.0 and chat.last_stats.tokens_per_pass > 4
    finally:
        eng.drafter, eng.draft_tokens = saved


