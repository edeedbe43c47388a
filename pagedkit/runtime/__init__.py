"""pagedkit.runtime: InferenceSession (ONNX on torch, CPU or CUDA) and the KV block manager.

The engine (pagedkit.engine) and the apps (pagedkit.apps) sit above this layer; their old paths under
pagedkit.runtime (pagedkit.runtime.engine, .serve, .bench, .cli) are deprecated aliases (moved.py).
The names below are imported on first use, so that `pagedkit.runtime.lite` (CPU generation without torch)
can be imported without torch.
"""

from importlib import import_module

from . import moved as _moved

_moved.install()

_WHERE = {"KVCacheExhausted": ".kv.cache", "KVCacheManager": ".kv.cache", "GroupConfig": ".kv.config",
          "KVCacheConfig": ".kv.config", "LayerCacheSpec": ".kv.config", "StepPlan": ".kv.plan",
          "InferenceSession": ".session", "NodeArg": ".session", "SessionOptions": ".session"}

__all__ = [
    "GroupConfig", "InferenceSession", "KVCacheConfig", "KVCacheExhausted", "KVCacheManager", "LayerCacheSpec",
    "NodeArg", "SessionOptions", "StepPlan",
]


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
