"""Block types no kernel reads yet (IQ1-IQ3, TQ1_0/TQ2_0, MXFP4): converted at load to Q8_0
(engine/gguf_file.runnable), within 8-bit rounding of the file's own values, counted in the
plan at their converted size, and said so by describe() and doctor."""
import subprocess
import sys

import numpy as np
import pytest
import torch

import engine
from engine import checkpoint
from engine.gguf_file import CONVERT_TO, converted, held_bytes, runnable
from engine.gguf_reader import Tensor, read
from engine.kernels import gguf_kernel
from engine.shape import ModelShape

pytestmark = pytest.mark.skipif(not gguf_kernel.available(), reason=f"no GGUF kernel here: {gguf_kernel.why_not()}")


@pytest.mark.parametrize("kind", ["MXFP4", "TQ1_0", "TQ2_0", "IQ3_S", "IQ2_XXS", "IQ1_M"])
def test_a_tensor_without_a_kernel_becomes_q8_0_of_its_own_values(kind):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
    qtype = GGMLQuantizationType[kind]
    bs, nbytes = GGML_QUANT_SIZES[qtype]
    g = np.random.default_rng(0)
    if kind in ("MXFP4", "TQ1_0", "TQ2_0"):            # gguf-py writes these
        raw = quants.quantize(g.standard_normal((6, 512)).astype(np.float32), qtype)
    else:                                              # random blocks: any grid index is valid
        raw = g.integers(0, 256, (6, 512 // bs * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        blocks[:, :2] = np.frombuffer(np.full(len(blocks), 0.01, np.float16).tobytes(), np.uint8).reshape(-1, 2)
    t = Tensor("blk.0.ffn_down.weight", kind, (6, 512), torch.from_numpy(raw))
    assert converted(kind) and not converted("Q4_K") and not converted("F32")
    out = runnable(t)
    assert out.kind == CONVERT_TO and out.shape == t.shape and held_bytes(t) == out.data.numel()
    want = torch.from_numpy(quants.dequantize(raw, qtype)).float()
    got = gguf_kernel.dequantize(out.data, CONVERT_TO, 512)
    # each block's error: half a step of its scale, plus 127 times the scale's half-float
    # rounding (relative 2^-11, or half the spacing of half-float subnormals, 2^-25)
    step = want.view(6, 16, 32).abs().amax(-1, keepdim=True) / 127
    bound = 0.5 * step + 127 * torch.maximum(step * 2.0 ** -11, torch.tensor(2.0 ** -25)) * 1.01
    assert ((got.view(6, 16, 32) - want.view(6, 16, 32)).abs() <= bound).all()
    assert runnable(out) is out


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """A tiny Qwen3 as a GGUF with its MLP in MXFP4 and TQ2_0 (gguf-py's quantizer), and an
    F32 GGUF of the same model holding those blocks' own values."""
    from gguf import GGMLQuantizationType, quants

    from gguf_writer import write_gguf
    from tiny import build_model
    base = tmp_path_factory.mktemp("gguf-convert")
    src = build_model(base / "hf", "qwen3", tokenizer=tokenizer, layers=2, hidden=256, seed=3)
    types = {"ffn_down.weight": "TQ2_0", "ffn_gate.weight": "MXFP4", "ffn_up.weight": "MXFP4"}
    blocks = write_gguf(src, base / "blocks.gguf", types=types)
    # the reference: the same checkpoint with those matrices replaced by their blocks' values
    from safetensors.torch import load_file, save_file
    import shutil
    ref = shutil.copytree(src, base / "ref")
    state = load_file(ref / "model.safetensors")
    for name, w in state.items():
        kind = next((k for end, k in (("down_proj.weight", "TQ2_0"), ("gate_proj.weight", "MXFP4"),
                                      ("up_proj.weight", "MXFP4")) if name.endswith(end)), None)
        if kind is not None:
            qtype = GGMLQuantizationType[kind]
            state[name] = torch.from_numpy(quants.dequantize(quants.quantize(w.float().numpy(), qtype), qtype))
    save_file(state, ref / "model.safetensors")
    return blocks, write_gguf(ref, base / "ref.gguf")


def test_a_file_of_such_blocks_runs_from_them_converted(files, tmp_path):
    blocks, ref = files
    eng = engine.open(str(blocks), profile="resident-gguf", drafter="none", cache_dir=tmp_path)
    assert dict(eng.target.converted) == {"MXFP4": 4, "TQ2_0": 2}
    assert "MXFP4, TQ2_0 converted at load" in eng.describe()["weights"]
    assert "Q8_0" in eng.describe()["products"]
    want = engine.open(str(ref), profile="resident-gguf", drafter="none", cache_dir=tmp_path)
    ids = list(range(20, 60))
    got, exact = eng.target.forward(ids, all_logits=True), want.target.forward(ids, all_logits=True)
    # the converted weights are the file's within 8-bit rounding: the logits within a few
    # hundredths of their spread (the same model in float32 reads the blocks' exact values)
    assert (got - exact).abs().max() <= 0.05 * (exact.max() - exact.min())
    # planned at what is held: the converted matrices at Q8_0's 34 bytes a 32
    shape = ModelShape.of(checkpoint.resolve(str(blocks), tmp_path))
    held = sum(held_bytes(t) for t in read(blocks)[1].values() if t.name.startswith("blk.") and len(t.shape) >= 2
               and t.name.endswith(".weight"))
    assert shape.gguf_linear_bytes == held


def test_doctor_says_what_is_converted(files, tmp_path):
    blocks, _ = files
    out = subprocess.run([sys.executable, "-m", "localchat", "doctor", "--model", str(blocks), "--profile", "resident-gguf"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Converted at load: MXFP4, TQ2_0 blocks have no kernel here yet" in out.stdout
    assert "Products under resident-gguf" in out.stdout and "Q8_0" in out.stdout


def test_a_file_whose_heads_do_not_match_its_matrices_is_one_line(files, tmp_path):
    """Metadata that states another head size than the matrices hold (a mis-conversion):
    refused in one line naming the file, never run as garbage."""
    import shutil

    from gguf import GGUFReader
    bad = shutil.copyfile(files[0], tmp_path / "mis-stated.gguf")
    field = GGUFReader(str(bad), "r+").fields["qwen3.attention.key_length"]
    field.parts[-1][0] = 128                               # the matrices hold heads of 64
    out = subprocess.run([sys.executable, "-m", "localchat", "-m", str(bad), "--profile", "resident-gguf", "hi"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "mis-stated.gguf: its q, k and v projections hold 512 rows" in out.stderr
