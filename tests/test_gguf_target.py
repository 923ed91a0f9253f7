"""The demo model run from its GGUF file's own blocks (engine/targets/gguf_target.py): no
float copy of the weights, logits within float32 rounding of transformers' float32 import
of the same file, and speculation exact by construction (every row a lone row)."""
import pytest
import torch

import engine
from engine import checkpoint
from engine.kernels import gguf_kernel
from engine.targets.gguf_target import load_gguf
from engine.targets.resident import load_resident

pytestmark = [pytest.mark.demo,
              pytest.mark.skipif(not gguf_kernel.available(), reason=f"no GGUF kernel here: {gguf_kernel.why_not()}")]


@pytest.fixture(scope="module")
def targets():
    imported = checkpoint.resolve(None).path
    return load_gguf(checkpoint.demo_gguf_path(), imported), load_resident(imported, torch.device("cpu"), torch.float32)


def test_the_weights_are_the_files_blocks_not_a_float_copy(targets):
    packed, exact = targets
    size = checkpoint.demo_gguf_path().stat().st_size
    assert packed.weight_bytes() <= size < exact.weight_bytes() / 3
    assert packed.formats == {"Q4_1": 210, "Q8_0": 1} and packed.kind == "gguf"


def test_logits_are_the_imported_models_within_float32_rounding(targets):
    packed, exact = targets
    ids = list(range(20, 60))
    with torch.inference_mode():
        for t in targets:
            t.cache.rollback(0)
        got = [packed.forward(ids, all_logits=True)] + [packed.forward([i]) for i in (5, 7, 11)]
        want = [exact.forward(ids, all_logits=True)] + [exact.forward([i]) for i in (5, 7, 11)]
        for t in targets:
            t.cache.rollback(0)
    for g, w in zip(got, want):
        # the same float32 weights summed in another order: a mapping error would be O(1)
        assert (g - w).abs().max() <= 1e-3 * w.abs().max()


def test_verify_rows_are_one_token_steps(targets):
    packed, _ = targets
    ids = list(range(30, 70))
    with torch.inference_mode():
        packed.cache.rollback(0)
        packed.forward(ids[:30])
        verify = packed.forward(ids[30:39], all_logits=True)
        packed.cache.rollback(30)
        steps = torch.cat([packed.forward([i]) for i in ids[30:39]])
        packed.cache.rollback(0)
    assert torch.equal(verify, steps)


def test_speculation_on_it_is_plain_greedy(targets):
    packed, _ = targets
    ckpt = checkpoint.resolve(None)
    eng = engine.Engine(ckpt, engine.engine._load_tokenizer(ckpt.path), packed, drafter=engine.NoDrafter())
    prompt = "List the numbers from one to twenty, separated by commas."
    plain = list(eng.chat().send(prompt, max_new_tokens=40))[-1]
    eng.drafter, eng.draft_tokens = engine.NgramDrafter(), 4
    chat = eng.chat()
    spec = list(chat.send(prompt, max_new_tokens=40))[-1]
    assert list(spec.token_ids) == list(plain.token_ids) and chat.last_stats.drafted_tokens > 0


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_file(request, tmp_path_factory):
    """A tiny Llama or Qwen3 (q/k norms, a head size other than hidden / heads) with the
    demo's tokenizer (the converter knows its pre-tokenizer), and llama.cpp's converter's
    F32 and Q8_0 files of it."""
    from transformers import AutoTokenizer

    from llama_cpp import convert
    from tiny import build_model
    base = tmp_path_factory.mktemp(f"gguf-{request.param}")
    tok = AutoTokenizer.from_pretrained(checkpoint.resolve(None).path)
    src = build_model(base / "hf", request.param, tokenizer=tok, layers=2, hidden=64, seed=5)
    return src, {kind: convert(src, base / f"tiny.{kind}.gguf", kind) for kind in ("f32", "q8_0")}


