"""pagedkit.InferenceSession API: onnxruntime-compatible metadata, run() vs run_torch(), numpy feeds never
mutated, persistent caches updated in place, unsupported ops reported at creation, (unsafe) external
data, bad feeds and bad index inputs reported clearly, subgraph scopes, outputs that alias constants.

The oracle is onnxruntime CPU for models it can run (GQA / standard ops), and the PagedAttention
reference kernel for PagedAttention models (ORT has no CPU PagedAttention kernel).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nodes import make_paged_case
from pagedkit import InferenceSession
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.runtime.loading import UnsafeModelError
from pagedkit.validators import ValidationError

ROOT = Path(__file__).resolve().parents[1]
TINY_PAGED = ROOT / "examples" / "tiny-paged"
RNG = np.random.default_rng(7)
F = TensorProto.FLOAT


def _close(got, ref, tol=1e-5):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()


def _w(name, shape, scale=0.3):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def gqa_model(opset: int = 21) -> onnx.ModelProto:
    """input_ids [B, S] -> Gather -> MatMul -> GroupQueryAttention (packed QKV, BNSH past/present, seqlens from
    attention_mask: ReduceSum - 1, total from Shape) -> MatMul -> logits [B, S, 32]."""
    nodes = [
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("ReduceSum", ["attention_mask", "one"], ["msum"], keepdims=0),
        helper.make_node("Sub", ["msum", "one"], ["seqlens64"]),
        helper.make_node("Cast", ["seqlens64"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mshape"]),
        helper.make_node("Gather", ["mshape", "one"], ["total64"], axis=0),
        helper.make_node("Cast", ["total64"], ["total"], to=TensorProto.INT32),
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "wqkv"], ["qkv"]),
        helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total"],
                         ["attn", "present_key", "present_value"], domain="com.microsoft", name="gqa0",
                         num_heads=4, kv_num_heads=2),
        helper.make_node("MatMul", ["attn", "wout"], ["logits"]),
    ]
    cache = ["batch", 2, "past", 16]
    graph = helper.make_graph(
        nodes, "tiny_gqa",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
         helper.make_tensor_value_info("past_key", F, cache), helper.make_tensor_value_info("past_value", F, cache)],
        [helper.make_tensor_value_info("logits", F, ["batch", "seq", 32]),
         helper.make_tensor_value_info("present_key", F, ["batch", 2, "total", 16]),
         helper.make_tensor_value_info("present_value", F, ["batch", 2, "total", 16])],
        [_w("emb", (50, 64), 1.0), _w("wqkv", (64, 128)), _w("wout", (64, 32))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def gqa_feeds(batch=1, seq=5, past=0):
    cache = (RNG.standard_normal((batch, 2, past, 16)) + 0.5).astype(np.float32)
    return {"input_ids": RNG.integers(0, 50, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, past + seq), np.int64),
            "past_key": cache, "past_value": (cache[::-1] * 0.7).copy()}


# ---- metadata ------------------------------------------------------------------------------------

def test_inputs_outputs_providers_match_onnxruntime():
    model = gqa_model()
    ours = InferenceSession(model.SerializeToString())
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for mine, theirs in ((ours.get_inputs(), ref.get_inputs()), (ours.get_outputs(), ref.get_outputs())):
        assert [(a.name, a.shape, a.type) for a in mine] == [(a.name, a.shape, a.type) for a in theirs]
    assert ours.get_providers() == ["CPUExecutionProvider"]
    assert ours.attention_variants == {"gqa0": "reference"}
    assert ours.host_inputs == frozenset() and ours.cache_inputs == {"past_key", "past_value"}
    with pytest.raises(ValueError, match="unknown"):
        InferenceSession(model, providers=["TensorrtExecutionProvider"])


def test_run_matches_onnxruntime_and_run_torch():
    model = gqa_model()
    sess = InferenceSession(model)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, seq, past in ((1, 5, 0), (2, 1, 4), (1, 3, 6)):
        feeds = gqa_feeds(batch, seq, past)
        want = ref.run(None, feeds)
        got = sess.run(None, feeds)
        for g, w in zip(got, want):
            _close(g, w)
        torch_out = sess.run_torch({k: torch.from_numpy(v.copy()) for k, v in feeds.items()})
        for name, g in zip([o.name for o in sess.get_outputs()], got):
            np.testing.assert_array_equal(torch_out[name].numpy(), g)
    subset = sess.run(["present_value"], feeds)
    assert len(subset) == 1 and subset[0].shape == (1, 2, 9, 16)


# ---- caches --------------------------------------------------------------------------------------

def _paged_feeds(seed=0):
    """Feeds of examples/tiny-paged: two sequences (past 5 and 18, 3 and 1 new tokens) over shuffled
    blocks of a poisoned cache (random values, never zeros)."""
    g = torch.Generator().manual_seed(seed)
    nb, bs = 8, 16
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    cache = lambda: (torch.randn(nb, bs, 2, 16, generator=g) * 3).half()  # noqa: E731
    return {
        "input_ids": torch.randint(3, 128, (4,), generator=g),
        "cumulative_sequence_lengths": torch.tensor([0, 3, 4], dtype=torch.int32),
        "past_sequence_lengths": torch.tensor([5, 18], dtype=torch.int32),
        "block_table": torch.stack([perm[:2], perm[2:4]]),
        "attention_metadata": torch.tensor([3, 19, 8], dtype=torch.int32),
        **{f"past_key_values.{i}.{k}": cache() for i in range(2) for k in ("key", "value")},
    }


def test_numpy_run_never_mutates_the_callers_caches():
    sess = InferenceSession(TINY_PAGED)
    feeds = {k: v.numpy() for k, v in _paged_feeds().items()}
    before = {k: v.copy() for k, v in feeds.items()}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for k, v in feeds.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    # the returned caches are updated: exactly the 4 written slots (block, offset) differ, per layer
    table, slots = feeds["block_table"], []
    for b, (past, n) in enumerate(((5, 3), (18, 1))):
        slots += [(int(table[b, p // 16]), p % 16) for p in range(past, past + n)]
    for i in range(2):
        new, old = out[f"present.{i}.key"], feeds[f"past_key_values.{i}.key"]
        changed = {tuple(x) for x in np.argwhere((new != old).any(axis=(2, 3)))}
        assert changed == set(slots)
        assert not np.shares_memory(new, feeds[f"past_key_values.{i}.key"])


def test_run_torch_updates_persistent_caches_in_place():
    sess = InferenceSession(TINY_PAGED)
    feeds = _paged_feeds()
    caches = {k: v for k, v in feeds.items() if k.startswith("past_key_values")}
    ptrs = {k: v.data_ptr() for k, v in caches.items()}
    snapshot = {k: v.clone() for k, v in caches.items()}
    numpy_out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v.numpy() for k, v in feeds.items()})))
    out = sess.run_torch(feeds)
    for i in range(2):
        for kind in ("key", "value"):
            present, past = out[f"present.{i}.{kind}"], caches[f"past_key_values.{i}.{kind}"]
            assert present is past and present.data_ptr() == ptrs[f"past_key_values.{i}.{kind}"]
            assert not torch.equal(past, snapshot[f"past_key_values.{i}.{kind}"])  # written in place
            np.testing.assert_array_equal(present.numpy(), numpy_out[f"present.{i}.{kind}"])
    np.testing.assert_array_equal(out["logits"].numpy(), numpy_out["logits"])


def test_paged_model_matches_the_reference_kernel_layer_by_layer():
    """One attention node in isolation: session == reference on the same inputs (caches included)."""
    case = make_paged_case(num_heads=4, kv_num_heads=2, head_size=16, past=(3, 17), q_lens=(2, 1),
                           slot_mapping=True, metadata=True, seed=3)
    sess = InferenceSession(case.model())
    feeds = {k: v.clone() for k, v in case.inputs.items()}
    ref = paged_attention({k: v.clone() for k, v in case.inputs.items()}, outputs=case.outputs, **case.attrs)
    out = sess.run_torch(feeds)
    assert sess.attention_variants["PagedAttention_0"] in ("torch_sdpa", "reference")
    for name in case.outputs:
        if name == "output":  # fp16 output computed in float32 by both: equal up to rounding
            err = (out[name].float() - ref[name].float()).abs().max() / ref[name].float().abs().max()
            assert err <= 1e-3, err
        else:  # the cache writes are bit-exact
            torch.testing.assert_close(out[name], ref[name], rtol=0, atol=0)


# ---- creation-time errors ------------------------------------------------------------------------

def test_unsupported_ops_are_reported_at_creation():
    nodes = [helper.make_node("StringNormalizer", ["s"], ["s2"], name="norm_strings"),
             helper.make_node("FancyOp", ["x"], ["y"], domain="com.example", name="my_fancy_node"),
             helper.make_node("Relu", ["x"], ["z"], name="fine")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2]),
                                           helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info(n, F, [2]) for n in ("y", "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)])
    with pytest.raises(NotImplementedError) as err:
        InferenceSession(model)
    msg = str(err.value)
    assert "ai.onnx::StringNormalizer (node 'norm_strings')" in msg
    assert "com.example::FancyOp (node 'my_fancy_node')" in msg
    assert "Relu" not in msg


def test_undefined_names_are_reported_at_creation():
    node = helper.make_node("Add", ["x", "nowhere"], ["y"], name="adder")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [2])],
                              [helper.make_tensor_value_info("y", F, [2])])
    with pytest.raises(ValueError, match="node 'adder' \\(Add\\): input 'nowhere'"):
        InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


# ---- external data ---------------------------------------------------------------------------------

def _save_external(model: onnx.ModelProto, folder: Path, location="weights.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # save_model moves the tensors of the proto it is given to external data
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def test_external_data_loads(tmp_path):
    model = gqa_model()
    path = _save_external(model, tmp_path / "m")
    assert onnx.load(str(path), load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    feeds = gqa_feeds(1, 4, 2)
    want = InferenceSession(model).run(None, feeds)
    for sess in (InferenceSession(path), InferenceSession(tmp_path / "m")):  # the file or its folder
        for g, w in zip(sess.run(None, feeds), want):
            np.testing.assert_array_equal(g, w)


def _relocate(path: Path, location: str) -> None:
    m = onnx.load(str(path), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(m, str(path))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink", "range"])
def test_unsafe_external_data_is_refused(tmp_path, where):
    path = _save_external(gqa_model(), tmp_path / "m")
    outside = tmp_path / "outside.bin"
    outside.write_bytes((tmp_path / "m" / "weights.bin").read_bytes())
    if where == "dotdot":
        _relocate(path, "../outside.bin")
    elif where == "absolute":
        _relocate(path, str(outside))
    elif where == "symlink":
        os.symlink(outside, tmp_path / "m" / "link.bin")
        _relocate(path, "link.bin")
    else:  # a range beyond the end of the file
        (tmp_path / "m" / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UnsafeModelError) as err:
        InferenceSession(path)
    assert "external data" in str(err.value)
    assert ("beyond the end" in str(err.value)) == (where == "range")
    with pytest.raises(UnsafeModelError, match="bytes cannot reference external data"):
        InferenceSession(onnx.load(str(path), load_external_data=False).SerializeToString())


# ---- bad feeds ---------------------------------------------------------------------------------------

def test_bad_feeds_give_clear_errors():
    sess = InferenceSession(gqa_model())
    feeds = gqa_feeds(1, 3, 0)
    with pytest.raises(TypeError, match="input 'input_ids': unexpected data type tensor\\(int32\\), expected tensor\\(int64\\)"):
        sess.run(None, {**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    with pytest.raises(ValueError, match="input 'past_key': invalid rank 3"):
        sess.run(None, {**feeds, "past_key": feeds["past_key"][0]})
    with pytest.raises(ValueError, match="input 'past_key': invalid dimension 1: got 3, expected 2"):
        sess.run(None, {**feeds, "past_key": np.ones((1, 3, 0, 16), np.float32)})
    with pytest.raises(ValueError, match="invalid input name 'bogus'"):
        sess.run(None, {**feeds, "bogus": np.ones(1)})
    with pytest.raises(ValueError, match="missing input\\(s\\) \\['attention_mask'\\]"):
        sess.run(None, {k: v for k, v in feeds.items() if k != "attention_mask"})
    with pytest.raises(ValueError, match="invalid output name\\(s\\) \\['nope'\\]"):
        sess.run(["nope"], feeds)
    with pytest.raises(TypeError, match="run_torch takes torch tensors"):
        sess.run_torch(feeds)


@pytest.mark.parametrize("bad", ["slot_mapping", "block_table_short", "past_beyond_table"])
def test_bad_index_inputs_are_clear_errors_and_write_nothing(bad):
    case = make_paged_case(num_heads=4, kv_num_heads=2, head_size=16, past=(3, 17), q_lens=(2, 1),
                           slot_mapping=True, seed=5, extra_blocks=0)
    node, info = case.node(symbolic="dynamic")  # token / batch / block-table extents symbolic
    graph = helper.make_graph([node], "pa", [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n],
                              [helper.make_tensor_value_info(n, *info[n]) for n in node.output if n])
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("com.microsoft", 1)]))
    feeds = {k: v.clone() for k, v in case.inputs.items()}
    nb, bs = feeds["key_cache"].shape[:2]
    if bad == "slot_mapping":
        feeds["slot_mapping"][1] = nb * bs + 5  # beyond the cache
        words = "slot_mapping"
    elif bad == "block_table_short":
        feeds["block_table"] = feeds["block_table"][:, :1].clone()  # sequence 1 needs 2 blocks
        words = "block_table"
    else:
        feeds["past_seqlens"][0] = 40  # beyond what its block_table row covers
        words = "block_table|past_seqlens"
    caches = {k: feeds[k].clone() for k in ("key_cache", "value_cache")}
    with pytest.raises(ValueError, match=words) as err:
        sess.run_torch(feeds)
    assert "PagedAttention" in str(err.value) and isinstance(err.value, ValidationError)
    for k, v in caches.items():  # nothing was written, in or out of range
        assert torch.equal(feeds[k], v), k


# ---- graph semantics -------------------------------------------------------------------------------

def _if_model() -> onnx.ModelProto:
    """If on a runtime condition; both branches read outer-scope values, one has its own initializer;
    'h' is both a graph output and read by later nodes."""
    then_g = helper.make_graph([helper.make_node("Add", ["h", "bias_then"], ["r"])], "then", [],
                               [helper.make_tensor_value_info("r", F, [2, 3])], [_w("bias_then", (2, 3))])
    else_g = helper.make_graph([helper.make_node("Mul", ["h", "scale"], ["r2"])], "else", [],
                               [helper.make_tensor_value_info("r2", F, [2, 3])])
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="branch"),
             helper.make_node("Identity", ["w_const"], ["w_out"]),
             helper.make_node("Identity", ["w_const"], ["w_out2"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info(n, F, [2, 3]) for n in ("y", "h", "w_out", "w_out2")],
        [_w("scale", (2, 3)), numpy_helper.from_array(np.array(0.0, np.float32), "zero"), _w("w_const", (2, 3))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_if_subgraphs_read_the_enclosing_scope_and_outputs_never_alias_constants():
    model = _if_model()
    sess = InferenceSession(model)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for sign in (1.0, -1.0):
        x = (np.abs(RNG.standard_normal((2, 3))) + 0.1).astype(np.float32) * sign
        got, want = sess.run(None, {"x": x}), ref.run(None, {"x": x})
        for g, w in zip(got, want):
            _close(g, w)
        got[2][...] = 123.0  # a caller scribbling on an output must not reach the session's constants
        assert not np.shares_memory(got[2], got[3])
    again = sess.run(["w_out"], {"x": x})[0]
    _close(again, want[2])


def test_constant_subgraphs_fold_at_creation():
    """Shape arithmetic on initializers runs once at creation; the result is the same as onnxruntime's."""
    nodes = [helper.make_node("Shape", ["w"], ["ws"]),
             helper.make_node("ReduceProd", ["ws"], ["n"], keepdims=1),
             helper.make_node("Concat", ["n", "one"], ["shape"], axis=0),
             helper.make_node("Reshape", ["w", "shape"], ["wf"]),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [3, 6])],
                              [helper.make_tensor_value_info("y", F, [3, 1])],
                              [_w("w", (2, 3)), numpy_helper.from_array(np.array([1], np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess = InferenceSession(model)
    assert [s.op_type for s in sess._compiled.graph.steps] == ["MatMul"]
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    _close(sess.run(None, {"x": x})[0], ref[0])


def test_intermediates_are_released_after_their_last_use():
    sess = InferenceSession(gqa_model())
    released = {n for s in sess._compiled.graph.steps for n in s.release}
    assert {"x", "qkv", "attn", "msum"} <= released
    assert not released & {"logits", "present_key", "present_value"}


# ---- CUDA (run with -m gpu on the device) -------------------------------------------------------------

def _shape_model() -> onnx.ModelProto:
    """Device math around host shape arithmetic: Shape -> Gather -> Concat -> Reshape, Slice bounds from a
    Shape, a small int constant used both as a device operand and as a host one."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("Gather", ["xs", "zero_i"], ["b"], axis=0),
             helper.make_node("Concat", ["b", "minus1"], ["shape2"], axis=0),
             helper.make_node("Reshape", ["x", "shape2"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["y0"]),
             helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["y0", "bf"], ["y1"]),
             helper.make_node("Slice", ["y1", "zero_i", "b", "zero_i"], ["y"]),
             helper.make_node("Add", ["ids", "zero_i"], ["ids2"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, ["B", 4, 8]),
                     helper.make_tensor_value_info("ids", TensorProto.INT64, ["B"])],
        [helper.make_tensor_value_info("y", F, ["B", 5]), helper.make_tensor_value_info("ids2", TensorProto.INT64, ["B"])],
        [_w("w", (32, 5)), numpy_helper.from_array(np.array([0], np.int64), "zero_i"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.gpu
def test_cuda_shape_arithmetic_stays_on_the_host_and_runs_without_syncs():
    model = _shape_model()
    cpu, gpu = InferenceSession(model), InferenceSession(model, providers=["CUDAExecutionProvider"])
    assert gpu.get_providers()[0] == "CUDAExecutionProvider"
    x = RNG.standard_normal((3, 4, 8)).astype(np.float32)
    ids = np.array([4, 5, 6], np.int64)
    for g, c in zip(gpu.run(None, {"x": x, "ids": ids}), cpu.run(None, {"x": x, "ids": ids})):
        _close(g, c)
    feeds = {"x": torch.from_numpy(x).cuda(), "ids": torch.from_numpy(ids).cuda()}
    gpu.run_torch(feeds)  # warm-up: device copies of host constants are made once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gpu.run_torch(feeds)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out["y"].is_cuda and out["ids2"].is_cuda
    _close(out["y"].cpu().numpy(), cpu.run(["y"], {"x": x, "ids": ids})[0])


@pytest.mark.gpu
def test_cuda_sessions_match_cpu_and_update_device_caches_in_place():
    cpu = InferenceSession(TINY_PAGED)
    gpu = InferenceSession(TINY_PAGED, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert gpu.host_inputs == {"attention_metadata"}
    feeds = _paged_feeds()
    want = cpu.run_torch({k: v.clone() for k, v in feeds.items()})
    dev = {k: (v if k == "attention_metadata" else v.cuda()) for k, v in feeds.items()}
    got = gpu.run_torch(dev)
    for name, ref in want.items():
        err = (got[name].float().cpu() - ref.float()).abs().max() / ref.float().abs().max()
        assert err <= 2e-3, (name, float(err))
    assert got["present.0.key"] is dev["past_key_values.0.key"]
    with pytest.raises(ValueError, match="must be on cuda"):
        gpu.run_torch({**dev, "past_key_values.0.key": feeds["past_key_values.0.key"]})
    np_out = gpu.run(["logits"], {k: v.numpy() for k, v in feeds.items()})[0]
    assert np.abs(np_out.astype(np.float32) - want["logits"].float().numpy()).max() <= 2e-3 * want["logits"].abs().max().item()

    model = gqa_model()  # GroupQueryAttention has no GPU kernel yet: the reference fallback, allowed explicitly
    cpu = InferenceSession(model)
    gpu = InferenceSession(model, providers=["CUDAExecutionProvider"], allow_reference_fallback=True)
    feeds = gqa_feeds(2, 1, 4)
    for g, c in zip(gpu.run(None, feeds), cpu.run(None, feeds)):
        _close(g, c)
