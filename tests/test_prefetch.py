"""L2 prefetch of decode-step weights (runtime/prefetch.py, kernels/triton/prefetch.py) on the CPU:

- the kernel's addressing through the interpreter (it records the chunks a GPU launch would request): exactly the
  whole chunks of the requested head, never past the tensor's end, over sizes at and around the chunk and
  program limits;
- the schedule over a real session's products (a tiny Llama with the size limit lowered): which weight each
  product requests, before or after its own launch, how many bytes, and nothing outside a capture or past
  MAX_ROWS rows; the fork is joined at the end of the run.
The GPU side (real prefetches inside captured decode graphs, replays bit-equal to eager) is
tests/test_prefetch_gpu.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pagedkit import settings
from pagedkit.runtime import prefetch

triton = pytest.importorskip("triton")
from pagedkit.kernels.triton import prefetch as kpf  # noqa: E402


@pytest.mark.parametrize("mode", ["bulk", "line"])
@pytest.mark.parametrize("chunks_total,request_bytes_delta", [
    (1, 0), (3, -1), (3, 0), (3, 1), (32, 0), (33, 0), (65, -7), (70, 10**9)])
def test_kernel_requests_exactly_the_whole_chunks_of_the_head(mode, chunks_total, request_bytes_delta):
    chunk = kpf.chunk_bytes(mode)
    if mode == "bulk" and chunks_total > 40:
        chunks_total //= 8  # keep the interpreter quick
    t = torch.randn(chunks_total * chunk // 2 + 3, dtype=torch.float16)  # a tail shorter than a chunk
    total = t.numel() * 2
    nbytes = max(0, min(chunks_total, 3) * chunk + request_bytes_delta) if request_bytes_delta < 10**8 else 10**9
    marks = torch.zeros(chunks_total + 40, dtype=torch.int32)
    n = kpf.prefetch_l2(t, nbytes, mode, marks=marks)
    want = min(nbytes, total) // chunk
    assert n == want
    assert marks[:want].eq(1).all() and marks[want:].eq(0).all(), marks.nonzero().flatten().tolist()
    assert want * chunk <= total


def test_kernel_refuses_what_it_cannot_request():
    t = torch.zeros(4096, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        kpf.prefetch_l2(t.view(64, 64).T, 1024, "line", marks=torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="aligned"):
        kpf.prefetch_l2(t[1:], 1024, "line", marks=torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="mode"):
        kpf.prefetch_l2(t, 1024, "tma")
    with pytest.raises(ValueError, match="marks"):
        kpf.prefetch_l2(t, 1024, "line", marks=torch.zeros(2, dtype=torch.int32))
    assert kpf.prefetch_l2(t, 100, "line") == 0  # less than a chunk: nothing to request, no launch


def test_setting_parses_and_names_what_is_wrong():
    assert settings.parse_prefetch("off") is None and settings.parse_prefetch("0") is None
    assert settings.parse_prefetch("16") == {"mb": 16.0, "at": "late", "mode": "bulk", "distance": 1}
    assert settings.parse_prefetch("8.5:early:line:d2") == {"mb": 8.5, "at": "early", "mode": "line",
                                                              "distance": 2}
    for bad in ("-1", "16:soon", "16:d0", "x"):
        with pytest.raises(ValueError):
            settings.parse_prefetch(bad)


def _chain_model(path, widths=(16, 24, 8, 32, 16, 12)):
    """x [B, T, 16] -> (MatMul by a constant, Add a constant [1, n] row, Relu) per width: products of several sizes
    with short ops between (the Add's 2-D constant is no product's weight)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev, k = [], [], "x", widths[0]
    for i, n in enumerate(widths[1:]):
        inits += [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal((1, n)).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        prev, k = f"r{i}", n
    g = helper.make_graph(nodes, "chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", widths[0]])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["B", "T", k])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return len(widths) - 1


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """A CPU session over a chain of products (MIN_BYTES lowered so all count), the products' runs and the forks
    traced, as if capturing."""
    from pagedkit.runtime import InferenceSession

    n = _chain_model(tmp_path / "m.onnx")
    monkeypatch.setattr(prefetch, "MIN_BYTES", 1)
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    assert sess._prefetch is None  # a CPU session never prefetches
    prods = prefetch.products(sess._main, device_type="cpu")
    assert len(prods) == n
    log: list = []
    for k, p in enumerate(prods):
        op = sess._main.ops[p.op]
        op.run = (lambda run, k: (lambda ins: (log.append(("run", k)), run(ins))[1]))(op.run, k)
    pf = prefetch.Prefetcher(prods)
    for k, p in enumerate(prods):
        op = sess._main.ops[p.op]
        op.run = pf.wrap(k, op.run)
    sess._prefetch = pf

    def fork(items, mode):
        log.append(("fork", [(next(j for j, q in enumerate(prods) if q.weight is w), n) for w, n in items], mode))
        pf.forked = bool(items) or pf.forked

    monkeypatch.setattr(pf, "fork", fork)
    monkeypatch.setattr(pf, "join", lambda: (log.append(("join",)), setattr(pf, "forked", False)))
    monkeypatch.setattr(prefetch, "_capturing", lambda: True)
    return sess, prods, log, pf


def _run_step(sess, tokens: int):
    sess.run_torch({"x": torch.randn(1, tokens, 16)})  # [1, T, 16]: rows are every leading dimension


