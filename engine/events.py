"""What `Chat.send` yields: text as it is decoded, live statistics, and the end of an answer."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict


@dataclass(frozen=True)
class TextDelta:
    """New text. For a model without reasoning blocks, the concatenation of all deltas of an
    answer equals `tokenizer.decode(answer_ids, skip_special_tokens=True)`. A thinking
    model's reasoning comes as deltas with `reasoning` set (engine/reasoning.py): those
    concatenated are Done.reasoning, the others Done.text, and the tags are in neither."""
    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class Stats:
    """A snapshot of the answer's statistics, sent live during decoding and once at the end."""
    prompt_tokens: int = 0          # tokens in the rendered conversation, this turn
    prefill_tokens: int = 0         # tokens actually run through prefill (the rest came from the cache)
    restored_tokens: int = 0        # of the rest, those read from the resume store (a conversation resumed warm)
    restore_seconds: float = 0.0    # ... and the time that took (before the prefill: time to first token is both)
    prefill_pending: int = 0        # of those, the ones not run yet (a long prefill on its way, chunk by chunk)
    prefill_seconds: float = 0.0
    prefill_tps: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_tps: float = 0.0
    forward_passes: int = 0         # target passes during decoding
    tokens_per_pass: float = 0.0     # tokens added per target pass while decoding
    drafted_tokens: int = 0         # speculative decoding: tokens the drafter proposed
    accepted_tokens: int = 0        # ... and the target kept
    acceptance: float = 0.0
    draft_k: int = 0                # the draft length of the last round
    predicted_tokens_per_pass: float = 0.0   # (1 - a^(k+1)) / (1 - a) over the rounds run
    context_tokens: int = 0         # tokens held in the KV cache
    context_max: int = 0
    device_bytes: int = 0           # bytes the engine holds on the device (weights + KV cache)
    host_bytes: int = 0             # resident set size of this process
    peak_host_bytes: int = 0
    # Streamed profile only (zero otherwise): weights moved to the device during this answer.
    streamed_bytes: int = 0         # bytes read from host RAM or disk
    stream_seconds: float = 0.0     # time the reader spent moving them
    stream_gbps: float = 0.0        # streamed_bytes / stream_seconds
    stream_hidden: float = 0.0      # share of that time hidden behind compute (0..1)
    pass_seconds: float = 0.0       # mean seconds of a target pass
    bound_pass_seconds: float = 0.0  # the transfer bound of a pass: streamed bytes / tier bandwidth
    compute_threads: str = ""       # how many threads one-token steps ran on, and why (CPU only)
    expert_bytes: int = 0           # a streamed mixture: routed experts read from the files' mapping

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Done:
    """The answer ended. reason: stop (end-of-sequence token), length (max tokens),
    cancelled (Chat.cancel), error (message in `error`)."""
    reason: str
    token_ids: tuple[int, ...] = field(default=())
    text: str = ""
    error: str = ""
    bad_weights: bool = False       # the error is the checkpoint's (non-finite weights): nothing to retry
    reasoning: str = ""             # a thinking model's reasoning, apart from `text` (the answer)
    # the calls the answer made ({"name", "arguments": dict}, ...), `text` then what came before them
    tool_calls: tuple = ()
    tool_error: str = ""            # text that began a call but is not one (it stays in `text`)
    reasoning_tokens: int = 0       # of token_ids, those written inside the reasoning (to the pass)
