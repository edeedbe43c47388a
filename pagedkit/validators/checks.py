"""Public validation entry points: one node (static), concrete inputs (run time).

`validate_node` and `check_inputs` build a `NodeView` and run the same rule set
(rules/paged.py and rules/gqa.py RULES); they return a list of Issues and never raise for bad input.
`require_valid_inputs` is the raising boundary used by kernels and the runtime.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from .contract import OpContract, get_contract
from .issues import Issue, raise_if_any
from .nodeview import Dim, NodeView, TensorInfo


def _rules_for(contract: OpContract):
    if contract.name == "PagedAttention":
        from .rules.paged import RULES
    else:
        from .rules.gqa import RULES
    return RULES


def run_rules(view: NodeView) -> list[Issue]:
    """Run every rule of the view's op; a rule that crashes is reported, never propagated."""
    issues = list(view.extra)
    for rule in _rules_for(view.contract):
        try:
            issues.extend(rule(view))
        except Exception as exc:  # a validator never raises for bad input
            issues.append(view.issue("node", f"internal:{getattr(rule, '__name__', rule)}", "no crash",
                                     f"{type(exc).__name__}: {exc}", "validator rule failed on this node"))
    return issues


def _attr_value(a: onnx.AttributeProto) -> Any:
    return onnx.helper.get_attribute_value(a)


def view_of_node(
    node: onnx.NodeProto,
    value_info: Mapping[str, tuple[int | None, tuple[Dim, ...] | None]] | None = None,
    constants: Mapping[str, np.ndarray] | None = None,
) -> NodeView:
    """Static view of an ONNX node. value_info maps tensor name -> (elem type, shape); constants
    maps tensor name -> integer values known statically (initializers, Constant nodes)."""
    contract = get_contract(node.op_type)
    value_info = value_info or {}
    constants = constants or {}
    name = node.name or node.op_type
    extra: list[Issue] = []
    attrs = {}
    for a in node.attribute:
        attrs[a.name] = _attr_value(a)
        if isinstance(attrs[a.name], bytes):
            attrs[a.name] = attrs[a.name].decode("utf-8", "replace")

    def info(tname: str) -> TensorInfo:
        dtype, shape = value_info.get(tname, (None, None))
        val = constants.get(tname)
        return TensorInfo(tname, dtype, shape, val)

    inputs = {i: info(n) for i, n in enumerate(node.input) if n and i < len(contract.inputs)}
    outputs = {i: info(n) for i, n in enumerate(node.output) if n and i < len(contract.outputs)}
    if len(node.input) > len(contract.inputs):
        extra.append(Issue(name, "node", "too-many-inputs", f"at most {len(contract.inputs)} inputs",
                           str(len(node.input)), f"{contract.name} has {len(contract.inputs)} inputs, the node "
                           f"lists {len(node.input)}"))
    if len(node.output) > len(contract.outputs):
        extra.append(Issue(name, "node", "too-many-outputs", f"at most {len(contract.outputs)} outputs",
                           str(len(node.output)), f"{contract.name} has {len(contract.outputs)} outputs, the node "
                           f"lists {len(node.output)}"))
    return NodeView(contract, name, attrs, inputs, outputs, len(node.input), len(node.output), False, extra)


def validate_node(
    node: onnx.NodeProto | NodeView,
    value_info: Mapping[str, tuple[int | None, tuple[Dim, ...] | None]] | None = None,
    constants: Mapping[str, np.ndarray] | None = None,
) -> list[Issue]:
    """Issues of one PagedAttention / GroupQueryAttention node, using whatever is known."""
    view = node if isinstance(node, NodeView) else view_of_node(node, value_info, constants)
    return run_rules(view)


def check_inputs(
    inputs: Mapping[str, Any],
    attrs: Mapping[str, Any],
    *,
    op_type: str = "PagedAttention",
    outputs: Sequence[str] | None = None,
    node_name: str = "",
) -> list[Issue]:
    """Issues of a run-time call: inputs keyed by ONNX input name (torch tensors or numpy arrays,
    None = absent), attributes as given on the node, outputs = names of requested outputs (None:
    not known, output-presence rules are skipped)."""
    view = NodeView.from_tensors(get_contract(op_type), inputs, attrs, outputs, node_name)
    return run_rules(view)


def require_valid_inputs(inputs, attrs, *, op_type="PagedAttention", outputs=None, node_name="") -> None:
    """check_inputs, raising one ValidationError listing every issue."""
    raise_if_any(check_inputs(inputs, attrs, op_type=op_type, outputs=outputs, node_name=node_name),
                 f"{op_type} inputs")
