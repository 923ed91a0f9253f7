"""The compiled decode step (engine/compile/step.py): built in the background on a tiny model
through the real torch.compile path (inductor, max-autotune, freezing; ~15-40 s on two
cores, once per session: the cache dir is shared), then used between tokens without
changing a token; failures fall back to eager decoding."""
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import engine
from engine.compile import exported
from engine.compile import step as compiled
from engine.compile import worker as compile_worker
from engine.kernels import q4_kernel
from tiny import build_model
from waiting import wait_until

PROMPT = "the cat sat on the mat and the dog"


def answer(eng, n=40):
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=n))
    return chat.last_done.token_ids, chat.last_stats


@pytest.fixture(scope="module", autouse=True)
def _buckets_win_their_race():
    """A verify bucket goes live only if it beats the eager pass in a timed race, and timing
    is what a loaded or a slower machine changes. These tests are about what happens after
    the race, so the real race runs and its verdict is fixed: the compiled pass wins. (The
    tests that are about the verdict inject their own: EvenRace below.)"""
    real = compiled.CompiledStep._race

    def race(self, package, rows, reps=5):
        eager, fast = real(self, package, rows, reps)
        return max(eager, fast) * 1.25, min(eager, fast)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled.CompiledStep, "_race", race)
        yield


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


def test_a_second_start_loads_the_package_and_switches_mid_answer(compiled_engine, tiny_llama, compile_cache,
                                                                  eager_ids):
    # The first engine left its package on disk; a second start of the same model loads
    # it instead of compiling. Started after the answer's first token, it goes live
    # between two tokens, and the text is the eager one.
    assert compiled_engine.target.compiled.source == "built"
    assert compiled_engine.target.compiled.built_in == "child"     # built by a child process (engine/compile/builder.py)
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", cache_dir=compile_cache)
    chat = eng.chat()
    events = chat.send(PROMPT, max_new_tokens=40)
    first = next(events)
    assert eng.start_compile(compile_cache)
    step = eng.target.compiled
    assert step.wait(120), step.error
    assert step.source == "cache" and step.notes == [], step.notes
    list(events)
    assert first is not None and chat.last_done.token_ids == eager_ids
    assert chat.last_stats.compile_state == "ready"


def test_cached_mode_loads_a_built_step_and_never_builds_one(compiled_engine, tiny_llama, compile_cache, tmp_path):
    # What a one-shot answer runs with --compile auto: the step an earlier start built, if any.
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", compile="cached", cache_dir=compile_cache)
    assert eng.target.compiled.wait(120) and eng.target.compiled.source == "cache"
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", compile="cached", cache_dir=tmp_path)
    step = eng.target.compiled
    assert not step.wait(60) and step.state == "off"
    # The first engine races its step in the background (engine/compile/proof.py); once
    # that is done nothing else runs, and nothing was built.
    wait_until(lambda: not compile_worker.busy(), 120)
    assert not step.package.exists()


def test_a_one_shot_step_loads_once_the_first_token_is_out(compiled_engine, tiny_llama, compile_cache, eager_ids):
    # What `localchat "question"` runs with --compile auto: the step an earlier start built,
    # loaded after the answer's first token (the first token comes as early as eagerly,
    # and the load runs beside the decoding), and the answer is the eager one.
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", compile="oneshot", cache_dir=compile_cache)
    step = eng.target.compiled
    assert step.late and not step.build
    # Its package started loading beside the model's weights; it goes live only after the
    # first token of an answer.
    assert step.package in exported._preloads
    assert not step.wait(1.5) and step.state == "compiling"
    chat = eng.chat()
    events = chat.send(PROMPT, max_new_tokens=40)
    next(events)
    assert step.wait(120) and step.source == "cache", step.notes
    assert step.package not in exported._preloads                # taken, not loaded twice
    list(events)
    assert chat.last_done.token_ids == eager_ids
    assert chat.last_stats.compile_state == "ready"


