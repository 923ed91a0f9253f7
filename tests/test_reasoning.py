"""A thinking model's reasoning, told apart from its answer: the splitter on text cut
anywhere; the published templates of Qwen3 (the model opens the block) and Qwen3.5 (the
prompt opens it), tests/templates/; and the engine, one-shot, serve and the chat UI on a
tiny random model with Qwen3.5's template (an empty block when enable_thinking is false)."""
import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import engine
from engine.reasoning import Splitter, open_at_end, thinks
from serving import Server
from tiny import build_model

TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE = (TEMPLATES / "qwen3_5.jinja").read_text()       # Qwen3.5's, as published


def split(chunks, inside=False):
    s = Splitter(inside)
    pieces = [p for c in chunks for p in s.push(c)] + s.flush()
    return pieces, s.reasoning, s.answer


@pytest.mark.parametrize("cut", range(1, 12))
def test_tags_are_found_wherever_the_text_is_cut(cut):
    text = "<think>\nFirst, 2 + 2.\n</think>\n\nIt is 4."
    chunks = [text[i:i + cut] for i in range(0, len(text), cut)]
    pieces, reasoning, answer = split(chunks)
    assert (reasoning, answer) == ("First, 2 + 2.\n", "It is 4.")
    assert "".join(t for r, t in pieces if r) == reasoning and "".join(t for r, t in pieces if not r) == answer


def test_a_block_the_prompt_opened_and_text_that_only_looks_like_a_tag():
    assert split(["Let me see.</think>", "\n\nYes."], inside=True)[1:] == ("Let me see.", "Yes.")
    assert split(["a < b and <b>bold</b>"])[1:] == ("", "a < b and <b>bold</b>")
    assert split(["Done. Then <think>x</think>"])[1:] == ("", "Done. Then <think>x</think>")   # mid-answer: text
    assert split(["cut off mid-<th"], inside=True)[1:] == ("cut off mid-<th", "")             # flushed at the end
    assert open_at_end("…<|im_start|>assistant\n<think>\n") and not open_at_end("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name,opened", [("qwen3", False), ("qwen3_5", True)])
def test_the_published_templates_open_the_block_where_their_models_expect_it(tokenizer, name, opened):
    import copy
    from engine.session import render_text
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    assert thinks(tok)
    msgs = [{"role": "user", "content": "2 + 2?"}]
    default, _ = render_text(tok, msgs)
    off, _ = render_text(tok, msgs, thinking=False)
    assert open_at_end(default) == opened and not open_at_end(off) and off.endswith("<think>\n\n</think>\n\n")
    # what each model writes after its prompt, split as the template means it
    written = ("" if opened else "<think>\n") + "Two and two.\n</think>\n\nFour."
    _, thought, answer = split([written[:9], written[9:]], inside=open_at_end(default))
    assert (thought.strip(), answer) == ("Two and two.", "Four.")
    # an earlier turn as the engine keeps it (the model's text whole): the template decides
    # how its reasoning goes back; both render it in its block again, the answer after it
    turns = msgs + [{"role": "assistant", "content": written.removeprefix("<think>\n")},
                    {"role": "user", "content": "and 3 + 3?"}]
    again = render_text(tok, turns)[0]
    assert "<think>\nTwo and two.\n</think>\n\nFour.<|im_end|>" in again


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tokenizer):
    from transformers import AutoTokenizer
    path = build_model(tmp_path_factory.mktemp("thinker"), "qwen3", tokenizer=tokenizer, seed=4)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def test_the_engine_streams_reasoning_apart_and_enable_thinking_reaches_the_template(thinker):
    eng = engine.open(str(thinker), dtype="float32", drafter="none")
    assert thinks(eng.tokenizer)
    chat = eng.chat()
    events = list(chat.send("what is 2 + 2?", max_new_tokens=12))
    deltas = [e for e in events if isinstance(e, engine.TextDelta)]
    done = events[-1]
    whole = eng.tokenizer.decode(list(done.token_ids), skip_special_tokens=True)
    # the random model never closes the block the prompt opened: all of it is reasoning
    assert deltas and all(d.reasoning for d in deltas)
    assert done.text == "" and done.reasoning == whole.strip() and "".join(d.text for d in deltas) == whole.lstrip("\n")
    chat = eng.chat()
    chat.thinking = False                               # the template writes an empty, closed block
    events = list(chat.send("what is 2 + 2?", max_new_tokens=12))
    done = events[-1]
    assert not any(e.reasoning for e in events if isinstance(e, engine.TextDelta))
    assert done.reasoning == "" and done.text == eng.tokenizer.decode(list(done.token_ids), skip_special_tokens=True)


def run_cli(model, *args):
    return subprocess.run([sys.executable, "-m", "localchat", "--model", str(model), "--drafter", "none",
                           "--no-log", "-n", "8", *args], capture_output=True, text=True, timeout=240)


