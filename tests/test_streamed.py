"""The streamed target: bit-identical logits to the resident target, the budget held,
tiers, and faults (a file truncated or gone mid-run, a budget too small)."""
import os
import shutil

import pytest
import torch

import engine
from engine import planner
from engine.errors import BadRequest, CheckpointError
from engine.targets.resident import load_resident
from engine.targets.streamed import load_streamed, minimum_budget
from tiny import budget_for, build_model

CPU = torch.device("cpu")


def _model_bytes(path):
    from engine.checkpoint import tensor_index
    return sum(e.nbytes for e in tensor_index(path).values())


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory, tokenizer):
    """Six layers, tied embeddings, two shards: the head is streamed from the embedding's bytes."""
    return build_model(tmp_path_factory.mktemp("tiny-tied"), "llama", layers=6, tie=True, shard="150KB",
                       tokenizer=tokenizer, seed=3)



@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory, tokenizer):
    """A bfloat16 checkpoint: streamed pieces go through staging and are converted."""
    return build_model(tmp_path_factory.mktemp("tiny-bf16"), "qwen3", layers=4, dtype=torch.bfloat16,
                       tokenizer=tokenizer, seed=5)


def _passes(target, seed=0):
    """A prefill, single steps and verify passes of several lengths: what decoding does.
    Where the layer kernel runs, the resident target runs all its layers in one call of it
    and the streamed one each layer in its own call as the layer arrives: the same bits."""
    g = torch.Generator().manual_seed(seed)
    out = [target.forward(torch.randint(0, target.vocab_size, (23,), generator=g).tolist(), all_logits=True)]
    for n in (1, 1, 2, 5, 9, 1, 17, 40):
        out.append(target.forward(torch.randint(0, target.vocab_size, (n,), generator=g).tolist(), all_logits=True))
    return out


def _assert_same(a_list, b_list):
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        assert torch.equal(a, b), f"pass {i}: max difference {(a - b).abs().max().item()}"


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Run the test with torch on this many threads (the resident target's count), then
    restore: exactness must not hang on the thread count one machine happens to use."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_tied"])
@pytest.mark.parametrize("share", [0.0, 0.4])
def test_streamed_logits_equal_resident_bit_for_bit(request, fixture, share, torch_threads):
    path = request.getfixturevalue(fixture)
    ref = _passes(load_resident(path, CPU, torch.float32))
    total = _model_bytes(path)
    # slot_numel small enough that the head is split in several chunks
    slot = 4096 * 4
    budget = minimum_budget(path, CPU, torch.float32, slot_numel=slot) + int(total * share)
    st = load_streamed(path, CPU, torch.float32, weight_budget=budget, slot_numel=slot)
    assert len(st.index.head_units) > 1
    from engine.kernels import layer_kernel
    assert (st.impl._one is not None) == (not layer_kernel.why_not(torch.float32))
    _assert_same(ref, _passes(st))
    assert st.ledger.peak <= st.weight_budget
    st.close()


def test_split_threads_only_where_steps_run_in_localchats_kernels(tiny_llama, torch_threads):
    """One-token steps leave the prefetch readers a core only where they run in localchat's
    kernels, whose bits do not depend on the thread count; on torch's kernels every step
    runs on every thread. It says which it chose and why."""
    st = load_streamed(tiny_llama, CPU, torch.float32, weight_budget=minimum_budget(tiny_llama, CPU, torch.float32))
    reason = st.describe()["compute_threads"]
    if torch_threads == 1:
        assert st.split is None and st._compute_threads(1) is None and "torch's setting" in reason
        return
    assert st.split is not None and st.split.reason == reason
    st.forward([1, 2, 3])
    assert st._compute_threads(5) is None                         # a verify pass: always every thread
    if st.impl.steps_in_kernels(st.prefetcher.slots[0].views):
        assert st._compute_threads(1) == st.split.threads < torch_threads
        assert "same bits on any thread count" in reason
    st.impl._one = None                                           # as where layer.c does not run
    st.split = None
    st._check_split()
    assert st.split.threads is None and st._compute_threads(1) is None and "torch's kernels" in st.split.reason
    st.close()


