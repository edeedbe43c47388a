"""The LM head on the rows read (runtime/fuse.py `logit_rows`, ops SelectRows, engine/model.py's row feed).

A prefill of T tokens samples one row, yet the head's [T, K] x [K, V] product made every row (on the H200 at 4063
tokens: 2.8 ms of a 19 ms prefill, and a [T, V] logits tensor). The session's torch path gathers the head's input
rows named by the optional input `pagedkit.logit_rows`; the engine feeds the rows it samples. Oracle: the same
session run without the feed (every row, the head as the model wrote it), sliced on the host; the engine's
logits with the feed against the engine with the feed turned off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit.kernels.cpu.logits import ROWS_INPUT
from pagedkit.runtime.session import InferenceSession

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-paged"


def _head_model(path: Path, *, rank3: bool = False, trans_a: bool = False, scale: float = 0.5) -> tuple:
    """x [T, 8] -> MatMul W [8, 6] (Gemm transA when asked) -> Mul by a constant -> logits [T, 6] (or [1, T, 6])."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    xs = ["one", "T", 8] if rank3 else ["T", 8]
    ls = ["one", "T", 6] if rank3 else ["T", 6]
    if trans_a:
        xs = [8, "T"]
        head = helper.make_node("Gemm", ["x", "w"], ["h"], transA=1)
    else:
        head = helper.make_node("MatMul", ["x", "w"], ["h"])
    g = helper.make_graph(
        [helper.make_node("Relu", ["x0"], ["x"]), head, helper.make_node("Mul", ["h", "s"], ["logits"])], "g",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, xs)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ls)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(scale, np.float32), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, path)
    return w, scale


def test_the_head_of_a_token_logits_model_reads_the_rows_fed(tmp_path):
    w, scale = _head_model(tmp_path / "m.onnx")
    s = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    assert s.fused.get("logit_rows") == 1 and [a.name for a in s.get_overridable_initializers()] == [ROWS_INPUT]
    x = torch.randn(7, 8)
    ref = np.maximum(x.numpy().astype(np.float64), 0) @ w.astype(np.float64) * scale  # float64 oracle, every row
    full = s.run_torch({"x0": x})["logits"]
    assert full.shape == (7, 6) and np.abs(full.numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    import onnxruntime as ort

    peer = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x0": x.numpy()})[0]  # onnxruntime on the unfused graph
    for rows in ([6], [3, 0, 5], [2, 2], list(range(7))):
        got = s.run_torch({"x0": x, ROWS_INPUT: torch.tensor(rows)})["logits"]
        assert got.shape == (len(rows), 6)
        assert np.abs(got.numpy() - ref[rows]).max() <= 1e-5 * np.abs(ref).max(), rows
        assert np.abs(got.numpy() - peer[rows]).max() <= 1e-5 * np.abs(peer).max(), rows
    empty = s.run_torch({"x0": x, ROWS_INPUT: torch.zeros(0, dtype=torch.int64)})["logits"]
    assert torch.equal(empty, full)  # empty = every row


def test_rows_out_of_range_name_the_input(tmp_path):
    _head_model(tmp_path / "m.onnx")
    s = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    with pytest.raises(Exception, match=r"pagedkit\.logit_rows.*\[0, 4\).*7"):
        s.run_torch({"x0": torch.randn(4, 8), ROWS_INPUT: torch.tensor([1, 7])})
    with pytest.raises(Exception, match=r"pagedkit\.logit_rows.*-1"):
        s.run_torch({"x0": torch.randn(4, 8), ROWS_INPUT: torch.tensor([-1])})


@pytest.mark.parametrize("kw", [{"rank3": True}, {"trans_a": True}])
def test_logits_whose_rows_are_not_the_tokens_are_left_alone(tmp_path, kw):
    _head_model(tmp_path / "m.onnx", **kw)
    s = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    assert "logit_rows" not in s.fused and s.get_overridable_initializers() == []
    with pytest.raises(ValueError, match="invalid input name"):
        s.run_torch({"x0": torch.randn(*((1, 4, 8) if kw.get("rank3") else (8, 4))), ROWS_INPUT: torch.tensor([0])})


def test_the_exported_paged_model_selects_its_rows():
    s = InferenceSession(str(TINY / "model.onnx"), cpu_backend="torch")
    assert s.fused.get("logit_rows") == 1 and ROWS_INPUT in [a.name for a in s.get_overridable_initializers()]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_the_engine_computes_the_head_on_the_rows_it_samples_only(monkeypatch, backend):
    """Chunked prefills (a middle chunk samples nothing), a batch of two, decode: the engine's logits equal those of
    the same engine computing every row, and the head saw only the rows sampled."""
    from pagedkit.engine import Engine, SamplingParams

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", backend)
    prompts = [[(7 * i) % 100 + 3 for i in range(70)], [4, 9, 2]]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)

    def run(select: bool):
        e = Engine(str(TINY), "cpu", max_batch_size=2, max_num_tokens=32, num_blocks=32, enable_prefix_caching=False)
        assert e.model.rows is not None
        if not select:
            e.model.rows = None
        seen, orig_run, orig_fwd = [], e.model.run, e.model.forward

        def spy_run(plan, token_ids, rows=None, device_ids=None):
            out = orig_run(plan, token_ids, rows, device_ids)
            seen.append((len(token_ids), list(rows) if rows is not None else None, out.clone()))
            return out

        fed = []
        e.model.forward = lambda feeds, hint: (fed.append(feeds.get(ROWS_INPUT)), orig_fwd(feeds, hint))[1]
        e.model.run = spy_run
        outs = e.generate(prompts, params)
        return [o.token_ids for o in outs], seen, fed

    toks, seen, fed = run(True)
    ref_toks, ref_seen, ref_fed = run(False)
    assert toks == ref_toks and all(f is None for f in ref_fed)
    assert len(seen) == len(ref_seen) and any(n > 2 for n, _, _ in seen)  # prompt chunks of 32 tokens ran
    for (n, rows, got), (_, _, ref), f in zip(seen, ref_seen, fed):
        assert got.shape == ref.shape == (len(rows), ref.shape[-1])
        scale = ref.abs().max().item() if ref.numel() else 1.0
        assert (got - ref).abs().max().item() <= 1e-5 * scale if ref.numel() else True
        if rows != list(range(n)):  # the feed: the rows sampled (one row for a chunk that samples none)
            assert f is not None and f.tolist() == (rows or [n - 1])
        else:
            assert f is None
    assert any(rows == [] for _, rows, _ in seen)  # a middle chunk of the 70-token prompt


