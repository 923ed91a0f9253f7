"""Hardware detection, profiles and the memory planner: the arithmetic, the choices, and
every bad input with a message that names the file, key or flag."""
import json
import os
import subprocess
import sys

import pytest
import torch

import engine
from engine import hardware, profiles
from engine.planner import ModelShape, make_plan

QWEN3_14B = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408, "vocab_size": 151936,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def gpu(vram):
    return hardware.detect(vram=vram, ram="64GiB", device="cpu")


def test_qwen3_14b_published_arithmetic():
    s = ModelShape.from_config(QWEN3_14B, "Qwen3-14B")
    assert abs(s.weight_bytes() / 29.5e9 - 1) < 0.01
    assert s.kv_bytes_per_token() == 163_840
    assert round(s.kv_bytes_per_token() * 8192 / 1e9, 1) == 1.3
    assert round(s.kv_bytes_per_token() * 32768 / 1e9, 1) == 5.4


def test_qwen3_14b_profile_choice_by_budget():
    s = ModelShape.from_config(QWEN3_14B, "Qwen3-14B")
    small = make_plan(s, gpu("8GiB"), profiles.load_all())
    assert small.chosen != "resident-exact" and not small.row("resident-exact").fits
    big = make_plan(s, gpu("80GB"), profiles.load_all())
    assert big.chosen == "resident-exact" and "fit" in big.reason
    mid = make_plan(s, gpu("20GB"), profiles.load_all())
    assert mid.chosen == "resident-int8" and "resident-exact would need" in mid.reason
    row = small.row("streamed-exact")
    assert row.fits and row.resident_layers + row.host_layers + row.disk_layers == 40
    assert row.streamed_bytes_per_pass > 0 and row.weights <= 8 * 2**30


def test_forced_profile_that_does_not_fit_says_by_how_much():
    s = ModelShape.from_config(QWEN3_14B)
    with pytest.raises(engine.BadRequest, match=r"--profile resident-exact needs 3\d\.\d GB .* short by"):
        make_plan(s, gpu("8GiB"), profiles.load_all(), force="resident-exact")
    with pytest.raises(engine.BadRequest, match="no such profile"):
        make_plan(s, gpu("8GiB"), profiles.load_all(), force="turbo")


def test_nothing_fits_names_the_smallest_need():
    s = ModelShape.from_config(QWEN3_14B)
    plan = make_plan(s, gpu("1GiB"), profiles.load_all())
    assert plan.chosen is None and "Nothing fits" in plan.reason and "short by" in plan.reason


def test_longest_context_that_fits_grows_with_budget():
    s = ModelShape.from_config(QWEN3_14B)
    a = make_plan(s, gpu("40GB"), profiles.load_all()).row("resident-exact").max_context
    b = make_plan(s, gpu("80GB"), profiles.load_all()).row("resident-exact").max_context
    assert 0 < a < b
    assert abs((b - a) - 40e9 / s.kv_bytes_per_token()) < 2


def test_shape_from_checkpoint_counts_every_weight(tiny_qwen3):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    shape = ModelShape.from_checkpoint(tiny_qwen3)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.weight_bytes() == 4 * shape.params
    assert ModelShape.from_config(json.loads((tiny_qwen3 / "config.json").read_text())).params == shape.params


def test_parse_size():
    assert hardware.parse_size("8GiB") == 8 * 2**30
    assert hardware.parse_size("16 GB") == 16 * 10**9
    assert hardware.parse_size("512MiB") == 512 * 2**20
    with pytest.raises(engine.BadRequest, match="--vram eight: not a size"):
        hardware.parse_size("eight", "--vram")


def test_detection_without_nvidia_driver_is_cpu():
    hw = hardware.detect()
    if not torch.cuda.is_available():
        assert hw.device == "cpu" and hw.budget_bytes == hw.host_available_bytes and hw.cpu_cores >= 1
    assert hw.host_total_bytes > 0 and hw.disk_free_bytes > 0
    with pytest.raises(engine.BadRequest, match="--device cuda:7: no such device"):
        hardware.detect(device="cuda:7")


def test_overrides():
    hw = hardware.detect(vram="3GiB", ram="5GiB", device="cpu")
    assert hw.budget_bytes == 3 * 2**30 and hw.host_available_bytes == 5 * 2**30
    assert set(hw.overrides) == {"vram", "ram"}


