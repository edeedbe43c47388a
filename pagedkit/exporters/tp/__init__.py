"""Tensor-parallel export: one graph per rank, Megatron-style (plan.py: the cut as data; build.py: a rank's graph
with its com.microsoft::AllReduce / AllGather; export.py: `paged-export --tp N`; comm.py: the per-step collective
traffic of a model at N ranks, for docs/distributed.md)."""

from .plan import ShardError, ShardPlan, make_plan

__all__ = ["ShardError", "ShardPlan", "make_plan"]
