"""com.microsoft AllReduce / AllGather (onnxruntime's collective schema, collective_defs.cc) over the
torch.distributed set this process belongs to (runtime/distributed/group.py).

AllReduce: each input summed over the ranks (variadic; T float16 / float / double; the input is not written).
AllGather: each input concatenated over the ranks along `axis` (default 1, as onnxruntime's attribute), rank
order; `group_size` must be the set's size. A graph holding either runs only inside a tensor-parallel set (the
op refuses otherwise, naming the node and the way to run it: paged-run --tp N).
"""

from __future__ import annotations

from ..distributed import group as tp_group
from .registry import MS_DOMAIN, register

COLLECTIVE_OPS = ("AllReduce", "AllGather")  # run by torch.distributed, never by onnxruntime's CPU build


@register("AllReduce", domain=MS_DOMAIN)
def all_reduce(inputs, attrs, ctx):
    g = tp_group.active("AllReduce", ctx.node_name)
    return [g.all_reduce(x) for x in inputs]


@register("AllGather", domain=MS_DOMAIN)
def all_gather(inputs, attrs, ctx):
    size = int(attrs.get("group_size", 1))
    g = tp_group.active("AllGather", ctx.node_name, group_size=size)
    axis = int(attrs.get("axis", 1))
    return [g.all_gather(x, axis) for x in inputs]
