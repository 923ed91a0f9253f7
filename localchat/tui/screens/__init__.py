"""Modal screens over the chat, one per module."""
from .confirm import ConfirmScreen
from .context_full import ContextFullScreen
from .settings import SettingsScreen
from .text_prompt import TextPromptScreen

__all__ = ["ConfirmScreen", "ContextFullScreen", "SettingsScreen", "TextPromptScreen"]
