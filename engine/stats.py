"""Per-answer statistics: prefill and decode speed apart, tokens per pass, memory."""
from __future__ import annotations

import time

from . import hardware
from .events import Stats
from .speculative import RoundStats


class StatsTracker:
    def __init__(self, target, prompt_tokens: int, prefill_tokens: int, restored_tokens: int = 0,
                 restore_seconds: float = 0.0):
        """`restored_tokens`: of the prompt, those a resume store loaded, in `restore_seconds`."""
        self.target = target
        self.prompt_tokens = prompt_tokens
        self.prefill_tokens = prefill_tokens
        self.restored_tokens, self.restore_seconds = restored_tokens, restore_seconds
        self.prefill_seconds = 0.0
        self.prefilled = 0          # prefill tokens run so far
        self.generated = 0
        self.decode_tokens = 0      # tokens produced by decode passes (the first comes from prefill)
        self.decode_seconds = 0.0
        self.rounds = RoundStats()  # drafted / accepted counts, filled by the decode loop
        self._t0 = time.perf_counter()
        self._last_emit = 0.0
        self._stream0 = target.stream_stats() if hasattr(target, "stream_stats") else None

    def prefill_progress(self, done: int) -> None:
        """`done` of the prefill's tokens have run (a chunked prefill, on its way)."""
        self.prefilled = done
        self.prefill_seconds = time.perf_counter() - self._t0

    def prefill_done(self) -> None:
        now = time.perf_counter()
        self.prefill_seconds = now - self._t0
        self.prefilled = self.prefill_tokens
        self._t0 = now

    def pass_done(self, tokens: int, first: bool) -> None:
        now = time.perf_counter()
        self.generated += tokens
        if not first:
            self.decode_seconds += now - self._t0
            self.decode_tokens += tokens
        self._t0 = now

    def due(self, interval: float = 0.25) -> bool:
        """Live stats at most every `interval` seconds: sampling memory is not free."""
        now = time.perf_counter()
        if now - self._last_emit >= interval:
            self._last_emit = now
            return True
        return False

    def snapshot(self) -> Stats:
        t = self.target
        dev = hardware.device_allocated(t.device)
        stream = {}
        if self._stream0 is not None:
            d = t.stream_stats().minus(self._stream0)
            stream = dict(streamed_bytes=d.streamed_bytes, stream_seconds=d.load_seconds, stream_gbps=d.gbps,
                          stream_hidden=d.hidden, pass_seconds=d.pass_seconds / d.passes if d.passes else 0.0,
                          bound_pass_seconds=t.bound_pass_seconds(),
                          compute_threads=t.split.short if getattr(t, "split", None) else "",
                          expert_bytes=d.expert_bytes)
        return Stats(**stream,
            prompt_tokens=self.prompt_tokens,
            prefill_tokens=self.prefill_tokens,
            restored_tokens=self.restored_tokens,
            restore_seconds=self.restore_seconds,
            prefill_pending=self.prefill_tokens - self.prefilled if self.prefilled else 0,
            prefill_seconds=self.prefill_seconds,
            prefill_tps=self.prefilled / self.prefill_seconds if self.prefill_seconds else 0.0,
            generated_tokens=self.generated,
            decode_seconds=self.decode_seconds,
            decode_tps=self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            forward_passes=self.rounds.rounds,
            tokens_per_pass=self.decode_tokens / self.rounds.rounds if self.rounds.rounds else 0.0,
            drafted_tokens=self.rounds.drafted,
            accepted_tokens=self.rounds.accepted,
            acceptance=self.rounds.accepted / self.rounds.drafted if self.rounds.drafted else 0.0,
            draft_k=self.rounds.k,
            predicted_tokens_per_pass=self.rounds.expected_tokens_per_pass(),
            context_tokens=t.cache.length,
            context_max=t.max_positions,
            device_bytes=dev if dev is not None else t.device_bytes(),
            host_bytes=hardware.host_rss(),
            peak_host_bytes=hardware.peak_host_rss(),
        )
