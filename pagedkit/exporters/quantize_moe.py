"""`--weights int4` for mixture-of-experts layers: every com.microsoft::MoE node becomes a com.microsoft::QMoE
node over 4-bit expert weights, so that experts always run in one MoE / QMoE node (the MatMuls around them go
to MatMulNBits through quantize.quantize_weights_int4, which calls this last).

Layout (onnxruntime's QMoE schema, quant_type 'int', weights_prepacked 0 = the raw layout, as onnxruntime-genai's
builder writes for its CPU path):
  fcX_experts_weights uint8 [E, N, K / 2]: expert e's weight W_e [N, K] (N output features, K inputs: fc1
      [E, fusion * I, H] with gate / up interleaved when swiglu_fusion=1, fc2 [E, H, I], fc3 [E, I, H]) quantized
      along K by onnxruntime's own MatMulNBits quantizer (quantize_matmul_4bits: symmetric, block `block_size`,
      the block's largest-magnitude weight mapped exactly to code 0 by a signed scale), element 2j of a row in the
      low nibble and 2j + 1 in the high nibble — each expert's rows are MatMulNBits' B for that expert;
  fcX_scales [E, N, K / block_size] in the node's T (float16 / float32 exports: quantized in that type;
      bfloat16: in float32, the scales then rounded to bfloat16);
  no zero points (the default 8): W_e[n, k] = (code - 8) * scale[e, n, k / block_size].
Biases stay float (fcX_experts_bias, T). Attributes: the MoE node's own (k, activation_type, swiglu_fusion,
activation_alpha / beta, swiglu_limit, normalize_routing_weights, use_sparse_mixer) plus expert_weight_bits 4,
block_size, weights_prepacked 0; no accuracy_level (0: the expert products keep float activations, as the
builder's QMoE). QMoE needs the hidden and the expert inner size both multiples of the block: a node where
they are not keeps float experts (a MoE node) and is named in the returned list.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

MOE_TO_QMOE = {2: (2, 3), 4: (5, 6), 6: (8, 9)}  # MoE weight input -> QMoE weight / scales inputs
MOE_BIAS_TO_QMOE = {3: 4, 5: 7, 7: 10}


def quantize_experts_4bits(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """w [E, N, K] float16 / float32 -> (codes uint8 [E, N, K / 2], scales [E, N, K / block_size], w's dtype)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    e, n, k = w.shape
    blocks = k // block_size
    packed = np.zeros((e, n, blocks, block_size // 2), np.uint8)
    scales = np.zeros((e, n * blocks), w.dtype)
    zero_points = np.zeros((n * ((blocks + 1) // 2),), np.uint8)  # unused (symmetric)
    for j in range(e):  # the quantizer's weight is [K, N] (a MatMul's B)
        quantize_matmul_4bits(packed[j], np.ascontiguousarray(w[j].T), scales[j], zero_points, block_size, n, k, True)
    return packed.reshape(e, n, k // 2), scales.reshape(e, n, blocks)


def _array(t: onnx.TensorProto) -> np.ndarray:
    a = numpy_helper.to_array(t)
    return a if a.dtype in (np.float16, np.float32) else a.astype(np.float32)  # bfloat16: quantized in float32


def quantize_moe_int4(model: onnx.ModelProto, block_size: int = 32) -> list[str]:
    """Every com.microsoft MoE node with initializer expert weights -> QMoE (in place). Returns the names of the
    MoE nodes left float (sizes not multiples of block_size)."""
    inits = {t.name: t for t in model.graph.initializer}
    kept = []
    for idx, node in enumerate(list(model.graph.node)):
        if node.op_type != "MoE" or node.domain != "com.microsoft":
            continue
        ins = list(node.input) + [""] * (8 - len(node.input))
        weights = {i: inits.get(ins[i]) for i in MOE_TO_QMOE if ins[i]}
        if any(t is None for t in weights.values()):
            kept.append(node.name)  # expert weights computed at run time: nothing to quantize here
            continue
        if any(t.dims[2] % block_size or t.dims[2] % 2 for t in weights.values()):
            kept.append(node.name)
            continue
        new_in = [ins[0], ins[1]] + [""] * 9
        for i, t in weights.items():
            codes, scales = quantize_experts_4bits(_array(t), block_size)
            w_slot, s_slot = MOE_TO_QMOE[i]
            scales = scales.astype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))  # T (bfloat16: rounded)
            q, s = numpy_helper.from_array(codes, f"{t.name}_Q4"), numpy_helper.from_array(scales, f"{t.name}_scales")
            model.graph.initializer.extend([q, s])
            new_in[w_slot], new_in[s_slot] = q.name, s.name
            if sum(t.name in n.input for n in model.graph.node) == 1:  # this node's only
                model.graph.initializer.remove(t)
        for i, j in MOE_BIAS_TO_QMOE.items():
            new_in[j] = ins[i]
        while new_in and not new_in[-1]:
            new_in.pop()
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs.update(expert_weight_bits=4, block_size=block_size, weights_prepacked=0)
        qmoe = onnx.helper.make_node("QMoE", new_in, list(node.output), name=f"{node.name}_Q4", domain="com.microsoft",
                                     **attrs)
        model.graph.node.remove(node)
        model.graph.node.insert(idx, qmoe)
    return kept
