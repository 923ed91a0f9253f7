"""The decode loop, as small pure functions in the spirit of gpt-fast's generate.py.

    prefill(target, ids)              run the new prompt tokens, logits of the last one
    decode_one_token(target, token)   one step: feed the last token, logits of the next
    decode(target, first, ...)        the loop: yields the tokens each target pass adds

`decode` yields a list per target pass so that a speculative round (several tokens for
one verify pass) is a drop-in replacement for `decode_one_token`'s single token."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from .sampling import SamplingParams, next_token


def prefill(target, ids: list[int]) -> torch.Tensor:
    return target.forward(ids)[-1]


def decode_one_token(target, token: int) -> torch.Tensor:
    return target.forward([token])[-1]


def decode(target, first_logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           max_new_tokens: int, stop_ids: frozenset[int],
           cancel: threading.Event | None = None) -> Iterator[list[int]]:
    """Yield the tokens of each pass until a stop token, max_new_tokens, or cancel.
    The first token comes from the prefill's logits; a stop token is yielded too
    (the caller decides not to show it). The last token is never fed back: the
    cache holds everything but it, so the next turn's prefill starts with it."""
    token = next_token(first_logits, params, gen)
    yield [token]
    produced = 1
    while produced < max_new_tokens and token not in stop_ids:
        if cancel is not None and cancel.is_set():
            return
        token = next_token(decode_one_token(target, token), params, gen)
        produced += 1
        yield [token]
