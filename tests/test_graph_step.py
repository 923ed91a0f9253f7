"""The graph step (engine/models/graph_step.py): a GPU's one-token steps and verify passes
as one compiled function of static shapes. It is meant for CUDA graphs; here torch.compile
runs the same graph on the CPU (LOCALCHAT_GRAPH_STEP=on), so what it guarantees by
construction is checked bit for bit: a verify pass's rows are one-token steps, so greedy
speculation is plain greedy; and what it computes, against transformers' generate()."""
import pytest
import torch

import engine
from engine.session import render_prompt
from tiny import build_model

CONTEXT = 128          # the tiny model's context: short, so a test reaches its end


@pytest.fixture(scope="module")
def graph_engine(tmp_path_factory, tokenizer):
    """A tiny Qwen3 (q/k norms) in float32 with the graph step forced on; compiled once, on
    its first step (about half a minute on the 2-core machine)."""
    import torch._inductor.config as inductor
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALCHAT_GRAPH_STEP", "on")
    # inductor compiles in this thread: no pool of compile threads outlives the module
    mp.setattr(inductor, "compile_threads", 1)
    try:
        path = build_model(tmp_path_factory.mktemp("graph"), "qwen3", layers=2, tokenizer=tokenizer, seed=4,
                           max_positions=CONTEXT)
        eng = engine.open(str(path), dtype="float32", drafter="ngram", draft_tokens=4)
        yield path, eng
    finally:
        mp.undo()
    # The thread of torch's prefetch pool, which torch.compile starts, ends with the module
    # too (a module-level executor: a fresh one starts its thread only when next used).
    from concurrent.futures import ThreadPoolExecutor

    import torch.utils._functools as prefetch
    prefetch._prefetch_executor.shutdown(wait=True)
    prefetch._prefetch_executor = ThreadPoolExecutor(max_workers=2)


def test_it_runs_where_asked_and_says_so(graph_engine):
    # where asked it serves, unless its check at load found a row of a pass that is not a
    # one-token step's bits on this machine: then the eager forward runs, and it says so
    _, eng = graph_engine
    graph, note = eng.target.impl._graph, eng.describe()["graph_step"]
    if graph is None:
        assert note.startswith("the eager forward: its compiled products give row"), note
    else:
        assert graph.width == eng.max_draft + 1 and note == f"compiled, {eng.max_draft + 1} rows a pass"


def test_a_graph_whose_rows_are_not_steps_stops_serving(graph_engine, monkeypatch):
    # the check itself: a compiled pass that rounds its last row apart is refused, said, and
    # the forward's passes go back to the eager ones
    from engine.models import graph_step
    _, eng = graph_engine
    f = eng.target.impl
    graph = graph_step.GraphStep.__new__(graph_step.GraphStep)
    graph.fwd, graph.width, graph._marked, graph.refused = f, eng.max_draft + 1, None, ""
    graph._offsets = torch.arange(graph.width)

    def apart(ids, positions):              # a pass whose row 8 is not a step's row 0
        out = f._output(f._rms(f._embed(ids), f.norm))
        out[-1] += 1e-3 * (ids[0] != ids[-1])
        return out
    monkeypatch.setattr(graph, "_compiled", apart, raising=False)
    monkeypatch.setattr(f, "graph_note", "")
    with torch.inference_mode():
        assert not graph._rows_are_steps(0)
    assert graph.refused.startswith(f"its compiled products give row {graph.width - 1} of a {graph.width}-row pass")
    assert f.graph_note == f"the eager forward: {graph.refused}"
    monkeypatch.setattr(f, "_graph", graph)
    with torch.inference_mode():
        f.cache.rollback(0)
        assert f([7, 8, 9], 0, True).shape[0] == 3 and f._graph is None     # served eagerly
        f.cache.rollback(0)


def test_off_a_gpu_it_is_not_used_unless_asked(tiny_llama, monkeypatch):
    monkeypatch.delenv("LOCALCHAT_GRAPH_STEP", raising=False)
    eng = engine.open(str(tiny_llama), dtype="float32", drafter="none")
    assert eng.target.impl._graph is None and "graph_step" not in eng.describe()


