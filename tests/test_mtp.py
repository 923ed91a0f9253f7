"""`--drafter mtp`: the checkpoint's own multi-token-prediction layer drafts for Qwen3.5 and
Qwen3-Next (engine/models/mtp.py, drafters.MtpDrafter). Its proposals are what the layer
computes from the whole sequence at once (the target's final hidden states, the next
tokens' embeddings), whatever was cut back and fed since; speculation with it is plain
greedy token for token in every profile; a model without the layer is one line. Random
weights say nothing of acceptance: these tests check the mechanics."""
import subprocess
import sys

import pytest
import torch

import engine
from engine.sampling import SamplingParams
from tiny import add_mtp, build_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("mtp")
    return {kind: add_mtp(build_model(root / kind, kind, layers=4, tokenizer=tokenizer, seed=3), seed=4)
            for kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next")}


def _stats(events):
    return [e for e in events if isinstance(e, engine.Stats)][-1]


def _reference(path, history: list[int], layer, k: int) -> tuple[list[int], torch.Tensor]:
    """k drafts from the whole sequence in one pass: transformers' own model gives the final
    hidden states of positions 0..n-1, the layer reads them beside tokens 1..n on a fresh
    cache, then chains its own output."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = len(history) - 1
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([history[:n]])).last_hidden_state[0]
        embed = model.get_input_embeddings()
        cache = DynamicCache(config=layer.config)
        g = layer(embed(torch.tensor(history[1:])), hidden, torch.arange(n), cache)[-1:]
        out = []
        for j in range(k):
            out.append(int(torch.argmax(model.lm_head(g)[-1])))
            g = layer(embed(torch.tensor(out[-1:])), g, torch.tensor([n + j]), cache)
    return out, hidden


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_proposals_are_what_the_layer_computes_from_the_whole_sequence(mtp_models, kind):
    eng = engine.open(str(mtp_models[kind]), drafter="mtp", dtype="float32", draft_tokens=3)
    eng.stop_ids = frozenset()
    chat = eng.chat()
    for turn in ("Why is the sky blue?", "And the sea?"):       # the second turn cuts back and catches up
        done = list(chat.send(turn, max_new_tokens=12))[-1]
        history = list(chat.cached_ids) + [done.token_ids[-1]]
        assert eng.target.cache.length == len(history) - 1
        got, _ = eng.drafter.propose(history, 4, GREEDY, None)
        want, hidden = _reference(mtp_models[kind], history, eng.drafter.layer, 4)
        assert got == want, (turn, got, want)
        # the hook kept the target's own final hidden states, row for row
        # (the kernels' float32 sums are not transformers' order: a few ulp, grown over the layers)
        assert torch.allclose(eng.drafter.hidden[:len(history) - 1].float(), hidden, atol=2e-3, rtol=1e-3)
        # the drafted steps are dropped: the cache holds the committed pairs only
        assert eng.drafter.cache.get_seq_length() == len(history) - 1
    assert eng.describe()["drafter"] == f"mtp:{eng.name}"


@pytest.mark.parametrize("profile", ["resident-exact", "resident-int4", "streamed-exact"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_speculation_with_the_mtp_layer_is_plain_greedy(mtp_models, kind, profile, tmp_path):
    answers = []
    for drafter, k in (("none", None), ("mtp", 3), ("mtp", None)):
        eng = engine.open(str(mtp_models[kind]), drafter=drafter, profile=profile, draft_tokens=k, cache_dir=tmp_path)
        eng.stop_ids = frozenset()
        events = list(eng.chat().send("Why is the sky blue?", max_new_tokens=24))
        answers.append(list(events[-1].token_ids))
        if k:
            assert _stats(events).drafted_tokens > 0              # the layer drafted
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 24


def test_sampled_answers_with_the_mtp_layer_come_whole(mtp_models):
    eng = engine.open(str(mtp_models["qwen3_5_moe"]), drafter="mtp", draft_tokens=2)
    eng.stop_ids = frozenset()
    events = list(eng.chat().send("hi", max_new_tokens=16, temperature=0.8, seed=5))
    assert len(events[-1].token_ids) == 16 and _stats(events).drafted_tokens > 0


def test_a_model_without_the_layer_is_one_line(tmp_path, tokenizer, tiny_llama):
    bare = build_model(tmp_path / "bare", "qwen3_5", layers=4, tokenizer=tokenizer)
    with pytest.raises(engine.BadRequest, match="no mtp.. tensors"):
        engine.open(str(bare), drafter="mtp")
    with pytest.raises(engine.BadRequest, match="llama has no multi-token-prediction layer"):
        engine.open(str(tiny_llama), drafter="mtp")
    proc = subprocess.run([sys.executable, "-m", "localchat", "--model", str(bare), "--drafter", "mtp", "--no-log",
                           "hi"], capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "--drafter mtp" in err, err


def test_the_plan_counts_the_layer_beside_the_target(mtp_models):
    """Its weights (every mtp.* tensor, in the target's dtype), one attention layer's keys
    and values, and the target's hidden state of every position of the context."""
    from engine.planner import ModelShape
    path = mtp_models["qwen3_5_moe"]
    shape = ModelShape.from_checkpoint(path)
    eng = engine.open(str(path), drafter="mtp", dtype="float32", context=64)
    params = sum(p.numel() for p in eng.drafter.layer.parameters())
    assert shape.mtp_params == params > 0
    kv = 2 * shape.kv_heads * shape.head_dim * 4                  # a float32 key and value a position
    assert eng.plan.row(eng.plan.chosen).drafter == params * 4 + kv * 64 + 64 * shape.hidden * 4
    assert engine.open(str(path), drafter="ngram", context=64).plan.row("resident-exact").drafter == 0


@pytest.mark.parametrize("profile", ["resident-int8", "resident-int4"])
def test_a_quantized_target_holds_the_layer_in_its_own_format(mtp_models, profile, tmp_path):
    """Under int8 or int4 the layer's attention and experts are packed as the target's are
    (the plan counts them so: about 0.5 GB of Qwen3.5-35B-A3B's 1.7 GB layer in int4), its norms
    and fc exact; it drafts, and the answer stays plain greedy (the test above)."""
    from engine.planner import ModelShape
    from engine.targets.module_quant import PackedExperts, PackedLinear
    path = mtp_models["qwen3_5_moe"]
    eng = engine.open(str(path), drafter="mtp", profile=profile, context=64, cache_dir=tmp_path)
    block = eng.drafter.layer.model.layers[0]
    assert isinstance(block.self_attn.q_proj, PackedLinear) and isinstance(block.mlp.experts, PackedExperts)
    assert isinstance(block.mlp.shared_expert.down_proj, PackedLinear)
    assert type(eng.drafter.layer.fc) is torch.nn.Linear
    fmt = profile.removeprefix("resident-")
    assert block.self_attn.q_proj.w.__class__.__name__ == ("Int8Weight" if fmt == "int8" else "Int4Weight")
    shape = ModelShape.from_checkpoint(path)
    row = eng.plan.row(eng.plan.chosen)
    act = eng.target.cache.dtype.itemsize
    kv = 2 * shape.kv_heads * shape.head_dim * act                # a key and value a position
    packed = shape.linear_bytes(fmt, 32, shape.mtp_params)
    assert row.drafter == packed + 64 * shape.hidden * act + kv * 64
    assert packed < shape.mtp_params * act / (1.9 if fmt == "int8" else 3)
    events = list(eng.chat().send("Why is the sky blue?", max_new_tokens=12))
    assert _stats(events).drafted_tokens > 0


def test_bench_measures_the_mtp_drafter_where_the_checkpoint_has_one(mtp_models, tmp_path):
    import json
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"id": "prose", "kind": "prose", "prompt": "Why is the sky blue?"}\n')
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "localchat", "bench", "--model", str(mtp_models["qwen3_5"]),
                           "--workloads", str(wl), "-n", "16", "--runs", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "mtp tok/s" in proc.stdout
    row = json.loads(out.read_text())["workloads"][0]
    assert row["mtp"]["identical"] is True and row["ngram"]["identical"] is True
