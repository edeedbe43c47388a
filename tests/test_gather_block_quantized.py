"""com.microsoft GatherBlockQuantized vs onnxruntime CPU on single-node models (random inputs): uint8 data
(2 / 4 / 8 bits packed along the last axis, zero points packed like it or the default 2^(bits-1)), int4 /
uint4 data (zero points of the same type or the default 0; other gather / quantize axes), float8 data,
K not a multiple of the block, float16 scales, int32 / int64 indices of any rank, negative and
out-of-range indices (zeros). Data, scales and zero points are initializers (as in genai's models, and
the only way to hand onnxruntime int4 tensors); ours reads them through util.tensor_from_proto, as a session
does. Outputs must match within 1e-6 * max|ref| (float16: 1e-3). Teeth: a zero point off by one or a
scale 2% off fails.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from ops_single_node import assert_matches, ints, uniform
from pagedkit.runtime.ops import OpContext, lookup, node_attributes
from pagedkit.runtime.ops.util import tensor_from_proto

RNG = np.random.default_rng(7)


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., n] -> bytes [..., ceil(n * bits / 8)], first value in the lowest bits."""
    per = 8 // bits
    n = values.shape[-1]
    padded = np.zeros((*values.shape[:-1], -(-n // per) * per), np.uint8)
    padded[..., :n] = values
    grouped = padded.reshape(*values.shape[:-1], -1, per).astype(np.uint32)
    return (grouped << (np.arange(per) * bits)).sum(-1).astype(np.uint8)


def uint8_case(rows=50, k=64, bits=4, block=32, zp=True, scale_dtype=np.float32):
    nb = math.ceil(k / block)
    codes = ints(0, 1 << bits, rows, k, dtype=np.uint8)
    consts = {"data": pack(codes, bits) if bits < 8 else codes,
              "scales": uniform(0.01, 0.2, rows, nb, dtype=scale_dtype)}
    if zp:
        z = ints(0, 1 << bits, rows, nb, dtype=np.uint8)
        consts["zero_points"] = pack(z, bits) if bits < 8 else z
    return consts, dict(bits=bits, block_size=block, gather_axis=0, quantize_axis=1)


def int4_case(shape=(50, 64), signed=True, block=32, gaxis=0, qaxis=1, zp=True):
    lo, hi = (-8, 8) if signed else (0, 16)
    dt = ml_dtypes.int4 if signed else ml_dtypes.uint4
    sshape = list(shape)
    sshape[qaxis] = math.ceil(shape[qaxis] / block)
    consts = {"data": ints(lo, hi, *shape, dtype=np.int8).astype(dt), "scales": uniform(0.01, 0.2, *sshape)}
    if zp:
        consts["zero_points"] = ints(lo, hi, *sshape, dtype=np.int8).astype(dt)
    return consts, dict(bits=4, block_size=block, gather_axis=gaxis, quantize_axis=qaxis)


def fp8_case(shape=(40, 64), block=32, broadcast=False, dt=ml_dtypes.float8_e4m3fn):
    sshape = [1] * len(shape) if broadcast else [shape[0], math.ceil(shape[1] / block) if block else 1]
    consts = {"data": (RNG.standard_normal(shape) * 4).astype(dt), "scales": uniform(0.01, 0.2, *sshape)}
    return consts, dict(block_size=block, gather_axis=0, quantize_axis=1)


def idx(*shape, hi=50, dtype=np.int64, oob=True):
    x = ints(-hi, hi, *shape, dtype=dtype)
    if oob:
        x.flat[0], x.flat[-1] = hi + 3, -hi - 2  # out of range: zeros
    return x


CASES = [
    ("u8-4b-nozp", *uint8_case(zp=False), idx(2, 3)),
    ("u8-4b-zp", *uint8_case(), idx(7)),
    ("u8-4b-zp-f16", *uint8_case(scale_dtype=np.float16), idx(1, 5)),
    ("u8-4b-zp-K48", *uint8_case(k=48), idx(4)),
    ("u8-4b-zp-b16-3blocks", *uint8_case(k=48, block=16), idx(4, dtype=np.int32)),
    ("u8-4b-b128", *uint8_case(k=256, block=128), idx(3)),
    ("u8-8b-zp", *uint8_case(bits=8), idx(6)),
    ("u8-8b-nozp", *uint8_case(bits=8, zp=False), idx(6)),
    ("u8-2b-zp", *uint8_case(bits=2, k=96), idx(2, 2)),
    ("int4-zp", *int4_case(), idx(2, 3)),
    ("int4-nozp", *int4_case(zp=False), idx(5, dtype=np.int32)),
    ("uint4-zp", *int4_case(signed=False), idx(5)),
    ("uint4-3d-g1-q0", *int4_case(shape=(64, 12, 5), signed=False, block=16, gaxis=1, qaxis=0), idx(2, 2, hi=12)),
    ("int4-3d-g2-q1", *int4_case(shape=(3, 40, 9), block=16, gaxis=2, qaxis=1), idx(4, hi=9)),
    ("int4-g0-q0", *int4_case(shape=(64, 8), block=16, gaxis=0, qaxis=0), idx(5, hi=64)),
    ("fp8-e4m3-b32", *fp8_case(), idx(3, hi=40)),
    ("fp8-e5m2-rowscale", *fp8_case(block=0, dt=ml_dtypes.float8_e5m2), idx(3, hi=40)),
    ("fp8-tensor-scale", *fp8_case(block=0, broadcast=True), idx(2, 2, hi=40)),
]


def model(consts: dict, attrs: dict, indices: np.ndarray):
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    names = ["data", "indices", "scales"] + (["zero_points"] if "zero_points" in consts else [])
    node = helper.make_node("GatherBlockQuantized", names, ["y"], name="gbq", domain="com.microsoft", **attrs)
    x = helper.make_tensor_value_info("indices", helper.np_dtype_to_tensor_dtype(indices.dtype), indices.shape)
    y = helper.make_empty_tensor_value_info("y")
    graph = helper.make_graph([node], "gbq", [x], [y], initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=10)
    return m, node, inits


def run_both(consts, attrs, indices):
    m, node, inits = model(consts, attrs, indices)
    try:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - an onnxruntime build without this type registration
        pytest.skip(f"onnxruntime CPU cannot run this form: {str(exc).splitlines()[0][:200]}")
    ref = sess.run(None, {"indices": indices})[0]
    ins = {t.name: tensor_from_proto(t) for t in inits} | {"indices": torch.from_numpy(indices)}
    fn = lookup("com.microsoft", "GatherBlockQuantized", 1, "gbq")
    ours = fn([ins[n] for n in node.input], node_attributes(node), OpContext(node_name="gbq"))[0]
    return ours, ref


@pytest.mark.parametrize("name, consts, attrs, indices", CASES, ids=[c[0] for c in CASES])
def test_gather_block_quantized_matches_onnxruntime(name, consts, attrs, indices):
    ours, ref = run_both(consts, attrs, indices)
    assert_matches(ours, ref, 1e-3 if ref.dtype == np.float16 else 1e-6, name)
    assert np.abs(ref).max() > 0


@pytest.mark.parametrize("perturb", ["zero_point", "scale"])
def test_comparison_has_teeth(perturb):
    consts, attrs = uint8_case()
    indices = np.arange(50, dtype=np.int64)
    _, ref = run_both(consts, attrs, indices)
    bad = dict(consts)
    if perturb == "zero_point":
        bad["zero_points"] = consts["zero_points"].copy()
        z = bad["zero_points"][3, 0]
        bad["zero_points"][3, 0] = (z & 0xF0) | (((z & 0x0F) + 1) & 0x0F)  # row 3, block 0, off by one
    else:
        bad["scales"] = consts["scales"].copy()
        bad["scales"][3, 1] *= 1.02
    ours, _ = run_both(bad, attrs, indices)
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        assert_matches(ours, ref, 1e-6, perturb)


def test_refusals_name_the_node():
    fn = lookup("com.microsoft", "GatherBlockQuantized", 1)
    consts, attrs = uint8_case()
    t = {k: torch.from_numpy(v) for k, v in consts.items()}
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="node 'g'.*gather_axis 0"):
        fn([t["data"], ids, t["scales"]], attrs | dict(gather_axis=1, quantize_axis=0), OpContext(node_name="g"))
    with pytest.raises(ValueError, match="node 'g'.*scales shape"):
        fn([t["data"], ids, t["scales"][:, :1]], attrs, OpContext(node_name="g"))
    with pytest.raises(ValueError, match="node 'g'.*block_size"):
        fn([t["data"], ids, t["scales"]], attrs | dict(block_size=24), OpContext(node_name="g"))
    with pytest.raises(TypeError, match="node 'g'.*float32"):
        fn([t["scales"], ids, t["scales"]], attrs, OpContext(node_name="g"))