def test_the_one_shot_cli_uses_the_built_step_and_builds_none(compiled_engine, tiny_llama, compile_cache, eager_ids):
    import json
    import subprocess
    import sys
    # compiled steps only: a first run in this cache dir builds the row kernels (engine/kernels)
    steps = lambda: sorted(p.name for p in compile_cache.rglob("*")   # noqa: E731
                           if p.is_file() and "kernels" not in p.relative_to(compile_cache).parts)
    before = steps()
    env = dict(os.environ, LOCALCHAT_CACHE_DIR=str(compile_cache))
    proc = subprocess.run([sys.executable, "-m", "localchat", "--model", str(tiny_llama), "--dtype", "float32",
                           "--drafter", "none", "-n", "40", "--json", "--no-log", PROMPT],
                          capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout)
    assert tuple(out["token_ids"]) == tuple(eager_ids)
    # Loaded after the first token: whether it went live before this short answer ended
    # is timing (the in-process test above waits for it); that nothing was built is not.
    assert out["stats"]["compile_state"] in ("compiling", "ready")
    assert steps() == before


def test_a_late_step_is_checked_before_its_first_step_and_a_stale_one_never_runs(compiled_engine, tokenizer,
                                                                                 tmp_path):
    # A late step's package skips the check when it loads (the loading thread would slow the
    # tokens decoding beside it) and is checked by the first step that would run it: one
    # made from other weights is deleted there, and that step and the rest run eagerly.
    import shutil
    other = build_model(tmp_path / "other", seed=1, tokenizer=tokenizer)
    want = answer(engine.open(str(other), dtype="float32", drafter="none"))[0]
    eng = engine.open(str(other), dtype="float32", drafter="none")
    step = compiled.CompiledStep(eng.target, tmp_path, "stale", build=False, late=True)
    step.package.parent.mkdir(parents=True)
    shutil.copy(compiled_engine.target.compiled.package, step.package)
    eng.target.compiled = step
    step.start()
    chat = eng.chat()
    # A one-token answer: its first token lets the package load, and no step of this answer
    # is left to run it (the check happens in the next answer, below).
    list(chat.send("hello", max_new_tokens=1))
    assert step.wait(120) and step._unchecked, (step.state, step.error, step.notes)
    assert answer(eng)[0] == want
    assert step.state == "off" and not step.package.exists()
    assert any("not this model's" in n for n in step.notes), step.notes


def test_a_package_slower_than_eager_is_not_used(compiled_engine, tiny_llama, tmp_path):
    # Its race (recorded beside it) lost to the eager step, at a size where races decide
    # (proof.BOUND_FROM), and no rebuild is due: the step is not even loaded, and says why.
    import json
    import shutil
    from engine.compile import proof
    step = _unloaded(tiny_llama, tmp_path, "slow")
    step.package.parent.mkdir(parents=True)
    shutil.copy(compiled_engine.target.compiled.package, step.package)
    record = {"built": {"quiet": True}, "rebuilds": 1,
              "race": {"eager_ms": 108.0, "step_ms": 134.0, "weight_bytes": 3 << 30, "bound_ms": 64.0,
                       "bandwidth": 47e9, "eager": step._eager_kind()}}
    proof.path_of(step.package).write_text(json.dumps(record))
    step.build = False
    step.start()
    step.wait(60)
    assert step.state == "off" and step._fn is None
    assert any("134.0 ms a token against 108.0 eager: decoding eagerly" in n for n in step.notes), step.notes
    assert "not used: the eager step is faster" in proof.describe(record)
    assert proof.eager_wins(dict(record, race=dict(record["race"], weight_bytes=1 << 20))) == ""   # too small to tell


