"""The op table: (domain, op_type) -> torch implementation, and the context an implementation gets.

An implementation is `fn(inputs, attrs, ctx) -> list[torch.Tensor]`:
- `inputs`: the node's inputs in ONNX order, torch tensors on the run device; an absent optional
  input (empty name, or fewer inputs than the schema allows) is None.
- `attrs`: python values as `onnx.helper.get_attribute_value` gives them, with strings decoded
  (`node_attributes` below does that); TENSOR attributes stay `onnx.TensorProto` (convert with
  `tensor_from_proto`), GRAPH attributes stay `onnx.GraphProto`.
- `ctx`: an `OpContext` (opset of the node's domain, node name, number of node outputs, device, and
  `run_subgraph` supplied by the session for control flow).
It returns the outputs in ONNX order. Outputs may be views of inputs (Reshape, Transpose, Slice,
Expand, Identity...): implementations never write into their inputs, and a caller that mutates an
output in place must copy first. Optional outputs the node does not request may still be returned
(the session drops them) or be None.

Shape-like inputs (Reshape shape, Slice starts/ends/axes/steps, Unsqueeze axes, TopK k, Range
bounds, ...) are int64 tensors read on the host with `.tolist()`: these ops are host-side shape
bookkeeping, the only host reads the table does. Each op declares them (`host_inputs`) so that a
session keeps the tensors feeding them on the CPU, as onnxruntime's CUDA kernels take such inputs in
CPU memory; Shape and Size return CPU tensors (`has_host_outputs`) for the same reason. Data-dependent
output shapes (NonZero), `If`'s condition and MoE's per-expert counts on large batches are the other,
inherent, host reads. Placing tensors (moving a CPU tensor to the device when a device op needs it)
is the session's job: implementations do not move inputs between devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import onnx
import torch

OpImpl = Callable[[list[torch.Tensor | None], dict[str, Any], "OpContext"], list[torch.Tensor | None]]

# ai.onnx is keyed by "", the spelling ONNX graphs use for the default domain.
ONNX_DOMAIN = ""
MS_DOMAIN = "com.microsoft"
FUSED_DOMAIN = "pagedkit.fused"  # ops the session's fusions create (runtime/fuse.py); never in a model file
ORT_DOMAIN = "pagedkit.ort"  # segments the CPU session hands to onnxruntime (runtime/delegate.py); never in a file
# Highest ai.onnx opset whose semantics the implementations were written against.
MAX_ONNX_OPSET = 23


@dataclass
class OpContext:
    """What an op implementation may know besides its inputs and attributes."""

    opset: int = MAX_ONNX_OPSET  # opset version of the node's domain in the model
    node_name: str = ""
    num_outputs: int = 1  # len(node.output): Split without sizes splits into this many pieces
    # the device the node runs on: where outputs made from host values go (Constant,
    # ConstantOfShape, Range), as onnxruntime's CUDA kernels put them on the GPU
    device: torch.device | str = "cpu"
    # run_subgraph(graph, feeds) -> graph outputs in order. Supplied by the session; it resolves
    # names the subgraph takes from the enclosing scope itself (feeds only bind the subgraph's inputs).
    run_subgraph: Callable[[onnx.GraphProto, dict[str, torch.Tensor]], list[torch.Tensor]] | None = None
    # which outputs the node names (an empty name: not produced for anyone); None = all. An op may skip
    # work for the others and return None there (the statistics outputs of the normalizations).
    requested: tuple[bool, ...] | None = None
    # prepack only: indices of constant inputs nobody else reads (the session drops them after prepacking);
    # the prepack function may take them apart while laying them out (packed.transpose_releasing)
    consumable: frozenset[int] = frozenset()

    def wants(self, i: int) -> bool:
        return self.requested is None or (i < len(self.requested) and self.requested[i])


OPS: dict[tuple[str, str], OpImpl] = {}
# (domain, op_type) -> newest ai.onnx opset whose version of the op is implemented
_MAX_SINCE: dict[tuple[str, str], int] = {}
# (domain, op_type) -> input indices read on the host (shape-like); a session keeps the tensors
# feeding them on the CPU so that reading them costs no device sync (onnxruntime's CPU-memory inputs)
_HOST_INPUTS: dict[tuple[str, str], frozenset[int]] = {}
# ops whose outputs are host (CPU) tensors whatever the device: Shape, Size (as onnxruntime's CUDA EP)
_HOST_OUTPUTS: set[tuple[str, str]] = set()
# (domain, op_type) -> prepack function: lays a node's constant inputs out once, at session creation
_PREPACK: dict[tuple[str, str], "PrepackFn"] = {}

# prepack(inputs, attrs, ctx) -> {input index: replacement}. `inputs` holds the node's constant inputs
# (initializers and folded values, on the host), RUNTIME for inputs computed or fed at run time and None
# for absent ones; each replacement (a
# tensor in another dtype / layout, or a Packed object, see packed.py) takes the place of that input for
# this node only, and the original is dropped once no other node reads it (one copy in memory).
# The op's implementation must accept both the original and the replacement in that slot.
PrepackFn = Callable[[list[Any], dict[str, Any], "OpContext"], dict[int, Any]]


def normalize_domain(domain: str | None) -> str:
    return ONNX_DOMAIN if domain in (None, "", "ai.onnx") else domain


def register(*op_types: str, domain: str = ONNX_DOMAIN, max_since: int = MAX_ONNX_OPSET,
             host_inputs: tuple[int, ...] = (), host_outputs: bool = False):
    """Decorator: register `fn` for each op type in `domain`.

    For ai.onnx ops, `max_since` is the newest schema version (`since_version`) the implementation
    follows; `lookup` refuses a model whose opset selects a newer version of the op.
    `host_inputs`: indices of the inputs the implementation reads on the host (`.tolist()`);
    every other input is only used by device ops. `host_outputs`: outputs are CPU tensors.
    """
    domain = normalize_domain(domain)

    def deco(fn: OpImpl) -> OpImpl:
        for op_type in op_types:
            key = (domain, op_type)
            if key in OPS:
                raise RuntimeError(f"op {domain or 'ai.onnx'}::{op_type} registered twice")
            OPS[key] = fn
            _MAX_SINCE[key] = max_since
            _HOST_INPUTS[key] = frozenset(host_inputs)
            if host_outputs:
                _HOST_OUTPUTS.add(key)
        return fn

    return deco


class _RunTime:
    """The prepack placeholder of an input that only exists at run time."""

    def __repr__(self) -> str:
        return "<run-time value>"


RUNTIME = _RunTime()


def prepack(*op_types: str, domain: str = ONNX_DOMAIN):
    """Decorator: register `fn` (a PrepackFn, see above) as the creation-time layout step of each op type."""
    domain = normalize_domain(domain)

    def deco(fn: PrepackFn) -> PrepackFn:
        for op_type in op_types:
            if (domain, op_type) in _PREPACK:
                raise RuntimeError(f"prepack for {domain or 'ai.onnx'}::{op_type} registered twice")
            _PREPACK[(domain, op_type)] = fn
        return fn

    return deco


def prepacker(domain: str | None, op_type: str) -> PrepackFn | None:
    """The op's prepack function, or None."""
    return _PREPACK.get((normalize_domain(domain), op_type))


