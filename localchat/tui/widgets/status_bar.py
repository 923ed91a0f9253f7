"""One line at the bottom: what is loaded, how fast it runs, how full the context is, memory.

    SmolLM2-135M │ prefill 377 · decode 71.7 tok/s │ 1.62 tok/pass · accept 41% · k 3 │ ctx 70/8192 │ mem …

Fed from the engine's `Stats` events while an answer streams (the engine sends one at
most every 0.25 s), so the figures move live."""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from engine import Stats

from ...format import human_bytes, rate

_SEP = " │ "


class StatusBar(Widget):
    """`model` is the engine's name, `activity` a short state ("Loading model…",
    "generating", ""), `stats` the latest engine Stats, `context_max` the window size
    known before the first answer."""

    DEFAULT_CSS = """
    StatusBar {
        height: 1;
        width: 1fr;
    }
    """

    model: reactive[str] = reactive("")
    activity: reactive[str] = reactive("")
    stats: reactive[Stats | None] = reactive(None)
    context_max: reactive[int] = reactive(0)

    def render(self) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis")
        if self.model:
            line.append(self.model, style="bold")
        if self.activity:
            if line:
                line.append(_SEP, style="dim")
            line.append(self.activity, style="italic")
        if not self.model:
            return line
        s = self.stats or Stats(context_max=self.context_max)
        if getattr(s, "backend", ""):
            return self._backend(line, s)
        if s.prefill_pending:
            # a long prompt on its way through prefill, chunk by chunk
            fields = [f"prefill {s.prefill_tokens - s.prefill_pending}/{s.prefill_tokens} · {rate(s.prefill_tps)} tok/s"]
        else:
            fields = [f"prefill {rate(s.prefill_tps)} · decode {rate(s.decode_tps)} tok/s"]
        if s.restored_tokens:
            # a conversation resumed warm: this much of its prompt came from the kept cache
            fields.append(f"{s.restored_tokens} restored")
        if s.drafted_tokens:
            # Speculative decoding at work: tokens each target pass adds, how many drafts
            # the target kept, and the draft length chosen for the last round.
            fields.append(f"{s.tokens_per_pass:.2f} tok/pass · accept {s.acceptance:.0%} · k {s.draft_k}")
        if s.streamed_bytes:
            # Streamed profile: weights arriving per second and the share hidden behind compute.
            fields.append(f"stream {s.stream_gbps:.1f} GB/s · {s.stream_hidden:.0%} hidden")
        fields += [
            f"ctx {s.context_tokens}/{s.context_max or self.context_max or '?'}",
        ]
        if self.stats is not None:
            fields.append(f"mem {human_bytes(s.device_bytes)} dev · {human_bytes(s.host_bytes)} host")
        for field in fields:
            line.append(_SEP, style="dim")
            line.append(field)
        return line

    def _backend(self, line: Text, s) -> Text:
        """An answer from --backend: time to first token and decode tok/s measured here from
        chunk arrival, and the server's own figures when it sends them."""
        fields = [f"first token {s.ttft_seconds:.2f} s · decode {rate(s.decode_tps)} tok/s"]
        if s.server_decode_tps:
            fields.append(f"server {rate(s.server_prefill_tps)} · {rate(s.server_decode_tps)} tok/s")
        if s.tokens_per_pass:
            fields.append(f"{s.tokens_per_pass:.2f} tok/pass · accept {s.acceptance:.0%} · k {s.draft_k}")
        fields.append(f"{s.prompt_tokens} prompt · {s.generated_tokens} tokens")
        for field in fields:
            line.append(_SEP, style="dim")
            line.append(field)
        return line

    @property
    def text(self) -> str:
        """The line as plain text (what tests and screen readers look at)."""
        return self.render().plain
