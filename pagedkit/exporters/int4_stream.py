"""`--weights int4` without the float model in memory: quantize.quantize_weights_int4's rewrite done on the graph
builder before any weight is evaluated, its int4 tensors lazy and quantized chunk by chunk as they are written.

The graph is the one onnxruntime's MatMulNBitsQuantizer gives (quantize.py): every MatMul over a 2-D constant
weight B [K, N] (the LM head unless `lm_head` is False; a tied LM head first untied into `lm_head.MatMul.weight`
= the table transposed) becomes `{name}_Q4` MatMulNBits over `{B}_Q4` uint8 [N, K / block, block / 2] and
`{B}_scales` [N, K / block] (B's type; bfloat16 weights quantized in float32, scales rounded to bfloat16),
initializers appended after the others in node order, unused float weights dropped; a tied embedding reads the
head's codes through GatherBlockQuantized; com.microsoft MoE nodes become QMoE (quantize_moe.py). The codes
are those of onnxruntime's own kernel (`quantize_matmul_4bits`, symmetric) over the float weight as the float
export would store it: a chunk of output columns of B is a chunk of rows of the checkpoint weight, quantized
alone (blocks run along K within a column), so the int4 weights are written 64 MiB at a time from the rows of the
checkpoint they come from (slicing.narrow), and equal the in-memory quantizer's byte for byte.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch

from ..interface import dtypes
from .graph import GraphBuilder, Pending
from .lazy import LazyTensor
from .quantize import EMBED_GATHER, EMBED_TABLE, LM_HEAD_MATMUL, TIED_HEAD_WEIGHT
from .quantize_moe import MOE_BIAS_TO_QMOE, MOE_TO_QMOE
from .slicing import narrow


def _float_chunk(value, dim: int, a: int, b: int, elem_type: int) -> np.ndarray:
    """value[a:b] along dim as the float initializer stores it, as numpy (bfloat16: float32)."""
    t = narrow(value, dim, a, b).to(dtypes.torch_dtype(elem_type))
    return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()


class _MatMulQ4:
    """The int4 form of one MatMul weight B [K, N]: codes and scales of output columns, quantized on demand."""

    def __init__(self, p: Pending, block: int):
        self.value, self.elem_type, self.block = p.value, p.elem_type, block
        self.k, self.n = (int(d) for d in p.value.shape)
        self.kb = -(-self.k // block)
        bf16 = p.elem_type == onnx.TensorProto.BFLOAT16
        self.np_dtype = np.float32 if bf16 else dtypes.numpy_dtype(p.elem_type)
        self.scale_type = p.elem_type
        self._scales: np.ndarray | None = None
        self._done = 0

    def codes(self, a: int, b: int) -> torch.Tensor:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits

        w = _float_chunk(self.value, 1, a, b, self.elem_type).astype(self.np_dtype, copy=False)  # [K, n]
        pad = self.kb * self.block - self.k
        if pad:
            w = np.pad(w, ((0, pad), (0, 0)))
        w = np.ascontiguousarray(w)
        n = b - a
        packed = np.zeros((n, self.kb, self.block // 2), np.uint8)
        scales = np.zeros((n, self.kb), self.np_dtype)
        zero = np.zeros((n, (self.kb + 1) // 2), np.uint8)
        quantize_matmul_4bits(packed, w, scales, zero, self.block, n, self.k, True)  # K: as onnxruntime calls it
        if self._scales is None:
            self._scales = np.zeros((self.n, self.kb), self.np_dtype)
        self._scales[a:b] = scales
        self._done += n
        return torch.from_numpy(packed)

    def scales(self) -> torch.Tensor:
        if self._scales is None or self._done < self.n:  # the codes were not all written first
            self._done = 0
            self.codes(0, self.n)
        s, self._scales = torch.from_numpy(self._scales), None
        return s.to(dtypes.torch_dtype(self.scale_type))

    def lazy_codes(self) -> LazyTensor:
        meta = torch.empty(self.n, self.kb, self.block // 2, dtype=torch.uint8, device="meta")
        return LazyTensor(meta, lambda: self.codes(0, self.n), lambda d, a, b: self.codes(a, b) if d == 0 else None)

    def lazy_scales(self) -> LazyTensor:
        meta = torch.empty(self.n, self.kb, dtype=dtypes.torch_dtype(self.scale_type), device="meta")
        return LazyTensor(meta, self.scales)


class _ExpertsQ4:
    """The QMoE form of one MoE weight [E, N, K]: per expert, K quantized in blocks (quantize_moe's layout)."""

    def __init__(self, p: Pending, block: int):
        self.value, self.elem_type, self.block = p.value, p.elem_type, block
        self.e, self.n, self.k = (int(d) for d in p.value.shape)
        self.np_dtype = np.float32 if p.elem_type == onnx.TensorProto.BFLOAT16 else dtypes.numpy_dtype(p.elem_type)
        self._scales: dict[int, np.ndarray] = {}

    def codes(self, a: int, b: int) -> torch.Tensor:
        from .quantize_moe import quantize_experts_4bits

        w = _float_chunk(self.value, 0, a, b, self.elem_type).astype(self.np_dtype, copy=False)
        codes, scales = quantize_experts_4bits(w, self.block)
        for j in range(b - a):
            self._scales[a + j] = scales[j]
        return torch.from_numpy(codes)

    def scales(self) -> torch.Tensor:
        if len(self._scales) < self.e:
            self._scales.clear()
            self.codes(0, self.e)
        s = np.stack([self._scales.pop(j) for j in range(self.e)])
        return torch.from_numpy(s).to(dtypes.torch_dtype(self.elem_type))

    def lazy_codes(self) -> LazyTensor:
        meta = torch.empty(self.e, self.n, self.k // 2, dtype=torch.uint8, device="meta")
        return LazyTensor(meta, lambda: self.codes(0, self.e), lambda d, a, b: self.codes(a, b) if d == 0 else None)

    def lazy_scales(self) -> LazyTensor:
        meta = torch.empty(self.e, self.n, self.k // self.block, dtype=dtypes.torch_dtype(self.elem_type),
                           device="meta")
        return LazyTensor(meta, self.scales)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class _Builder:
    """Node / initializer bookkeeping over a GraphBuilder, as the proto-level rewrite sees a graph."""

    def __init__(self, g: GraphBuilder):
        self.g = g
        self.inits = {p.name: p for p in g.initializers}

    def users(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.g.nodes if name in n.input]

    def add(self, name: str, value, elem_type: int) -> str:
        p = Pending(name, value, elem_type)
        self.g.initializers.append(p)
        self.inits[name] = p
        self.g.vi[name] = (elem_type, tuple(int(d) for d in value.shape))
        return name

    def const_i64(self, values: list[int]) -> str:
        name = f"/model/constants/INT64/{values}"
        if name not in self.inits:
            self.add(name, torch.tensor(values, dtype=torch.int64), onnx.TensorProto.INT64)
        return name

    def drop_unused(self) -> None:
        used = {i for n in self.g.nodes for i in n.input}
        self.g.initializers[:] = [p for p in self.g.initializers if p.name in used]
        self.inits = {p.name: p for p in self.g.initializers}


def quantize_builder_int4(g: GraphBuilder, block_size: int, accuracy_level: int, lm_head: bool = True) -> None:
    """quantize.quantize_weights_int4 on the builder (module doc), in place; nothing is evaluated."""
    b = _Builder(g)
    tied = _tied_head(b) if lm_head else None
    if tied is not None:
        idx = g.nodes.index(tied)
        b.add(TIED_HEAD_WEIGHT, b.inits[EMBED_TABLE].value.t(), b.inits[EMBED_TABLE].elem_type)
        g.nodes[idx] = onnx.helper.make_node("MatMul", [tied.input[0], TIED_HEAD_WEIGHT], list(tied.output),
                                             name=LM_HEAD_MATMUL)
    for idx, node in enumerate(list(g.nodes)):
        if node.op_type != "MatMul" or (not lm_head and node.name == LM_HEAD_MATMUL):
            continue
        p = b.inits.get(node.input[1])
        if p is None or len(p.value.shape) != 2:
            continue
        q = _MatMulQ4(p, block_size)
        ins = [node.input[0], b.add(f"{p.name}_Q4", q.lazy_codes(), onnx.TensorProto.UINT8),
               b.add(f"{p.name}_scales", q.lazy_scales(), q.scale_type)]
        attrs = dict(K=q.k, N=q.n, bits=4, block_size=block_size)
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        g.nodes[idx] = onnx.helper.make_node("MatMulNBits", ins, list(node.output), name=f"{node.name}_Q4",
                                             domain="com.microsoft", **attrs)
    b.drop_unused()
    if tied is not None:
        _quantized_embedding(b, tied.output[0])
    _qmoe(b, block_size)


def _tied_head(b: _Builder) -> onnx.NodeProto | None:
    """quantize._tied_head on the builder."""
    users = b.users(EMBED_TABLE)
    gemm = [n for n in users if n.op_type == "Gemm" and list(n.input) == [n.input[0], EMBED_TABLE]]
    gather = [n for n in users if n.op_type == "Gather" and n.input[0] == EMBED_TABLE]
    if len(gemm) != 1 or len(gather) != 1 or len(users) != 2 or EMBED_TABLE not in b.inits:
        return None
    return gemm[0] if _attrs(gemm[0]) == {"transB": 1} else None


def _quantized_embedding(b: _Builder, logits_src: str) -> None:
    """quantize._quantized_embedding on the builder."""
    g = b.g
    head = next(n for n in g.nodes if n.op_type == "MatMulNBits" and n.output[0] == logits_src)
    attrs = _attrs(head)
    k, n_out, block, bits = attrs["K"], attrs["N"], attrs["block_size"], attrs["bits"]
    packed, scales = head.input[1], head.input[2]
    k_blocks = -(-k // block)
    gather = next(n for n in g.nodes if n.op_type == "Gather" and n.input[0] == EMBED_TABLE)
    base = EMBED_GATHER.rsplit("/", 1)[0]
    row = k_blocks * block * bits // 8
    nodes = [onnx.helper.make_node("Reshape", [packed, b.const_i64([n_out, row])], [f"{base}/Reshape/output_0"],
                                   name=f"{base}/Reshape")]
    out = f"{base}/GatherBlockQuantized/output_0"
    nodes.append(onnx.helper.make_node("GatherBlockQuantized", [f"{base}/Reshape/output_0", gather.input[1], scales],
                                       [out], name=f"{base}/GatherBlockQuantized", domain="com.microsoft", bits=bits,
                                       block_size=block, gather_axis=0, quantize_axis=1))
    if k_blocks * block != k:
        sl = [out, b.const_i64([0]), b.const_i64([k]), b.const_i64([-1])]
        out = f"{base}/Slice/output_0"
        nodes.append(onnx.helper.make_node("Slice", sl, [out], name=f"{base}/Slice"))
    old = gather.output[0]
    idx = g.nodes.index(gather)
    g.nodes[idx:idx + 1] = nodes
    for node in g.nodes:
        for j, name in enumerate(node.input):
            if name == old:
                node.input[j] = out
    if not b.users(EMBED_TABLE):
        g.initializers[:] = [p for p in g.initializers if p.name != EMBED_TABLE]
        b.inits.pop(EMBED_TABLE, None)


def _qmoe(b: _Builder, block_size: int) -> None:
    """quantize_moe.quantize_moe_int4 on the builder."""
    g = b.g
    for idx, node in enumerate(list(g.nodes)):
        if node.op_type != "MoE" or node.domain != "com.microsoft":
            continue
        ins = list(node.input) + [""] * (8 - len(node.input))
        weights = {i: b.inits.get(ins[i]) for i in MOE_TO_QMOE if ins[i]}
        if any(p is None for p in weights.values()):
            continue
        if any(int(p.value.shape[2]) % block_size or int(p.value.shape[2]) % 2 for p in weights.values()):
            continue
        new_in = [ins[0], ins[1]] + [""] * 9
        for i, p in weights.items():
            q = _ExpertsQ4(p, block_size)
            w_slot, s_slot = MOE_TO_QMOE[i]
            new_in[w_slot] = b.add(f"{p.name}_Q4", q.lazy_codes(), onnx.TensorProto.UINT8)
            new_in[s_slot] = b.add(f"{p.name}_scales", q.lazy_scales(), p.elem_type)
            if sum(p.name in n.input for n in g.nodes) == 1:
                g.initializers[:] = [x for x in g.initializers if x.name != p.name]
        for i, j in MOE_BIAS_TO_QMOE.items():
            new_in[j] = ins[i]
        while new_in and not new_in[-1]:
            new_in.pop()
        attrs = _attrs(node)
        attrs.update(expert_weight_bits=4, block_size=block_size, weights_prepacked=0)
        g.nodes[idx] = onnx.helper.make_node("QMoE", new_in, list(node.output), name=f"{node.name}_Q4",
                                             domain="com.microsoft", **attrs)

