"""pagedkit.runtime.ops vs onnxruntime CPU, part 2: the LLM ops (norms, rotary, MatMulNBits, GatherBlockQuantized,
Quantize/DequantizeLinear, MoE, QMoE, If), plus lookup errors, coverage of the whole table and the doc.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import test_ops_vs_ort as part1
from ops_single_node import (assert_matches, case, check_case, i64, ints, nbits_inputs, randn, run_ort, run_ours,
                             uniform)
from pagedkit.runtime.ops import OPS, OpContext, lookup, node_attributes, supported_ops_markdown

MS = dict(domain="com.microsoft")
F16 = dict(tol=1e-3)

NORMS = [
    case("LayerNormalization", randn(2, 3, 16), randn(16), randn(16), opset=17, id="LayerNorm"),
    case("LayerNormalization", randn(2, 3, 4) + 2, randn(3, 4), attrs=dict(axis=1, epsilon=1e-3), outputs=3,
         opset=17, id="LayerNorm-axis1-stats"),
    case("LayerNormalization", randn(4, 32, dtype=np.float16), randn(32, dtype=np.float16), opset=17,
         id="LayerNorm-f16", **F16),
    case("RMSNormalization", randn(2, 3, 16), randn(16), opset=23, id="RMSNorm"),
    case("RMSNormalization", randn(2, 3, 4), randn(3, 4), attrs=dict(axis=-2, epsilon=1e-3), opset=23,
         id="RMSNorm-axis-2"),
    case("SimplifiedLayerNormalization", randn(2, 3, 16), randn(16), outputs=2, opset=17, id="SimplifiedLN"),
    case("SimplifiedLayerNormalization", randn(4, 32, dtype=np.float16), randn(32, dtype=np.float16),
         attrs=dict(epsilon=1e-6), opset=17, id="SimplifiedLN-f16", **F16),
    case("SkipLayerNormalization", randn(2, 3, 16), randn(2, 3, 16), randn(16), randn(16), randn(16),
         outputs=4, id="SkipLN-all", **MS),
    case("SkipLayerNormalization", randn(2, 3, 16), randn(3, 16), randn(16), id="SkipLN-bcast-skip", **MS),
    case("SkipSimplifiedLayerNormalization", randn(5, 16), randn(5, 16), randn(16), randn(16),
         attrs=dict(epsilon=1e-6), outputs=["y0", "", "", "y3"], id="SkipSimplifiedLN-2d-bias", **MS),
    case("SkipSimplifiedLayerNormalization", randn(2, 3, 16), randn(2, 3, 16), randn(16), outputs=4,
         id="SkipSimplifiedLN-stats", **MS),
    case("SkipSimplifiedLayerNormalization", randn(2, 3, 32, dtype=np.float16), randn(2, 3, 32, dtype=np.float16),
         randn(32, dtype=np.float16), outputs=["y0", "", "", "y3"], id="SkipSimplifiedLN-f16", **MS, **F16),
]


def cos_sin(max_pos: int, half: int, dtype=np.float32):
    angles = np.arange(max_pos)[:, None] * uniform(0.01, 1.0, half)[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


B, S, N, H = 2, 3, 4, 8
COS, SIN = cos_sin(16, H // 2)
COS_P, SIN_P = cos_sin(16, 2)  # partial rotation: rotary_embedding_dim 4
POS = ints(0, 16, B, S)
ROTARY = [
    case("RotaryEmbedding", randn(B, N, S, H), COS, SIN, POS, opset=23, id="onnx-Rotary-4d"),
    case("RotaryEmbedding", randn(B, S, N * H), COS, SIN, POS, attrs=dict(num_heads=N, interleaved=1), opset=23,
         id="onnx-Rotary-3d-interleaved"),
    case("RotaryEmbedding", randn(B, N, S, H), COS_P, SIN_P, POS, attrs=dict(rotary_embedding_dim=4), opset=23,
         id="onnx-Rotary-partial"),
    case("RotaryEmbedding", randn(B, N, S, H), COS[POS], SIN[POS], opset=23, id="onnx-Rotary-no-pos"),
    case("RotaryEmbedding", randn(B, S, N * H), POS, COS, SIN, id="ms-Rotary-3d", **MS),
    case("RotaryEmbedding", randn(B, N, S, H), POS, COS, SIN, attrs=dict(interleaved=1), id="ms-Rotary-4d-inter", **MS),
    case("RotaryEmbedding", randn(B, S, N * H), i64(5), COS, SIN, id="ms-Rotary-offset", **MS),
    case("RotaryEmbedding", randn(B, S, N * H), POS, COS_P, SIN_P, attrs=dict(num_heads=N, rotary_embedding_dim=4),
         id="ms-Rotary-partial", **MS),
    case("RotaryEmbedding", randn(B, S, N * H, dtype=np.float16), POS, COS.astype(np.float16),
         SIN.astype(np.float16), id="ms-Rotary-f16", **MS, **F16),
]


def nbits_case(bits: int, k: int, n: int = 12, block: int = 32, zp: str = "none", bias: bool = False,
               dtype=np.float32, m: tuple = (2, 3)):
    ins = nbits_inputs(n, k, block, zp, bias, dtype, bits, m)
    name = f"MatMulNBits-{bits}b-K{k}-{zp}" + ("-bias" if bias else "") + ("-f16" if dtype == np.float16 else "")
    return case("MatMulNBits", *ins, attrs=dict(K=k, N=n, bits=bits, block_size=block), id=name,
                tol=1e-3 if dtype == np.float16 else 1e-5, **MS)


QUANT = [
    nbits_case(4, 64),
    nbits_case(4, 48, zp="packed", bias=True),
    nbits_case(4, 64, zp="float", block=16),
    nbits_case(8, 64, zp="packed"),
    nbits_case(2, 64, zp="packed", m=(5,)),
    nbits_case(4, 64, zp="packed", dtype=np.float16),
    case("GatherBlockQuantized", ints(0, 256, 20, 16, dtype=np.uint8), ints(-20, 20, 2, 3), uniform(0.01, 0.2, 20, 1),
         ints(0, 256, 20, 1, dtype=np.uint8), attrs=dict(bits=4, block_size=32), id="GatherBlockQuantized-u8-zp",
         **MS),  # the other forms (int4 / uint4 / float8 data, axes): tests/test_gather_block_quantized.py
    case("DequantizeLinear", ints(-128, 128, 3, 4, dtype=np.int8), np.array(0.05, np.float32), np.array(3, np.int8),
         id="Dequantize-tensor"),
    case("DequantizeLinear", ints(0, 256, 3, 4, dtype=np.uint8), uniform(0.01, 0.1, 4), ints(0, 256, 4, dtype=np.uint8),
         attrs=dict(axis=1), id="Dequantize-axis"),
    case("DequantizeLinear", ints(-128, 128, 4, 6, dtype=np.int8), uniform(0.01, 0.1, 4, 2),
         attrs=dict(axis=1, block_size=3), opset=21, id="Dequantize-blocked"),
    case("QuantizeLinear", randn(3, 4) * 3, np.array(0.05, np.float32), id="Quantize-uint8"),
    case("QuantizeLinear", randn(3, 4) * 3, uniform(0.01, 0.1, 3), ints(-20, 20, 3, dtype=np.int8), attrs=dict(axis=0),
         id="Quantize-int8-axis"),
]


def moe_case(tokens: int, act: str, k: int, normalize: int, bias: bool, attrs=None, experts: int = 4,
             hidden: int = 8, inter: int = 6, dtype=np.float32, id=None):
    width = 2 if act == "swiglu" else 1  # fc1 rows per intermediate channel (gate and up)
    router = randn(tokens, experts, dtype=dtype) * 2
    ins = [randn(tokens, hidden, dtype=dtype), router,
           randn(experts, width * inter, hidden, dtype=dtype) * 0.5,
           randn(experts, width * inter, dtype=dtype) if bias else None,
           randn(experts, hidden, inter, dtype=dtype) * 0.5,
           randn(experts, hidden, dtype=dtype) if bias else None]
    a = dict(k=k, activation_type=act, normalize_routing_weights=normalize, **(attrs or {}))
    if act == "swiglu":
        a.setdefault("swiglu_fusion", 1)
    return case("MoE", *ins, attrs=a, id=id, tol=1e-3 if dtype == np.float16 else 1e-5, **MS)


GPT_OSS = dict(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
MOE = [
    moe_case(7, "swiglu", 2, 1, True, GPT_OSS, id="MoE-swiglu-gptoss-grouped"),
    moe_case(1, "swiglu", 2, 1, True, GPT_OSS, id="MoE-swiglu-gptoss-decode"),
    moe_case(5, "swiglu", 2, 0, False, dict(swiglu_limit=0.5), id="MoE-swiglu-limit"),
    moe_case(6, "relu", 1, 0, False, id="MoE-relu-top1"),
    moe_case(6, "gelu", 2, 1, True, id="MoE-gelu"),
    moe_case(2, "silu", 2, 0, True, id="MoE-silu-decode"),
    moe_case(6, "identity", 3, 1, False, id="MoE-identity-top3"),
    moe_case(6, "swiglu", 2, 1, True, GPT_OSS, dtype=np.float16, id="MoE-swiglu-f16"),
]


def qmoe_case(tokens: int, bits: int = 4, block: int = 32, zp: bool = False, experts: int = 4, hidden: int = 64,
              inter: int = 32, id=None):
    """QMoE as genai's CPU builder writes it for GPT-OSS (interleaved swiglu, quant_type int, raw [E, N, K/pack]
    weights), with the other integer forms: 8 bits, zero points, per-row scales (block 0 = no block_size)."""
    def weights(n, k):
        q = ints(0, 256, experts, n, k * bits // 8, dtype=np.uint8)
        g = [k // block] if block else []
        sc = uniform(0.01, 0.05, experts, n, *g) * np.sign(randn(experts, n, *g))
        z = None
        if zp:
            z = ints(0, 256, experts, *([n, math.ceil(g[0] * bits / 8)] if block else [math.ceil(n * bits / 8)]),
                     dtype=np.uint8)
        return q, sc.astype(np.float32), z
    q1, s1, z1 = weights(2 * inter, hidden)
    q2, s2, z2 = weights(hidden, inter)
    ins = [randn(tokens, hidden), randn(tokens, experts) * 2, q1, s1, randn(experts, 2 * inter), q2, s2,
           randn(experts, hidden), None, None, None, z1, z2]
    a = dict(k=2, activation_type="swiglu", normalize_routing_weights=1, expert_weight_bits=bits, swiglu_fusion=1,
             **GPT_OSS) | (dict(block_size=block) if block else {})
    return case("QMoE", *ins, attrs=a, id=id, **MS)


QMOE = [
    qmoe_case(7, id="QMoE-4b-b32-prefill"),
    qmoe_case(1, id="QMoE-4b-b32-decode"),
    qmoe_case(5, zp=True, block=64, inter=64, id="QMoE-4b-b64-zp"),
    qmoe_case(6, bits=8, id="QMoE-8b-b32"),
    qmoe_case(6, block=0, id="QMoE-4b-per-row"),
    qmoe_case(6, bits=8, block=0, zp=True, id="QMoE-8b-per-row-zp"),
]


@pytest.mark.parametrize("c", NORMS + ROTARY + QUANT + MOE + QMOE)
def test_llm_op_matches_onnxruntime(c):
    check_case(c)


@pytest.mark.parametrize("c", QMOE[:3])
def test_qmoe_prepacked_matches_unpacked(c):
    """The prepack step's dequantized experts (scales / zero points absorbed) give the per-call result."""
    from pagedkit.runtime.ops.moe import prepack_qmoe, qmoe

    node = c.node()
    ins = [torch.from_numpy(a) if a is not None else None for a in c.inputs]
    attrs, ctx = node_attributes(node), OpContext(node_name="q")
    rep = prepack_qmoe([None, None, *ins[2:]], attrs, ctx)
    assert rep[2].dtype == torch.float32 and rep[5].shape == (4, 64, c.inputs[5].shape[2] * 2) and 3 in rep and 6 in rep
    assert "dequantized" in rep[2].describe()
    packed = [rep.get(i, x) for i, x in enumerate(ins)]
    torch.testing.assert_close(qmoe(packed, attrs, ctx)[0], qmoe(ins, attrs, ctx)[0], rtol=0, atol=0)


