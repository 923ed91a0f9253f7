"""Slash commands, typed in the message box (`/temperature 0.7`) or picked from the
command palette (Ctrl+P). One table serves both, /help and the README.

The app runs a command with `ChatApp.run_command(name, argument)`. In the palette, a
command that needs an argument can be typed whole ("temperature 0.7"); picked without
one, it puts "/name " in the message box to be completed there."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider


@dataclass(frozen=True)
class SlashCommand:
    name: str
    argument: str          # how the argument is written in help ("" = none)
    help: str
    needs_argument: bool = False


COMMANDS = (
    SlashCommand("new", "", "start a new conversation (the current one stays saved)"),
    SlashCommand("system", "TEXT", "set this conversation's system message (no text: remove it)"),
    SlashCommand("clear", "", "clear the screen and the model's context; later turns go to a new conversation"),
    SlashCommand("retry", "", "answer the last prompt again (replaces the last answer)"),
    SlashCommand("edit", "", "put the last prompt back in the box to edit and resend it"),
    SlashCommand("copy", "[N]", "copy the last answer, or its code block N, to the clipboard"),
    SlashCommand("model", "PATH_OR_REPO", "load another model (the conversation carries over)", True),
    SlashCommand("profile", "NAME", "reload the model with a profile: auto, or one `localchat doctor` lists", True),
    SlashCommand("drafter", "KIND", "speculative drafter: auto, ngram, model, mtp, none", True),
    SlashCommand("think", "[on|off]", "a thinking model reasons first (on) or answers at once (off); "
                                     "no argument: its template's default"),
    SlashCommand("temperature", "T", "sampling temperature for the next answers (0 = greedy; "
                                     "'model': the model's recommendation)", True),
    SlashCommand("stats", "", "the statistics of the last answer"),
    SlashCommand("export", "[FILE]", "write this conversation as Markdown (default: ./localchat-ID.md)"),
    SlashCommand("settings", "", "theme, default temperature, max tokens, system prompt"),
    SlashCommand("help", "", "keys and commands"),
    SlashCommand("quit", "", "leave localchat"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def parse(text: str) -> tuple[str, str] | None:
    """('name', 'argument') if the text is a slash command, else None. "//x" sends "/x"
    as a prompt (returns None); an unknown command is returned for the app to refuse."""
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//") or len(stripped) < 2:
        return None
    name, _, argument = stripped[1:].partition(" ")
    return name.lower(), argument.strip()


def help_text() -> str:
    width = max(len(f"/{c.name} {c.argument}") for c in COMMANDS)
    return "\n".join(f"/{c.name} {c.argument}".ljust(width + 2) + c.help for c in COMMANDS)


class SlashCommandProvider(Provider):
    """The slash commands in Textual's command palette."""

    async def discover(self) -> Hits:
        for c in COMMANDS:
            yield DiscoveryHit(f"/{c.name} {c.argument}".strip(), partial(self._run, c.name, ""), help=c.help)

    async def search(self, query: str) -> Hits:
        query = query.strip().removeprefix("/")
        name, _, argument = query.partition(" ")
        matcher = self.matcher(name)
        for c in COMMANDS:
            if argument and c.name == name.lower():
                # The whole command typed in the palette: run it with its argument.
                yield Hit(100, f"/{c.name} {argument}", partial(self._run, c.name, argument.strip()), help=c.help)
                continue
            score = matcher.match(c.name)
            if score > 0:
                yield Hit(score, matcher.highlight(f"/{c.name} {c.argument}".strip()),
                          partial(self._run, c.name, ""), help=c.help)

    async def _run(self, name: str, argument: str) -> None:
        app = self.app
        if BY_NAME[name].needs_argument and not argument:
            app.put_in_prompt(f"/{name} ")
            return
        await app.run_command(name, argument)
