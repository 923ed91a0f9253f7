"""Incremental detokenization for streaming.

A token can end in the middle of a UTF-8 character, and many tokenizers decide spaces
from the neighbouring tokens, so decoding tokens one by one breaks text. We decode the
whole answer so far and emit what is new, holding back a trailing replacement
character (an incomplete multi-byte sequence) until the next token completes it. The
concatenation of everything emitted equals `tokenizer.decode(ids)` of the answer."""
from __future__ import annotations


class IncrementalDecoder:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids) -> str:
        self.ids.extend(token_ids)
        text = self._decode()
        stable = text.rstrip("\ufffd")
        if not stable.startswith(self.emitted):
            # The decoder rewrote earlier text (rare: a space decided by a later token).
            # Emit only from the first difference on; what was shown stays shown.
            common = 0
            for a, b in zip(stable, self.emitted):
                if a != b:
                    break
                common += 1
            self.emitted = self.emitted[:common]
        delta = stable[len(self.emitted):]
        self.emitted = stable
        return delta

    def flush(self) -> str:
        """At the end of an answer: whatever is left, incomplete characters included."""
        text = self._decode()
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
