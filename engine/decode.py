"""The two target calls of decoding, as small pure functions in the spirit of
gpt-fast's generate.py; the loop that uses them is in speculative.py.

    prefill(target, ids)              run the new prompt tokens, logits of the last one
    decode_one_token(target, token)   one step: feed the last token, logits of the next
"""
from __future__ import annotations

import torch


def prefill(target, ids: list[int]) -> torch.Tensor:
    return target.forward(ids)[-1]


def decode_one_token(target, token: int) -> torch.Tensor:
    return target.forward([token])[-1]
