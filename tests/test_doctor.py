"""`localchat doctor`: its speed bounds rest on this machine's measured memory read rate
(kept per machine, measured again on request), a hub model that is not downloaded is
planned from the catalog, and sizes print with enough figures to differ."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from engine import bandwidth, openmp, planner


def run_doctor(*args, env=None):
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}     # a caller's own spin
    return subprocess.run([sys.executable, "-m", "localchat", "doctor", *args], capture_output=True, timeout=240,
                          env=dict(base, HF_HUB_OFFLINE="1", **(env or {})))


def test_the_read_rate_is_measured_once_per_machine_and_again_on_request(tmp_path):
    cpu = torch.device("cpu")
    first = bandwidth.measured(tmp_path, cpu)
    assert first["cpu"] > 1e9                                 # any machine reads memory faster than 1 GB/s
    kept = json.loads((tmp_path / bandwidth.FILE).read_text())
    assert kept[bandwidth.machine_key(cpu)] == first
    assert bandwidth.measured(tmp_path, cpu) == first          # from the file, not measured again
    again = bandwidth.measured(tmp_path, cpu, refresh=True)
    assert again["measured_at"] > first["measured_at"]
    (tmp_path / bandwidth.FILE).write_text("not json")         # a damaged file is measured over
    assert bandwidth.measured(tmp_path, cpu)["cpu"] > 1e9


def test_the_probe_counts_what_other_processes_took_while_it_ran():
    # a busy loop for every core: none is idle, and they take more than a quarter of one
    spins = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(os.cpu_count(), 64))]
    try:
        time.sleep(0.5)                                        # the loops are running
        rate, others = bandwidth.probe(torch.device("cpu"))
    finally:
        for spin in spins:
            spin.kill()
            spin.wait()
    assert rate > 1e9
    assert others is not None and others > bandwidth.BUSY_CORES


def test_work_beside_idle_cores_does_not_count():
    marks = (100.0, 50.0, 10.0)                       # busy, idle, own CPU seconds
    # 1 s: 2 cores busy, 1 of them ours; no idle core: one core competed
    assert bandwidth._competing_cores(marks, (102.0, 50.1, 11.0), 1.0) == pytest.approx(1.0)
    # the same beside 6 idle cores (a big host): nothing competed for the probe's threads
    assert bandwidth._competing_cores(marks, (102.0, 56.0, 11.0), 1.0) == 0.0


def test_a_busy_figure_gives_way_to_a_quiet_or_a_higher_one():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    busy = {"cpu": 10e9, "measured_at": 1.0, "busy": 1.0}
    quiet = bandwidth.merged(busy, cpu, 5e9, 0.0, now=2.0)
    assert quiet == {"cpu": 5e9, "measured_at": 2.0}           # quiet replaces, even when lower
    assert bandwidth.merged(busy, cpu, 5e9, 1.5, now=2.0) == dict(busy, measured_at=2.0)   # lower and busy: kept
    assert bandwidth.merged(busy, cpu, 20e9, 1.5, now=2.0) == {"cpu": 20e9, "measured_at": 2.0, "busy": 1.5}
    assert bandwidth.merged(busy, cpu, 5e9, 1.5, refresh=True, now=2.0)["cpu"] == 5e9     # asked for: what it read
    assert bandwidth.merged(quiet, cpu, 1e9, 1.0, now=3.0)["busy"] == 1.0                 # marked, to be retried
    assert "busy" not in bandwidth.merged(None, gpu, 1e12, 3.0)      # a GPU's read does not share the cores
    assert bandwidth.rates(busy) == {"cpu": 10e9}


def test_a_busy_figure_is_measured_again_once_it_is_old(tmp_path):
    cpu = torch.device("cpu")
    key = bandwidth.machine_key(cpu)
    recent = {"cpu": 1e15, "measured_at": time.time() - 5, "busy": 1.0}
    (tmp_path / bandwidth.FILE).write_text(json.dumps({key: recent}))
    assert bandwidth.measured(tmp_path, cpu) == recent          # retried only after RETRY_S
    old = dict(recent, measured_at=time.time() - bandwidth.RETRY_S - 1)
    (tmp_path / bandwidth.FILE).write_text(json.dumps({key: old}))
    again = bandwidth.measured(tmp_path, cpu)
    assert again["measured_at"] > old["measured_at"]
    # busy again: the higher figure stays (nothing reads 1e15 B/s); quiet: the new one replaces it
    assert (again["cpu"] == 1e15) == ("busy" in again)
    assert json.loads((tmp_path / bandwidth.FILE).read_text())[key] == again


def test_doctor_says_when_the_read_rate_was_measured_among_busy_processes():
    from localchat.doctor import _bandwidth_text
    read = {"cpu": 8e9, "measured_at": time.time(), "busy": 1.0}
    text = _bandwidth_text(read, bandwidth.rates(read), "cpu", False)
    assert "8.0 GB/s" in text and "1.0 cores busy" in text and "localchat doctor --measure" in text
    assert "busy" not in _bandwidth_text(dict(read, busy=None), {"cpu": 8e9}, "cpu", False)


def test_doctor_bounds_are_bytes_over_the_measured_rate(tiny_llama):
    proc = run_doctor("--model", str(tiny_llama), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rate = out["bandwidth"]["cpu"]
    exact = next(r for r in out["plan"]["rows"] if r["profile"] == "resident-exact")
    assert exact["tps_bound"] == pytest.approx(rate / exact["read_per_token"], rel=1e-6)
    # a dense model reads its weights a token, less all but one row of an untied embedding
    assert 0 < exact["weights"] - exact["read_per_token"] < exact["weights"] / 2
    text = run_doctor("--model", str(tiny_llama)).stdout.decode()
    assert "Memory read rate:" in text and "measured" in text
    # the CLI sets libgomp's spin before anything imports torch (engine/openmp.py, benchmarks/busy.py)
    assert f"Idle threads: spin {openmp.SPIN} times, then sleep" in text


def test_doctor_plans_a_catalog_model_that_is_not_downloaded():
    proc = run_doctor("--model", "Qwen/Qwen3-14B", "--vram", "8GiB", env={"GOMP_SPINCOUNT": "5"})
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    assert "Idle threads: as set in the environment (GOMP_SPINCOUNT=5)" in out    # the user's own is kept
    assert "built-in catalog" in out and "14768.3 M parameters" in out and "streamed-exact" in out
    proc = run_doctor("--model", "nobody/not-in-the-catalog")
    assert proc.returncode == 2 and b"nobody/not-in-the-catalog" in proc.stderr


def test_sizes_print_with_enough_figures_to_differ():
    assert planner.gb(232e6) == "232 MB" and planner.gb(1.54e9) == "1.54 GB" and planner.gb(0) == "0"
    assert planner.gb_apart(2.341e9, 2.3405e9) == ("2.3410 GB", "2.3405 GB")
    # A need just over the budget still prints as two different figures.
    from engine import hardware, profiles
    from engine.errors import BadRequest
    shape = planner.ModelShape("m", 2, 64, 4, 2, 16, 128, 400, 4, 10**6, 10**5, False, 2)
    hw = hardware.Hardware((), 10**10, 10**10, 10**10, "/", "cpu", 2, False, "cpu", 10**9, ("vram",))
    row = planner.make_plan(shape, hw, profiles.builtin(), context=64).row("resident-exact")
    # A small budget keeps a tenth of itself as margin: need = rest + budget / 10; and it
    # prefills in chunks as narrow as one verify pass before it refuses (planner._chunked_row).
    positions = profiles.find(profiles.builtin(), "resident-exact").max_draft + 1
    rest = row.total - row.margin - row.activations + planner.activation_bytes(shape, positions, 64, positions)
    budget = int(rest / 0.9) - 3000
    short = hardware.Hardware((), 10**10, 10**10, 10**10, "/", "cpu", 2, False, "cpu", budget, ("vram",))
    with pytest.raises(BadRequest) as err:
        planner.make_plan(shape, short, profiles.builtin(), context=64, force="resident-exact")
    need, budget = str(err.value).split("needs ")[1].split(": short")[0].split(" but the budget is ")
    assert need != budget, str(err.value)


def _hub_cache_with_only_a_config(tmp_path, tokenizer, repo="acme/tiny-hybrid"):
    """A Hugging Face hub cache (its real layout) holding a hybrid's config.json and no
    weights: what a machine has after huggingface-hub fetched only that file."""
    import shutil
    from tiny import build_model
    src = build_model(tmp_path / "src", "qwen3_5", layers=4, tokenizer=tokenizer, seed=1)
    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(rev)
    (folder / "snapshots" / rev).mkdir(parents=True)
    shutil.copy(src / "config.json", folder / "snapshots" / rev / "config.json")
    return cache, src


def test_doctor_and_setup_plan_a_hub_model_from_its_config_alone(tmp_path, tokenizer):
    """A hub model the catalog does not know is planned from its config.json (a few KB),
    never by downloading its weights: doctor shows the hybrid's state column, setup says
    what fits before it fetches anything and refuses a model that fits nothing."""
    cache, src = _hub_cache_with_only_a_config(tmp_path, tokenizer)
    env = {"HF_HUB_CACHE": str(cache)}
    proc = run_doctor("--model", "acme/tiny-hybrid", env=env)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    assert "Planned from its config.json on the hub" in out
    assert any(line.startswith("profile") and " state " in line for line in out.splitlines())   # a hybrid's column
    planned = planner.ModelShape.from_config(json.loads((src / "config.json").read_text()))
    assert f"{planned.params / 1e6:.1f} M parameters" in out
    setup = [sys.executable, "-m", "localchat", "setup", "--model", "acme/tiny-hybrid", "--yes"]
    run = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    proc = subprocess.run(setup, capture_output=True, timeout=240, env=run)
    assert "(its config.json): resident-exact" in proc.stdout.decode()
    assert proc.returncode != 0 and b"acme/tiny-hybrid" in proc.stderr    # the weights cannot be fetched offline
    proc = subprocess.run(setup + ["--vram", "50KB"], capture_output=True, timeout=240, env=run)
    assert proc.returncode == 1 and b"does not fit this machine" in proc.stderr


def test_doctor_says_what_an_answer_samples_with_and_why(tmp_path, tiny_llama):
    """The model's recommendation and where it came from; the user's settings, where they
    override it; the JSON gives both."""
    import shutil
    model = shutil.copytree(tiny_llama, tmp_path / "m")
    written = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**written, "do_sample": True, "temperature": 0.6,
                                                              "top_p": 0.95, "top_k": 20}))
    greedy = run_doctor("--model", str(tiny_llama)).stdout.decode()
    assert ("Sampling: greedy (the model's generation_config.json does not sample); -t/--temperature samples "
            "instead") in greedy
    sampled = run_doctor("--model", str(model)).stdout.decode()
    assert ("Sampling: temperature 0.6, top-p 0.95, top-k 20 (the model's generation_config.json); -t 0 answers "
            "greedy") in sampled
    mine = run_doctor("--model", str(model), env={"LOCALCHAT_TEMPERATURE": "0"}).stdout.decode()
    assert "; your settings (temperature) make it greedy" in mine
    out = json.loads(run_doctor("--model", str(model), "--json", env={"LOCALCHAT_TOP_K": "5"}).stdout)
    assert out["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 5,
                               "model_recommends": {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                    "source": "the model's generation_config.json"}}


@pytest.mark.demo
def test_doctor_plans_a_gguf_model_by_its_files_bytes_and_formats(tmp_path):
    from engine import checkpoint
    demo = checkpoint.demo_gguf_path()
    proc = run_doctor("--model", str(demo), env={"LOCALCHAT_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.decode()
    assert "matrices in Q4_1 (210), Q8_0 (1); its blocks run as stored (resident-gguf)" in text
    assert "→ resident-gguf" in text and "the file's own blocks fit" in text
    assert not list(tmp_path.glob("imports/*/*.safetensors"))        # planned without a float copy
