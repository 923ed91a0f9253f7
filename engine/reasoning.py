"""A thinking model's reasoning, told apart from its answer as it streams.

Models whose chat template writes `<think>…</think>` (Qwen3, Qwen3.5, Qwen3-Next-Thinking,
DeepSeek-R1 distills) reason first, then answer. The template decides where the reasoning
starts: Qwen3 lets the model open `<think>` itself, Qwen3.5 and the R1 distills open it at
the end of the prompt, and Qwen3 with `enable_thinking=False` writes an empty block there,
so the answer starts at once. So the split starts inside the reasoning exactly when the
rendered prompt ends with the block open.

The tags are in neither part. Text that might be the start of a tag is held back until the
next piece tells which it is, so a tag split across tokens is still found."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(tokenizer) -> bool:
    """Whether the model's chat template has reasoning blocks."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):                    # named templates: the default one
        template = template.get("default") or next(iter(template.values()), "")
    return isinstance(template, str) and OPEN in template and CLOSE in template


def open_at_end(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a reasoning block open for the model to continue."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class Splitter:
    """Feed decoded text; get (is_reasoning, text) pieces in order, the tags removed."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.held = ""
        self.reasoning = ""
        self.answer = ""
        self.seen_close = False

    def push(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        buf = self.held + text
        self.held = ""
        while buf:
            tag = CLOSE if self.inside else OPEN
            at = buf.find(tag)
            if at >= 0:
                self._emit(out, buf[:at])
                buf = buf[at + len(tag):]
                if self.inside:
                    self.seen_close = True
                elif self.answer.strip():
                    self._emit(out, tag)          # a tag after the answer began is text
                    continue
                self.inside = not self.inside
                continue
            keep = _partial_tag_suffix(buf, tag)
            self._emit(out, buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            break
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        self._emit(out, self.held)
        self.held = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if self.inside and not self.reasoning:
            text = text.lstrip("\n")          # the template's newline after <think>
        if not text:
            return
        if not self.inside and not self.answer and self.seen_close:
            text = text.lstrip("\n")          # blank lines between the reasoning and the answer
            if not text:
                return
        if self.inside:
            self.reasoning += text
        else:
            self.answer += text
        if out and out[-1][0] == self.inside:
            out[-1] = (self.inside, out[-1][1] + text)
        else:
            out.append((self.inside, text))


def _partial_tag_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
