"""`localchat setup`: the catalog's numbers, the wizard driven through a prompt-toolkit
pipe input, the backup of an existing config, the offline fallback to the demo model,
the disk check, and the non-interactive form."""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from engine import hardware, profiles
from engine.planner import ModelShape
from localchat import catalog, config, wizard


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config" / "config.toml"


@pytest.fixture(scope="module")
def hw():
    return hardware.detect(vram="8GiB", device="cpu")


def drive(hw, keys: str, **kw):
    """Run the wizard with `keys` typed into a pipe input; return (exit code, what it said)."""
    said = []
    with create_pipe_input() as inp:
        inp.send_text(keys)
        session = PromptSession(input=inp, output=DummyOutput())
        code = wizard.run_wizard(hw, profiles.load_all(), wizard.prompt_asker(session), said.append, **kw)
    return code, "\n".join(said)


def other_model() -> str:
    return str(len(catalog.CATALOG) + 1)


def test_catalog_qwen3_14b_numbers():
    shape = catalog.find("Qwen/Qwen3-14B").shape()
    assert shape.weight_bytes() == pytest.approx(29.5e9, rel=0.01)
    assert shape.kv_bytes_per_token() == 163_840
    assert catalog.find("qwen/qwen3-14b").drafter == "Qwen/Qwen3-0.6B"


def test_catalog_entries_plan_and_share_tokenizers():
    for m in catalog.CATALOG:
        shape = ModelShape.from_config(m.config)
        assert shape.params > 100e6
        if m.drafter:
            d = catalog.find(m.drafter)
            assert d is not None and d.config["vocab_size"] == m.config["vocab_size"]
    assert catalog.find("Qwen/Qwen3-0.6B").shape().params == pytest.approx(0.6e9, rel=0.02)
    assert catalog.find("meta-llama/Llama-3.1-8B-Instruct").shape().params == pytest.approx(8.03e9, rel=0.01)
    assert catalog.find("demo").repo is None


GB = 10**9


def _options(hw, bandwidth):
    opts = wizard.plan_catalog(hw, profiles.load_all(), bandwidth=bandwidth, usable_tps=10)
    return {o.model.key: o for o in opts}, wizard.recommend(list(opts))


def test_setup_recommends_what_decodes_at_a_usable_speed_on_a_2_core_cpu():
    """A 2-core CPU with 25 GB, memory read at 50 GB/s: at 0.75 of the bound (what the
    engine's step reaches), a token must read at most 3.75 GB to reach 10 tok/s. By hand,
    from the Qwen3 configs: Qwen3-4B's decoder linears are 36 x (2560x4096 + 2x2560x1024 +
    4096x2560 + 3x2560x9728) = 3.634e9 weights, in int4 3.634e9/2 + 4 x 3.634e9/32 (bf16
    scale and zero per 32) = 2.27 GB, plus the tied embedding 151936 x 2560 held as the head,
    in int8 with a bf16 scale a row (0.389e9 + 0.3e6) = 0.389 GB: 2.66 GB, bound 18.8 tok/s,
    expected 14.1. Exact bf16 it is 8.04 GB (4.7): too slow. Qwen3-8B in int4: 36 x 192.9e6
    = 6.946e9 weights -> 4.34 GB, plus its head 151936 x 4096 in int8 (0.622 GB) and one
    row of its untied bf16 embedding = 4.96 GB: 10.1 bound, 7.6 expected, too slow.

    The mixture Qwen3.5-35B-A3B is the largest model that is fast enough: a token reads its
    top 8 of 256 experts. Its decoder matrices are 33.621e9 weights, of which the routed
    experts are 40 layers x 256 x 3 x 2048 x 512 = 32.212e9: in int4 the other 1.409e9 are
    0.881 GB, the experts read 8/256 x 32.212e9 x 0.625 = 0.629 GB; the rest (head 248320 x
    2048, router, shared-expert gates, norms, conv kernels: 1.039e9 less the embedding table
    but one row) 1.061 GB in bf16: 2.571 GB; the head in int8 (508.6e6 + 2 x 248320 bytes
    instead of 2 x 508.6e6) saves 0.508 GB: 2.063 GB, bound 24.2 tok/s, expected 18.2, while
    all its int4 weights (22.6 GB) fit in the 25 GB."""
    cpu = hardware.Hardware((), 25 * GB, 25 * GB, 500 * GB, "/", "EPYC", 2, True, "cpu", 25 * GB, ("vram",))
    opts, rec = _options(cpu, {"cpu": 50e9})
    assert (rec.model.key, rec.profile) == ("Qwen/Qwen3.5-35B-A3B", "resident-int4")
    assert rec.tps == pytest.approx(50e9 / 2.063e9, rel=0.01)
    assert opts["Qwen/Qwen3-4B"].profile == "resident-int4" and opts["Qwen/Qwen3-4B"].usable
    assert opts["Qwen/Qwen3-4B"].tps == pytest.approx(50e9 / 2.66e9, rel=0.01)
    assert opts["Qwen/Qwen3-4B"].auto == "resident-exact"          # so setup writes the profile down
    assert not opts["Qwen/Qwen3-8B"].usable and opts["Qwen/Qwen3-8B"].tps == pytest.approx(50e9 / 4.96e9, rel=0.01)
    assert not opts["Qwen/Qwen3-14B"].usable


