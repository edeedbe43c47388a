"""The op table on CUDA tensors. Every case of the onnxruntime comparisons, run on the GPU (inputs
the op reads on the host stay on the CPU, as a session places them), matches the same
implementation on the CPU, which the other test files check against onnxruntime CPU: integers
exactly, floats within the case's norm-relative tolerance. Outputs stay on the GPU (Shape and Size
return host tensors), and no op synchronizes with the host (a prerequisite of CUDA-graph capture),
except the inherent ones: NonZero, MoE's per-expert counts on large batches, and Constant, which
copies its attribute to the device (a session folds Constant nodes into initializers)."""

from __future__ import annotations

import pytest
import torch

import test_ops_vs_ort as part1
import test_ops_vs_ort_llm as part2
from ops_single_node import assert_matches, node_attributes, prepare_ours, run_ours
from pagedkit.runtime.ops import has_host_outputs

pytestmark = pytest.mark.gpu

ALL = (part1.ELEMENTWISE + part1.ACTIVATIONS + part1.SHAPE + part1.INDEXING + part1.REDUCE + part1.MATH
       + part2.NORMS + part2.ROTARY + part2.QUANT + part2.MOE)


@pytest.mark.parametrize("c", ALL)
def test_op_on_cuda_matches_cpu(c):
    node, feeds = c.node(), c.feeds()
    cpu = run_ours(node, feeds, c.opset)
    gpu = run_ours(node, feeds, c.opset, device="cuda")
    assert len(gpu) == len(cpu)
    want = "cpu" if has_host_outputs(node.domain, node.op_type) else "cuda"
    for i, (g, r) in enumerate(zip(gpu, cpu)):
        assert g.device.type == want, f"{c.op} output {i} is on {g.device}, expected {want}"
        assert_matches(g, r.numpy(), c.tol, f"{c.op} output {i} on cuda")


def _syncs_inherently(c) -> bool:
    if c.op == "MoE":  # decode-sized batches gather expert weights; larger ones read per-expert counts
        tokens, experts, k = c.inputs[0].shape[0], c.inputs[1].shape[-1], c.attrs.get("k", 1)
        return tokens * k > experts
    # Constant copies its attribute data to the device (sessions fold it into an initializer)
    return c.op in ("NonZero", "Constant")


@pytest.mark.parametrize("c", [p for p in ALL if not _syncs_inherently(p.values[0])])
def test_op_does_not_sync_with_the_host(c):
    node, feeds = c.node(), c.feeds()
    fn, inputs, ctx = prepare_ours(node, feeds, c.opset, device="cuda")
    attrs = node_attributes(node)
    fn(inputs, attrs, ctx)  # warm up (lazy CUDA init, kernel loading)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(inputs, attrs, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