@pytest.mark.parametrize("at,distance,mb", [("late", 1, 1e-3), ("early", 1, 1e-3), ("late", 2, 1e3)])
def test_each_product_requests_the_head_of_the_one_distance_later(traced, monkeypatch, at, distance, mb):
    sess, prods, log, pf = traced
    monkeypatch.setattr(prefetch, "CONFIG", {"mb": mb, "at": at, "mode": "line", "distance": distance})
    _run_step(sess, 3)
    want = []
    for k, p in enumerate(prods):
        j = k + distance
        size = prods[j].weight.shape[0] * prods[j].weight.shape[1] * 4 if j < len(prods) else 0  # float32 bytes
        fork = [("fork", [(j, min(size, int(mb * (1 << 20))))], "line")] if j < len(prods) else []
        fork = fork or [("fork", [], "line")]
        want += (fork + [("run", k)]) if at == "early" else ([("run", k)] + fork)
    want.append(("join",))
    assert log == want


def test_no_request_outside_a_capture_past_max_rows_or_without_a_config(traced, monkeypatch):
    sess, prods, log, pf = traced
    monkeypatch.setattr(prefetch, "CONFIG", {"mb": 1.0, "at": "late", "mode": "bulk", "distance": 1})
    monkeypatch.setattr(prefetch, "MAX_ROWS", 2)
    _run_step(sess, 3)  # 3 rows > MAX_ROWS
    assert [e for e in log if e[0] == "fork"] == []
    log.clear()
    monkeypatch.setattr(prefetch, "MAX_ROWS", 3)
    _run_step(sess, 3)  # exactly MAX_ROWS rows: prefetches
    assert sum(1 for e in log if e[0] == "fork" and e[1]) == len(prods) - 1
    log.clear()
    monkeypatch.setattr(prefetch, "_capturing", lambda: False)
    _run_step(sess, 3)
    assert [e for e in log if e[0] == "fork"] == []
    log.clear()
    monkeypatch.setattr(prefetch, "_capturing", lambda: True)
    monkeypatch.setattr(prefetch, "CONFIG", None)
    _run_step(sess, 3)
    assert [e for e in log if e[0] == "fork"] == []


def test_products_are_the_constant_weights_in_step_order(tmp_path, monkeypatch):
    from pagedkit.runtime import InferenceSession

    n = _chain_model(tmp_path / "m.onnx")
    monkeypatch.setattr(prefetch, "MIN_BYTES", 1)
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    prods = prefetch.products(sess._main, device_type="cpu")
    assert len(prods) == n and [p.op for p in prods] == sorted(p.op for p in prods)
    for p in prods:
        op = sess._main.ops[p.op]
        assert op.step.op_type == "MatMul" and sess._main.template[op.ins[1]] is p.weight
    assert [tuple(p.weight.shape) for p in prods] == [(16, 24), (24, 8), (8, 32), (32, 16), (16, 12)]
    monkeypatch.setattr(prefetch, "MIN_BYTES", 16 * 24 * 4)  # at least [16, 24]'s bytes: it and [32, 16]
    assert [tuple(p.weight.shape) for p in prefetch.products(sess._main, device_type="cpu")] == [(16, 24), (32, 16)]
    assert prefetch.products(sess._main) == []  # no CUDA weights on the CPU


def test_default_limits(traced, monkeypatch):
    """MAX_ROWS (64) rows prefetch, one more does not; MIN_BYTES (1 MiB) weights count, smaller ones do not."""
    sess, prods, log, pf = traced
    assert prefetch.MAX_ROWS == 64
    monkeypatch.setattr(prefetch, "CONFIG", {"mb": 1.0, "at": "late", "mode": "bulk", "distance": 1})
    _run_step(sess, 64)
    assert sum(1 for e in log if e[0] == "fork" and e[1]) == len(prods) - 1
    log.clear()
    _run_step(sess, 65)
    assert [e for e in log if e[0] == "fork"] == []


def test_min_bytes_default(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pagedkit.runtime import InferenceSession

    assert prefetch.MIN_BYTES == 1 << 20
    # float64: the CPU session leaves such weights as tensors (float32 ones it prepacks for oneDNN)
    w0 = numpy_helper.from_array(np.zeros((512, 256), np.float64), "w0")  # exactly 1 MiB
    w1 = numpy_helper.from_array(np.zeros((256, 511), np.float64), "w1")  # 2 KiB less
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["y"]), helper.make_node("MatMul", ["y", "w1"], ["z"])]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["T", 512])],
                          [helper.make_tensor_value_info("z", TensorProto.DOUBLE, ["T", 511])], [w0, w1])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    got = prefetch.products(sess._main, device_type="cpu")
    assert [tuple(p.weight.shape) for p in got] == [(512, 256)] and got[0].nbytes == 1 << 20


def test_attach_wraps_every_product_on_cuda_only(tmp_path, monkeypatch):
    from pagedkit.runtime import InferenceSession

    _chain_model(tmp_path / "m.onnx")
    monkeypatch.setattr(prefetch, "MIN_BYTES", 1)
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    prog = sess._main
    assert prefetch.attach(prog, torch.device("cpu")) is None
    assert prefetch.attach(prog, torch.device("cuda")) is None  # no CUDA weights: nothing to prefetch
    cpu_prods = prefetch.products(prog, device_type="cpu")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream", device))
    for n in (1, 2):
        monkeypatch.setattr(prefetch, "products", lambda p, n=n: cpu_prods[:n])
        runs = [op.run for op in prog.ops]
        pf = prefetch.attach(prog, torch.device("cuda"))
        if n == 1:
            assert pf is None and [op.run for op in prog.ops] == runs  # one product: nothing to prefetch ahead
            continue
        assert pf is not None and pf.side == ("stream", torch.device("cuda")) and pf.prods == cpu_prods[:2]
        wrapped = [i for i, op in enumerate(prog.ops) if op.run is not runs[i]]
        assert wrapped == [p.op for p in cpu_prods[:2]]
