"""The memory plan as a picture: one bar the width of the device budget, a coloured
segment per term (weights, KV cache, a hybrid's recurrent state with its turn checkpoint
and speculation's replay buffer, drafter, activations, runtime and margin) and what is
left free, with a legend of the sizes underneath.

    ██████████████████▓▓▓▓▒▒░░···························
    weights 538 MB · KV 96 MB · drafter 0 B · act 20 MB · runtime 1.1 GB · free 6.2 GB of 8.0 GB"""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ...format import human_bytes

# (label, the PlanRow fields summed, style): the order the terms are drawn in.
SEGMENTS = (
    ("weights", ("weights",), "bold #5fafff"),
    ("KV", ("kv",), "#87d787"),
    ("state", ("state",), "#5fd7af"),      # hybrids only: shown when not 0
    ("drafter", ("drafter",), "#d787d7"),
    ("act", ("activations",), "#ffaf5f"),
    ("runtime", ("runtime", "margin"), "#808080"),
)
FREE_STYLE = "#3a3a3a"


def segment_sizes(row) -> list[tuple[str, int, str]]:
    """(label, bytes, style) for each drawn term, then free = budget − total (never negative)."""
    sizes = [(label, sum(getattr(row, f) for f in fields), style) for label, fields, style in SEGMENTS]
    sizes.append(("free", max(0, row.budget - row.total), FREE_STYLE))
    return sizes


def cells(sizes: list[int], width: int) -> list[int]:
    """Split `width` cells in proportion to `sizes` (largest remainders), giving every
    non-zero term at least one cell so a small KV cache is still seen."""
    total = sum(sizes) or 1
    raw = [s * width / total for s in sizes]
    out = [max(1, int(r)) if s else 0 for r, s in zip(raw, sizes)]
    while sum(out) > width and max(out) > 1:
        out[out.index(max(out))] -= 1
    order = sorted(range(len(sizes)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    for i in order:
        if sum(out) >= width:
            break
        if sizes[i]:
            out[i] += 1
    return out


class PlanBar(Widget):
    """`row` is the chosen profile's `engine.planner.PlanRow` (None before a model loads)."""

    DEFAULT_CSS = """
    PlanBar {
        height: 2;
    }
    """

    row = reactive(None, layout=True)

    def render(self) -> Text:
        if self.row is None:
            return Text("memory plan: no model loaded", style="dim")
        sizes = segment_sizes(self.row)
        width = max(10, self.size.width)
        bar = Text(no_wrap=True)
        for (label, _, style), n in zip(sizes, cells([s for _, s, _ in sizes], width)):
            bar.append(("·" if label == "free" else "█") * n, style=style)
        legend = Text(no_wrap=True, overflow="ellipsis")
        for i, (label, size, style) in enumerate(sizes):
            if size or label in ("weights", "free"):
                if legend:
                    legend.append(" · ", style="dim")
                legend.append("■ ", style=style)
                legend.append(f"{label} {human_bytes(size)}")
        legend.append(f" of {human_bytes(self.row.budget)} budget", style="dim")
        return Text("\n").join([bar, legend])
