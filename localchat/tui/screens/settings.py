"""Settings (F2 or /settings): theme, default temperature, max tokens and system prompt.

Save checks every field and says which one is wrong in the dialog (nothing is applied
until all are right); the app applies the result and writes these four keys to the
config file, leaving the file's other keys as they were. Esc cancels."""
from __future__ import annotations

import math
from dataclasses import replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, TextArea

from ...config import Settings

SAVED_KEYS = ("theme", "temperature", "max_tokens", "system")


class SettingsScreen(ModalScreen[Settings | None]):
    DEFAULT_CSS = """
    SettingsScreen {
        align: center middle;
    }
    SettingsScreen > VerticalScroll {
        width: 80;
        height: auto;
        max-height: 90%;
        padding: 1 2;
        border: thick $primary 60%;
        background: $surface;
    }
    SettingsScreen Label {
        margin-top: 1;
    }
    SettingsScreen #system {
        height: 6;
    }
    SettingsScreen #problem {
        color: $text-error;
        height: auto;
    }
    SettingsScreen Horizontal {
        height: auto;
        align-horizontal: right;
        margin-top: 1;
    }
    SettingsScreen Button {
        margin-left: 2;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: Settings, themes: list[str], model_temperature: float | None = None) -> None:
        """model_temperature: what the loaded model recommends (shown while the setting is empty)."""
        super().__init__()
        self.settings, self.themes, self.model_temperature = settings, themes, model_temperature

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll():
            yield Static("[b]Settings[/b] — saved to the config file")
            yield Label("Theme")
            yield Select([(t, t) for t in self.themes], value=s.theme if s.theme in self.themes else Select.BLANK,
                         allow_blank=False, id="theme")
            yield Label("Default temperature (0 = greedy; empty = the model's recommendation)")
            model = "" if self.model_temperature is None else f": {self.model_temperature:g}"
            yield Input("" if s.temperature is None else f"{s.temperature:g}", id="temperature",
                        placeholder=f"the model's{model}")
            yield Label("Max tokens per answer")
            yield Input(str(s.max_tokens), id="max-tokens")
            yield Label("System prompt (for new conversations)")
            yield TextArea(s.system or "", id="system")
            yield Static("", id="problem")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def read(self) -> Settings | str:
        """The settings as edited, or one line saying which field is wrong."""
        temperature = self.query_one("#temperature", Input).value.strip()
        max_tokens = self.query_one("#max-tokens", Input).value.strip()
        try:
            t = float(temperature) if temperature else None
            if t is not None and not (t >= 0 and math.isfinite(t)):
                raise ValueError
        except ValueError:
            return f"temperature {temperature!r}: a number, 0 or more (empty: the model's recommendation)"
        try:
            n = int(max_tokens)
            if n < 1:
                raise ValueError
        except ValueError:
            return f"max tokens {max_tokens!r}: a whole number, at least 1"
        theme = self.query_one("#theme", Select).value
        system = self.query_one("#system", TextArea).text.strip() or None
        return replace(self.settings, theme=str(theme), temperature=t, max_tokens=n, system=system)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        result = self.read()
        if isinstance(result, str):
            self.query_one("#problem", Static).update(result)
            return
        self.dismiss(result)

    def action_cancel(self) -> None:
        self.dismiss(None)
