"""Where a target's weights live (how they compute is engine/models/): resident.py on the
device in the checkpoint's dtype, quantized.py int8/int4 (qweights.py the kernels, qcache.py
the cache of quantized layers), streamed.py layer by layer from RAM or disk (layer_index.py,
prefetch.py). Every target offers the same small interface:

    target.forward(ids, all_logits=False) -> float32 logits   (appends to target.cache)
    target.cache                           the KVCache (rollback moves its length)
    target.device_bytes()                  bytes it holds on the device

so the decode loop, the session and the UI do not know which kind runs."""
from .resident import ResidentTarget, load_resident

__all__ = ["ResidentTarget", "load_resident"]
