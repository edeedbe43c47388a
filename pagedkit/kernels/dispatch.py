"""Attention kernel dispatch: one variant per node, chosen at session creation from static shapes,
dtypes, attributes and the device only; the chosen variant's name is reported
(`InferenceSession.attention_variants`, like ORT's SdpaKernel= debug info).

Variants declare what they serve (`supports(info) -> reason or None`); the first that serves the node
wins. The loop-based reference serves everything on any device and is last: on CUDA it is only used
when the session allows reference fallback (contract-decisions §9), with a one-time warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import onnx
import torch

from ..validators.contract import get_contract


@dataclass
class NodeInfo:
    op_type: str
    attrs: dict[str, Any]
    present_inputs: set[str]
    present_outputs: set[str]
    device: torch.device


@dataclass
class Variant:
    name: str
    op_type: str
    fn: Callable  # fn(inputs: dict, outputs: list[str], **attrs) -> dict

    def run(self, node: onnx.NodeProto, inputs: list, attrs: dict) -> list:
        contract = get_contract(self.op_type)
        feed = {contract.inputs[i].name: t for i, t in enumerate(inputs) if t is not None}
        out_names = [contract.outputs[i].name for i, n in enumerate(node.output) if n]
        result = self.fn(feed, outputs=out_names, **attrs)
        return [result[contract.outputs[i].name] if n else None for i, n in enumerate(node.output)]


def _info(node: onnx.NodeProto, device: torch.device) -> NodeInfo:
    contract = get_contract(node.op_type)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    ins = {contract.inputs[i].name for i, n in enumerate(node.input) if n and i < len(contract.inputs)}
    outs = {contract.outputs[i].name for i, n in enumerate(node.output) if n and i < len(contract.outputs)}
    return NodeInfo(node.op_type, attrs, ins, outs, device)


def _reference(op_type: str) -> Variant:
    from . import reference, reference_gqa

    fn = reference.paged_attention if op_type == "PagedAttention" else reference_gqa.group_query_attention
    return Variant("reference", op_type, fn)


def _fast_variants(op_type: str) -> list[tuple[Callable[[NodeInfo], str | None], Variant]]:
    """(supports, variant) pairs in priority order. supports returns None when it serves the node,
    else the reason it does not."""
    variants = []
    try:
        from . import torch_paged
    except ImportError:
        return variants
    if op_type == "PagedAttention":
        variants.append((torch_paged.supports, Variant(torch_paged.NAME, op_type, torch_paged.paged_attention)))
    return variants


_warned: set[str] = set()


def select_variant(node: onnx.NodeProto, model: onnx.ModelProto | None, device: torch.device,
                   allow_reference_fallback: bool = True) -> Variant:
    info = _info(node, device)
    reasons = []
    for supports, variant in _fast_variants(node.op_type):
        why = supports(info)
        if why is None:
            return variant
        reasons.append(f"{variant.name}: {why}")
    if device.type == "cpu":
        return _reference(node.op_type)
    if not allow_reference_fallback:
        raise NotImplementedError(
            f"node '{node.name}' ({node.op_type}): no GPU variant serves it ({'; '.join(reasons) or 'none registered'}); "
            "create the session with allow_reference_fallback=True to run it on the reference")
    if node.name not in _warned:
        _warned.add(node.name)
        warnings.warn(f"node '{node.name}' ({node.op_type}) runs on the loop-based reference on {device} "
                      f"({'; '.join(reasons) or 'no GPU variant registered'}); not CUDA-graph capturable")
    return _reference(node.op_type)
