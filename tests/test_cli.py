"""The command line as a user meets it: prompts from arguments and stdin, flags,
exit codes, and one-line errors (never a traceback)."""
import io
import os
import subprocess
import sys

import pytest

from localchat import cli, common, config
from localchat.oneshot import read_prompt


class FakeStdin(io.TextIOWrapper):
    def __init__(self, data: bytes, tty=False):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty


def test_stdin_first_then_arguments():
    prompt, replaced = read_prompt(["and", "this"], FakeStdin(b"context from a file\n"))
    assert prompt == "context from a file\n\nand this" and not replaced


def test_terminal_stdin_is_not_read():
    assert read_prompt(["hello"], FakeStdin(b"ignored", tty=True)) == ("hello", False)


def test_non_utf8_stdin_is_replaced_and_flagged():
    prompt, replaced = read_prompt([], FakeStdin(b"caf\xe9 au lait"))
    assert prompt == "caf\ufffd au lait" and replaced


def test_flags_override_config():
    args = cli.build_parser().parse_args(["--temperature", "0.5", "-n", "7", "hi"])
    s = common.settings_from(args, config.Settings(temperature=0.9, max_tokens=100, system="x"))
    assert (s.temperature, s.max_tokens, s.system) == (0.5, 7, "x")


def test_config_file_and_environment(tmp_path):
    path = tmp_path / "config.toml"
    config.save(config.Settings(temperature=0.7, system="Be terse."), path)
    s, warnings = config.load(path, {"LOCALCHAT_TEMPERATURE": "0.2"})
    assert (s.temperature, s.system, warnings) == (0.2, "Be terse.", [])


def test_malformed_config_names_file_and_line(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('model = "a"\ntemperature = = 3\n')
    s, warnings = config.load(path, {})
    assert s == config.Settings() and "config.toml" in warnings[0] and "line 2" in warnings[0]


def run_cli(*args, stdin=b"", extra_env=None):
    env = os.environ.copy()
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "localchat", *args], input=stdin, capture_output=True,
                          timeout=300, env=env)


def one_line_error(proc, *needles):
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    line = [l for l in err.splitlines() if l.startswith("localchat:")]
    assert line, err
    for n in needles:
        assert n in line[-1], err


@pytest.mark.parametrize("flag,value", [("--max-tokens", "0"), ("--max-tokens", "-3"), ("--top-p", "0"),
                                        ("--temperature", "-1")])
def test_bad_flag_values_exit_2(flag, value):
    proc = run_cli(flag, value, "hi")
    assert proc.returncode == 2
    one_line_error(proc, flag)


def test_missing_model_path_exits_2(tmp_path):
    proc = run_cli("--model", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 2
    one_line_error(proc, "nope", "no such file")


def test_empty_prompt_exits_2():
    proc = run_cli(stdin=b"  \n")
    assert proc.returncode == 2
    one_line_error(proc, "prompt is empty")


def test_truncated_model_exits_2(tmp_path, tiny_llama):
    import shutil
    d = shutil.copytree(tiny_llama, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = run_cli("--model", str(d), "hi")
    assert proc.returncode == 2
    one_line_error(proc, "model.safetensors", "truncated")


def test_tiny_model_answers_with_stats_and_bad_utf8(tiny_llama):
    proc = run_cli("--model", str(tiny_llama), "-n", "10", "--stats", stdin=b"caf\xe9")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    assert "not valid UTF-8" in err and "decode" in err and "Traceback" not in err


def test_bench_measures_each_workload_and_writes_json(tmp_path, tiny_llama):
    import json
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"id": "copy", "kind": "copy", "prompt": "Repeat: the cat sat on the mat, the cat sat on the mat"}\n'
                  '{"id": "code", "kind": "code", "prompt": "def fib(n):"}\n')
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "--model", str(tiny_llama), "--workloads", str(wl), "-n", "24", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.decode()
    assert "plain tok/s" in table and "copy" in table and "code" in table
    data = json.loads(out.read_text())
    assert [r["id"] for r in data["workloads"]] == ["copy", "code"]
    for r in data["workloads"]:
        assert r["ngram"]["identical"] is True
        assert r["plain"]["decode_tps"] > 0 and r["ngram"]["tokens_per_pass"] >= 1.0
        assert r["lookup_ceiling"]["tokens_per_pass"] >= 1.0 and r["lookup_ceiling"]["speedup"] > 0
    assert "ceiling" in table


def test_bench_bad_workloads_file(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"id": "x"}\n')
    proc = run_cli("bench", "--workloads", str(wl))
    assert proc.returncode == 2
    one_line_error(proc, "w.jsonl line 1", "prompt")


