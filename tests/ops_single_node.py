"""Helpers for the op-table tests: run one node through onnxruntime CPU and through pagedkit's table.

A case is one node (op type, domain, attributes) with concrete numpy inputs; `check_case` builds a
single-node model, runs it with onnxruntime 1.32 CPU (the oracle) and with
`pagedkit.runtime.ops.lookup(...)`, and compares every requested output: integers and bools
exactly, floats with max|diff| <= tol * max|ref| (tol 1e-5 for fp32, 1e-3 for fp16). It also checks
that the implementation left its inputs untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from pagedkit.runtime.ops import MS_DOMAIN, OpContext, host_inputs, lookup, node_attributes

RNG = np.random.default_rng(20240611)


def randn(*shape, dtype=np.float32) -> np.ndarray:
    """Standard normal values with no zeros (|x| >= 1e-2)."""
    x = RNG.standard_normal(shape)
    x = np.where(np.abs(x) < 1e-2, 0.5, x)
    return x.astype(dtype)


def uniform(lo: float, hi: float, *shape, dtype=np.float32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


def ints(lo: int, hi: int, *shape, dtype=np.int64, nonzero: bool = False) -> np.ndarray:
    x = RNG.integers(lo, hi, shape)
    if nonzero:
        x = np.where(x == 0, 1, x)
    return x.astype(dtype)


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass
class Case:
    op: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 18
    domain: str = ""
    outputs: int | list[str] = 1  # count, or names with "" for outputs not requested
    tol: float = 1e-5

    def node(self) -> onnx.NodeProto:
        names = [f"x{i}" if a is not None else "" for i, a in enumerate(self.inputs)]
        while names and not names[-1]:
            names.pop()
        outs = [f"y{i}" for i in range(self.outputs)] if isinstance(self.outputs, int) else self.outputs
        return helper.make_node(self.op, names, outs, name=f"{self.op}_node", domain=self.domain or None, **self.attrs)

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"x{i}": a for i, a in enumerate(self.inputs) if a is not None}


def case(op: str, *inputs, id: str | None = None, marks=(), **kw) -> Any:
    """A pytest param for `check_case`; keyword arguments: attrs, opset, domain, outputs, tol."""
    c = Case(op, list(inputs), **kw)
    return pytest.param(c, id=id or op, marks=marks)


def onnx_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    graph = helper.make_graph([node], "single_node", inputs, outputs)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=10)


def run_ort(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    sess = ort.InferenceSession(onnx_model(node, feeds, opset).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_ours(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int, run_subgraph=None,
             device: str = "cpu") -> list:
    fn, inputs, ctx = prepare_ours(node, feeds, opset, run_subgraph, device)
    outs = fn(inputs, node_attributes(node), ctx)
    return [o for o, name in zip(outs, node.output) if name]


def prepare_ours(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int, run_subgraph=None,
                 device: str = "cpu"):
    """(implementation, inputs, ctx); inputs on `device`, except those the op reads on the host (CPU)."""
    fn = lookup(node.domain, node.op_type, opset, node.name)
    on_host = host_inputs(node.domain, node.op_type)
    inputs = [torch.from_numpy(feeds[n]).to("cpu" if i in on_host else device) if n else None
              for i, n in enumerate(node.input)]
    ctx = OpContext(opset=opset, node_name=node.name, num_outputs=len(node.output), device=device,
                    run_subgraph=run_subgraph, requested=tuple(bool(o) for o in node.output))
    return fn, inputs, ctx


def assert_matches(ours: torch.Tensor, ref: np.ndarray, tol: float, what: str) -> None:
    assert ours is not None, f"{what}: no output"
    ours_np = ours.detach().cpu().numpy()
    assert ours_np.dtype == ref.dtype, f"{what}: dtype {ours_np.dtype} != onnxruntime's {ref.dtype}"
    assert ours_np.shape == ref.shape, f"{what}: shape {ours_np.shape} != onnxruntime's {ref.shape}"
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(ours_np, ref, err_msg=what)
        return
    r, o = ref.astype(np.float64), ours_np.astype(np.float64)
    assert np.array_equal(np.isnan(r), np.isnan(o)), f"{what}: NaN positions differ"
    finite = ~np.isnan(r)
    if not finite.any():
        return
    diff = np.abs(r[finite] - o[finite])
    diff = np.where(r[finite] == o[finite], 0.0, diff)  # equal infinities
    bound = tol * np.max(np.abs(r[finite][np.isfinite(r[finite])]), initial=0.0)
    assert diff.max() <= bound, f"{what}: max|diff| {diff.max():.3e} > {tol} * max|ref| = {bound:.3e}"


def check_case(c: Case, run_subgraph=None) -> None:
    node, feeds = c.node(), c.feeds()
    before = {k: v.copy() for k, v in feeds.items()}
    ref = run_ort(node, feeds, c.opset)
    ours = run_ours(node, feeds, c.opset, run_subgraph)
    assert len(ours) == len(ref), f"{c.op}: {len(ours)} outputs, onnxruntime gives {len(ref)}"
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_matches(o, r, c.tol, f"{c.op} output {i}")
    for k, v in feeds.items():
        assert np.array_equal(v, before[k], equal_nan=True), f"{c.op}: input {k} was modified"


def nbits_inputs(n: int, k: int, block: int, zp: str = "none", bias: bool = False, dtype=np.float32,
                 bits: int = 4, m: tuple = (2, 3)) -> list:
    """Random MatMulNBits inputs [A, B, scales, zero_points (none / packed uint8 / float), g_idx None, bias]."""
    kb = -(-k // block)
    b = ints(0, 256, n, kb, block * bits // 8, dtype=np.uint8)
    scales = (uniform(0.02, 0.1, n, kb) * np.sign(randn(n, kb))).astype(dtype)
    zero_points = {"none": None,
                   "packed": ints(0, 256, n, -(-kb * bits // 8), dtype=np.uint8),
                   "float": uniform(0, 2 ** bits - 1, n, kb).round().astype(dtype)}[zp]
    return [randn(*m, k, dtype=dtype), b, scales, zero_points, None, randn(n, dtype=dtype) if bias else None]