@pytest.mark.parametrize("text,needle", [
    ('summary = "x"\n[target]\nplacement = "resident"\nweights = "exact"\n', "missing name"),
    ('name = "x"\n[target]\nplacement = "resident"\n', "missing [target] weights"),
    ('name = "x"\n[target]\nplacement = "orbit"\nweights = "exact"\n',
     "placement = 'orbit' is not allowed (use one of: resident, streamed)"),
    ('name = "x"\n[target]\nplacement = "resident"\nweights = "int3"\n', "use one of: exact, int8, int4"),
    ('name = "x"\ncolour = "red"\n[target]\nplacement = "resident"\nweights = "exact"\n', "unknown key colour"),
    ('name = "x"\n[target]\nplacement = "resident"\nweights = "exact"\n[drafter]\nmax_draft = "many"\n',
     "[drafter] max_draft = 'many' must be a number"),
    ('name = "x"\n[gpu]\nx = 1\n', "unknown table [gpu]"),
    ('name = = "x"', "not valid TOML"),
])
def test_bad_profile_names_file_and_key(tmp_path, text, needle):
    f = tmp_path / "mine.toml"
    f.write_text(text)
    with pytest.raises(engine.BadRequest) as exc:
        profiles.load_all(tmp_path)
    assert str(f) in str(exc.value) and needle in str(exc.value)


def test_user_profiles_add_and_replace(tmp_path):
    (tmp_path / "a.toml").write_text('name = "resident-exact"\nrank = 1\n[target]\nplacement = "resident"\n'
                                    'weights = "exact"\n[memory]\nmargin_mib = 2048\n')
    (tmp_path / "b.toml").write_text('name = "tiny-margin"\nrank = 9\n[target]\nplacement = "resident"\n'
                                    'weights = "int4"\n[memory]\nmargin_mib = 0\n')
    all_ = profiles.load_all(tmp_path)
    names = [p.name for p in all_]
    assert names.count("resident-exact") == 1 and "tiny-margin" in names
    assert profiles.find(all_, "resident-exact").margin_mib == 2048


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "localchat", *args], capture_output=True, timeout=300,
                          env=os.environ.copy())


def test_doctor_json_on_a_tiny_model(tiny_llama):
    proc = run_cli("doctor", "--model", str(tiny_llama), "--vram", "2GiB", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["plan"]["chosen"] == "resident-exact"
    assert {r["profile"] for r in out["plan"]["rows"]} >= {"resident-exact", "resident-int8", "resident-int4",
                                                           "streamed-exact"}
    assert out["hardware"]["budget_bytes"] == 2 * 2**30


def test_doctor_table_and_forced_profile(tiny_llama):
    proc = run_cli("doctor", "--model", str(tiny_llama))
    assert proc.returncode == 0 and b"resident-exact" in proc.stdout and b"\xe2\x86\x92" in proc.stdout
    proc = run_cli("doctor", "--model", str(tiny_llama), "--vram", "1MB", "--profile", "resident-exact")
    assert proc.returncode == 2 and b"short by" in proc.stderr and b"Traceback" not in proc.stderr


@pytest.mark.demo
def test_planned_resident_bytes_match_what_the_engine_holds(demo_engine):
    """Predicted weights + KV for the profile the demo model runs (resident-gguf: its file's
    blocks) against the bytes the running engine actually holds (its weight tensors and its
    preallocated cache)."""
    t = demo_engine.target
    assert demo_engine.plan.chosen == "resident-gguf"
    shape = ModelShape.of(demo_engine.checkpoint)
    hw = hardware.detect(vram="4GiB", device="cpu")
    plan = make_plan(shape, hw, profiles.load_all(), context=t.cache.capacity)
    row = plan.row("resident-gguf")
    predicted = row.weights + row.kv
    assert abs(predicted / t.device_bytes() - 1) < 0.15
    assert row.kv == t.cache.nbytes()


@pytest.mark.demo
@pytest.mark.parametrize("profile, budget", [("resident-int8", "4GiB"), ("resident-int4", "4GiB"),
                                             ("streamed-exact", "300MB")])
def test_planned_bytes_match_what_each_target_holds(profile, budget):
    """For each profile forced on the demo model: the planner's weights + KV against the
    bytes the loaded target holds (its weight tensors or, streamed, its ledger of resident
    units and prefetch slots; its preallocated KV cache grown to the planned context)."""
    import engine
    eng = engine.open(None, profile=profile, memory_budget=budget, context=1024, drafter="none")
    t = eng.target
    t.cache.reserve(eng.plan.row(profile).context)
    row = eng.plan.row(profile)
    held = t.weight_bytes() + t.cache.nbytes()
    assert abs((row.weights + row.kv) / held - 1) < 0.15, (row, held)
