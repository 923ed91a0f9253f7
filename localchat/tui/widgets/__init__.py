"""The TUI's widgets, one per module (as in Textual's own widgets)."""
from .assistant_message import AssistantMessage
from .conversation import Conversation
from .notice import Notice
from .status_bar import StatusBar
from .user_message import UserMessage

__all__ = ["AssistantMessage", "Conversation", "Notice", "StatusBar", "UserMessage"]