def test_a_race_against_another_eager_step_is_run_again(compiled_engine, tiny_llama, tmp_path):
    # The same losing record, raced against an earlier version's eager step (no "eager"
    # kind: torch's kernels before the row kernels came): its verdict says nothing about
    # this eager step, so the package loads and is raced again, in this process.
    import json
    import shutil
    from engine.compile import proof
    step = _unloaded(tiny_llama, tmp_path, "stale")
    step.package.parent.mkdir(parents=True)
    shutil.copy(compiled_engine.target.compiled.package, step.package)
    old = {"built": {"quiet": True}, "rebuilds": 1,
           "race": {"eager_ms": 108.0, "step_ms": 134.0, "weight_bytes": 3 << 30, "bound_ms": 64.0, "bandwidth": 47e9}}
    proof.path_of(step.package).write_text(json.dumps(old))
    assert proof.stale(old, step._eager_kind()) and proof.eager_wins(old)
    step.build = False
    step.start()
    assert step.wait(120) and step.state == "ready", (step.state, step.notes)
    assert step.wait_proven(300), step.notes
    raced = proof.read(step.package)["race"]
    assert raced["eager"] == step._eager_kind() and raced["weight_bytes"] == step.target.weight_bytes()
    assert not proof.stale(proof.read(step.package), step._eager_kind())


def test_a_package_an_earlier_version_kept_as_an_archive_is_migrated(compiled_engine, tiny_llama, tmp_path):
    # Earlier versions kept a CPU step as the whole AOTInductor archive, unpacked at every
    # load; its library is taken out once (the build's choices kept) and loads from then on.
    import zipfile
    good = compiled_engine.target.compiled.package
    assert good.suffix == ".so"
    step = _unloaded(tiny_llama, tmp_path, "old")
    step.package.parent.mkdir(parents=True)
    archive = step.package.with_suffix(".pt2")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("step/data/aotinductor/model/x.wrapper.cpp", "// the build's source")
        z.write(good, "step/data/aotinductor/model/x.wrapper.so")
    assert step._load_package() is True and step.notes == []
    assert step.package.read_bytes() == good.read_bytes() and not archive.exists()
    # One that is not an archive says so, and the step is built again.
    step = _unloaded(tiny_llama, tmp_path, "bad")
    step.package.parent.mkdir(parents=True)
    step.package.with_suffix(".pt2").write_bytes(b"not a zip")
    assert step._load_package() is False
    assert "could not be read" in step.notes[0]


def test_doctor_shows_the_built_steps_and_their_size(compiled_engine, tiny_llama, compile_cache):
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, LOCALCHAT_CACHE_DIR=str(compile_cache))
    run = lambda *a: subprocess.run([sys.executable, "-m", "localchat", "doctor", "--model", str(tiny_llama), *a],
                                    capture_output=True, timeout=300, env=env)   # noqa: E731
    out = json.loads(run("--json").stdout)
    package = compiled_engine.target.compiled.package
    assert {"path": str(package), "bytes": package.stat().st_size} in \
        [{k: s[k] for k in ("path", "bytes")} for s in out["compiled_steps"]]
    text = run().stdout.decode()
    assert "Compiled decode steps:" in text and str(package.parent.parent) in text


@pytest.fixture(scope="module")
def verify_engine(tiny_llama, compile_cache):
    """n-gram drafts of up to 3 tokens: verify passes of 2 and 4 positions are compiled
    (after the step), without weights of their own."""
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=3, compile="on",
                      cache_dir=compile_cache)
    step = eng.target.compiled
    assert step.rows == (2, 4)
    assert step.wait(900), step.error
    assert step.wait_passes(900), (step.passes_error, step.notes)
    return eng


