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


@dataclass
class _Step:
    """One node, compiled at session creation (protobuf wrappers are not stable dict keys)."""

    node: onnx.NodeProto
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    impl: Any = None  # op-table implementation
    variant: Any = None  # attention kernel variant
    ctx: Any = None
    folded: bool = False  # evaluated once at creation (depends on constants only)


class _Graph:
    """A compiled (sub)graph: its steps and output names."""

    def __init__(self, steps: list[_Step], outputs: list[str]):
        self.steps = steps
        self.outputs = outputs


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
        self.attention_variants: dict[str, str] = {}  # node name -> variant chosen at creation
        missing: list[str] = []
        self._graph = self._compile(graph, missing)
        if missing:
            raise NotImplementedError("pagedkit cannot run these ops: " + "; ".join(missing))
        self._consts: dict[str, torch.Tensor] = {}
        for init in graph.initializer:
            self._consts[init.name] = self._place(to_torch(onnx.numpy_helper.to_array(init, self._base_dir or "")))
        self._fold_constants()

    # ---- creation-time work -------------------------------------------------------------------
    def _compile(self, graph: onnx.GraphProto, missing: list[str]) -> _Graph:
        from ..kernels.dispatch import select_variant
        from .ops import OpContext, lookup, node_attributes

        steps = []
        for node in graph.node:
            domain = node.domain if node.domain not in ("", "ai.onnx") else ""
            step = _Step(node, node.name or node.op_type, list(node.input), list(node.output), node_attributes(node))
            if (domain, node.op_type) in ATTENTION_OPS:
                step.variant = select_variant(node, self._model, self.device, self.allow_reference_fallback)
                self.attention_variants[step.name] = step.variant.name
            else:
                try:
                    step.impl = lookup(domain, node.op_type, self._opsets.get(domain, 1), node.name)
                except NotImplementedError as exc:
                    missing.append(str(exc).split(";")[0])
                for key, value in list(step.attrs.items()):
                    if isinstance(value, onnx.GraphProto):
                        step.attrs[key] = self._compile(value, missing)
                step.ctx = OpContext(opset=self._opsets.get(domain, 1), node_name=node.name,
                                     num_outputs=len(node.output), device=self.device,
                                     run_subgraph=self._run_subgraph)
            steps.append(step)
        return _Graph(steps, [o.name for o in graph.output])

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        # small integer tensors stay on the host: they are shape bookkeeping (no device syncs later)
        if t.dtype in (torch.int64, torch.int32) and t.numel() <= 64:
            return t
        return t.to(self.device)

    def _fold_constants(self) -> None:
        """Evaluate once every node whose inputs are all initializers / constants."""
        for step in self._graph.steps:
            if step.variant is not None or any(isinstance(v, _Graph) for v in step.attrs.values()):
                continue
            if all((not n) or n in self._consts for n in step.inputs):
                for name, t in zip(step.outputs, self._run_step(step, self._consts)):
                    if name and t is not None:
                        self._consts[name] = t
                step.folded = True

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
        names = list(output_names or [o.name for o in self._outputs])
        outs = self.run_torch(feeds, names)
        return [to_numpy(outs[n]) for n in names]

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
        env = self._execute(self._graph, dict(feeds))
        unknown = [n for n in names if n not in env]
        if unknown:
            raise ValueError(f"unknown output(s) {unknown}")
        return {n: env[n] for n in names}

    # ---- execution ------------------------------------------------------------------------------
    def _is_host_input(self, name: str, t: torch.Tensor) -> bool:
        return name == "attention_metadata"

    def _run_subgraph(self, graph: "_Graph", feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        env = self._execute(graph, dict(feeds), outer=self._scope[-1] if self._scope else None)
        return [env[n] for n in graph.outputs]

    _scope: list = []

    def _execute(self, graph: _Graph, feeds: dict, outer: Mapping | None = None) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = dict(self._consts)
        if outer:
            env.update(outer)
        env.update(feeds)
        self._scope = self._scope + [env]
        try:
            for step in graph.steps:
                if step.folded:
                    continue
                for name, t in zip(step.outputs, self._run_step(step, env)):
                    if name:
                        env[name] = t
        finally:
            self._scope = self._scope[:-1]
        return env

    def _run_step(self, step: _Step, env: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        try:
            inputs = [env[n] if n else None for n in step.inputs]
        except KeyError as exc:
            raise RuntimeError(f"node '{step.name}' ({step.node.op_type}): no value for input {exc}") from None
        if step.variant is not None:
            return step.variant.run(step.node, inputs, step.attrs)
        if any(isinstance(t, torch.Tensor) and t.device != self.device for t in inputs) and \
                any(isinstance(t, torch.Tensor) and t.device == self.device for t in inputs):
            inputs = [t.to(self.device) if isinstance(t, torch.Tensor) and not _is_shape_operand(step.node, i)
                      else t for i, t in enumerate(inputs)]
        try:
            return list(step.impl(inputs, step.attrs, step.ctx))
        except Exception as exc:
            raise RuntimeError(f"node '{step.name}' ({step.node.op_type}) failed: {exc}") from exc


# inputs that are read on the host (shape-like operands) stay where they are
_SHAPE_OPERANDS = {
    "Reshape": {1}, "Expand": {1}, "Slice": {1, 2, 3, 4}, "Unsqueeze": {1}, "Squeeze": {1}, "Tile": {1},
    "ConstantOfShape": {0}, "Range": {0, 1, 2}, "Split": {1}, "TopK": {1}, "Pad": {1, 2, 3},
    "ReduceSum": {1}, "ReduceMean": {1}, "ReduceMax": {1}, "ReduceMin": {1}, "ReduceProd": {1},
    "ReduceL2": {1}, "ReduceSumSquare": {1}, "OneHot": {1}, "CumSum": {1},
}


def _is_shape_operand(node: onnx.NodeProto, index: int) -> bool:
    return index in _SHAPE_OPERANDS.get(node.op_type, ())