def test_every_row_of_a_verify_pass_is_a_one_token_step(graph_engine):
    _, eng = graph_engine
    t = eng.target
    ids = list(range(7, 60))
    with torch.inference_mode():
        t.cache.rollback(0)
        t.forward(ids[:20])                     # a prefill: the eager forward
        at = t.cache.length
        for width in (2, 5, eng.max_draft + 1):
            t.cache.rollback(at)
            verify = t.forward(ids[20:20 + width], all_logits=True)
            t.cache.rollback(at)
            steps = torch.cat([t.forward(ids[20 + r:21 + r]) for r in range(width)])
            assert torch.equal(verify, steps), width
        t.cache.rollback(0)


def test_the_cache_takes_its_slack_when_it_reaches_the_context():
    from engine.cache import KVCache
    from engine.errors import ContextFull
    c = KVCache(1, 1, 4, torch.float32, torch.device("cpu"), capacity=16, max_positions=40)
    c.slack = 3
    c.grow_to(17)
    assert c.capacity == 32                    # doubling, short of the context
    c.grow_to(33)
    assert c.capacity == 43                    # the context and its slack at once: one more graph, not two
    c.length = 38
    with pytest.raises(ContextFull):
        c.reserve(3)                           # the slack is never committed


def test_the_last_positions_of_the_context_run_the_same_graph(graph_engine, monkeypatch):
    """The padding of a pass at the end of the context lands in the cache's slack, so the
    last positions are graph steps too, and verify rows there are one-token steps."""
    _, eng = graph_engine
    t = eng.target
    graph = t.impl._graph
    if graph is None:
        pytest.skip(f"the graph does not serve on this machine: {eng.describe()['graph_step']}")
    ran = []
    monkeypatch.setattr(graph, "_compiled", lambda *a, f=graph._compiled: ran.append(1) or f(*a))
    ids = [7 + i % 50 for i in range(CONTEXT)]
    with torch.inference_mode():
        t.cache.rollback(0)
        t.forward(ids[:CONTEXT - 5])
        at = t.cache.length
        for width in (2, 5):
            t.cache.rollback(at)
            verify = t.forward(ids[at:at + width], all_logits=True)
            t.cache.rollback(at)
            steps = torch.cat([t.forward(ids[at + r:at + r + 1]) for r in range(width)])
            assert torch.equal(verify, steps), width
        assert len(ran) == 2 + 2 + 5
        assert t.cache.length == CONTEXT and t.cache.capacity == CONTEXT + graph.width - 1
        t.cache.rollback(0)


def test_greedy_is_generate_and_speculation_changes_nothing(graph_engine):
    from transformers import AutoModelForCausalLM
    path, eng = graph_engine
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    spec = list(eng.chat().send(prompt, max_new_tokens=40))[-1]
    eng.set_drafter("none")
    try:
        plain = list(eng.chat().send(prompt, max_new_tokens=40))[-1]
    finally:
        eng.set_drafter("ngram")
    ids = torch.tensor([render_prompt(eng.tokenizer, [{"role": "user", "content": prompt}])])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
    assert list(spec.token_ids) == list(plain.token_ids) == want


def test_where_it_cannot_run_describe_says_why(tiny_llama, tmp_path, monkeypatch):
    """Asked for (as on a GPU) over int8 weights, or a streamed forward: the eager step, and
    describe() says why."""
    monkeypatch.setenv("LOCALCHAT_GRAPH_STEP", "on")
    eng = engine.open(str(tiny_llama), profile="resident-int8", drafter="none", cache_dir=tmp_path)
    assert eng.target.impl._graph is None
    assert "not plain tensors" in eng.describe()["graph_step"]
    eng = engine.open(str(tiny_llama), profile="streamed-exact", drafter="none")
    assert eng.target.impl._graph is None and "streamed" in eng.describe()["graph_step"]
