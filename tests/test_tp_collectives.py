"""com.microsoft AllReduce / AllGather (pagedkit/runtime/ops/collectives.py) on two gloo ranks, through the whole
runtime path (a tensor-parallel folder, TensorParallel.session, DistributedSession.run): each rank's graph adds its
own constant c_r to the shared input x, then
    y = AllReduce(x + c_r)                          oracle: 2 x + c_0 + c_1
    z = AllGather(x * c_r, axis=1, group_size=2)    oracle: concatenate([x * c_0, x * c_1], axis 1)
    w = AllGather(x * c_r, axis=0, group_size=2)    oracle: concatenate(..., axis 0)
in float32, float16 and float64, against numpy (float64). The all-reduce's input is not written (x + c_r feeds a
second output, read after the reduction)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "float64": TensorProto.DOUBLE}


def _rank_graph(rank: int, dtype: str, consts: np.ndarray) -> onnx.ModelProto:
    t = TYPES[dtype]
    ms = "com.microsoft"
    nodes = [helper.make_node("Add", ["x", "c"], ["xc"]),
             helper.make_node("AllReduce", ["xc"], ["y"], domain=ms, name="ar"),
             helper.make_node("Identity", ["xc"], ["own"]),
             helper.make_node("Mul", ["x", "c"], ["m"]),
             helper.make_node("AllGather", ["m"], ["z"], domain=ms, name="ag1", axis=1, group_size=2),
             helper.make_node("AllGather", ["m"], ["w"], domain=ms, name="ag0", axis=0, group_size=2)]
    vi = lambda n, shape: helper.make_tensor_value_info(n, t, shape)  # noqa: E731
    graph = helper.make_graph(nodes, f"rank{rank}", [vi("x", [3, 4])],
                              [vi("y", [3, 4]), vi("own", [3, 4]), vi("z", [3, 8]), vi("w", [6, 4])],
                              [numpy_helper.from_array(consts[rank].astype(dtype), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(ms, 1)],
                             ir_version=10)


def _folder(tmp_path, dtype: str, consts: np.ndarray):
    for r in range(2):
        (tmp_path / f"rank_{r}").mkdir()
        onnx.save(_rank_graph(r, dtype, consts), str(tmp_path / f"rank_{r}" / "model.onnx"))
    section = {"tensor_parallel": {"world_size": 2, "ranks": ["rank_0/model.onnx", "rank_1/model.onnx"]}}
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {}}, "pagedkit": section}))
    return tmp_path


@pytest.fixture(scope="module")
def tp():
    from pagedkit.runtime.distributed import TensorParallel

    with TensorParallel(2, timeout=60, threads=1) as s:
        yield s


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_collectives_on_two_ranks(tp, tmp_path, dtype, backend):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4)).astype(dtype)
    consts = rng.standard_normal((2, 3, 4))
    folder = _folder(tmp_path, dtype, consts)
    sess = tp.session(folder, cpu_backend=backend)
    try:
        y, own, z, w = sess.run(["y", "own", "z", "w"], {"x": x})
    finally:
        sess.close()
    c = consts.astype(dtype).astype(np.float64)
    x64 = x.astype(np.float64)
    tol = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(y, 2 * x64 + c[0] + c[1], rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(own, x64 + c[0], rtol=tol, atol=tol)  # rank 0's input, untouched by the sum
    np.testing.assert_allclose(z, np.concatenate([x64 * c[0], x64 * c[1]], axis=1), rtol=tol, atol=tol)
    np.testing.assert_allclose(w, np.concatenate([x64 * c[0], x64 * c[1]], axis=0), rtol=tol, atol=tol)
    assert y.dtype == np.dtype(dtype) and z.shape == (3, 8) and w.shape == (6, 4)


def test_group_size_must_be_the_set(tp, tmp_path):
    from pagedkit.runtime.distributed import TPError

    folder = _folder(tmp_path, "float32", np.ones((2, 3, 4)))
    m = onnx.load(str(folder / "rank_0" / "model.onnx"))
    next(a for n in m.graph.node if n.name == "ag1" for a in n.attribute if a.name == "group_size").i = 4
    onnx.save(m, str(folder / "rank_0" / "model.onnx"))
    sess = tp.session(folder, cpu_backend="torch")
    with pytest.raises(TPError, match="AllGather node 'ag1'.*set of 4, run in a set of 2 ranks"):
        sess.run(["z"], {"x": np.ones((3, 4), np.float32)})
