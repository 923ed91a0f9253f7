"""Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Qwen3-MoE GGUFs written by llama.cpp's own converter, run
from their blocks (engine/targets/gguf_modules.py): the converter's changes undone (norms
stored as w + 1, ssm_a as -exp(A_log), Qwen3.5's value heads tiled, Qwen3-Next's fused
in-projections split), so an F32 file is the checkpoint to the bit; a Q8_0 file is its own
weights as gguf-py dequantizes them within float32 rounding, its steps in C (Qwen3.5's out
projection reading its input in the file's tiled order) as the modules compute them;
verify rows are lone steps, and speculation is plain greedy."""
import pytest
import torch

import engine
from engine import checkpoint
from engine.kernels import gguf_kernel
from engine.models import hybrid_layers
from test_hybrid_speculative import ScriptedDrafter, _prompt_len

pytestmark = pytest.mark.skipif(not gguf_kernel.available(), reason=f"no GGUF kernel here: {gguf_kernel.why_not()}")

IDS = list(range(100, 140))


def _dequantized(f32, q8, out):
    """`f32` with every tensor's values replaced by gguf-py's dequantization of the same
    tensor of `q8`: the Q8_0 file's own weights, in float32, through nothing of ours."""
    import shutil

    from gguf import GGUFReader
    from gguf.quants import dequantize
    shutil.copyfile(f32, out)
    blocks = {t.name: t for t in GGUFReader(str(q8)).tensors}
    for t in GGUFReader(str(out), "r+").tensors:
        q = blocks[t.name]
        if q.tensor_type != t.tensor_type:
            t.data[...] = dequantize(q.data, q.tensor_type).reshape(t.data.shape)
    return out


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe"])
def files(request, tmp_path_factory):
    """A tiny Qwen3.5, Qwen3.5-MoE or Qwen3-Next (4 layers, one of them full attention) with
    the demo's tokenizer (the converter knows its pre-tokenizer); its F32 and Q8_0 files by
    llama.cpp's converter, and the F32 file holding the Q8_0 file's dequantized weights."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from llama_cpp import convert
    from tiny import build_model
    base = tmp_path_factory.mktemp(f"gguf-{request.param}")
    tok = AutoTokenizer.from_pretrained(checkpoint.resolve(None).path)
    src = build_model(base / "hf", request.param, tokenizer=tok, layers=4, hidden=64, seed=7)
    given = src
    if request.param == "qwen3_5_moe":
        # transformers reads a qwen3_5_moe checkpoint's tokenizer as Qwen3.5's own class,
        # whose pre-tokenizer the converter does not know over the demo's vocabulary: the
        # converter is shown the dense model type (it goes by the architecture, the MoE's)
        given = shutil.copytree(src, base / "to-convert")
        cfg = json.loads((given / "config.json").read_text())
        (given / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen3_5_text")))
    mtp = () if request.param == "qwen3_moe" else ("--no-mtp",)     # the converter refuses the flag there
    f = {kind: convert(given, base / f"tiny.{kind}.gguf", kind, *mtp) for kind in ("f32", "q8_0")}
    f["dequantized"] = _dequantized(f["f32"], f["q8_0"], base / "tiny.dequantized.gguf")
    f["cache"] = base / "cache"              # their imports, once for the module's tests
    return src, f


def _open(f, kind: str, **kw):
    return engine.open(str(f[kind]), cache_dir=f["cache"], drafter="none", **kw)


def _logits(eng, width: int = 4):
    """A prefill's logits, then `width` one-token steps'."""
    t = eng.target
    eng.cache_owner = None
    with torch.inference_mode():
        t.cache.rollback(0)
        out = [t.forward(IDS, all_logits=True)] + [t.forward([i]) for i in (5, 7, 11, 13)[:width]]
        t.cache.rollback(0)
    return out


def test_an_f32_file_is_the_checkpoint_to_the_bit(files):
    src, f = files
    eng = _open(f, "f32")
    exact = engine.open(str(src), profile="resident-exact", dtype="float32", drafter="none")
    assert eng.plan.chosen == "resident-gguf" and eng.target.kind == "gguf"
    for got, want in zip(_logits(eng), _logits(exact)):
        assert torch.equal(got, want)


def test_a_q8_0_file_is_its_dequantized_weights_within_rounding(files):
    _, f = files
    eng = _open(f, "q8_0")
    assert eng.plan.chosen == "resident-gguf" and eng.target.formats["Q8_0"] > 0
    assert not list(eng.checkpoint.path.glob("*.safetensors"))                  # no float copy
    assert eng.target.weight_bytes() <= f["q8_0"].stat().st_size
    info = eng.describe()
    assert info["weights"].startswith("GGUF Q8_0")
    if eng.target.config.model_type != "qwen3_moe":                          # no delta-net layers there
        assert "in C" in info["hybrid_layers"]
    if eng.target.config.model_type in ("qwen3_5_moe_text", "qwen3_moe"):
        assert "one C call" in info["experts"]                                # the experts' blocks in C
    exact = _open(f, "dequantized")
    for got, want in zip(_logits(eng), _logits(exact)):
        # the same float32 weights, the activations rounded to 16 bits inside the block
        # products (about 1e-5 of a product) and everything summed in another order; a
        # router's near-tie may pick another expert from so small a change, which moves a
        # tiny random model's logits by about a percent: a mapping error would be O(1)
        assert (got - want).abs().max() <= 5e-2 * want.abs().max()


def test_steps_in_c_are_what_the_modules_compute(files, monkeypatch):
    src, f = files
    if "qwen3_moe" in src.parent.name:
        pytest.skip("Qwen3-MoE has no delta-net layers to run in C")
    ran = []
    plain = hybrid_layers.HybridLayers._delta_net
    monkeypatch.setattr(hybrid_layers.HybridLayers, "_delta_net",
                        lambda self, *a: ran.append(plain(self, *a)) or ran[-1])
    in_c = _logits(_open(f, "q8_0"))
    assert sum(ran) == 3 * 4                    # each step's three delta-net layers in C (the prefill starts them)
    monkeypatch.setenv("LOCALCHAT_HYBRID_KERNEL", "off")
    modules = _logits(_open(f, "q8_0"))
    for c, m in zip(in_c[1:], modules[1:]):
        # the same products; float operations in another order may leave a value a last bit
        # apart, and so a code apart where the products round it to 16 bits
        assert (c - m).abs().max() <= 1e-3 * m.abs().max()


def test_verify_rows_are_steps_and_speculation_is_plain_greedy(files):
    _, f = files
    eng = _open(f, "q8_0")
    t, cache = eng.target, eng.target.cache
    drafts = [40, 41, 42, 43, 44]
    with torch.inference_mode():
        cache.rollback(0)
        t.forward(IDS)
        cache.checkpoint()
        steps = torch.cat([t.forward([d], all_logits=True) for d in drafts])
        cache.rollback(len(IDS))
        with cache.record():
            rows = t.forward(drafts, all_logits=True)
        cache.rollback(len(IDS))
        cache.settle()
        cache.rollback(0)
    assert torch.equal(steps, rows)
    prompt = "Why is the sky blue?"
    plain = list(eng.chat().send(prompt, max_new_tokens=30))[-1]
    # drafts from the answer, every third token wrong: accepted runs and rejections both
    eng.drafter = ScriptedDrafter(list(plain.token_ids), _prompt_len(eng, prompt), t.vocab_size, wrong_every=3)
    eng.draft_tokens = 4
    chat = eng.chat()
    spec = list(chat.send(prompt, max_new_tokens=30))[-1]
    assert list(spec.token_ids) == list(plain.token_ids) and chat.last_stats.drafted_tokens > 0


def test_the_float_copy_is_transformers_reading_or_one_line_where_it_cannot(files, tmp_path):
    # transformers reads qwen35 and qwen35moe files (their float32 copy, for the other
    # profiles); a qwen3next file it cannot read runs from its blocks only, and says so
    from engine.errors import CheckpointError
    src, f = files
    if "next" in src.parent.name:
        with pytest.raises(CheckpointError, match="runs from its own blocks only"):
            engine.open(str(f["q8_0"]), cache_dir=tmp_path, profile="resident-exact", drafter="none")
        return
    exact = engine.open(str(f["q8_0"]), cache_dir=tmp_path, profile="resident-exact", drafter="none")
    packed = _open(f, "dequantized")
    assert exact.target.kind != "gguf"
    for got, want in zip(_logits(exact, 1), _logits(packed, 1)):
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
