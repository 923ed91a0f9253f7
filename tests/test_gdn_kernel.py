"""gdn.c: a gated delta-net layer's per-token conv and recurrence in C. Each matches
transformers' reference torch function to float32 rounding, T tokens in one call are bit for
bit T one-token calls at any thread count (what a verify pass and the replay of accepted
updates rely on), arguments it does not take go to the reference, and an engine's model
calls it only inside the engine's own passes."""
import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as Q

import engine
from engine.kernels import gdn_kernel
from tiny import build_model

pytestmark = pytest.mark.skipif(bool(gdn_kernel.why_not()), reason=f"gdn.c: {gdn_kernel.why_not()}")

RULE = gdn_kernel.delta_rule(Q.torch_recurrent_gated_delta_rule)
CONV = gdn_kernel.conv_update(Q.causal_conv1d_update)


def _inputs(dtype, T=5, Hk=4, Hv=8, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, Hk, D, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, T, Hv, D, generator=g).to(dtype)
    decay = -torch.rand(1, T, Hv, generator=g)
    beta = torch.rand(1, T, Hv, generator=g).to(dtype)
    state = torch.randn(1, Hv, D, D, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l2", [True, False])
def test_rule_matches_transformers(dtype, l2):
    q, k, v, decay, beta, state = _inputs(dtype)
    for init in (state, None):
        want, want_s = Q.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=init,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=l2)
        got, got_s = RULE(q, k, v, g=decay, beta=beta, initial_state=init, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2)
        assert got.dtype == dtype and got_s.dtype == torch.float32 and got.shape == want.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), want.float(), atol=tol * want.abs().max().item())
        assert torch.allclose(got_s, want_s, atol=1e-5 * want_s.abs().max().item())
    # the committed state is read, never written (a verify pass steps from it into copies)
    assert torch.equal(state, _inputs(dtype)[5])


@pytest.mark.parametrize("T", [5, 70])
def test_a_prefills_rule_is_the_chunked_rule_token_by_token(T):
    """In a prefill gdn.c's recurrence takes the chunked rule's name (models/delta_net.py):
    the chunked rule's result to float32 rounding, across its 64-token chunks, and bit for
    bit the recurrence of one-token steps over the same tokens."""
    chunked = gdn_kernel.delta_rule(Q.torch_chunk_gated_delta_rule)
    q, k, v, decay, beta, state = _inputs(torch.float32, T=T)
    for init in (state, None):
        want, want_s = Q.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=init,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        got, got_s = chunked(q, k, v, g=decay, beta=beta, initial_state=init, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, chunk_size=64)
        assert got.shape == want.shape and got_s.shape == want_s.shape
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item())
        assert torch.allclose(got_s, want_s, atol=1e-4 * want_s.abs().max().item())
        steps, steps_s = RULE(q, k, v, g=decay, beta=beta, initial_state=init, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        assert torch.equal(got, steps) and torch.equal(got_s, steps_s)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_in_one_call_are_one_token_calls(dtype, threads):
    q, k, v, decay, beta, state = _inputs(dtype, T=7, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole, final = RULE(q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        s, rows = state, []
        for t in range(7):
            o, s = RULE(*(x[:, t:t + 1] for x in (q, k, v)), g=decay[:, t:t + 1], beta=beta[:, t:t + 1],
                        initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True)
            rows.append(o)
        x = torch.randn(1, 7, 48).to(dtype).transpose(1, 2)
        w, window = torch.randn(48, 4).to(dtype), torch.randn(1, 48, 4).to(dtype)
        one = window.clone()
        conv = CONV(x, window, w, None, "silu")
        conv_rows = torch.cat([CONV(x[:, :, t:t + 1], one, w, None, "silu") for t in range(7)], -1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.cat(rows, 1), whole) and torch.equal(s, final)
    assert torch.equal(conv_rows, conv) and torch.equal(one, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_matches_transformers_and_moves_the_window(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 40, generator=g).to(dtype).transpose(1, 2)
    w = torch.randn(40, 4, generator=g).to(dtype)
    window = torch.randn(1, 40, 4, generator=g).to(dtype)
    theirs, mine = window.clone(), window.clone()
    for act in ("silu", None):
        want = Q.causal_conv1d_update(x, theirs, w, None, act)
        got = CONV(x, mine, w, None, act)
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), want.float(), atol=tol * want.abs().max().item())
        assert torch.equal(mine, theirs)


def test_arguments_it_does_not_take_run_the_reference():
    x = torch.randn(1, 16, 1)
    w, bias, window = torch.randn(16, 4), torch.randn(16), torch.randn(1, 16, 4)
    a, b = window.clone(), window.clone()
    assert torch.equal(CONV(x, a, w, bias, "silu"), Q.causal_conv1d_update(x, b, w, bias, "silu"))
    q, k, v, decay, beta, state = _inputs(torch.float16)          # no float16 in gdn.c
    want = Q.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=state,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = RULE(q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
               use_qk_l2norm_in_kernel=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_an_engine_calls_it_inside_its_own_passes_only(tmp_path, tokenizer):
    path = build_model(tmp_path / "q", "qwen3_5", layers=4, tokenizer=tokenizer, seed=2)
    eng = engine.open(str(path), drafter="none")
    assert "in C" in eng.describe()["delta_net"]
    model = eng.target.impl.model
    layer = next(m for m in model.modules() if hasattr(m, "A_log"))
    seen = []
    layer.register_forward_pre_hook(lambda m, a: seen.append((Q.torch_recurrent_gated_delta_rule,
                                                               Q.torch_chunk_gated_delta_rule)))
    list(eng.chat().send("Why is the sky blue?", max_new_tokens=4))       # a prefill, then steps
    assert seen and all(f.__module__ != Q.__name__ for fns in seen for f in fns)
    # outside the engine's passes, transformers' own functions again
    assert Q.torch_recurrent_gated_delta_rule.__module__ == Q.__name__
    assert Q.torch_chunk_gated_delta_rule.__module__ == Q.__name__
    assert Q.causal_conv1d_update.__module__ == Q.__name__


def test_a_prefills_bf16_causal_conv_in_float32_is_transformers_conv():
    """delta_net's CONV_FN: the same causal conv in float32, rounded once to bf16, as
    transformers' bf16 conv (which also sums in float): within one bf16 rounding."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    from engine.models import delta_net
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 96, 23, generator=g).bfloat16()
    w = (torch.randn(96, 4, generator=g) * 0.5).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    ours = delta_net._float_conv(q35.causal_conv1d_fn)(x, w, b, activation="silu")
    want = q35.causal_conv1d_fn(x, w, b, activation="silu")
    assert ours.dtype == want.dtype == torch.bfloat16 and ours.shape == want.shape == x.shape
    torch.testing.assert_close(ours.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
