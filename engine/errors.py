"""Errors the engine raises for bad input. Each message names the file, model or
setting at fault and what to do, so the app can show it as one line."""


class EngineError(Exception):
    """Base class: the message is meant for the user as it is."""


class ModelNotFound(EngineError):
    """The model path, repo id or demo model could not be found."""


class CheckpointError(EngineError):
    """A checkpoint exists but is unreadable: missing config, truncated or corrupt weights."""


class BadWeights(CheckpointError):
    """The weights read, but hold NaN or inf: no retry helps, the model must be replaced."""


class UnsupportedModel(EngineError):
    """The checkpoint's architecture is not one this engine can run."""


class BadRequest(EngineError):
    """A request to the engine is invalid (empty prompt, max_new_tokens <= 0, ...)."""


class ContextFull(EngineError):
    """The conversation no longer fits the model's context window."""
