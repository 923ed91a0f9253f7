"""The compiled decode step (engine/compiled.py): built in the background on a tiny model
through the real torch.compile path (inductor, max-autotune, freezing; ~15-40 s on two
cores, once per session: the cache dir is shared), then used between tokens without
changing a token; failures fall back to eager decoding."""
import threading
import time

import pytest
import torch

import engine
from engine import compiled

PROMPT = "the cat sat on the mat and the dog"


def answer(eng, n=40):
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=n))
    return chat.last_done.token_ids, chat.last_stats


@pytest.fixture(scope="module")
def eager_ids(tiny_llama):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    return answer(eng)[0]


@pytest.fixture(scope="module")
def compiled_engine(tiny_llama, compile_cache):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", compile="on", cache_dir=compile_cache)
    step = eng.target.compiled
    assert step is not None and step.state in ("compiling", "ready")
    assert step.wait(900), step.error
    return eng


def test_compiled_step_gives_the_eager_tokens(compiled_engine, eager_ids):
    ids, stats = answer(compiled_engine)
    assert compiled_engine.target.compiled.state == "ready"
    assert stats.compile_state == "ready"
    assert ids == eager_ids
    # The compiled logits are the eager ones up to float32 rounding (other kernels, same sums).
    t = compiled_engine.target
    t.cache.rollback(0)
    t.forward([3, 4, 5])
    with torch.inference_mode():
        ids1 = torch.tensor([6])
        fast = t.compiled(ids1, t.cache.length)
        slow = t.impl(ids1, t.cache.length, False)
    assert torch.allclose(fast, slow, atol=1e-4, rtol=1e-4)


def test_switch_mid_answer_keeps_the_text(tiny_llama, compile_cache, eager_ids):
    # A second engine compiles again (from the warm cache); the answer starts eagerly and
    # is paused until the compiled step is ready, so its rest runs compiled.
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", compile="on", cache_dir=compile_cache)
    step = eng.target.compiled
    chat = eng.chat()
    events = chat.send(PROMPT, max_new_tokens=40)
    first = next(events)
    assert step.state == "compiling"      # the first token came from the eager step
    # The compile pauses while an answer runs (it would starve it of the GIL); this answer
    # is itself paused here, so let the compile finish as if the answer had ended.
    compiled.resume()
    assert step.wait(900), step.error
    list(events)
    assert first is not None and chat.last_done.token_ids == eager_ids
    assert chat.last_stats.compile_state == "ready"


def test_a_step_that_would_recompile_falls_back_to_eager(compiled_engine, eager_ids):
    step = compiled_engine.target.compiled

    def would_recompile(*args):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
    good = step._fn
    step._fn = would_recompile
    try:
        ids, stats = answer(compiled_engine)
        assert ids == eager_ids
        assert step.state == "failed" and "would recompile" in step.error
        assert stats.compile_state == "failed"
    finally:
        step._fn, step.state, step.error = good, "ready", ""


class ExplodingCompiler(compiled.CompiledStep):
    """Inductor failing in every mode (injected: a real internal compiler error cannot be
    summoned on demand)."""
    tried: list[str]

    def _build(self, mode):
        self.tried = getattr(self, "tried", []) + [mode]
        raise RuntimeError(f"inductor exploded in {mode}")


def test_a_failed_compile_leaves_eager_decoding(tiny_llama, tmp_path, eager_ids):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    step = eng.target.compiled = ExplodingCompiler(eng.target, tmp_path, "bad")
    step.start()
    assert not step.wait(60)
    assert step.tried == [compiled.MODE, "default"]          # max-autotune, then the plain mode
    assert step.state == "failed" and "exploded in default" in step.error
    assert answer(eng)[0] == eager_ids


def test_bfloat16_compiles_in_the_fallback_mode_if_max_autotune_fails(tiny_llama, compile_cache):
    # max-autotune trips an inductor assertion on this bf16 graph (torch 2.13); the step
    # still compiles, in the default mode, and answers.
    eng = engine.open(str(tiny_llama), dtype="bfloat16", drafter="none", compile="on", cache_dir=compile_cache)
    step = eng.target.compiled
    assert step.wait(900), step.error
    ids, stats = answer(eng)
    assert stats.compile_state == "ready" and len(ids) > 0