def _gemm_model(path: Path, bias_shape: tuple | None, cast: bool = False) -> None:
    """x [T, 8] -> Gemm(x, W [6, 8], transB, C) (-> Cast to float) -> logits [T, 6]."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias_shape is not None:
        inits.append(numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "c"))
        ins.append("c")
    nodes = [helper.make_node("Gemm", ins, ["h" if cast else "logits"], transB=1)]
    if cast:
        nodes.append(helper.make_node("Cast", ["h"], ["logits"], to=TensorProto.FLOAT))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 6])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("bias,cast,fused", [(None, False, True), ((6,), False, True), ((6,), True, True),
                                             ((1, 6), False, False)])
def test_gemm_heads_through_casts_and_biases(tmp_path, bias, cast, fused):
    """A Gemm head (transB) with no bias or a [V] bias, behind a Cast, reads the rows fed; a 2-D bias C could differ
    by row, so that head is left alone. The rows equal the every-row logits' rows."""
    _gemm_model(tmp_path / "m.onnx", bias, cast)
    s = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    assert ("logit_rows" in s.fused) == fused
    x = torch.randn(5, 8)
    full = s.run_torch({"x": x})["logits"]
    if fused:
        got = s.run_torch({"x": x, ROWS_INPUT: torch.tensor([4, 1])})["logits"]
        assert torch.allclose(got, full[[4, 1]], rtol=1e-5, atol=1e-5 * float(full.abs().max()))
    else:
        assert s.get_overridable_initializers() == []


def test_the_prefill_floor_counts_routed_experts_at_their_share(tmp_path):
    """paged-bench's product count (apps/bench/floor.py): a MoE node's experts count k / num_experts of their
    weights (fc1, fc2, fc3), a QMoE's packed 4-bit weights two elements a byte; a plain MatMul all of its B."""
    from pagedkit.apps.bench import floor

    f = lambda name, shape, dt=np.float16: numpy_helper.from_array(np.zeros(shape, dt), name)  # noqa: E731
    e, h, i = 4, 8, 6
    inits = [f("router", (h, e)), f("fc1", (e, 2 * i, h)), f("fc2", (e, h, i)), f("fc3", (e, i, h)),
             f("q1", (e, 2 * i, h // 2), np.uint8), f("q2", (e, h, i // 2), np.uint8), f("s1", (e, 2 * i)),
             f("s2", (e, h))]
    nodes = [helper.make_node("MatMul", ["x", "router"], ["r"]),
             helper.make_node("MoE", ["x", "r", "fc1", "", "fc2", "", "fc3"], ["y"], domain="com.microsoft", k=2),
             helper.make_node("QMoE", ["y", "r", "q1", "s1", "", "q2", "s2"], ["z"], domain="com.microsoft", k=1,
                              expert_weight_bits=4)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", h])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT16, ["T", h])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    onnx.save(helper.make_model(g, opset_imports=opsets), tmp_path / "m.onnx")
    moe = e * (2 * i * h + h * i + i * h) * 2 // e  # all three weights of the 4 experts, k = 2 of them a token
    qmoe = e * (2 * i * h + h * i) * 1 // e  # unpacked from 4 bits, k = 1 of 4
    assert floor.product_weights(tmp_path / "m.onnx") == (h * e + moe + qmoe, 0)
