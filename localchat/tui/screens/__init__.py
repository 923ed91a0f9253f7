"""Modal screens over the chat, one per module."""
from .confirm import ConfirmScreen
from .settings import SettingsScreen
from .text_prompt import TextPromptScreen

__all__ = ["ConfirmScreen", "SettingsScreen", "TextPromptScreen"]
