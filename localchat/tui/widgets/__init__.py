"""The TUI's widgets, one per module (as in Textual's own widgets)."""
from .assistant_message import AssistantMessage
from .conversation import Conversation
from .gauges import GaugesPanel
from .notice import Notice
from .plan_bar import PlanBar
from .prompt_input import PromptInput
from .sidebar import Sidebar
from .status_bar import StatusBar
from .user_message import UserMessage

__all__ = ["AssistantMessage", "Conversation", "GaugesPanel", "Notice", "PlanBar", "PromptInput", "Sidebar",
           "StatusBar", "UserMessage"]