def test_compiled_verify_passes_keep_the_greedy_tokens(verify_engine, eager_ids):
    eng = verify_engine
    step = eng.target.compiled
    # They run on the forward's own weight tensors (no copy in memory).
    own = {w.data_ptr() for w in eng.target.impl.weight_tensors()}
    for rows in (2, 4):
        given = step.passes[rows]._weights
        assert given and {w.data_ptr() for w in given.values()} == own
    # A pass of 3 positions runs in the 4-row bucket, padded; its logits are the eager
    # pass's to float32 rounding, and the cache holds the 3 positions it was given.
    t = eng.target
    t.cache.rollback(0)
    t.forward([3, 4, 5, 6])
    pos = t.cache.length
    assert step.pass_rows(3) == 4 and step.pass_rows(5) is None
    fast = t.forward([7, 8, 9], all_logits=True)
    assert t.cache.length == pos + 3
    t.cache.rollback(pos)
    with torch.inference_mode():
        slow = t.impl(torch.tensor([7, 8, 9]), pos, True)
    assert fast.shape == slow.shape and torch.allclose(fast, slow, atol=1e-4, rtol=1e-4)
    # Speculative greedy decoding through the compiled step and passes gives the plain tokens.
    chat = eng.chat()
    list(chat.send(PROMPT, max_new_tokens=40))
    assert chat.last_done.token_ids == eager_ids
    assert chat.last_stats.drafted_tokens > 0 and chat.last_stats.compiled_passes == (2, 4)
    from localchat.oneshot import format_stats
    assert "compiled step · compiled verify (2, 4 positions)" in format_stats(chat.last_stats)
    assert step.passes_state == "ready"


def test_a_second_start_loads_the_verify_passes_and_drops_a_corrupt_one(verify_engine, tiny_llama, compile_cache,
                                                                        tmp_path):
    import shutil
    step = verify_engine.target.compiled
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=3, compile="cached",
                      cache_dir=compile_cache)
    again = eng.target.compiled
    assert again.wait_passes(300) and again.notes == []
    # A corrupt bucket is deleted (and would be rebuilt); the others still load.
    folder = tmp_path / "inductor" / "k"
    folder.mkdir(parents=True)
    shutil.copy(step.package, folder / "step.so")
    shutil.copy(step.cache_dir / "verify-4.so", folder / "verify-4.so")
    (folder / "verify-2.so").write_bytes(b"not a library" * 100)
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=3, cache_dir=tmp_path)
    broken = eng.target.compiled = compiled.CompiledStep(eng.target, tmp_path, "k", build=False, rows=(2, 4))
    broken.start()
    assert not broken.wait_passes(300)
    assert sorted(broken.passes) == [4] and not (folder / "verify-2.so").exists()
    assert any("verify pass of 2 unusable, deleted" in n for n in broken.notes)


def test_a_drafter_chosen_later_gets_its_verify_passes(verify_engine, tiny_llama, compile_cache):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", max_draft=3, compile="cached",
                      cache_dir=compile_cache)
    step = eng.target.compiled
    assert step.wait(120) and step.rows == () and step.passes_state == "off"
    eng.set_drafter("ngram")                     # what /drafter ngram does in the chat
    assert step.wait_passes(300) and sorted(step.passes) == [2, 4] and step.passes_state == "ready"


class EvenRace(compiled.CompiledStep):
    """Every bucket times the same as the eager pass (injected: what a small CPU measures
    for the demo model's wider passes, which the tiny model cannot reproduce)."""

    def _race(self, package, rows, reps=5):
        return 50.0, 50.0 if rows == 4 else 40.0


