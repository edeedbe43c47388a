"""Control flow: If, through the session's subgraph runner (`ctx.run_subgraph`).

The condition is read on the host (an inherent sync: the branch decides what runs next).
"""

from __future__ import annotations

from .registry import register
from .util import host_scalar


@register("If", max_since=25, host_inputs=(0,))  # later versions add element types only
def if_(inputs, attrs, ctx):
    where = f"If node {ctx.node_name!r}"
    if ctx.run_subgraph is None:
        raise RuntimeError(f"{where}: running a branch needs ctx.run_subgraph, which the session supplies")
    branch = attrs["then_branch"] if bool(host_scalar(inputs[0], f"{where} input 'cond'")) else attrs["else_branch"]
    return list(ctx.run_subgraph(branch, {}))
