"""`pagedkit.InferenceSession`: onnxruntime's Python API over a torch executor (CPU or CUDA).

Session creation does all the host-side work once: safe loading, op lookup (every op we cannot run
is reported here, with op type, domain and node name), initializers moved to the device, constant
folding of everything that depends only on initializers, and kernel-variant selection for the
attention nodes from static shapes and attributes. `run_torch` then only launches work: integer
shape bookkeeping stays on the host (Shape outputs live on the CPU), attention caches are updated in
place, and nothing reads device memory back to the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch

from .loading import load_model
from .tensors import to_numpy, to_torch

ATTENTION_OPS = {("com.microsoft", "PagedAttention"), ("com.microsoft", "GroupQueryAttention")}


@dataclass
class NodeArg:
    """What get_inputs() / get_outputs() return, like onnxruntime's NodeArg."""

    name: str
    shape: list
    type: str


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    tt = vi.type.tensor_type
    shape = []
    for d in tt.shape.dim:
        shape.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    dtype = onnx.helper.tensor_dtype_to_string(tt.elem_type).replace("TensorProto.", "").lower()
    dtype = {"float": "float", "float16": "float16"}.get(dtype, dtype)
    return NodeArg(vi.name, shape, f"tensor({dtype})")


class _Ctx:
    """Per-node context handed to op implementations."""

    def __init__(self, session: "InferenceSession", node: onnx.NodeProto, opset: int):
        self.session = session
        self.node = node
        self.node_name = node.name or node.op_type
        self.opset = opset
        self.device = session.device

    def run_subgraph(self, graph: onnx.GraphProto, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.session._run_graph(graph, dict(feeds), outer=feeds)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8")
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [s.decode("utf-8") for s in v]
        out[a.name] = v
    return out


class InferenceSession:
    """Runs an ONNX model with PagedAttention / GroupQueryAttention nodes on torch.

    providers: ["CPUExecutionProvider"] (default) or ["CUDAExecutionProvider", ...].
    allow_reference_fallback: run attention combinations no fast variant serves on the loop-based
    reference (with a one-time warning) instead of refusing at creation.
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes | onnx.ModelProto,
        sess_options: Any = None,
        providers: Sequence[str | tuple] | None = None,
        *,
        allow_reference_fallback: bool = True,
    ):
        self._model, self._base_dir = load_model(path_or_bytes)
        names = [p[0] if isinstance(p, tuple) else p for p in (providers or ["CPUExecutionProvider"])]
        unknown = [p for p in names if p not in ("CPUExecutionProvider", "CUDAExecutionProvider")]
        if unknown:
            raise ValueError(f"providers: unknown {unknown}; expected CPUExecutionProvider or CUDAExecutionProvider")
        if "CUDAExecutionProvider" in names and torch.cuda.is_available():
            self.device = torch.device("cuda")
            self._providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:
            if names and names[0] == "CUDAExecutionProvider" and "CPUExecutionProvider" not in names:
                raise RuntimeError("providers: CUDAExecutionProvider requested but CUDA is not available")
            self.device = torch.device("cpu")
            self._providers = ["CPUExecutionProvider"]
        self.allow_reference_fallback = allow_reference_fallback
        graph = self._model.graph
        self._opsets = {(o.domain or ""): o.version for o in self._model.opset_import}
        init_names = {i.name for i in graph.initializer}
        self._inputs = [_node_arg(vi) for vi in graph.input if vi.name not in init_names]
        self._outputs = [_node_arg(vi) for vi in graph.output]
        self._impls: dict[int, Any] = {}
        self._resolve(graph)
        self._consts: dict[str, torch.Tensor] = {}
        for init in graph.initializer:
            self._consts[init.name] = self._place(to_torch(onnx.numpy_helper.to_array(init, self._base_dir)))
        self._fold_constants(graph)
        self.attention_variants: dict[str, str] = {}  # node name -> variant chosen at creation
        self._plan_attention(graph)

    # ---- creation-time work -------------------------------------------------------------------
    def _resolve(self, graph: onnx.GraphProto) -> None:
        from . import ops

        missing = []
        for node in graph.node:
            domain = node.domain if node.domain not in ("", "ai.onnx") else ""
            if (domain, node.op_type) in ATTENTION_OPS:
                continue
            try:
                self._impls[id(node)] = ops.lookup(domain, node.op_type, self._opsets.get(domain, 1))
            except NotImplementedError:
                missing.append(f"{node.op_type} (domain '{domain or 'ai.onnx'}', node '{node.name}')")
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    try:
                        self._resolve(a.g)
                    except NotImplementedError as exc:
                        missing.append(str(exc))
        if missing:
            raise NotImplementedError("pagedkit cannot run these ops: " + "; ".join(missing))

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        # small integer tensors stay on the host: they are shape bookkeeping (no device syncs later)
        if t.dtype in (torch.int64, torch.int32) and t.numel() <= 64:
            return t
        return t.to(self.device)

    def _fold_constants(self, graph: onnx.GraphProto) -> None:
        """Evaluate once every node whose inputs are all initializers / constants."""
        self._folded: set[int] = set()
        for node in graph.node:
            key = (node.domain or "", node.op_type)
            if key in ATTENTION_OPS or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
                continue
            if all((not n) or n in self._consts for n in node.input):
                outs = self._run_node(node, self._consts)
                for name, t in zip(node.output, outs):
                    if name:
                        self._consts[name] = t
                self._folded.add(id(node))

    def _plan_attention(self, graph: onnx.GraphProto) -> None:
        from ..kernels.dispatch import select_variant

        self._variants = {}
        for node in graph.node:
            if (node.domain, node.op_type) in ATTENTION_OPS:
                variant = select_variant(node, self._model, self.device, self.allow_reference_fallback)
                self._variants[id(node)] = variant
                self.attention_variants[node.name or node.op_type] = variant.name

    # ---- ORT-compatible API ---------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_modelmeta(self):
        return self._model.metadata_props

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options=None) -> list:
        """numpy in, numpy out. Inputs are copied: the caller's arrays (caches included) are never
        mutated; updated caches come back as outputs."""
        feeds = {}
        for name, value in input_feed.items():
            t = to_torch(value, "cpu", copy=True)
            feeds[name] = t if self._is_host_input(name, t) else t.to(self.device)
        outs = self.run_torch(feeds, output_names)
        return [to_numpy(outs[n]) for n in (output_names or [o.name for o in self._outputs])]

    def run_torch(self, feeds: Mapping[str, torch.Tensor], output_names: Sequence[str] | None = None
                  ) -> dict[str, torch.Tensor]:
        """Zero-copy run on torch tensors: persistent cache tensors are updated in place and returned
        as the matching present outputs (same storage). attention_metadata stays on the CPU."""
        names = list(output_names or [o.name for o in self._outputs])
        known = {i.name for i in self._inputs}
        extra = [n for n in feeds if n not in known]
        if extra:
            raise ValueError(f"unknown input(s) {extra}; the model's inputs are {sorted(known)}")
        missing = [i.name for i in self._inputs if i.name not in feeds]
        if missing:
            raise ValueError(f"missing input(s) {missing}")
        values = self._run_graph(self._model.graph, dict(feeds), None, names)
        return {n: values[n] for n in names}

    # ---- execution ------------------------------------------------------------------------------
    def _is_host_input(self, name: str, t: torch.Tensor) -> bool:
        return name == "attention_metadata" or t.dtype == torch.int64 and t.numel() <= 64 and t.dim() <= 1

    def _run_graph(self, graph, feeds, outer=None, wanted=None):
        env: dict[str, torch.Tensor] = dict(self._consts)
        if outer:
            env.update(outer)
        env.update(feeds)
        top = graph is self._model.graph
        for node in graph.node:
            if top and id(node) in self._folded:
                continue
            outs = self._run_node(node, env)
            for name, t in zip(node.output, outs):
                if name:
                    env[name] = t
        if wanted is None:
            return [env[o.name] for o in graph.output]
        missing = [n for n in wanted if n not in env]
        if missing:
            raise ValueError(f"unknown output(s) {missing}")
        return env

    def _run_node(self, node: onnx.NodeProto, env: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        inputs = [env[n] if n else None for n in node.input]
        missing = [n for n, t in zip(node.input, inputs) if n and t is None]
        if missing:
            raise RuntimeError(f"node '{node.name}' ({node.op_type}): no value for input(s) {missing}")
        attrs = _attrs(node)
        variant = self._variants.get(id(node)) if hasattr(self, "_variants") else None
        if variant is not None:
            return variant.run(node, inputs, attrs)
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            inputs = [t.to(self.device) if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                      and not _is_shape_operand(node, i) else t for i, t in enumerate(inputs)]
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        ctx = _Ctx(self, node, self._opsets.get(domain, 1))
        try:
            return list(self._impls[id(node)](inputs, attrs, ctx))
        except Exception as exc:
            raise RuntimeError(f"node '{node.name}' ({node.op_type}) failed: {exc}") from exc


# inputs that are read on the host (shape-like operands) stay where they are
_SHAPE_OPERANDS = {
    "Reshape": {1}, "Expand": {1}, "Slice": {1, 2, 3, 4}, "Unsqueeze": {1}, "Squeeze": {1}, "Tile": {1},
    "ConstantOfShape": {0}, "Range": {0, 1, 2}, "Split": {1}, "TopK": {1}, "Pad": {1, 2, 3},
    "ReduceSum": {1}, "ReduceMean": {1}, "ReduceMax": {1}, "ReduceMin": {1}, "ReduceProd": {1},
    "ReduceL2": {1}, "ReduceSumSquare": {1}, "OneHot": {1}, "CumSum": {1},
}


def _is_shape_operand(node: onnx.NodeProto, index: int) -> bool:
    return index in _SHAPE_OPERANDS.get(node.op_type, ())
