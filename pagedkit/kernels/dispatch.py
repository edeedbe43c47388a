"""Attention kernel dispatch: one variant per node, chosen at session creation from static shapes,
dtypes, attributes and the device only; the chosen variant's name is reported
(`InferenceSession.attention_variants`, like ORT's SdpaKernel= debug info).

Variants declare what they serve (`supports(info) -> reason or None`); the first that serves the node
wins. The loop-based reference serves everything on any device and is last: on CUDA it is only used
when the session allows reference fallback (contract-decisions §9), with a one-time warning; it then
runs on CPU copies of the inputs and writes the caches back into the device buffers.

`bind(node, ...)` returns an `AttentionCall`: the node's inputs / outputs by contract name, computed
once, and the cache aliasing the runtime promises: a cache output IS its cache input (same tensor,
updated in place), as onnxruntime does with shared past/present buffers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import onnx
import torch

from ..validators.contract import CONTRACTS, get_contract

# host-memory inputs and cache aliasing are contract facts (validators/contract.py)
HOST_INPUTS = {op: c.host_inputs for op, c in CONTRACTS.items()}
CACHE_ALIASES = {op: c.cache_aliases for op, c in CONTRACTS.items()}


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
    cpu_only: bool = False  # runs on CPU tensors only (the reference)


@dataclass
class AttentionCall:
    """One attention node bound to its variant: positional inputs -> contract names -> outputs."""

    variant: Variant
    node_name: str
    in_names: list[str | None]  # contract name of each node input (None: absent)
    out_names: list[str | None]  # contract name of each node output (None: not requested)
    attrs: dict[str, Any]
    device: torch.device

    @property
    def name(self) -> str:
        return self.variant.name

    def run(self, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        feed = {n: t for n, t in zip(self.in_names, inputs) if n is not None and t is not None}
        requested = [n for n in self.out_names if n is not None]
        staged = feed
        if self.variant.cpu_only and self.device.type != "cpu":
            staged = {n: t.cpu() for n, t in feed.items()}
        result = self.variant.fn(staged, outputs=requested, **self.attrs)
        aliases = CACHE_ALIASES[self.variant.op_type]
        outs: list[torch.Tensor | None] = []
        for n in self.out_names:
            if n is None:
                outs.append(None)
                continue
            t = result[n]
            src = feed.get(aliases.get(n, ""))
            if src is not None and t is not src:
                if t.shape == src.shape and t.dtype == src.dtype:
                    src.copy_(t)  # the cache output is the cache input, updated in place
                    t = src
                else:  # a cache that grows (GQA without a shared buffer): a new tensor, like ORT
                    t = t.to(self.device)
            elif t.device != self.device:
                t = t.to(self.device)
            outs.append(t)
        return outs


def _info(node: onnx.NodeProto, device: torch.device) -> NodeInfo:
    contract = get_contract(node.op_type)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    ins = {contract.inputs[i].name for i, n in enumerate(node.input) if n and i < len(contract.inputs)}
    outs = {contract.outputs[i].name for i, n in enumerate(node.output) if n and i < len(contract.outputs)}
    return NodeInfo(node.op_type, attrs, ins, outs, device)


def _reference(op_type: str) -> Variant:
    from .gqa import reference as reference_gqa
    from .paged import reference

    fn = reference.paged_attention if op_type == "PagedAttention" else reference_gqa.group_query_attention
    return Variant("reference", op_type, fn, cpu_only=True)


def _fast_variants(op_type: str) -> list[tuple[Callable[[NodeInfo], str | None], Variant]]:
    """(supports, variant) pairs in priority order. supports returns None when it serves the node,
    else the reason it does not."""
    variants = []
    try:
        from .paged import torch_sdpa as torch_paged
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


def bind(node: onnx.NodeProto, model: onnx.ModelProto | None, device: torch.device,
         allow_reference_fallback: bool = True) -> AttentionCall:
    """Select the node's variant and bind its inputs / outputs to contract names (session creation)."""
    contract = get_contract(node.op_type)
    if len(node.input) > len(contract.inputs) or len(node.output) > len(contract.outputs):
        raise ValueError(f"node '{node.name}' ({node.op_type}): {len(node.input)} inputs / {len(node.output)} outputs, "
                         f"the contract has {len(contract.inputs)} / {len(contract.outputs)}")
    variant = select_variant(node, model, device, allow_reference_fallback)
    in_names = [contract.inputs[i].name if n else None for i, n in enumerate(node.input)]
    out_names = [contract.outputs[i].name if n else None for i, n in enumerate(node.output)]
    return AttentionCall(variant, node.name, in_names, out_names, _info(node, device).attrs, device)


def host_input_indices(op_type: str) -> frozenset[int]:
    """Indices of the node inputs kept in host memory (onnxruntime's CPU-memory inputs)."""
    contract = get_contract(op_type)
    return frozenset(contract.input_index(n) for n in HOST_INPUTS.get(op_type, ()))


def cache_input_indices(op_type: str) -> frozenset[int]:
    """Indices of the cache inputs (persistent buffers updated in place)."""
    contract = get_contract(op_type)
    return frozenset(contract.input_index(n) for n in CACHE_ALIASES.get(op_type, {}).values())