def test_setup_recommends_what_decodes_at_a_usable_speed_on_a_12gb_gpu():
    """12 GB at 360 GB/s (a consumer card): Qwen3-8B in int8 is 9.44 GB of weights with its
    head in bf16 (1 byte a weight + a bf16 scale a row), 8.82 GB with the head in int8 too
    (151936 x 4096: 1.245 GB in bf16, 0.623 in int8), + 1.34 GB of KV for 8192 tokens: it
    fits. Qwen3-14B even in int4 does not fit beside its KV, and streamed it reads at disk
    speed. Exact bf16 Qwen3-4B (8.04 GB) fits. Qwen3-8B's token reads 8.82 GB less its untied
    embedding table but one row (1.245 GB): 7.57 GB, 47.5 tok/s.

    The largest usable model is the hybrid Qwen3.5-9B, now in int8: 6.9185e9 decoder
    weights at 1 byte and a bf16 scale a row of 4096 (6.922 GB), the head 248320 x 4096 in
    int8 (1.0176 GB), the untied embedding table in bf16 (2.034 GB), norms and conv kernels
    (1.04e6 in bf16): 9.98 GB, which fits beside its KV (with the head in bf16 it did not,
    and int4 was chosen). A token reads all but the table, and one row of it: 7.94 GB,
    45.3 tok/s bound."""
    gpu = hardware.Hardware((hardware.Accelerator("cuda", 0, "12 GB card", 12 * GB, 12 * GB),), 64 * GB, 60 * GB,
                            500 * GB, "/", "x", 8, False, "cuda:0", 12 * GB, ())
    opts, rec = _options(gpu, {"cuda": 360e9})
    assert (rec.model.key, rec.profile) == ("Qwen/Qwen3.5-9B", "resident-int8")
    assert rec.tps == pytest.approx(360e9 / 7.94e9, rel=0.01)
    assert opts["Qwen/Qwen3-8B"].profile == "resident-int8"
    assert opts["Qwen/Qwen3-8B"].tps == pytest.approx(360e9 / 7.57e9, rel=0.01)
    assert opts["Qwen/Qwen3-4B"].profile == "resident-exact" and opts["Qwen/Qwen3-4B"].auto is None
    assert not opts["Qwen/Qwen3-14B"].usable


def test_nothing_usable_recommends_the_demo(hw):
    tiny = replace(hw, budget_bytes=10**6)
    assert wizard.recommend(wizard.plan_catalog(tiny, profiles.load_all())).model.repo is None


def test_setup_yes_writes_the_profile_that_makes_the_model_usable(config_file, monkeypatch):
    cpu = hardware.Hardware((), 25 * GB, 25 * GB, 500 * GB, "/", "EPYC", 2, True, "cpu", 25 * GB, ("vram",))
    fetched = []
    code = wizard.run_wizard(cpu, profiles.load_all(), lambda q: "", lambda s: None,
                             wizard.Answers(model=None, drafter="ngram", yes=True), fetch_model=fetched.append,
                             bandwidth={"cpu": 50e9}, usable_tps=10)
    # the planner picks int4 for it on its own (its exact weights do not fit): none is written
    assert code == 0 and fetched == ["Qwen/Qwen3.5-35B-A3B"]
    saved, _ = config.load(config_file, {})
    assert (saved.model, saved.profile, saved.drafter) == ("Qwen/Qwen3.5-35B-A3B", None, "ngram")


def test_wizard_end_to_end_with_a_local_model(hw, tiny_llama, config_file):
    # another model -> the tiny model's path -> drafter 2 (none) -> confirm
    code, said = drive(hw, f"{other_model()}\n{tiny_llama}\n2\ny\n")
    assert code == 0, said
    assert "→" in said and "Qwen3-14B" in said and str(config_file) in said and "localchat" in said
    settings, warnings = config.load(config_file, {})
    assert warnings == []
    assert Path(settings.model) == Path(tiny_llama).resolve()
    assert (settings.drafter, settings.draft_model) == ("none", None)