def test_every_weight_the_forwards_read_starts_on_64_bytes(tiny_llama, tiny_bf16):
    """Matrix-vector kernels may round by alignment: the resident forward's weights and the
    streamed slots' fields all start on 64-byte boundaries, so both run the same kernels."""
    from engine.targets import layer_index
    from engine.models.llama_family import ALIGN_BYTES
    for path, dtype in ((tiny_llama, torch.float32), (tiny_bf16, torch.bfloat16)):
        res = load_resident(path, CPU, dtype)
        assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in res.impl.weight_tensors())
        idx = layer_index.build(path, res.config.num_hidden_layers, False)
        es = torch.finfo(dtype).bits // 8
        assert all(start * es % ALIGN_BYTES == 0 for start, _ in idx.layout.fields.values())


def test_host_tier_and_bf16_staging_equal_resident(tiny_bf16, monkeypatch):
    from engine.targets import prefetch
    monkeypatch.setattr(prefetch, "READ_CHUNK", 4096)     # several reader threads on every piece
    ref = _passes(load_resident(tiny_bf16, CPU, torch.float32))
    third = _model_bytes(tiny_bf16) // 3
    st = load_streamed(tiny_bf16, CPU, torch.float32, host_budget=third,
                       weight_budget=minimum_budget(tiny_bf16, CPU, torch.float32) + third)
    assert st.placement.host and st.placement.disk, st.describe()
    _assert_same(ref, _passes(st))
    stats = st.stream_stats()
    assert stats.host_bytes > 0 and stats.disk_bytes > 0
    assert st.host_ledger.peak <= third


def test_bfloat16_compute_equals_resident(tiny_qwen3):
    ref = _passes(load_resident(tiny_qwen3, CPU, torch.bfloat16))
    st = load_streamed(tiny_qwen3, CPU, torch.bfloat16,
                       weight_budget=minimum_budget(tiny_qwen3, CPU, torch.bfloat16) + 50_000)
    _assert_same(ref, _passes(st))