def test_an_f32_file_is_the_checkpoint_to_the_bit(tiny_file, tmp_path):
    # llama.cpp's converter interleaves the rotary halves of a Llama's q and k: put back, the
    # same weights run the same code (the C layers here) to the same logits
    src, files = tiny_file
    packed = load_gguf(files["f32"], checkpoint.import_gguf(files["f32"], tmp_path))
    exact = load_resident(src, torch.device("cpu"), torch.float32)
    ids = list(range(100, 140))
    with torch.inference_mode():
        assert torch.equal(packed.forward(ids, all_logits=True), exact.forward(ids, all_logits=True))
        assert torch.equal(packed.forward([5]), exact.forward([5]))


def test_a_q8_0_file_is_its_dequantized_weights_within_rounding(tiny_file, tmp_path):
    _, files = tiny_file
    imported = checkpoint.import_gguf(files["q8_0"], tmp_path)         # gguf-py's float32 weights
    packed = load_gguf(files["q8_0"], imported)
    exact = load_resident(imported, torch.device("cpu"), torch.float32)
    assert packed.formats["Q8_0"] > 0 and packed.weight_bytes() < exact.weight_bytes() / 3
    ids = list(range(100, 140))
    with torch.inference_mode():
        got, want = packed.forward(ids, all_logits=True), exact.forward(ids, all_logits=True)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


def test_steps_run_in_one_call_of_c_as_the_torch_operations_compute_them(targets):
    # the layer kernel reads the file's blocks (gguf.c's products inside layer.c): one call a
    # pass, the same products as the forward's torch operations around them
    packed, _ = targets
    impl = packed.impl
    assert impl.layer_kernel_note == "" and impl._stack.has_head
    ids = list(range(40, 70))
    with torch.inference_mode():
        impl.cache.rollback(0)
        in_c = [packed.forward(ids, all_logits=True)] + [packed.forward([i]) for i in (5, 7)]
        stack, impl._stack = impl._stack, None
        try:
            impl.cache.rollback(0)
            ops = [packed.forward(ids, all_logits=True)] + [packed.forward([i]) for i in (5, 7)]
        finally:
            impl._stack = stack
            impl.cache.rollback(0)
    # the products round activations to 16 bits: where the two orders of float operations
    # leave a value a last bit apart, it may round to the neighbouring code
    for c, o in zip(in_c, ops):
        assert (c - o).abs().max() <= 1e-3 * o.abs().max()


def test_a_gguf_file_opens_as_stored_and_its_float_copy_is_written_only_when_asked(tmp_path):
    from engine.errors import BadRequest
    demo = checkpoint.demo_gguf_path()
    eng = engine.open(str(demo), cache_dir=tmp_path, drafter="none")
    assert eng.plan.chosen == "resident-gguf" and eng.target.kind == "gguf"
    assert eng.plan.row("resident-gguf").weights <= demo.stat().st_size
    assert not list((tmp_path / "imports").glob("*/*.safetensors"))          # config and tokenizer only
    with pytest.raises(BadRequest, match="resident-gguf: --dtype bfloat16"):
        engine.open(str(demo), cache_dir=tmp_path, profile="resident-gguf", dtype="bfloat16")
    exact = engine.open(str(demo), cache_dir=tmp_path, profile="resident-exact", drafter="none")
    assert exact.target.kind != "gguf" and len(list((tmp_path / "imports").glob("*/model.safetensors"))) == 1
    prompt = "Name three colours."
    a = list(eng.chat().send(prompt, max_new_tokens=12))[-1].token_ids
    b = list(exact.chat().send(prompt, max_new_tokens=12))[-1].token_ids
    assert len(a) > 0 and len(b) > 0