def test_moe_3d_input_matches_2d():
    c = moe_case(6, "swiglu", 2, 1, True, GPT_OSS).values[0]
    c2 = moe_case(6, "swiglu", 2, 1, True, GPT_OSS).values[0]
    c2.inputs[0] = c.inputs[0].reshape(2, 3, -1)
    c2.inputs[1:] = c.inputs[1:]
    check_case(c2)  # 3D [B, S, hidden] vs onnxruntime


def _tiny_graph_runner(outer: dict[str, torch.Tensor], opset: int):
    """The subgraph runner a session provides: nodes in order, names resolved in the subgraph then outside."""
    def run_subgraph(graph, feeds):
        env = {**outer, **feeds}
        for node in graph.node:
            fn = lookup(node.domain, node.op_type, opset, node.name)
            ctx = OpContext(opset=opset, node_name=node.name, num_outputs=len(node.output), run_subgraph=run_subgraph)
            outs = fn([env[n] if n else None for n in node.input], node_attributes(node), ctx)
            env.update(zip(node.output, outs))
        return [env[o.name] for o in graph.output]

    return run_subgraph


@pytest.mark.parametrize("cond", [True, False])
def test_if_runs_the_chosen_branch(cond):
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    then_g = helper.make_graph([helper.make_node("Add", ["x1", "x2"], ["out"])], "then", [], [out])
    else_g = helper.make_graph([helper.make_node("Mul", ["x1", "x2"], ["t"]),
                                helper.make_node("Neg", ["t"], ["out"])], "else", [], [out])
    node = helper.make_node("If", ["x0"], ["y0"], name="if_node", then_branch=then_g, else_branch=else_g)
    feeds = {"x0": np.array(cond), "x1": randn(3, 4), "x2": randn(3, 4)}  # x1, x2 reach the branches from outside
    outer = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref = run_ort(node, feeds, 17)
    ours = run_ours(node, feeds, 17, run_subgraph=_tiny_graph_runner(outer, 17))
    assert_matches(ours[0], ref[0], 1e-5, f"If output (cond={cond})")


