"""pagedkit.runtime: InferenceSession (ONNX on torch, CPU or CUDA) and the KV block manager.

The engine (pagedkit.engine) and the apps (pagedkit.apps) sit above this layer; their old paths under
pagedkit.runtime (pagedkit.runtime.engine, .serve, .bench, .cli) are deprecated aliases (moved.py).
"""

from .kv.cache import KVCacheExhausted, KVCacheManager
from .kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec
from .kv.plan import StepPlan
from .session import InferenceSession, NodeArg, SessionOptions
from . import moved as _moved

_moved.install()

__all__ = [
    "GroupConfig", "InferenceSession", "KVCacheConfig", "KVCacheExhausted", "KVCacheManager", "LayerCacheSpec",
    "NodeArg", "SessionOptions", "StepPlan",
]