def test_a_verify_bucket_that_is_not_faster_stays_eager(verify_engine, tiny_llama, compile_cache):
    key = verify_engine.target.compiled.cache_dir.name
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=3, cache_dir=compile_cache)
    step = eng.target.compiled = EvenRace(eng.target, compile_cache, key, build=False, rows=(2, 4))
    step.start()
    assert not step.wait_passes(300)
    assert sorted(step.passes) == [2] and step.pass_ms == {2: (50.0, 40.0), 4: (50.0, 50.0)}
    assert step.notes == ["verify pass of 4 kept eager: 50.0 ms compiled, 50.0 eager"]
    assert step.pass_rows(3) is None and step.pass_rows(2) == 2
    t = eng.target
    t.forward([3, 4, 5])
    t.forward([6, 7, 8])                         # eager, and no padding written into the count
    assert t.cache.length == 6


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="an OpenMP team of one thread adds no thread")
def test_a_compile_thread_waiting_for_an_answer_holds_no_openmp_team(verify_engine, tiny_llama, compile_cache):
    """A warm start while an answer runs: the step loads (and is checked, a parallel torch
    op), then the verify buckets wait for the answer to end. The waiting thread must not
    hold an OpenMP team: a second team makes libgomp sleep between the parallel regions of
    the thread that decodes. Counted in OS threads: the waiting worker is one, and when it
    has ended there is one fewer (a team would be one or more besides)."""
    key = verify_engine.target.compiled.cache_dir.name
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=3, cache_dir=compile_cache)
    torch.randn(256, 256) @ torch.randn(256, 256)           # this thread's own team, as a decoding thread has

    def threads():
        # A team's threads leave a few hundred milliseconds after the thread that owned it.
        counts = []
        while len(counts) < 5 or len(set(counts[-5:])) > 1:
            counts.append(len(os.listdir("/proc/self/task")))
            time.sleep(0.2)
        return counts[-1]
    compile_worker.pause()
    try:
        step = eng.target.compiled = compiled.CompiledStep(eng.target, compile_cache, key, build=False, rows=(2, 4))
        step.start()
        assert step.wait(300) and step.state == "ready"    # the step loads during an answer
        waiting = threads()
        assert step.passes_state == "compiling" and not step.passes    # the buckets wait for it to end
    finally:
        compile_worker.resume()
    assert step.wait_passes(300) and sorted(step.passes) == [2, 4]
    wait_until(lambda: not compile_worker.busy() and not any(
        t.name.startswith("localchat-compile") for t in threading.enumerate()))
    assert waiting - threads() == 1


def test_verify_passes_without_memory_for_the_step(tiny_llama, tmp_path, monkeypatch):
    # No room for the step's copy of the weights: the passes, which use the forward's
    # own, are still wanted (here only loaded: cached mode on an empty cache builds nothing).
    from engine import hardware
    monkeypatch.setattr(hardware, "available_memory", lambda device: 1 << 20)
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="ngram", max_draft=8, cache_dir=tmp_path)
    assert eng.start_compile(tmp_path, build=False) is True
    step = eng.target.compiled
    assert step.step is False and step.rows == (2, 4, 8) and "GiB is free" in eng.compile_note
    assert not step.wait_passes(60) and step.state == "off" and step.passes == {}


def test_leftovers_of_processes_that_are_gone_are_swept(tmp_path):
    # A process that leaves with os._exit mid-build or mid-load cannot clean up; the next
    # build or load removes what it left (never what a live process is using).
    import tempfile
    from engine.compile import exported
    gone, alive = 4_999_999, os.getpid()       # above any pid_max: no such process
    build_dir, half = tmp_path / f".build-{gone}", tmp_path / f".step-{gone}.partial.pt2"
    half_lib, link = tmp_path / f".step-{gone}.partial.so", tmp_path / f".load-{gone}-3.so"
    mine = tmp_path / f".build-{alive}"
    for d in (build_dir, mine):
        d.mkdir()
    for f in (half, half_lib, link):
        f.write_bytes(b"x")
    exported._sweep(tmp_path)
    assert not build_dir.exists() and mine.exists()
    assert not half.exists() and not half_lib.exists() and not link.exists()
    unpacked = Path(tempfile.gettempdir()) / f"localchat-step-{gone}-abc"
    unpacked.mkdir(exist_ok=True)
    exported._sweep_unpacked()
    assert not unpacked.exists()


def _unloaded(tiny_llama, cache_dir, key):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    step = compiled.CompiledStep(eng.target, cache_dir, key)
    exported.as_parameters(eng.target.impl)
    return step


