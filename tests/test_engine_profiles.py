"""engine.open picks the target the plan chose: resident exact, resident int8/int4, streamed;
a quantized copy of the target can draft for it; doctor shows measured fidelity."""
import subprocess
import sys

import pytest
import torch

import engine
from engine.checkpoint import tensor_index
from tiny import budget_for


def _bytes(path):
    return sum(e.nbytes for e in tensor_index(path).values())


def test_quantized_profile_is_chosen_when_exact_does_not_fit(tiny_llama):
    total = _bytes(tiny_llama)
    budget = budget_for(tiny_llama, "resident-int8")
    assert budget < total + 200_000
    eng = engine.open(str(tiny_llama), device="cpu", memory_budget=budget, context=64, drafter="none")
    assert eng.plan.chosen == "resident-int8"
    info = eng.describe()
    assert info["profile"] == "resident-int8" and info["weights"] == "int8"
    assert eng.target.weight_bytes() < total
    done = list(eng.chat().send("hello", max_new_tokens=6))[-1]
    assert done.reason in ("stop", "length")


def test_forced_int4_profile_loads_int4(tiny_llama):
    eng = engine.open(str(tiny_llama), device="cpu", profile="resident-int4", drafter="none")
    assert eng.describe()["weights"] == "int4 g32, head int8"


def test_self_drafter_is_a_quantized_copy_and_never_changes_the_answer(tiny_llama):
    prompt = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\nAgain: def fib(n):"
    plain = engine.open(str(tiny_llama), device="cpu", dtype="float32", drafter="none")
    spec = engine.open(str(tiny_llama), device="cpu", dtype="float32", drafter="model", draft_model="self")
    assert spec.drafter.kind == "model" and "(int4)" in spec.drafter.name
    a = list(plain.chat().send(prompt, max_new_tokens=24))
    b = list(spec.chat().send(prompt, max_new_tokens=24))
    assert a[-1].token_ids == b[-1].token_ids
    assert b[-2].drafted_tokens > 0
    with pytest.raises(engine.BadRequest, match="--drafter-weights"):
        engine.open(str(tiny_llama), device="cpu", drafter="model", draft_model="self", drafter_weights="exact")
    with pytest.raises(engine.BadRequest, match="--drafter-weights int3"):
        engine.open(str(tiny_llama), device="cpu", drafter_weights="int3")


def test_doctor_measures_fidelity_once_and_shows_it(tiny_llama):
    cmd = [sys.executable, "-m", "localchat.cli", "doctor", "--model", str(tiny_llama)]
    before = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert before.returncode == 0, before.stderr
    assert "--fidelity" in before.stdout
    measured = subprocess.run(cmd + ["--fidelity"], capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr
    line = next(ln for ln in measured.stdout.splitlines() if ln.startswith("Fidelity against"))
    assert "int8 top-1" in line and "int4 top-1" in line
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)   # kept, not measured again
    assert line in again.stdout


def test_a_user_profile_can_quantize_the_embeddings_too(tiny_llama, tmp_path):
    (tmp_path / "int4-all.toml").write_text(
        'name = "int4-all"\nrank = 0\n[target]\nplacement = "resident"\nweights = "int4"\nembeddings = true\n')
    eng = engine.open(str(tiny_llama), device="cpu", profile="int4-all", profile_dir=tmp_path, drafter="none")
    assert eng.target.quant.embeddings and eng.plan.chosen == "int4-all"
    (tmp_path / "bad.toml").write_text('name = "bad"\n[target]\nplacement = "resident"\nweights = "int4"\n'
                                       'embeddings = "yes"\n')
    with pytest.raises(engine.BadRequest, match="bad.toml.*embeddings.*true or false"):
        engine.open(str(tiny_llama), device="cpu", profile_dir=tmp_path)
    (tmp_path / "bad.toml").unlink()
    (tmp_path / "streamed-int4.toml").write_text(
        'name = "streamed-int4"\n[target]\nplacement = "streamed"\nweights = "int4"\n')
    with pytest.raises(engine.BadRequest, match="--profile streamed-int4: this version runs"):
        engine.open(str(tiny_llama), device="cpu", profile="streamed-int4", profile_dir=tmp_path)


def test_the_head_is_int8_unless_a_profile_keeps_it_exact(tiny_llama, tmp_path):
    """A quantized profile holds the output head (here tied: the table that serves the
    lookups too) in int8 per channel; `head = "exact"` keeps it in the activation dtype.
    The plan counts what is held, byte for byte in the head's difference."""
    (tmp_path / "int4-exact-head.toml").write_text(
        'name = "int4-exact-head"\nrank = 0\n[target]\nplacement = "resident"\nweights = "int4"\nhead = "exact"\n')
    exact_head = engine.open(str(tiny_llama), device="cpu", profile="int4-exact-head", profile_dir=tmp_path,
                             drafter="none", cache_dir=tmp_path / "cache")
    int8_head = engine.open(str(tiny_llama), device="cpu", profile="resident-int4", drafter="none",
                            cache_dir=tmp_path / "cache")
    assert exact_head.describe()["weights"] == "int4 g32, head exact" and int8_head.target.quant.head == "int8"
    held = exact_head.target.weight_bytes() - int8_head.target.weight_bytes()
    planned = exact_head.plan.row("int4-exact-head").weights - int8_head.plan.row("resident-int4").weights
    vocab, hidden = exact_head.target.impl.embed.shape
    assert held == planned == vocab * hidden * 2 - (vocab * hidden + 2 * vocab)
    with torch.inference_mode():
        a, b = (e.target.forward(list(range(5, 30))) for e in (exact_head, int8_head))
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05 * float(a.std()))
    (tmp_path / "int4-exact-head.toml").write_text(
        'name = "int4-exact-head"\n[target]\nplacement = "resident"\nweights = "int4"\nhead = "int4"\n')
    with pytest.raises(engine.BadRequest, match=r"int4-exact-head.toml.*\[target\] head"):
        engine.open(str(tiny_llama), device="cpu", profile_dir=tmp_path)


def test_loading_reports_progress_for_each_kind_of_target(tiny_llama):
    """What the chat UI shows while a model loads: the file being read and its bytes
    (resident), the layers quantized or loaded (int8/int4), the units placed (streamed)."""
    for profile, want in (("resident-exact", "reading model.safetensors"), ("resident-int8", None),
                          ("streamed-exact", "layer 1")):
        seen = []
        engine.open(str(tiny_llama), device="cpu", profile=profile, drafter="none", context=64,
                    progress=lambda what, done, total: seen.append((what, done, total)))
        assert seen, profile
        assert all(0 <= done <= total for _, done, total in seen), seen
        if want:
            assert any(what == want for what, _, _ in seen), seen
        assert seen[-1][1] == seen[-1][2]         # it ends complete
