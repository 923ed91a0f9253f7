"""The two target calls of decoding, as small pure functions in the spirit of
gpt-fast's generate.py; the loop that uses them is in speculative.py.

    prefill(target, ids)              run the new prompt tokens, logits of the last one
    prefill_chunks(target, ids)       the same in chunks, for progress and cancelling between them
    decode_one_token(target, token)   one step: feed the last token, logits of the next ([1, vocab])

A prefill runs in chunks of at most PREFILL_CHUNK tokens: its activations (and attention
scores over the context) are bounded by a chunk, which the planner counts, and an answer
can be stopped, or report progress, between two chunks. A streamed target moves every
weight once a pass, so it takes chunks eight times wider (its `prefill_chunk`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .planner import PREFILL_CHUNK


def prefill(target, ids: list[int]) -> torch.Tensor:
    logits = None
    for _, logits in prefill_chunks(target, ids):
        pass
    return logits


def prefill_chunks(target, ids: list[int]) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(tokens run so far, None) after each chunk but the last, then (len(ids), logits of
    the last token). The caller may stop between chunks: the cache then holds what ran."""
    step = getattr(target, "prefill_chunk", PREFILL_CHUNK)
    for a in range(0, len(ids), step):
        out = target.forward(ids[a:a + step])
        if a + step >= len(ids):
            yield len(ids), out[-1]
        else:
            yield a + step, None


def decode_one_token(target, token: int) -> torch.Tensor:
    """The logits of the next token, [1, vocab] as the target returns them (no indexing: a
    torch operation after a pass starts cold, layer_kernel.py says why)."""
    return target.forward([token])
