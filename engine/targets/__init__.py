"""How the target's weights live. Every target offers the same small interface:

    target.forward(ids, all_logits=False) -> float32 logits   (appends to target.cache)
    target.cache                           the KVCache (rollback moves its length)
    target.device_bytes()                  bytes it holds on the device

so the decode loop, the session and the UI do not know which kind runs."""
from .resident import ResidentTarget, load_resident

__all__ = ["ResidentTarget", "load_resident"]
