"""A GGUF file read where it lies (engine/gguf_file.py), checked against transformers' own
reading of the same file (the demo model's import, every weight decoded to float32): each
matrix, read as the file's blocks and put back in the checkpoint's row order, is the
imported weight to the bit, and its products are those weights times x."""
import pytest
import torch
from safetensors import safe_open

from engine import checkpoint
from engine.gguf_file import GGUFWeight, dense, hf_rows
from engine.gguf_reader import read
from engine.kernels import gguf_kernel
from engine.kernels.dispatch import Pass

pytestmark = [pytest.mark.demo,
              pytest.mark.skipif(not gguf_kernel.available(), reason=f"no GGUF kernel here: {gguf_kernel.why_not()}")]


@pytest.fixture(scope="module")
def demo():
    fields, tensors = read(checkpoint.demo_gguf_path())
    imported = checkpoint.resolve(None).path            # transformers' float32 copy of the same file
    with safe_open(str(next(imported.glob("*.safetensors"))), "pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    heads = int(fields["llama.attention.head_count"])
    kv_heads = int(fields["llama.attention.head_count_kv"])
    return tensors, hf, heads, kv_heads


def test_every_matrix_is_the_imported_weight_in_the_checkpoints_row_order(demo):
    tensors, hf, heads, kv_heads = demo
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    layers = sum(1 for n in tensors if n.endswith(".attn_q.weight"))
    for i in range(layers):
        for ours, theirs in names.items():
            t = tensors[f"blk.{i}.{ours}.weight"]
            want = hf[f"model.layers.{i}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                w = GGUFWeight.of(t, rows=[hf_rows(t.shape[0], heads if ours == "attn_q" else kv_heads)]).dense()
            else:
                w = dense(t)
            assert torch.equal(w, want), (i, ours)
    embed = tensors["token_embd.weight"]
    assert embed.kind in gguf_kernel.TYPES                       # a quantized embedding, read, not dropped
    ids = torch.tensor([0, 1, 17, 49151, 17])
    assert torch.equal(GGUFWeight.of(embed).rows(ids), hf["model.embed_tokens.weight"][ids])
    assert torch.equal(dense(tensors["output_norm.weight"]), hf["model.norm.weight"])


def test_a_fused_weight_multiplies_as_its_parts(demo):
    tensors, hf, heads, kv_heads = demo
    q, k, v = (tensors[f"blk.3.attn_{n}.weight"] for n in "qkv")
    w = GGUFWeight.of(q, k, v, rows=[hf_rows(q.shape[0], heads), hf_rows(k.shape[0], kv_heads), None])
    dense = torch.cat([hf[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert w.shape == tuple(dense.shape)
    g = torch.Generator().manual_seed(0)
    for M, kind in ((1, Pass.STEP), (5, Pass.VERIFY), (40, Pass.PREFILL)):
        x = torch.randn(M, w.shape[1], generator=g)
        want = x.double() @ dense.double().t()
        got = w.mm(x, None, kind).double()
        bound = w.shape[1] * 2.0 ** -23 * (x.double().abs() @ dense.double().abs().t())
        assert ((got - want).abs() <= bound).all(), M
    x = torch.randn(5, w.shape[1], generator=g)
    assert torch.equal(w.mm(x, None, Pass.VERIFY), torch.cat([w.mm(x[r:r + 1]) for r in range(5)]))


def test_a_weight_of_mixed_formats_multiplies_as_its_parts():
    # as Q4_K_M stacks a Q4_K q/k with a Q6_K v
    g = torch.Generator().manual_seed(1)
    parts = [("Q4_K", gguf_kernel.random_blocks("Q4_K", 24, 512, g)), ("Q6_K", gguf_kernel.random_blocks("Q6_K", 8, 512, g))]
    w = GGUFWeight(parts, 512)
    dense = torch.cat([gguf_kernel.dequantize(d, kind, 512) for kind, d in parts])
    assert w.shape == (32, 512) and torch.equal(w.dense(), dense)
    x = torch.randn(3, 512, generator=g)
    assert torch.equal(w.mm(x), torch.cat([gguf_kernel.linear(x, d, kind, 512) for kind, d in parts], 1))
    ids = torch.tensor([30, 2, 24, 23])
    assert torch.equal(w.rows(ids), dense[ids])
    with pytest.raises(ValueError, match="does not hold 768 weights"):
        GGUFWeight(parts, 768)
    with pytest.raises(ValueError, match="whole number of 256-weight blocks"):
        GGUFWeight(parts, 500)
