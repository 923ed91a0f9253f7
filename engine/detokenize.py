"""Incremental detokenization for streaming.

A token can end in the middle of a UTF-8 character, and many tokenizers decide spaces
from the neighbouring tokens, so decoding tokens one at a time breaks text. Each step
decodes a short window — the tokens of the previous step plus the new ones — and emits
what the new tokens add to it, holding back a trailing replacement character (an
incomplete multi-byte sequence) until a later token completes it. The window keeps each
step O(1) however long the answer grows (decoding the whole answer every step made a
long answer quadratic). At the end, `flush` decodes the whole answer once and emits
whatever the windows missed, so the concatenation of everything emitted equals
`tokenizer.decode(ids)` of the answer."""
from __future__ import annotations


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0          # the window starts here: context for spacing decisions
        self.read = 0            # tokens up to here have been emitted
        self.emitted = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token_ids) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) <= len(before) or window.endswith("\ufffd") or not window.startswith(before):
            return ""            # nothing complete yet: wait for the next token
        delta = window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.emitted += delta
        return delta

    def flush(self) -> str:
        """At the end of an answer: whatever is left, incomplete characters included."""
        text = self._decode(self.ids)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