def test_a_corrupt_or_stale_package_is_deleted_not_run(compiled_engine, tiny_llama, tokenizer, tmp_path):
    import shutil
    good = compiled_engine.target.compiled.package
    # Bytes that are no package: the load fails, the file goes, and the step is built again.
    step = _unloaded(tiny_llama, tmp_path, "corrupt")
    step.package.parent.mkdir(parents=True)
    step.package.write_bytes(b"not a zip" * 100)
    assert step._load_package() is False and not step.package.exists()
    assert "rebuilding" in step.notes[0]
    # A package made from other weights of the same shapes (a model re-downloaded under
    # the same name, a cache copied between machines): its logits give it away.
    other = build_model(tmp_path / "other", seed=1, tokenizer=tokenizer)
    step = _unloaded(other, tmp_path, "stale")
    step.package.parent.mkdir(parents=True)
    shutil.copy(good, step.package)
    assert step._load_package() is False and not step.package.exists()
    assert "not this model's" in step.notes[0]
    # The right weights load.
    step = _unloaded(tiny_llama, tmp_path, "good")
    step.package.parent.mkdir(parents=True)
    shutil.copy(good, step.package)
    assert step._load_package() is True and step.notes == []


def test_a_step_that_fails_at_run_time_falls_back_to_eager(compiled_engine, eager_ids):
    # A torch.compile step whose guards would fail, a package that raises: the answer goes
    # on eagerly (the failed step may have written this position's keys; the eager step
    # writes them again), and the step stays off.
    step = compiled_engine.target.compiled

    def would_recompile(*args):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
    good = step._fn
    step._fn = would_recompile
    try:
        ids, stats = answer(compiled_engine)
        assert ids == eager_ids
        assert step.state == "failed" and "Detected recompile" in step.error and "decoding eagerly" in step.error
        assert stats.compile_state == "failed"
    finally:
        step._fn, step.state, step.error = good, "ready", ""


class ExplodingCompiler(compiled.CompiledStep):
    """Inductor failing in every mode (injected: a real internal compiler error cannot be
    summoned on demand)."""
    tried: list[str]

    def _build(self, backend, mode):
        self.tried = getattr(self, "tried", []) + [(backend, mode)]
        raise RuntimeError(f"inductor exploded in {backend} {mode}")


def test_a_failed_compile_leaves_eager_decoding(tiny_llama, tmp_path, eager_ids):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    step = eng.target.compiled = ExplodingCompiler(eng.target, tmp_path, "bad")
    step.start()
    assert not step.wait(60)
    # A package autotuned, then in the plain mode, then torch.compile in the plain mode.
    assert step.tried == [("aot", compiled.MODE), ("aot", "default"), ("jit", "default")]
    assert step.state == "failed" and "exploded in jit default" in step.error
    assert len(step.notes) == 3
    assert answer(eng)[0] == eager_ids


def test_bfloat16_builds_autotuned(tiny_llama, compile_cache):
    # With epilogue fusion, max-autotune trips an inductor assertion on this bf16 graph
    # (torch 2.13); the engine's mode leaves it out, so bf16 builds autotuned too.
    eng = engine.open(str(tiny_llama), dtype="bfloat16", drafter="none", compile="on", cache_dir=compile_cache)
    step = eng.target.compiled
    assert step.wait(900), step.error
    assert step.source == "built" and step.mode == compiled.MODE, step.notes
    ids, stats = answer(eng)
    assert stats.compile_state == "ready" and len(ids) > 0


