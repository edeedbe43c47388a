"""The paged KV-cache manager: `config` (groups, layers, capacities), `pool` (block pool, prefix
hashes), `blocks` (per-group block bookkeeping), `plan` (persistent step-plan buffers), `staging`
(reused host buffers for asynchronous host <-> device copies) and `cache` (KVCacheManager, the public
entry point)."""

from .cache import KVCacheExhausted, KVCacheManager
from .config import GroupConfig, KVCacheConfig, LayerCacheSpec
from .plan import StepPlan

__all__ = ["GroupConfig", "KVCacheConfig", "KVCacheExhausted", "KVCacheManager", "LayerCacheSpec", "StepPlan"]
