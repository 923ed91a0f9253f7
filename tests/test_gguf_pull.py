"""One quant of a GGUF repo from the hub, named as llama.cpp names it (`owner/repo:Q8_0`),
against the local hub server (tests/hub_server.py) through huggingface_hub's own client, as
tests/test_download.py runs it: only that quant's files are fetched (every part of a split
one, checked against its hash), the one-shot answers from them offline what the same
weights in one local file answer, and a quant the repo does not hold is one line naming
what it does hold."""
import subprocess
import sys

import pytest

from hub_server import Hub, HubServer
from test_download import env_for

REPO = "tiny-org/tiny-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama by llama.cpp's converter: in the repo an F32 file, a Q8_0 split in three
    parts in a folder, a vision projector and a README; outside it, the Q8_0 in one file."""
    from transformers import AutoTokenizer

    from engine import checkpoint
    from llama_cpp import convert
    from tiny import build_model
    base = tmp_path_factory.mktemp("gguf-pull")
    tok = AutoTokenizer.from_pretrained(checkpoint.resolve(None).path)
    src = build_model(base / "hf", "llama", tokenizer=tok, layers=2, hidden=64, seed=11)
    repo = base / "repo"
    (repo / "Q8_0").mkdir(parents=True)
    convert(src, repo / "tiny-F32.gguf", "f32")
    convert(src, repo / "Q8_0" / "tiny-Q8_0.gguf", "q8_0", "--split-max-tensors", "8")
    (repo / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF, but a projector's: never fetched for a quant")
    (repo / "README.md").write_text("A tiny GGUF repo.\n")
    return repo, convert(src, base / "tiny-Q8_0.gguf", "q8_0")


@pytest.fixture
def server(files):
    hub = Hub()
    hub.add_folder(REPO, files[0])
    with HubServer(hub) as srv:
        yield srv


def _run(args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "localchat", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_quant_is_fetched_alone_all_its_parts_and_answers_offline(server, files, tmp_path):
    hub, env = server.hub, env_for(server, tmp_path)
    parts = sorted(f.name for f in hub.repos[REPO] if f.name.startswith("Q8_0/"))
    assert len(parts) == 3 and parts[0].endswith("-00001-of-00003.gguf")
    hub.corrupt[parts[1]] = 1                                   # a bad body: refetched, by its hash
    proc = _run(["models", "pull", f"{REPO}:q8_0"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(parts[0])               # the model is its first part
    assert sorted(hub.sent) == parts                            # that quant, nothing else
    assert hub.gets[parts[1]] == 2
    prompt = ["--no-log", "-n", "6", "Name a colour."]
    offline = _run(["-m", f"{REPO}:Q8_0", *prompt], dict(env, HF_HUB_OFFLINE="1"))
    local = _run(["-m", str(files[1]), *prompt], env)
    assert offline.returncode == 0 and local.returncode == 0, offline.stderr + local.stderr
    assert offline.stdout == local.stdout and offline.stdout.strip()


def test_a_quant_the_repo_does_not_hold_is_one_line_naming_what_it_holds(server, tmp_path):
    proc = _run(["-m", f"{REPO}:Q4_K_M", "--no-log", "hi"], env_for(server, tmp_path))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "Q4_K_M" in lines[0] and "tiny-F32.gguf" in lines[0] and "tiny-Q8_0.gguf" in lines[0]
    assert "mmproj" not in lines[0]
    whole = _run(["models", "pull", REPO], env_for(server, tmp_path))    # no quant named: say how
    assert whole.returncode == 2 and f"{REPO}:QUANT" in whole.stderr and "Traceback" not in whole.stderr


def test_quant_names_match_whole_tags_in_any_case():
    from engine.download import quant_files
    from engine.errors import ModelNotFound
    names = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-UD-Q4_K_XL.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf",
             "Q8_0/m-Q8_0-00001-of-00002.gguf", "mmproj-m-Q8_0.gguf", "m-IQ4_XS.gguf"]
    assert quant_files("r", names, "q4_k_m") == ["m-Q4_K_M.gguf"]
    assert quant_files("r", names, "UD-Q4_K_XL") == ["m-UD-Q4_K_XL.gguf"]
    assert quant_files("r", names, "Q8_0") == ["Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(ModelNotFound, match="no Q4_K file"):
        quant_files("r", names, "Q4_K")                          # neither Q4_K_M nor Q4_K_S
    with pytest.raises(ModelNotFound, match="split in 2 parts but the repo holds 1"):
        quant_files("r", names[:4], "Q8_0")
