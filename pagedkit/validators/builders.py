"""Node builders for com.microsoft PagedAttention and GroupQueryAttention, used by exporters and rewriters.

Inputs and outputs are given by their ONNX names (contract.py) and land at their contract index; gaps
become empty names and trailing gaps are dropped. Only attributes that differ from the contract default
are written. The node is validated (`checks.validate_node`) before it is returned.

    node = make_paged_attention_node(
        {"query": "q", "key": "k", "value": "v", "key_cache": "past.0.key", "value_cache": "past.0.value",
         "cumulative_sequence_length": "csl", "past_seqlens": "past_lens", "block_table": "block_table"},
        {"output": "attn", "key_cache_out": "present.0.key", "value_cache_out": "present.0.value"},
        name="layer0_attn", num_heads=32, kv_num_heads=8)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import onnx

from .checks import validate_node
from .contract import GROUP_QUERY_ATTENTION, PAGED_ATTENTION, OpContract
from .inference import register_schemas
from .issues import raise_if_any
from .nodeview import Dim

ValueInfo = Mapping[str, tuple[int | None, tuple[Dim, ...] | None]]


def _positional(contract: OpContract, given: Mapping[str, str | None] | Sequence[str | None], kind: str) -> list[str]:
    """Tensor names by contract index ('' for gaps, trailing gaps dropped)."""
    params = contract.inputs if kind == "input" else contract.outputs
    if isinstance(given, Mapping):
        names = [p.name for p in params]
        unknown = [k for k in given if k not in names]
        if unknown:
            raise ValueError(f"{contract.name}: unknown {kind} name(s) {unknown}; valid {kind}s by index: {names}")
        slots = [given.get(n) or "" for n in names]
    elif isinstance(given, (str, bytes)):
        raise TypeError(f"{contract.name}: {kind}s must be a mapping of {kind} name to tensor name "
                        f"(or a sequence of tensor names), got the string {given!r}")
    else:
        slots = [t or "" for t in given]
        if len(slots) > len(params):
            raise ValueError(f"{contract.name}: {len(slots)} {kind}s given, the operator has at most {len(params)}")
    for n in slots:
        if not isinstance(n, str):
            raise TypeError(f"{contract.name}: {kind} tensor names must be strings, got {n!r}")
    while slots and not slots[-1]:
        slots.pop()
    return slots


def _coerce(contract: OpContract, name: str, value: Any) -> Any:
    attr = contract.attr(name)
    try:
        if attr.type == "string":
            if isinstance(value, bytes):
                value = value.decode("utf-8")
            if not isinstance(value, str):
                raise TypeError
            return value
        if attr.type == "int":
            if isinstance(value, float) or int(value) != value:
                raise TypeError
            return int(value)
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{contract.name}: attribute '{name}' expects type {attr.type}, got "
                         f"{type(value).__name__} {value!r}") from None


def _is_default(contract: OpContract, name: str, value: Any) -> bool:
    default = contract.attr(name).default
    return default is not None and value == default


def _attributes(contract: OpContract, attributes: Mapping[str, Any]) -> dict[str, Any]:
    valid = [a.name for a in contract.attributes]
    unknown = [k for k in attributes if k not in valid]
    if unknown:
        raise ValueError(f"{contract.name}: unknown attribute(s) {unknown}; valid attributes: {valid}")
    out = {}
    for name, value in attributes.items():
        if value is None:
            continue
        value = _coerce(contract, name, value)
        if not _is_default(contract, name, value):
            out[name] = value
    return out


def make_node(
    contract: OpContract,
    inputs: Mapping[str, str | None],
    outputs: Mapping[str, str | None] | Sequence[str | None],
    *,
    name: str | None = None,
    value_info: ValueInfo | None = None,
    **attributes: Any,
) -> onnx.NodeProto:
    """Build and validate a node of `contract`'s operator (see the module doc); raises ValidationError."""
    if not isinstance(inputs, Mapping):
        raise TypeError(f"{contract.name}: inputs must be a mapping of input name to tensor name, "
                        f"got {type(inputs).__name__}")
    register_schemas()  # so that onnx shape inference / the checker know the op the caller is building
    node = onnx.helper.make_node(
        contract.name,
        _positional(contract, inputs, "input"),
        _positional(contract, outputs, "output"),
        name=name,
        domain=contract.domain,
        **_attributes(contract, attributes),
    )
    raise_if_any(validate_node(node, value_info), f"{contract.name} node {name or ''}".rstrip())
    return node


def make_paged_attention_node(
    inputs: Mapping[str, str | None],
    outputs: Mapping[str, str | None] | Sequence[str | None],
    *,
    name: str | None = None,
    value_info: ValueInfo | None = None,
    **attributes: Any,
) -> onnx.NodeProto:
    """A validated com.microsoft PagedAttention node.

    inputs: {ONNX input name: tensor name} (contract.py names, e.g. "key_cache"; None/"" = absent);
    outputs: {ONNX output name: tensor name} or tensor names by index; attributes: non-default ones are
    written. value_info (optional): {tensor name: (elem_type, shape)} for the checks. Unknown names raise
    ValueError; a node that breaks a contract rule raises ValidationError listing every issue.
    """
    return make_node(PAGED_ATTENTION, inputs, outputs, name=name, value_info=value_info, **attributes)


def make_gqa_node(
    inputs: Mapping[str, str | None],
    outputs: Mapping[str, str | None] | Sequence[str | None],
    *,
    name: str | None = None,
    value_info: ValueInfo | None = None,
    **attributes: Any,
) -> onnx.NodeProto:
    """A validated com.microsoft GroupQueryAttention node; arguments as make_paged_attention_node."""
    return make_node(GROUP_QUERY_ATTENTION, inputs, outputs, name=name, value_info=value_info, **attributes)
