"""The engine gauges panel (Ctrl+G): what the engine is doing, live while tokens arrive.

    speed      prefill 412 tok/s · decode 35.8 tok/s
               ▂▃▅▆▇▇▆▇█▇▇▆            (decode tok/s over this answer)
    speculation 1.42 tok/pass · accept 48% · k 3  (predicted 1.38)
    context    ███████░░░░░░░░░░░░░  1.2k / 4096 tokens · the model's own
    memory     device 630 MB of 8.0 GB · host 1.1 GB of 31 GB
    streamed   4.4 GB/s · 31% hidden behind compute   (streamed profile only)
    plan       resident-exact on cpu
               [the memory plan bar]

The tok/s sparkline plots the speed between consecutive Stats snapshots (the engine
sends one every 0.25 s at most), not the running average, so stalls show."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from engine import Stats

from ...format import human_bytes, rate
from .plan_bar import PlanBar

SPARK_POINTS = 120      # the newest points of a long answer


def bar(used: int, total: int, width: int = 20) -> Text:
    """A text bar, filled in proportion (context used against its maximum)."""
    filled = min(width, round(width * used / total)) if total else 0
    return Text.assemble(("█" * filled, "#5fafff"), ("░" * (width - filled), "#3a3a3a"))


def where_weights_live(description: dict) -> str:
    """For a streamed model, where its weights are: the units (layers, embeddings, head
    chunks) that stay on the device, those held in host RAM, those read from disk on
    every pass — what runs from the GPU's memory and what has to come over."""
    streaming = description.get("streaming")
    if not streaming:
        return ""
    return (f"\n{'':12}weights: {streaming['resident_units']} units stay on {description.get('device', '?')} · "
            f"{streaming['host_units']} streamed from host RAM · {streaming['disk_units']} from disk · "
            f"{human_bytes(streaming['streamed_bytes_per_pass'])} a pass")


class GaugesPanel(Vertical):
    """Call `set_engine(describe, plan, host_total)` once a model is loaded,
    `start_answer()` when an answer begins and `update(stats)` for each snapshot."""

    DEFAULT_CSS = """
    GaugesPanel {
        height: auto;
        padding: 0 1;
    }
    GaugesPanel > Static {
        height: auto;
    }
    GaugesPanel > Sparkline {
        height: 2;
        margin: 0 0 0 12;
    }
    GaugesPanel > PlanBar {
        margin: 0 0 0 12;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stats: Stats | None = None
        self.speeds: list[float] = []
        self._last: tuple[int, float] | None = None   # (generated, decode_seconds) of the last snapshot
        self.plan_label = ""
        self.budget = 0
        self.host_total = 0
        self.context_max = 0
        self.context_note = ""    # why the context is that long (describe()'s context_note)

    def compose(self) -> ComposeResult:
        yield Static(id="gauge-speed-line")
        yield Sparkline([], id="gauge-speed")
        yield Static(id="gauge-figures")
        yield Static(id="gauge-plan-label")
        yield PlanBar(id="gauge-plan")

    def on_mount(self) -> None:
        self._draw()

    def set_engine(self, description: dict, plan, host_total: int) -> None:
        row = plan.row(plan.chosen) if plan is not None and plan.chosen else None
        self.budget = row.budget if row else 0
        self.host_total = host_total
        self.context_max = int(description.get("context_max") or 0)
        self.context_note = description.get("context_note") or ""
        self.plan_label = (f"{description.get('profile') or 'resident'} on {description.get('device', '?')} · "
                           f"{description.get('dtype', '')} · drafter {description.get('drafter', '?')}"
                           + where_weights_live(description))
        self.query_one(PlanBar).row = row
        self._draw()

    def start_answer(self) -> None:
        self.speeds, self._last = [], None
        self.query_one(Sparkline).data = []

    def update(self, stats: Stats) -> None:
        if self._last is not None:
            tokens = stats.generated_tokens - self._last[0]
            seconds = stats.decode_seconds - self._last[1]
            if seconds > 0 and tokens >= 0:
                self.speeds.append(tokens / seconds)
                self.query_one(Sparkline).data = self.speeds[-SPARK_POINTS:]
        self._last = (stats.generated_tokens, stats.decode_seconds)
        self.stats = stats
        self._draw()

    def _draw(self) -> None:
        s = self.stats or Stats()
        self.query_one("#gauge-speed-line", Static).update(Text.assemble(
            ("speed".ljust(12), "bold"), f"prefill {rate(s.prefill_tps)} tok/s · decode {rate(s.decode_tps)} tok/s",
            ("" if self.speeds else "  (a sparkline of decode tok/s appears while an answer streams)", "dim")))
        self.query_one("#gauge-figures", Static).update(self.figures())
        self.query_one("#gauge-plan-label", Static).update(Text.assemble(("plan".ljust(12), "bold"),
                                                                         self.plan_label or "–"))

    def figures(self) -> Text:
        s = self.stats or Stats(context_max=self.context_max)
        rows: list[tuple[str, Text | str]] = []
        if s.drafted_tokens:
            rows.append(("speculation", f"{s.tokens_per_pass:.2f} tok/pass · accept {s.acceptance:.0%} · k {s.draft_k}"
                                        f"  (predicted {s.predicted_tokens_per_pass:.2f})"))
        else:
            rows.append(("speculation", f"{s.tokens_per_pass:.2f} tok/pass · no drafts yet"
                         if s.forward_passes else "–"))
        context_max = s.context_max or self.context_max
        rows.append(("context", Text.assemble(bar(s.context_tokens, context_max),
                                              f"  {s.context_tokens} / {context_max or '?'} tokens",
                                              (f" · {self.context_note}" if self.context_note else "", "dim"))))
        device = f"device {human_bytes(s.device_bytes)}" + (f" of {human_bytes(self.budget)}" if self.budget else "")
        host = f"host {human_bytes(s.host_bytes)}" + (f" of {human_bytes(self.host_total)}" if self.host_total else "")
        rows.append(("memory", f"{device} · {host}" if self.stats else "–"))
        if s.streamed_bytes:
            rows.append(("streamed", f"{human_bytes(s.streamed_bytes)} at {s.stream_gbps:.1f} GB/s · "
                                     f"{s.stream_hidden:.0%} hidden behind compute"))
        out = Text()
        for i, (label, value) in enumerate(rows):
            if i:
                out.append("\n")
            out.append(label.ljust(12), style="bold")
            out.append(value if isinstance(value, Text) else Text(value))
        return out