def test_if_without_runner_is_a_clear_error():
    fn = lookup("", "If", 17)
    with pytest.raises(RuntimeError, match="If node 'cond_node'.*run_subgraph"):
        fn([torch.tensor(True)], {"then_branch": None, "else_branch": None}, OpContext(node_name="cond_node"))


def test_lookup_unknown_op_names_it():
    with pytest.raises(NotImplementedError, match=r"ai\.onnx::NoSuchOp \(node 'n7'\)"):
        lookup("", "NoSuchOp", 17, node_name="n7")
    with pytest.raises(NotImplementedError, match=r"com\.microsoft::QAttention"):
        lookup("com.microsoft", "QAttention", 1)
    with pytest.raises(NotImplementedError, match=r"ai\.onnx::FancyOp"):
        lookup("ai.onnx", "FancyOp", 17)


def test_lookup_domains_and_opset_versions():
    assert lookup("ai.onnx", "Add", 17) is lookup("", "Add", 17) is OPS[("", "Add")]
    assert lookup("com.microsoft", "RotaryEmbedding", 1) is not lookup("", "RotaryEmbedding", 23)
    lookup("", "Reshape", 25)  # later Reshape versions add element types only
    with pytest.raises(NotImplementedError, match=r"ai\.onnx::Cast \(node 'c'\) at opset 28 selects version 28"):
        lookup("", "Cast", 28, node_name="c")


