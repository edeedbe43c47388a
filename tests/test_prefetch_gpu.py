"""L2 prefetch on the GPU (`pytest -m gpu`): runtime/prefetch.py's side-stream requests inside CUDA-graph captures.

- a chain of 4 MiB products captured with prefetching on (bulk and line requests, early and late forks, distance
  1 and 2): the capture holds the side stream's launches, ends joined, and its replays give the eager values
  bit for bit;
- the engine's decode graphs over the tiny Llama with every product prefetching: replays bit-equal to the same
  padded steps run eagerly.
Teeth: the same capture without the join at the end of the run fails (an unjoined side stream).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit.runtime import prefetch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _chain(path, k=1024, layers=4):
    rng = np.random.default_rng(1)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((k, 2 * k)) / k**0.5).astype(np.float16)  # 4 MiB
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Slice", [f"m{i}", "s0", "s1", "ax"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"])]
        prev = f"r{i}"
    inits += [numpy_helper.from_array(np.array([0], np.int64), "s0"),
              numpy_helper.from_array(np.array([k], np.int64), "s1"),
              numpy_helper.from_array(np.array([1], np.int64), "ax")]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", k])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, ["T", k])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("cfg", ["4:late", "1:early:line", "2:late:d2", "64:early:d2"])
def test_captured_chain_with_prefetch_replays_the_eager_values(tmp_path, monkeypatch, cfg):
    from pagedkit import settings
    from pagedkit.runtime import InferenceSession

    _chain(tmp_path / "m.onnx")
    sess = InferenceSession(str(tmp_path / "m.onnx"), providers=["CUDAExecutionProvider"])
    assert sess._prefetch is not None and len(sess._prefetch.prods) == 4
    monkeypatch.setattr(prefetch, "CONFIG", settings.parse_prefetch(cfg))
    x = torch.randn(4, 1024, dtype=torch.float16, device="cuda")
    (name,) = [a.name for a in sess.get_outputs()]
    ref = sess.run_torch({"x": x})[name].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sess.run_torch({"x": x})  # warm-up on the side stream, as torch.cuda.graph wants
    torch.cuda.current_stream().wait_stream(s)
    n0 = sess._prefetch.launched
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sess.run_torch({"x": x})[name]
    distance = settings.parse_prefetch(cfg)["distance"]
    assert sess._prefetch.launched - n0 == 4 - distance
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_teeth_a_capture_left_unjoined_fails(tmp_path, monkeypatch):
    from pagedkit.runtime import InferenceSession

    _chain(tmp_path / "m.onnx")
    sess = InferenceSession(str(tmp_path / "m.onnx"), providers=["CUDAExecutionProvider"])
    monkeypatch.setattr(prefetch, "CONFIG", {"mb": 4.0, "at": "late", "mode": "bulk", "distance": 1})
    monkeypatch.setattr(sess._prefetch, "join", lambda: None)
    x = torch.randn(4, 1024, dtype=torch.float16, device="cuda")
    sess.run_torch({"x": x})
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(g):
            sess.run_torch({"x": x})
    torch.cuda.synchronize()


def test_engine_decode_graphs_with_prefetch_replay_the_padded_eager_steps(tiny_llama, monkeypatch):
    import test_engine_graphs_gpu as eg

    monkeypatch.setattr(prefetch, "MIN_BYTES", 1)
    monkeypatch.setattr(prefetch, "CONFIG", {"mb": 1.0, "at": "late", "mode": "line", "distance": 1})
    graphs, padded, _ = eg._models(tiny_llama)
    assert graphs.session._prefetch is not None
    prompts = eg._prompts(3, 1, 144)
    got = eg._run(graphs, prompts, 8, 5, 144, grow_to=6)
    same = eg._run(padded, prompts, 8, 5, 144, grow_to=6)
    assert graphs.graphs.stats.captured >= 2 and graphs.graphs.stats.replays >= 5
    assert graphs.session._prefetch.launched > 0
    for i, (a, b) in enumerate(zip(got, same)):
        assert torch.equal(a, b), f"step {i}: the replay with prefetching differs from the padded eager step"
