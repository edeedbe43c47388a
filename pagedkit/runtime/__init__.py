"""pagedkit.runtime: InferenceSession (ONNX on torch, CPU or CUDA) and the KV block manager."""

from .kv.cache import KVCacheExhausted, KVCacheManager
from .kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec
from .kv.plan import StepPlan
from .session import InferenceSession, NodeArg, SessionOptions

__all__ = [
    "GroupConfig", "InferenceSession", "KVCacheConfig", "KVCacheExhausted", "KVCacheManager", "LayerCacheSpec",
    "NodeArg", "SessionOptions", "StepPlan",
]