def test_quantized_target_and_its_drafter_compile(tiny_llama, compile_cache, monkeypatch):
    # An int8 target drafted for by its own int4 copy (in aten's layout: our int4 kernel's is not compiled): both
    # steps compile, one after the other, and the answer is the eager one (float32 activations: to float32 rounding).
    monkeypatch.setenv("LOCALCHAT_INT4_KERNEL", "off")          # the build's child reads it too
    monkeypatch.setattr(q4_kernel, "_state", ["turned off (LOCALCHAT_INT4_KERNEL=off)"])
    kw = dict(dtype="float32", profile="resident-int8", drafter="model", draft_model="self", max_draft=1,
              cache_dir=compile_cache)
    eager = engine.open(str(tiny_llama), **kw)
    want = answer(eager)[0]
    eng = engine.open(str(tiny_llama), compile="on", **kw)
    step, draft_step = eng.target.compiled, eng.drafter.target.compiled
    assert step is not None and draft_step is not None
    assert step.wait(900), step.error
    assert draft_step.wait(900), draft_step.error
    assert (step.source, draft_step.source) == ("built", "built"), step.notes + draft_step.notes
    assert (step.built_in, draft_step.built_in) == ("child", "child")     # each reloaded from its recipe
    # Then the target's verify pass (drafts of one token: the 2-row bucket) on the int8 weights; the drafter verifies none.
    assert step.rows == (2,) and draft_step.rows == ()
    assert step.wait_passes(900), (step.passes_error, step.notes)
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
        two = torch.tensor([6, 7])
        fast2, slow2 = t.compiled.run_pass(two, t.cache.length, 2), t.impl(two, t.cache.length, True)
    assert torch.allclose(fast, slow, atol=1e-4, rtol=1e-4)
    assert torch.allclose(fast2, slow2, atol=1e-4, rtol=1e-4)


def test_streamed_targets_decode_eagerly(tiny_llama):
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", profile="streamed-exact")
    assert eng.start_compile() is False and "streamed" in eng.compile_note
    assert getattr(eng.target, "compiled", None) is None
    with pytest.raises(engine.BadRequest, match="--compile"):
        engine.open(str(tiny_llama), compile="sometimes")


def test_no_compile_without_memory_for_the_steps_own_weights(tiny_llama, tmp_path, monkeypatch):
    # The compiled step keeps a repacked copy of the weights: with less free memory than
    # that, the engine says so and decodes eagerly instead of risking the machine's memory.
    from engine import hardware
    monkeypatch.setattr(hardware, "available_memory", lambda device: 1 << 20)
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none", cache_dir=tmp_path)
    assert eng.start_compile(tmp_path) is False
    assert eng.target.compiled is None and "GiB is free" in eng.compile_note


def test_pass_costs_are_measured_afresh_when_a_step_goes_live():
    from engine.speculative import PassCosts

    class Target:
        compiled = None
    t, costs = Target(), PassCosts()
    costs.follow_kernels(t, None)
    costs.observe(2, 0.01, 0.05)
    costs.follow_kernels(t, None)                 # nothing changed: the figures stay
    assert costs.t_pass == {3: 0.05} and costs.t_draft == 0.005
    t.compiled = type("Step", (), {"state": "ready", "passes": {}})()
    costs.follow_kernels(t, None)
    assert costs.t_pass == {} and costs.t_draft == 0.005
    # A verify bucket goes live: the curve is measured afresh, and every pass that runs
    # in the bucket (padded) is measured under it.
    t.compiled.passes = {4: object()}
    t.compiled.pass_rows = lambda n: 4 if 2 < n <= 4 else None
    costs.observe(0, 0.0, 0.02)
    costs.follow_kernels(t, None)
    assert costs.t_pass == {}
    costs.observe(2, 0.01, 0.05)
    costs.observe(1, 0.01, 0.04)
    assert sorted(costs.t_pass) == [2, 4] and costs.key(3) == 4 and costs.key(5) == 5
    from engine.speculative import DraftController
    ctl = DraftController(costs=costs)
    assert ctl.t_verify(4) == ctl.t_verify(3) == costs.t_pass[4]


def test_every_step_compiles_its_own_code_object():
    # Dynamo's graphs and its recompile limit (8) are per code object: a process that
    # compiles several targets and drafters must not pile them onto one.
    a, b = compiled._own_step(), compiled._own_step()
    assert a.__code__ is not b.__code__ and a.__code__ is not compiled._step.__code__
    assert a.__code__ == compiled._step.__code__


def test_a_used_package_dir_is_marked_with_what_it_is_for(compiled_engine):
    from engine.compile import package_dirs
    step = compiled_engine.target.compiled
    assert package_dirs.lineage_of(step.cache_dir) == step.lineage
    assert step.lineage == f"{compiled_engine.name}|float32|exact|cpu"