def test_one_shot_prints_the_answer_and_the_reasoning_only_when_asked(thinker):
    plain = run_cli(thinker, "hi")                      # all reasoning, no answer: said, not silent
    assert plain.returncode == 0 and plain.stdout.strip() == "", plain.stderr
    assert "ended within the model's reasoning" in plain.stderr and "--show-thinking" in plain.stderr
    shown = run_cli(thinker, "--show-thinking", "hi")
    assert shown.returncode == 0 and shown.stdout.strip() and "<think>" not in shown.stdout, shown.stderr
    record = json.loads(run_cli(thinker, "--json", "hi").stdout)
    assert record["text"] == "" and record["reasoning"] == shown.stdout.strip()
    answer = run_cli(thinker, "--no-think", "hi")
    assert answer.returncode == 0 and answer.stdout.strip() and "reasoning" not in answer.stderr


def test_serve_returns_reasoning_content_apart_streamed_and_whole(thinker):
    server = Server(thinker)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "hi"}]
        whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=8)
        message = whole.choices[0].message
        assert message.content == "" and message.reasoning_content.strip()
        streamed = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, stream=True)
        parts = [c.choices[0].delta for c in streamed if c.choices]
        got = "".join(getattr(d, "reasoning_content", None) or "" for d in parts)
        assert got.strip() == message.reasoning_content and not "".join(d.content or "" for d in parts)
        off = client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
        with pytest.raises(openai.BadRequestError, match="enable_thinking"):
            client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": "yes"}})
        # the Responses API: the reasoning is an item of its own, before any message
        r = client.responses.create(model=model, input="hi", max_output_tokens=8)
        (item,) = r.output
        assert item.type == "reasoning" and item.content[0].text.strip() == message.reasoning_content
        assert r.usage.output_tokens_details.reasoning_tokens == 8 and r.output_text == ""
        events = list(client.responses.create(model=model, input="hi", max_output_tokens=8, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta").strip() == \
            message.reasoning_content
    finally:
        server.stop()


def test_the_chat_ui_folds_the_reasoning_above_the_answer_and_keeps_it_in_history(thinker, tmp_path):
    import asyncio

    from localchat.config import Settings
    from localchat.tui.app import ChatApp
    from localchat.tui.widgets import AssistantMessage
    from tui_helpers import SIZE, loader, type_and_send, wait_for
    from localchat import history
    from localchat.tui.store import ChatStore
    eng = engine.open(str(thinker), dtype="float32", drafter="none")
    db = history.History.open(tmp_path / "history.db")

    async def main():
        app = ChatApp(loader(eng), Settings(max_tokens=8), ChatStore(db))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.chat is not None, what="the model to load")
            await type_and_send(pilot, "what is 2 + 2?")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.generating, what="the answer")
            done = app.chat.last_done
            reply = app.query(AssistantMessage).first()
            # all 8 tokens were reasoning (the block never closed): folded, its count in the title
            assert done.reasoning and reply.reasoning.strip() == done.reasoning and reply.text == done.text == ""
            block = reply.reasoning_block
            assert block.collapsed and block.title.startswith("Thought for ") and "8 tokens" in block.title
            await pilot.click(block.query_one("CollapsibleTitle"))
            await pilot.pause()
            assert not block.collapsed
            # /think off: the template closes an empty block, and the model answers at once
            await type_and_send(pilot, "/think off")
            await pilot.pause()
            assert app.chat.thinking is False
            await type_and_send(pilot, "and 3 + 3?")
            await wait_for(pilot, lambda: not app.generating and len(app.query(AssistantMessage)) == 2,
                           what="the second answer")
            await wait_for(pilot, lambda: app.chat.last_done.text, what="the answer text")
            assert app.chat.last_done.reasoning == "" and not app.query(AssistantMessage).last().reasoning
            cid = app.store.cid
        saved = db.get(cid).messages
        assert [m.reasoning for m in saved if m.role == "assistant"] == [done.reasoning, None]
        assert "<summary>Reasoning</summary>" in history.to_markdown(db.get(cid))
        # resumed: the saved reasoning is shown folded, without seconds
        app = ChatApp(loader(eng), Settings(max_tokens=8), ChatStore(db), resume=cid)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: len(app.query(AssistantMessage)) == 2, what="the resumed conversation")
            first = app.query(AssistantMessage).first()
            assert first.reasoning == done.reasoning and first.reasoning_block.collapsed
            assert first.reasoning_block.title == "Reasoning"
    asyncio.run(main())
    db.close()


def test_a_backend_s_reasoning_stays_apart_in_the_one_shot(thinker):
    """`--backend` on a server that sends reasoning_content (localchat serve here, as vLLM
    and llama-server do): the one-shot prints the answer only, and the reasoning on request."""
    server = Server(thinker)
    try:
        base = [sys.executable, "-m", "localchat", "--backend", server.url, "--no-log", "-n", "8"]
        plain = subprocess.run(base + ["hi"], capture_output=True, text=True, timeout=120)
        assert plain.returncode == 0 and plain.stdout.strip() == "", plain.stderr
        assert "ended within the model's reasoning" in plain.stderr
        shown = subprocess.run(base + ["--show-thinking", "hi"], capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and shown.stdout.strip(), shown.stderr
        off = subprocess.run(base + ["--no-think", "hi"], capture_output=True, text=True, timeout=120)
        assert off.returncode == 0 and off.stdout.strip() and "reasoning" not in off.stderr, off.stderr
    finally:
        server.stop()