def test_doctor_fidelity_checks_a_gguf_and_names_a_degenerate_one(tmp_path):
    # a damaged or mis-mapped file answers garbage rather than an error: doctor --fidelity
    # reads the held texts from the file's blocks and says so in one line
    import shutil
    import subprocess
    import sys

    import gguf
    demo = checkpoint.demo_gguf_path()
    cmd = [sys.executable, "-m", "localchat.cli", "doctor", "--fidelity", "--model"]
    good = subprocess.run(cmd + [str(demo)], capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr
    assert "File check on the held texts" in good.stdout and "nothing looks mis-mapped" in good.stdout
    zeroed = shutil.copy(demo, tmp_path / "zeroed.gguf")
    embd = next(t for t in gguf.GGUFReader(str(zeroed)).tensors if t.name == "token_embd.weight")
    with open(zeroed, "r+b") as fh:                     # every embedding (and the tied head) zero
        fh.seek(embd.data_offset)
        fh.write(bytes(int(embd.n_bytes)))
    bad = subprocess.run(cmd + [str(zeroed)], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "zeroed.gguf" in lines[0] and "degenerate" in lines[0], bad.stderr


def test_doctor_fidelity_compares_a_gguf_with_its_checkpoint_and_names_a_mis_mapped_one(tmp_path):
    # the demo's file against its weights as a safetensors checkpoint answers as they do; the
    # same file with the last ten layers' q and out projections swapped (a mis-mapped
    # conversion whose logits are finite, varied and short of a uniform guess, so the file
    # check alone passes it) is named in one line
    import json
    import shutil
    import subprocess
    import sys

    import gguf
    demo = checkpoint.demo_gguf_path()
    reference = checkpoint.resolve(None).path            # the demo's weights as safetensors
    cmd = [sys.executable, "-m", "localchat.cli", "doctor", "--fidelity", "--json", "--reference", str(reference),
           "--model"]
    good = subprocess.run(cmd + [str(demo)], capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr
    against = json.loads(good.stdout)["against_checkpoint"]
    assert against["reference"] == str(reference) and against["how"] == "named with --reference"
    assert against["top1_agreement"] >= 0.98 and against["mean_kl"] < 1e-3 and not against["problem"]

    swapped = shutil.copy(demo, tmp_path / "swapped.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(str(swapped)).tensors}
    with open(swapped, "r+b") as fh:
        for i in range(20, 30):
            q, o = tensors[f"blk.{i}.attn_q.weight"], tensors[f"blk.{i}.attn_output.weight"]
            assert q.n_bytes == o.n_bytes and q.tensor_type == o.tensor_type
            fh.seek(q.data_offset)
            qb = fh.read(int(q.n_bytes))
            fh.seek(o.data_offset)
            ob = fh.read(int(o.n_bytes))
            fh.seek(q.data_offset)
            fh.write(ob)
            fh.seek(o.data_offset)
            fh.write(qb)
    plain = [c for c in cmd if c != "--json"]
    bad = subprocess.run(plain + [str(swapped)], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "File check on the held texts" in bad.stdout          # finite, not degenerate: only the comparison sees it
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "swapped.gguf" in lines[0] and "mis-mapped conversion" in lines[0], bad.stderr


def test_doctor_reference_is_a_safetensors_checkpoint_and_goes_with_fidelity_on_a_gguf(tmp_path):
    import subprocess
    import sys
    demo = checkpoint.demo_gguf_path()
    cmd = [sys.executable, "-m", "localchat.cli", "doctor"]
    for args, says in ((["--model", str(demo), "--reference", str(demo), "--fidelity"], "not another GGUF"),
                       (["--model", str(demo), "--reference", str(tmp_path / "none")], "goes with --fidelity"),
                       (["--model", str(demo), "--fidelity", "--reference", str(tmp_path / "none")],
                        "no such file or directory")):
        r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr


def test_the_repos_a_gguf_names_are_read_from_its_metadata():
    from localchat.doctor import _named_repos
    meta = {"general.source.url": "https://huggingface.co/Qwen/Qwen3.5-2B", "general.base_model.count": 2,
            "general.base_model.0.repo_url": "https://huggingface.co/Qwen/Qwen3.5-2B",
            "general.base_model.1.url": "https://huggingface.co/Qwen/Qwen3.5-2B-Base/tree/main",
            "general.repo_url": "https://github.com/someone/something"}
    assert _named_repos(meta) == [("general.source.url", "Qwen/Qwen3.5-2B"),
                                  ("general.base_model.1.url", "Qwen/Qwen3.5-2B-Base")]
    assert _named_repos({"general.name": "x"}) == []