def _tested_ops() -> set[tuple[str, str]]:
    params = (part1.ELEMENTWISE + part1.ACTIVATIONS + part1.SHAPE + part1.INDEXING + part1.REDUCE + part1.MATH
              + NORMS + ROTARY + QUANT + MOE + QMOE)
    tested = {(p.values[0].domain, p.values[0].op) for p in params}
    # pagedkit.fused::SiluMul: tests/test_fuse.py compares fused graphs with onnxruntime on the unfused ones
    # pagedkit.fused::SelectRows: tests/test_logit_rows.py compares the rows with onnxruntime on the unfused graph
    # pagedkit.fused::Linear / NormLinear / SiluLinear: tests/test_decode_linear.py compares a fused block with
    # onnxruntime on the unfused graph (test_fused_block_against_onnxruntime)
    # pagedkit.ort::Segment: runs onnxruntime itself (tests/test_delegate.py checks the whole session against HF)
    # com.microsoft::AllReduce / AllGather: onnxruntime's CPU build has no collective kernels; tests/test_tp_collectives.py
    # checks them on two gloo ranks against numpy sums / concatenations
    return tested | {("", "If"), ("pagedkit.fused", "SiluMul"), ("pagedkit.fused", "SelectRows"),
                     ("pagedkit.fused", "Linear"), ("pagedkit.fused", "NormLinear"), ("pagedkit.fused", "SiluLinear"),
                     ("pagedkit.ort", "Segment"),
                     ("com.microsoft", "AllReduce"), ("com.microsoft", "AllGather")}


def test_every_table_op_is_checked_against_onnxruntime():
    untested = sorted(set(OPS) - _tested_ops())
    assert not untested, f"ops in the table without an onnxruntime comparison: {untested}"
    assert len(OPS) >= 45


def test_doc_lists_exactly_the_table():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "runtime-ops.md").read_text()
    m = re.search(r"<!-- ops:begin -->\n(.*?)<!-- ops:end -->", doc, re.S)
    assert m, "docs/runtime-ops.md lacks the <!-- ops:begin --> / <!-- ops:end --> section"
    assert m.group(1) == supported_ops_markdown(), (
        "docs/runtime-ops.md is stale: regenerate with python -m pagedkit.runtime.ops --write-doc")
    listed = {(d if d != "ai.onnx" else "", op.strip()) for d, _, ops in re.findall(r"^\| (\S+) \| `(\S+)` \| (.*) \|$",
                                                                                     m.group(1), re.M)
              for op in ops.split(",")}
    assert listed == set(OPS)


def test_doc_example_runs(capsys):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "runtime-ops.md").read_text()
    exec(re.search(r"```python\n(.*?)```", doc, re.S).group(1), {})
    out = capsys.readouterr().out
    assert out.startswith("True\n") and "com.microsoft::QAttention (node 'attn0')" in out