def _where(op_type: str, domain: str, node_name: str | None) -> str:
    where = f"{domain or 'ai.onnx'}::{op_type}"
    return f"{where} (node {node_name!r})" if node_name else where


def lookup(domain: str | None, op_type: str, opset: int | None = None, node_name: str | None = None) -> OpImpl:
    """The implementation of `op_type` in `domain` at `opset`; NotImplementedError naming the op if none."""
    domain = normalize_domain(domain)
    fn = OPS.get((domain, op_type))
    if fn is None:
        raise NotImplementedError(
            f"pagedkit runtime has no implementation of {_where(op_type, domain, node_name)}; "
            f"supported ops: see docs/runtime-ops.md or pagedkit.runtime.ops.supported_ops()")
    if domain == ONNX_DOMAIN and opset is not None:
        since = _schema_since(op_type, opset)
        if since is not None and since > _MAX_SINCE[(domain, op_type)]:
            raise NotImplementedError(
                f"{_where(op_type, domain, node_name)} at opset {opset} selects version {since} of the op; "
                f"pagedkit implements it up to version {_MAX_SINCE[(domain, op_type)]}")
    return fn


def _schema_since(op_type: str, opset: int) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset, ONNX_DOMAIN).since_version
    except onnx.defs.SchemaError:
        return None  # op unknown to the installed onnx at that opset (e.g. ORT's SimplifiedLayerNormalization)


def host_inputs(domain: str | None, op_type: str) -> frozenset[int]:
    """Indices of the op's inputs read on the host: keep what feeds them on the CPU."""
    return _HOST_INPUTS[(normalize_domain(domain), op_type)]


def has_host_outputs(domain: str | None, op_type: str) -> bool:
    """True if the op's outputs are CPU tensors on any device (Shape, Size)."""
    return (normalize_domain(domain), op_type) in _HOST_OUTPUTS


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as python values, strings decoded to str (the form implementations get)."""
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8")
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [s.decode("utf-8") for s in v]
        out[a.name] = v
    return out