@pytest.mark.parametrize("args,needle", [(["--draft-tokens", "99"], "--draft-tokens 99"),
                                         (["--drafter", "model"], "--draft-model")])
def test_bad_drafter_flags_exit_2(args, needle):
    proc = run_cli(*args, "hi")
    assert proc.returncode == 2
    one_line_error(proc, needle)


def test_stats_line_shows_speculation(tiny_llama):
    proc = run_cli("--model", str(tiny_llama), "-n", "40", "--stats", "--drafter", "ngram", "--draft-tokens", "3",
                   "the cat sat on the mat the cat sat on the mat the cat sat")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    assert "tok/pass" in err and "drafted" in err and "accepted" in err


def test_flags_after_the_prompt_words():
    args = cli.build_parser().parse_intermixed_args(["-n", "5", "why", "is", "it", "--stats", "blue"])
    assert args.prompt == ["why", "is", "it", "blue"] and args.stats and args.max_tokens == 5


def test_a_model_that_does_not_fit_the_budget_is_refused(tiny_llama):
    proc = run_cli("--model", str(tiny_llama), "--vram", "100KB", "hi")
    assert proc.returncode == 2
    one_line_error(proc, "budget", "--vram")


def test_a_model_larger_than_the_budget_streams_and_says_so(tiny_llama):
    proc = run_cli("--model", str(tiny_llama), "--vram", "700KB", "--context", "256", "--stats", "-n", "4",
                   "--drafter", "none", "--profile", "streamed-exact", "hi")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    assert "streamed" in err and "GB/s" in err, err
    # which thread count one-token steps ran on, and why (engine/targets/streamed.py)
    assert "steps on" in err and ("same bits on any count" in err or "torch's kernels" in err), err


def test_a_setting_out_of_range_and_a_retired_one_are_one_warning_each(tiny_llama, tmp_path):
    # A setting from the environment (or the config file) that is out of range is one
    # warning naming where it came from; the run goes on with that setting's default.
    proc = run_cli("--model", str(tiny_llama), "-n", "2", "hi", extra_env={"LOCALCHAT_DRAFTER_WEIGHTS": "maybe"})
    assert proc.returncode == 0 and proc.stdout.strip()
    one_line_error(proc, "LOCALCHAT_DRAFTER_WEIGHTS", "auto, exact, int8, int4")
    # A config an earlier version wrote, with its `compile` setting: the answer comes, and
    # one line says the setting is gone and how to drop it.
    (tmp_path / "config.toml").write_text('compile = "on"\nmax_tokens = 3\n')
    proc = run_cli("--model", str(tiny_llama), "hi", extra_env={"LOCALCHAT_CONFIG_DIR": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip()
    one_line_error(proc, "'compile' is no longer used", "delete the line")


def test_saving_a_config_drops_its_retired_settings(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('compile = "off"\ntheme = "nord"\n')
    config.save(config.Settings(model="m"), path, keys=("model",))
    settings, warnings = config.load(path, {})
    assert (settings.model, settings.theme, warnings) == ("m", "nord", [])
    assert "compile" not in path.read_text()


def test_an_answer_samples_as_the_model_recommends_unless_told_otherwise(tmp_path, tiny_llama):
    """A checkpoint whose generation_config.json samples is answered with its values (the
    --json record says which), seeded runs repeat; -t 0 answers greedy, token for token
    what the same weights answer without the recommendation; a flag overrides one value
    and the model's others stay."""
    import json
    import shutil
    model = shutil.copytree(tiny_llama, tmp_path / "m")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 1.5,
                                                              "top_p": 0.9, "top_k": 50}))

    def answer(path, *flags):
        proc = run_cli("--model", str(path), "-n", "24", "--drafter", "none", "--json", "--no-log", *flags, "Hello")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    sampled, again = answer(model, "--seed", "3"), answer(model, "--seed", "3")
    assert sampled["sampling"] == {"temperature": 1.5, "top_p": 0.9, "top_k": 50, "seed": 3}
    assert sampled["token_ids"] == again["token_ids"]
    greedy, plain = answer(model, "-t", "0"), answer(tiny_llama)
    assert greedy["sampling"]["temperature"] == 0 and plain["sampling"]["temperature"] == 0
    assert greedy["token_ids"] == plain["token_ids"] != sampled["token_ids"]
    assert answer(model, "--top-k", "5", "--seed", "3")["sampling"] == {"temperature": 1.5, "top_p": 0.9, "top_k": 5,
                                                                        "seed": 3}
