"""Chat.restore: a conversation put back from saved messages answers as if it had
been held in memory all along (what resuming a saved conversation relies on)."""
import pytest

import engine


def answer(chat, text):
    return [e for e in chat.send(text, max_new_tokens=12) if isinstance(e, engine.Done)][0]


def test_restored_chat_sees_the_saved_conversation(tiny_llama):
    """Two turns live, then the same messages restored into a fresh chat: the model is
    prompted with exactly the saved conversation (rendered by the chat template) plus the
    new prompt, and a retry (restore without the last exchange, send again) reproduces
    the answer token for token (greedy)."""
    from engine.session import render_prompt
    eng = engine.open(str(tiny_llama))
    live = eng.chat(system="Be brief.")
    answer(live, "hello")
    answer(live, "why is the sky blue?")
    saved = [dict(m) for m in live.messages]

    resumed = eng.chat()
    resumed.restore(saved)
    first = answer(resumed, "and tea?")
    expected = render_prompt(eng.tokenizer, saved + [{"role": "user", "content": "and tea?"}])
    assert resumed.cached_ids[:len(expected)] == expected
    resumed.restore(resumed.messages[:-2])
    assert resumed.messages == saved
    assert answer(resumed, "and tea?").token_ids == first.token_ids


def test_restore_refuses_malformed_messages(tiny_llama):
    """A message without a known role or text content is refused with its index."""
    chat = engine.open(str(tiny_llama)).chat()
    with pytest.raises(engine.BadRequest, match="message 1"):
        chat.restore([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