def test_demote_keeps_logits(tiny_llama):
    ref = _passes(load_resident(tiny_llama, CPU, torch.float32))
    st = load_streamed(tiny_llama, CPU, torch.float32,
                       weight_budget=minimum_budget(tiny_llama, CPU, torch.float32) + _model_bytes(tiny_llama) // 2)
    before = len(st.resident)
    _passes(st)
    demoted = st.demote(1)       # everything was resident: it frees room for the prefetch slots too
    assert demoted >= 1 and len(st.resident) == before - demoted and st.prefetcher.slots
    st.cache.rollback(0)
    _assert_same(ref, _passes(st))
    assert st.ledger.peak <= st.weight_budget


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_needs_what_the_loader_needs(tiny_deep, dtype):
    """The streamed row's least weight budget is the loader's own, staging included: a
    float32 checkpoint computed in bf16 is read through a buffer of each unit's file bytes."""
    from dataclasses import replace
    from engine import hardware, planner, profiles
    shape = replace(planner.ModelShape.from_checkpoint(tiny_deep), dtype_bytes=torch.finfo(dtype).bits // 8)
    row = planner.make_plan(shape, hardware.detect(vram=10 ** 5, device="cpu"), profiles.builtin(),
                            context=256).row("streamed-exact")
    assert not row.fits and row.weights == minimum_budget(tiny_deep, CPU, dtype)


def test_budget_below_minimum_is_refused_with_the_minimum(tiny_llama):
    with pytest.raises(BadRequest, match="at least"):
        load_streamed(tiny_llama, CPU, torch.float32, weight_budget=1000)


def test_place_streamed_spreads_resident_units_and_counts_bytes():
    units = [100] * 10
    p = planner.place_streamed(units, 100, 10, 0, budget=10 + 200 + 400)
    assert len(p.resident) == 4 and p.fits
    assert sorted(p.resident) == [1, 3, 6, 8]          # spread over the pass, not bunched up
    assert p.device_bytes <= 610 and p.streamed_bytes == 600
    small = planner.place_streamed(units, 100, 10, 0, budget=150)
    assert not small.fits and small.min_budget == 210
    everything = planner.place_streamed(units, 100, 10, 50, budget=2000)
    assert len(everything.resident) == 10 and everything.embed_resident and everything.streamed_bytes == 0
    tiered = planner.place_streamed(units, 100, 10, 0, budget=310, host_budget=450)
    assert len(tiered.resident) == 1 and len(tiered.host) == 4 and len(tiered.disk) == 5


# -- faults: the answer stops with a clear error, the conversation is kept, the next prompt retries

def _copy(path, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(path, dst)
    return dst


def _streamed_engine(path, budget):
    return engine.open(str(path), device="cpu", dtype="float32", memory_budget=budget, context=256,
                       profile="streamed-exact", drafter="none")


@pytest.mark.parametrize("fault", ["truncate", "remove"])
def test_file_fault_mid_run_keeps_conversation_and_retries(tiny_tied, tmp_path, fault):
    path = _copy(tiny_tied, tmp_path)
    eng = _streamed_engine(path, "1200KB")
    assert eng.plan.chosen == "streamed-exact" and eng.target.placement.disk
    chat = eng.chat()
    first = list(chat.send("hello there", max_new_tokens=5))
    assert first[-1].reason in ("length", "stop")
    weights = sorted(path.glob("model-*.safetensors"))[-1]
    saved = tmp_path / "saved.safetensors"
    shutil.copy(weights, saved)
    if fault == "truncate":
        with open(weights, "r+b") as fh:
            fh.truncate(os.path.getsize(weights) // 2)
    else:
        weights.unlink()
    done = list(chat.send("and again", max_new_tokens=5))[-1]
    assert done.reason == "error"
    assert weights.name in done.error and ("truncated" in done.error or "changed size" in done.error
                                                  or "disappeared" in done.error)
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    shutil.copy(saved, weights)
    again = list(chat.send("once more", max_new_tokens=5))[-1]
    assert again.reason in ("length", "stop"), again.error


def test_open_picks_streamed_when_nothing_resident_fits(tiny_deep):
    model = tiny_deep
    eng = engine.open(str(model), device="cpu", dtype="float32", context=256, drafter="ngram",
                      memory_budget=budget_for(model, "streamed-exact", context=256))
    assert eng.plan.chosen == "streamed-exact"
    info = eng.describe()
    assert info["profile"] == "streamed-exact" and info["streaming"]["disk_units"] > 0
    ref = engine.open(str(model), device="cpu", dtype="float32", drafter="none")
    assert ref.plan.chosen == "resident-exact"
    prompt = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\nRepeat it: def fib(n):"
    a = list(eng.chat().send(prompt, max_new_tokens=30))
    b = list(ref.chat().send(prompt, max_new_tokens=30))
    assert a[-1].token_ids == b[-1].token_ids
    stats = a[-2]
    assert stats.streamed_bytes > 0 and stats.stream_gbps > 0 and 0 <= stats.stream_hidden <= 1
    assert stats.pass_seconds > 0 and stats.bound_pass_seconds > 0


def test_forced_profile_errors_name_the_flag(tiny_llama):
    with pytest.raises(BadRequest, match="--profile nope"):
        engine.open(str(tiny_llama), device="cpu", profile="nope")
    with pytest.raises(BadRequest, match="--profile resident-exact"):
        engine.open(str(tiny_llama), device="cpu", profile="resident-exact", memory_budget="100KB")
    with pytest.raises(BadRequest, match="raise --vram"):
        engine.open(str(tiny_llama), device="cpu", profile="streamed-exact", memory_budget="10KB")


def test_truncated_read_is_a_checkpoint_error(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path)
    st = load_streamed(path, CPU, torch.float32, weight_budget=minimum_budget(path, CPU, torch.float32))
    st.forward([1, 2, 3])
    with open(path / "model.safetensors", "r+b") as fh:
        fh.truncate(100_000)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        for _ in range(3):
            st.forward([4])


# -- the demo model (SmolLM2-135M, 538 MB in float32), with about a quarter of it held

@pytest.mark.demo
def test_demo_streamed_logits_equal_resident_with_a_quarter_budget(demo_engine):
    path = demo_engine.checkpoint.path
    budget = _model_bytes(path) // 4
    st = load_streamed(path, CPU, torch.float32, weight_budget=budget)
    assert st.placement.disk and st.placement.resident
    ref = load_resident(path, CPU, torch.float32)   # its layer kernel runs the stack, the streamed one layer by layer
    prompt = demo_engine.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    assert torch.equal(ref.forward(prompt, all_logits=True), st.forward(prompt, all_logits=True))
    for n in (1, 4, 9, 1):                   # decode steps and verify passes at pos > 0
        ids = prompt[:n]
        assert torch.equal(ref.forward(ids, all_logits=True), st.forward(ids, all_logits=True)), n
    assert st.ledger.peak <= budget


@pytest.mark.demo
def test_demo_streamed_speculative_greedy_equals_resident_plain(demo_engine):
    path = demo_engine.checkpoint.path
    eng = engine.open(None, memory_budget=str(_model_bytes(path) // 2), profile="streamed-exact", context=1024,
                      drafter="ngram", dtype="float32")
    assert eng.plan.chosen == "streamed-exact"
    prompt = ("Copy this list exactly, one item per line: apples, pears, plums, cherries, "
              "grapes, lemons, limes, oranges.")
    spec = list(eng.chat().send(prompt, max_new_tokens=48))
    demo_engine.drafter, saved = engine.NoDrafter(), demo_engine.drafter
    try:
        plain = list(demo_engine.chat().send(prompt, max_new_tokens=48))
    finally:
        demo_engine.drafter = saved
    assert spec[-1].token_ids == plain[-1].token_ids
    assert spec[-2].streamed_bytes > 0


@pytest.mark.demo
def test_demo_streaming_holds_its_budget_in_a_real_process(tmp_path):
    """Resident set of a real process: what streaming adds stays within the weight budget
    (plus activations), though the model is four times larger. Reads use pread, so the
    page cache, which the kernel may drop, is not counted as the engine's memory."""
    import json
    import subprocess
    import sys
    code = r'''
import json, psutil, torch
from transformers import LlamaForCausalLM   # the modeling code the skeleton imports
from engine import checkpoint
from engine.targets.streamed import load_streamed
path = checkpoint.resolve(None).path
total = sum(e.nbytes for e in checkpoint.tensor_index(path).values())
torch.ones(1) @ torch.ones(1)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                             # reset the peak resident set to the current one
base = psutil.Process().memory_info().rss
st = load_streamed(path, torch.device("cpu"), torch.float32, weight_budget=total // 4)
st.forward(list(range(100, 180)))
for t in range(12):
    st.forward([t + 200])
print(json.dumps({"path": str(path), "total": total, "budget": total // 4, "base": base, "peak": hwm(),
                  "held": st.ledger.peak}))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] <= r["budget"], r
    grown = r["peak"] - r["base"]
    assert grown <= r["budget"] + 80 * 2**20, r      # 80 MiB: activations, logits, allocator slack
    assert grown < r["total"] // 2, r


def test_out_of_memory_mid_pass_hands_back_resident_layers_and_retries_once(tiny_tied):
    """A device OOM raised inside a pass (injected: a CPU cannot be made to run out safely):
    the target demotes half its resident units, reruns the pass with the same result, and a
    second OOM is a clear error, not a hang."""
    ref = _passes(load_resident(tiny_tied, CPU, torch.float32))
    budget = minimum_budget(tiny_tied, CPU, torch.float32) + _model_bytes(tiny_tied) // 2
    st = load_streamed(tiny_tied, CPU, torch.float32, weight_budget=budget)
    real, fails = st.impl, {"left": 1}

    def flaky(ids, pos, all_logits):
        if fails["left"]:
            fails["left"] -= 1
            raise torch.OutOfMemoryError("injected")
        return real(ids, pos, all_logits)

    st.impl = flaky
    resident_before = len(st.resident)
    _assert_same(ref, _passes(st))
    assert len(st.resident) < resident_before
    fails["left"] = 2
    with pytest.raises(engine.EngineError, match="out of device memory"):
        st.forward([1])
    fails["left"] = 0
    st.forward([1])                      # and it still runs afterwards
    st.close()                           # its reader threads end with it
