"""The data of a compiled graph (graph.py compiles an ONNX graph into it; fuse.py rewrites it; plan.py and the
session run it): a `Graph` is a list of `Step`s, one per node, with its inputs, outputs and constants.

Below graph.py and fuse.py, which both build on these types (graph.py imports them, so `graph.Step` and
`graph.Graph` still name them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..kernels.dispatch import AttentionCall
    from .ops import OpContext


@dataclass
class Step:
    """One node, compiled (protobuf wrappers are not stable dict keys, so nothing here is one)."""

    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    impl: Any = None  # op-table implementation
    call: AttentionCall | None = None  # attention node bound to its kernel variant
    ctx: OpContext | None = None
    host_in: frozenset[int] = frozenset()  # input slots read on the host
    host_out: bool = False  # outputs are host tensors (Shape, Size)
    cache_in: frozenset[int] = frozenset()  # attention cache slots (updated in place)
    free_vars: frozenset[str] = frozenset()  # names its subgraphs read from enclosing scopes
    release: list[str] = field(default_factory=list)  # values dead after this step

    @property
    def has_subgraph(self) -> bool:
        return any(isinstance(v, Graph) for v in self.attrs.values())


@dataclass
class Graph:
    steps: list[Step]
    inputs: list[str]
    outputs: list[str]
    consts: dict[str, torch.Tensor]


def value_readers(g: Graph) -> dict[str, int]:
    """Value name -> how many times steps read it (inputs and subgraph free variables) or the graph outputs it."""
    n: dict[str, int] = {}
    for s in g.steps:
        for name in list(s.inputs) + list(s.free_vars):
            if name:
                n[name] = n.get(name, 0) + 1
    for name in g.outputs:
        n[name] = n.get(name, 0) + 1
    return n


def plain_step(step: Step, op: str, n_in: int) -> bool:
    """step is the ai.onnx op `op` with an implementation, no subgraph, n_in inputs all given and one output."""
    return (step.domain == "" and step.op_type == op and step.impl is not None and not step.has_subgraph
            and len(step.inputs) == n_in and all(step.inputs) and len(step.outputs) == 1)