def test_existing_config_is_backed_up(hw, tiny_llama, config_file):
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text('model = "old/model"\ntemperature = 0.5\n')
    code, said = drive(hw, f"{other_model()}\n{tiny_llama}\n1\n\n")
    assert code == 0, said
    backup = config_file.with_suffix(".toml.bak")
    assert backup.read_text() == 'model = "old/model"\ntemperature = 0.5\n'
    assert str(backup) in said
    settings, _ = config.load(config_file, {})
    assert Path(settings.model) == Path(tiny_llama).resolve()
    assert settings.drafter == "ngram" and settings.temperature == 0.5   # other settings kept


def test_offline_hub_model_offers_the_demo(hw, config_file):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text('model = "old/model"\n')
    repo = "localchat-tests/not-a-cached-model"
    code, said = drive(hw, f"{other_model()}\n{repo}\n\n\n\n")
    assert code == 0, said
    lines = [line for line in said.splitlines() if repo in line and "offline" in line]
    assert len(lines) == 1 and "demo" in lines[0]
    settings, _ = config.load(config_file, {})
    assert settings.model is None and settings.draft_model is None


def test_not_enough_disk_is_refused(hw, config_file, capsys):
    small = replace(hw, disk_free_bytes=10**9)
    code = wizard.run_wizard(small, profiles.load_all(), wizard._no_questions, lambda s: None,
                             wizard.Answers("Qwen/Qwen3-32B", "none", yes=True))
    assert code == 1
    assert "not enough disk space" in capsys.readouterr().err
    assert not config_file.exists()


def test_non_interactive_setup(tiny_llama, tmp_path):
    env = os.environ.copy()
    env["LOCALCHAT_CONFIG_DIR"] = str(tmp_path / "cfg")
    env["LOCALCHAT_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-m", "localchat", "setup", "--yes", "--model", str(tiny_llama),
                           "--drafter", "ngram", "--vram", "2GiB", "--no-build"],
                          capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    settings, _ = config.load(tmp_path / "cfg" / "config.toml", {})
    assert Path(settings.model) == Path(tiny_llama).resolve() and settings.drafter == "ngram"
    assert "C kernels" not in proc.stdout and not (tmp_path / "cache" / "kernels").exists()
    # the read rate it measured: setup says when other processes disturbed it, and only then
    read = tmp_path / "cache" / "bandwidth.json"
    (key, entry), = json.loads(read.read_text()).items()
    assert ("cores busy" in proc.stdout) == bool(entry.get("busy"))
    read.write_text(json.dumps({key: {"cpu": 3e9, "measured_at": time.time(), "busy": 1.5}}))
    again = subprocess.run(proc.args, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr
    assert "Memory read rate: 3.0 GB/s (other processes kept 1.5 cores busy" in again.stdout


def test_setup_builds_the_kernels_so_no_chat_waits_on_a_compiler(tiny_llama, tmp_path):
    from engine.kernels import build
    if build.compiler() is None:
        pytest.skip("no C compiler here")
    env = dict(os.environ, LOCALCHAT_CONFIG_DIR=str(tmp_path / "cfg"), LOCALCHAT_CACHE_DIR=str(tmp_path / "cache"))
    setup = [sys.executable, "-m", "localchat", "setup", "--yes", "--model", str(tiny_llama), "--drafter", "none"]
    proc = subprocess.run(setup, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    ready = next(l for l in proc.stdout.splitlines() if l.startswith("C kernels ready"))
    built = sorted(p.name for p in (tmp_path / "cache" / "kernels").glob("*.so"))
    # Every source this CPU runs was built: rows.c, layer.c, q8.c, q4.c, gdn.c by name.
    for name, source in (("rows", "rows-"), ("layers", "layer-"), ("int8", "q8-"), ("int4", "q4-"),
                         ("gated delta-net", "gdn-")):
        if name in ready.split(": ", 1)[1]:
            assert any(b.startswith(source) for b in built), (name, built)
    assert any(b.startswith("gdn-") for b in built), built       # gdn.c needs no more than a C compiler
    # A second setup, and a chat after it, find them: nothing is built again.
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "kernels").iterdir()}
    again = subprocess.run(setup, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0 and ready.split(": ", 1)[1] in again.stdout, again.stdout
    chat = subprocess.run([sys.executable, "-m", "localchat", "-n", "3", "hi"], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "kernels").iterdir()} == stamp


def test_setup_without_a_terminal_needs_yes(tmp_path):
    env = os.environ.copy()
    env["LOCALCHAT_CONFIG_DIR"] = str(tmp_path / "cfg")
    proc = subprocess.run([sys.executable, "-m", "localchat", "setup"], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--yes" in proc.stderr
    assert not (tmp_path / "cfg" / "config.toml").exists()
