"""Hybrid models with quantized weights (targets/module_quant.py): transformers' own
modules over packed int8/int4 matrices, built layer by layer from the checkpoint. The
logits are what the definition says (the exact model over quantize->dequantize weights),
every matrix of both layer kinds and every expert is quantized, the conv windows,
recurrent states and norms keep their own dtypes, and the disk cache serves a second start."""
import pytest
import torch
from torch import nn

import engine
from engine.cache import RecurrentCache
from engine.kernels.dispatch import Pass
from engine.targets import qweights
from engine.targets.module_quant import PackedExperts, PackedLinear
from engine.targets.quantized import load_quantized
from engine.targets.resident import ResidentTarget, load_resident
from tiny import build_model

CPU = torch.device("cpu")
KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_vl", "lfm2"]


@pytest.fixture(scope="module", params=KINDS)
def hybrid(request, tmp_path_factory, tokenizer):
    return build_model(tmp_path_factory.mktemp(request.param), request.param, layers=4, tokenizer=tokenizer, seed=3)


def _round_trip(w: torch.Tensor, fmt: str) -> torch.Tensor:
    return qweights.dequantize(qweights.quantize(w, fmt, 32, torch.float32)).to(w.dtype)


def dequantized_reference(path, fmt: str) -> ResidentTarget:
    """The exact model with each matrix the quantized target packs replaced by its
    quantize->dequantize round trip (int4 keeps a matrix it cannot take, as the target does),
    and the output head (a tied table with it) in int8."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for m in layer.modules():
                if isinstance(m, nn.Linear) and (fmt != "int4" or qweights.int4_problem(
                        m.out_features, m.in_features, 32) is None):
                    m.weight.copy_(_round_trip(m.weight, fmt))
                if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
                    for e in range(m.gate_up_proj.shape[0]):     # quantization is per row: fusing changes nothing
                        m.gate_up_proj[e].copy_(_round_trip(m.gate_up_proj[e], fmt))
                        m.down_proj[e].copy_(_round_trip(m.down_proj[e], fmt))
        model.lm_head.weight.copy_(_round_trip(model.lm_head.weight, "int8"))     # the head: int8 per channel
    return ResidentTarget(model, CPU, torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_logits_match_their_definition(hybrid, tmp_path, fmt):
    ids = list(range(3, 70))
    q = load_quantized(hybrid, CPU, fmt, act_dtype=torch.float32, cache_dir=tmp_path)
    assert isinstance(q.cache, RecurrentCache) and q.kind == "transformers" and not q.quant.cache_hit
    layers = q.impl.model.model.layers
    # Every matrix of both layer kinds is packed (and every expert, for Qwen3-Next): none
    # is left as a float nn.Linear but the few-row gates int4 cannot take.
    packed = [m for layer in layers for m in layer.modules() if isinstance(m, (PackedLinear, PackedExperts))]
    dense = [m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
    assert packed and all(fmt == "int4" and m.out_features < 16 for m in dense)
    mixer = getattr(layers[0], "linear_attn", None) or layers[0].conv      # the recurrent layer kind
    assert any(isinstance(m, PackedLinear) for m in mixer.modules())
    got = q.forward(ids, all_logits=True)
    want = dequantized_reference(hybrid, fmt).forward(ids, all_logits=True)
    # Same weights, plain float32 arithmetic: only the kernels' summation order differs
    # (each ~1e-7, grown through four layers of a random model; a wrong matrix anywhere
    # moves the logits by their whole spread).
    assert float((got - want).abs().max() / want.std()) < 1e-3
    # One-token steps after the prefill run the recurrent rule on the same state.
    q.cache.rollback(0)
    q.forward(ids[:-1])
    step = q.forward(ids[-1:])
    assert float((step[0] - got[-1]).abs().max() / want.std()) < 1e-3
    # The second start reads the disk cache and computes the same logits.
    again = load_quantized(hybrid, CPU, fmt, act_dtype=torch.float32, cache_dir=tmp_path)
    assert again.quant.cache_hit
    assert torch.equal(again.forward(ids, all_logits=True), got)


def test_bf16_activations_quantized_embeddings_and_size(hybrid, tmp_path):
    exact = load_resident(hybrid, CPU, torch.float32)
    for embeddings in (False, True):
        q = load_quantized(hybrid, CPU, "int4", act_dtype=torch.bfloat16, cache_dir=tmp_path, embeddings=embeddings)
        assert q.dtype == torch.bfloat16 and q.cache.k[0].dtype == torch.bfloat16
        # the recurrent states stay float32 in a bf16 model, as transformers keeps them (an
        # LFM2 short-conv layer has only its conv window, in the model's dtype)
        q.forward(list(range(3, 20)))
        states = [s.layer.recurrent_states[0] for s in q.cache.states]
        assert all(t.dtype == torch.float32 for t in states if t is not None)
        assert {s.layer.conv_states[0].dtype for s in q.cache.states} == {torch.bfloat16}
        assert q.weight_bytes() < exact.weight_bytes() * (0.5 if embeddings else 0.6)


def test_profiles_through_open(hybrid, tmp_path):
    """engine.open runs a hybrid's int8 and int4 profiles as a user gets them: a chat of
    several turns carries the recurrent state over (each turn prefills only its new
    tokens), and answers what the target decodes from scratch on the same tokens."""
    for profile in ("resident-int8", "resident-int4"):
        eng = engine.open(str(hybrid), drafter="none", profile=profile, cache_dir=tmp_path)
        assert eng.plan.chosen == profile and eng.target.quant.weights == profile.split("-")[1]
        chat = eng.chat()
        for i, turn in enumerate(("Hello there.", "Why is the sky blue?", "Thanks, bye.")):
            done = list(chat.send(turn, max_new_tokens=12))[-1]
            assert done.reason in ("length", "stop") and done.token_ids
            if i:
                assert chat.last_stats.prefill_tokens < chat.last_stats.prompt_tokens


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_only_steps_and_verify_passes_take_lone_rows(hybrid, tmp_path, monkeypatch, fmt):
    """A packed matrix's product asks for lone rows (each row as a one-token step computes
    it: the matrix-vector kernels) in one-token steps and verify passes, whose rows
    speculation compares, and not in a prefill, which takes the GEMM path: the same logits
    as a prefill in lone rows, up to the order of float32 sums."""
    q = load_quantized(hybrid, CPU, fmt, act_dtype=torch.float32, cache_dir=tmp_path)
    asked = []
    for cls in (qweights.Int8Weight, qweights.Int4Weight):
        real = cls.mm

        def mm(self, x, bias=None, kind=Pass.STEP, real=real):
            asked.append((x.shape[0], kind is not Pass.PREFILL))
            return real(self, x, bias, kind)
        monkeypatch.setattr(cls, "mm", mm)
    ids = list(range(3, 43))
    prefill = q.forward(ids[:30])
    assert asked and all(not lone for rows, lone in asked if rows > 1)
    asked.clear()
    q.forward(ids[30:31])
    assert asked and all(lone and rows == 1 for rows, lone in asked)
    asked.clear()
    verify = q.forward(ids[31:], all_logits=True)
    assert asked and all(lone for rows, lone in asked)
    assert verify.shape[0] == 9
    # The same prefill with every product in lone rows: the GEMM sums in another order,
    # nothing more (a tolerance as test_logits_match_their_definition's).
    for m in q.impl.model.modules():
        if isinstance(m, PackedLinear):
            m.row_passes = None
    q.cache.rollback(0)
    lone = q.forward(ids[:30])
    assert float((lone - prefill).abs().max() / lone.std()) < 1e-3
