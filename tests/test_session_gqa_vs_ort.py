"""Multi-layer GroupQueryAttention models run by onnxruntime CPU and by pagedkit.InferenceSession give the same
outputs (fp32, max|diff| <= 1e-5 * max|ref|) over a prefill and decode steps, each side feeding its own
present caches back as the next past:
- a hand-built 3-layer decoder (RMSNorm, packed QKV, rotary, a local-window layer, a softcap layer, a
  windowed layer with a fixed sliding-window cache buffer), batch 1 and batch 2;
- onnxruntime-genai's builder fp32 CPU Llama (GQA layout, attention_mask -> seqlens / total subgraph).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pagedkit import InferenceSession
from pagedkit.kernels.gqa.cache import resident_count

F = TensorProto.FLOAT
HEADS, KV_HEADS, HEAD, HIDDEN, VOCAB, MAX_POS = 4, 2, 16, 64, 96, 64
WINDOW, WINDOW_CACHE = 4, 6  # local_window_size, capacity of the sliding-window cache layer
LAYERS = [dict(), dict(local_window_size=WINDOW, softcap=20.0), dict(local_window_size=WINDOW, sliding_window_cache=1)]
TOL = 1e-5


def _rng(seed=0):
    return np.random.default_rng(seed)


def decoder_model(seed: int = 0) -> onnx.ModelProto:
    rng = _rng(seed)
    w = lambda name, shape, s: numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name)  # noqa: E731
    inv = 1.0 / 10000 ** (np.arange(0, HEAD, 2) / HEAD)
    ang = np.outer(np.arange(MAX_POS), inv)
    inits = [w("emb", (VOCAB, HIDDEN), 1.0), w("lm", (HIDDEN, VOCAB), 0.2),
             numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "one"], ["msum"], keepdims=0),
             helper.make_node("Sub", ["msum", "one"], ["sk64"]),
             helper.make_node("Cast", ["sk64"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mshape"]),
             helper.make_node("Gather", ["mshape", "one"], ["tot64"], axis=0),
             helper.make_node("Cast", ["tot64"], ["total"], to=TensorProto.INT32),
             helper.make_node("Gather", ["emb", "input_ids"], ["h0"])]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outputs = [helper.make_tensor_value_info("logits", F, ["batch", "seq", VOCAB])]
    h = "h0"
    for i, attrs in enumerate(LAYERS):
        inits += [numpy_helper.from_array((1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32), f"g{i}"),
                  w(f"wqkv{i}", (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD), 1.2 / np.sqrt(HIDDEN)),
                  w(f"wo{i}", (HEADS * HEAD, HIDDEN), 1.0 / np.sqrt(HIDDEN))]
        nodes += [helper.make_node("SimplifiedLayerNormalization", [h, f"g{i}"], [f"n{i}"], epsilon=1e-6, axis=-1),
                  helper.make_node("MatMul", [f"n{i}", f"wqkv{i}"], [f"qkv{i}"]),
                  helper.make_node("GroupQueryAttention",
                                   [f"qkv{i}", "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                                    "seqlens_k", "total", "cos", "sin"],
                                   [f"attn{i}", f"present.{i}.key", f"present.{i}.value"], name=f"gqa{i}",
                                   domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1,
                                   **attrs),
                  helper.make_node("MatMul", [f"attn{i}", f"wo{i}"], [f"o{i}"]),
                  helper.make_node("Add", [h, f"o{i}"], [f"h{i + 1}"])]
        h = f"h{i + 1}"
        past = "window" if attrs.get("sliding_window_cache") else "past"
        present = "window" if attrs.get("sliding_window_cache") else "total"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", F, ["batch", KV_HEADS, past, HEAD]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", F, ["batch", KV_HEADS, present, HEAD]))
    nodes.append(helper.make_node("MatMul", [h, "lm"], ["logits"]))
    graph = helper.make_graph(nodes, "gqa_decoder", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def _close(got: np.ndarray, ref: np.ndarray, what: str) -> float:
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), what
    err = float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
    assert err <= TOL, f"{what}: max|diff| / max|ref| = {err:.3g} > {TOL}"
    return err


def run_both(model_bytes: bytes, first: dict, steps: int, seed: int = 1, windowed=()) -> list[float]:
    """Prefill with `first`, then `steps` decode steps of one random token per batch entry; each side feeds
    its own presents back. windowed: present outputs of sliding-window-cache layers. Returns the relative
    difference of every output at every step."""
    rng = _rng(seed)
    ref = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    ours = InferenceSession(model_bytes)
    names = [o.name for o in ref.get_outputs()]
    assert names == [o.name for o in ours.get_outputs()]
    pasts = [n for n in first if n.startswith("past_key_values.")]
    feeds_ref, feeds_ours, errs = dict(first), {k: v.copy() for k, v in first.items()}, []
    batch = first["input_ids"].shape[0]
    vocab = ref.get_outputs()[0].shape[-1]
    for step in range(steps + 1):
        out_ref = dict(zip(names, ref.run(None, feeds_ref)))
        out_ours = dict(zip(names, ours.run(None, feeds_ours)))
        total = feeds_ref["attention_mask"].shape[1]
        for n in names:
            got, want = out_ours[n], out_ref[n]
            if n in windowed:  # rows beyond the L(T) resident positions are unspecified (ORT leaves garbage)
                rows = resident_count(total, want.shape[2], WINDOW)
                got, want = got[:, :, :rows], want[:, :, :rows]
            errs.append(_close(got, want, f"step {step}: {n}"))
        ids = rng.integers(3, vocab, (batch, 1)).astype(np.int64)
        mask = np.ones((batch, feeds_ref["attention_mask"].shape[1] + 1), np.int64)
        feeds_ref = {"input_ids": ids, "attention_mask": mask}
        feeds_ours = {"input_ids": ids.copy(), "attention_mask": mask.copy()}
        for p in pasts:
            present = p.replace("past_key_values", "present")
            feeds_ref[p], feeds_ours[p] = out_ref[present], out_ours[present]
    return errs


def _first(batch: int, prompt: int, seed: int = 2, past_shapes=None) -> dict:
    rng = _rng(seed)
    feeds = {"input_ids": rng.integers(3, VOCAB, (batch, prompt)).astype(np.int64),
             "attention_mask": np.ones((batch, prompt), np.int64)}
    for name, cap in (past_shapes or {}).items():
        feeds[name] = (rng.standard_normal((batch, KV_HEADS, cap, HEAD)) * 5).astype(np.float32)  # poison
    return feeds


@pytest.mark.parametrize("batch,prompt", [(1, 9), (2, 5)])
def test_hand_built_decoder_matches_ort(batch, prompt):
    model = decoder_model().SerializeToString()
    shapes, windowed = {}, []
    for i, attrs in enumerate(LAYERS):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = WINDOW_CACHE if attrs.get("sliding_window_cache") else 0
            if attrs.get("sliding_window_cache"):
                windowed.append(f"present.{i}.{kind}")
    errs = run_both(model, _first(batch, prompt, past_shapes=shapes), steps=6, windowed=windowed)
    assert len(errs) == 7 * 7 and max(errs) <= TOL


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory):
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from test_genai_run import build, shared_root

    model_dir, _ = build(shared_root(tmp_path_factory), "llama", "gqa")
    return model_dir


@pytest.mark.parametrize("batch,prompt", [(1, 12), (2, 6)])
def test_genai_builder_llama_gqa_matches_ort(llama_gqa, batch, prompt):
    model = onnx.load(str(llama_gqa / "model.onnx"))  # external data loaded: both sessions get the same bytes
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == 2
    shapes = {vi.name: 0 for vi in model.graph.input if vi.name.startswith("past_key_values.")}
    first = _first(batch, prompt, past_shapes=shapes)
    first["input_ids"] %= 128
    errs = run_both(model.SerializeToString(), first, steps=5)
    assert max(errs) <= TOL
