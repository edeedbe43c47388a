"""Control flow: If, through the session's subgraph runner (`ctx.run_subgraph`); pagedkit.ort::Segment, a run
of nodes handed to onnxruntime (runtime/delegate.py builds them and keeps them in SEGMENTS).

The condition is read on the host (an inherent sync: the branch decides what runs next).
"""

from __future__ import annotations

import weakref

from .registry import ORT_DOMAIN, register
from .util import host_scalar

SEGMENTS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()  # key -> delegate.Segment


@register("Segment", domain=ORT_DOMAIN)
def segment(inputs, attrs, ctx):
    """A delegated segment (runtime/delegate.py): attribute `key` names the live Segment; its run(inputs) runs
    the onnxruntime session over the node's inputs and returns its outputs."""
    seg = SEGMENTS.get(attrs["key"])
    if seg is None:
        raise RuntimeError(f"node '{ctx.node_name}': delegated segment {attrs['key']!r} is gone (its session was "
                           "released)")
    return seg.run(inputs)


@register("If", max_since=25, host_inputs=(0,))  # later versions add element types only
def if_(inputs, attrs, ctx):
    where = f"If node {ctx.node_name!r}"
    if ctx.run_subgraph is None:
        raise RuntimeError(f"{where}: running a branch needs ctx.run_subgraph, which the session supplies")
    branch = attrs["then_branch"] if bool(host_scalar(inputs[0], f"{where} input 'cond'")) else attrs["else_branch"]
    return list(ctx.run_subgraph(branch, {}))