def test_quantized_target_and_its_drafter_compile(tiny_llama, compile_cache):
    # An int8 target drafted for by its own int4 copy: both decode steps compile, one
    # after the other, and the answer is the eager one (float32 activations: the
    # compiled int8 kernel accumulates as the aten one does, to float32 rounding).
    kw = dict(dtype="float32", profile="resident-int8", drafter="model", draft_model="self", cache_dir=compile_cache)
    eager = engine.open(str(tiny_llama), **kw)
    want = answer(eager)[0]
    eng = engine.open(str(tiny_llama), compile="on", **kw)
    step, draft_step = eng.target.compiled, eng.drafter.target.compiled
    assert step is not None and draft_step is not None
    assert step.wait(900), step.error
    assert draft_step.wait(900), draft_step.error
    # The packed weights became constants of the graph: their tensors are parameters.
    assert isinstance(eng.target.impl.layers[0].qkv.q, torch.nn.Parameter)
    ids, stats = answer(eng)
    assert ids == want and stats.compile_state == "ready"
    t = eng.target
    t.cache.rollback(0)
    t.forward([3, 4, 5])
    with torch.inference_mode():
        one = torch.tensor([6])
        fast, slow = t.compiled(one, t.cache.length), t.impl(one, t.cache.length, False)
    assert torch.allclose(fast, slow, atol=1e-4, rtol=1e-4)


def test_streamed_targets_decode_eagerly(tiny_llama):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", profile="streamed-exact")
    assert eng.start_compile() is False and "streamed" in eng.compile_note
    assert getattr(eng.target, "compiled", None) is None
    with pytest.raises(engine.BadRequest, match="--compile"):
        engine.open(str(tiny_llama), compile="sometimes")


def test_pass_costs_are_measured_afresh_when_a_step_goes_live():
    from engine.speculative import PassCosts

    class Target:
        compiled = None
    t, costs = Target(), PassCosts()
    costs.follow_kernels(t, None)
    costs.observe(2, 0.01, 0.05)
    costs.follow_kernels(t, None)                 # nothing changed: the figures stay
    assert costs.t_pass == {3: 0.05} and costs.t_draft == 0.005
    t.compiled = type("Step", (), {"state": "ready"})()
    costs.follow_kernels(t, None)
    assert costs.t_pass == {} and costs.t_draft == 0.005


class BusyCompile(compiled.CompiledStep):
    """Stands in for the compiler's Python work (allocating all the time) on the real
    compile thread, counting how far it got."""

    def __init__(self):
        super().__init__(None, None, "busy")
        self.count = 0
        self.stop = threading.Event()

    def _compile(self):
        kept = []
        while not self.stop.is_set():
            # Like a compiler building graphs, it keeps what it allocates, so collections
            # come every few rounds (objects freed at once would not count towards one).
            kept.append([[] for _ in range(100)])
            if len(kept) > 1000:
                kept = []
            self.count += 1
        self.state = "ready"


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_compile_thread_parks_while_an_answer_runs():
    step = BusyCompile()
    compiled._submit(step)
    wait_until(lambda: step.count > 0)
    compiled.pause()
    try:
        time.sleep(0.2)                      # it parks at its next collection
        before = step.count
        time.sleep(0.3)
        assert step.count == before and compiled.busy()
    finally:
        compiled.resume()
    wait_until(lambda: step.count > before)  # and goes on once the answers are done
    step.stop.set()
    assert step.wait(10) and not compiled.busy()


def test_every_step_compiles_its_own_code_object():
    # Dynamo's graphs and its recompile limit (8) are per code object: a process that
    # compiles several targets and drafters must not pile them onto one.
    a, b = compiled._own_step(), compiled._own_step()
    assert a.__code__ is not b.__code__ and a.__code__ is not compiled._step.__code__
    assert a.__code__ == compiled._step.__code__


def test_cache_key_separates_what_a_graph_is_valid_for():
    a = compiled.cache_key("m", torch.float32, "exact", torch.device("cpu"))
    assert a == compiled.cache_key("m", torch.float32, "exact", torch.device("cpu"))
    assert a != compiled.cache_key("m", torch.bfloat16, "exact", torch.device("cpu"))
    assert a != compiled.cache_key("other", torch.float32, "exact", torch.device("cpu"))
