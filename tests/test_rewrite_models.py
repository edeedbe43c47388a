"""Whole-model rewrites on tiny hand-built decoders (pagedkit/rewriters/gqa_to_paged.py, paged_to_gqa.py,
rewrite.py), fast enough to check what the builder models of tests/test_rewrite_genai.py cannot reach cheaply.

The decoder (`decoder`) has the onnxruntime-genai builder's GQA layout: input_ids [B, S] -> Gather embedding;
per layer MatMul -> packed GroupQueryAttention over past_key_values.{i}.* (seqlens_k / total_sequence_length
from attention_mask: ReduceSum - 1, Shape, as the builder writes them) -> MatMul + residual; lm_head -> logits.
Checks:
- numbers: the original in onnxruntime CPU is the oracle; its paged rewrite in pagedkit.InferenceSession (all
  sequences packed over a shuffled block table), and the round trip GQA -> paged -> GQA in onnxruntime CPU, agree
  within 5e-3 * max |ref| (attention runs in fp16 after the rewrite); a 2% wrong scale fails the comparison.
- layout: graph I/O shapes, which block table each layer reads, LayerSpec / genai_config per layer
  (local_window_size absent = -1 = full attention; 0 = full attention as every pagedkit kernel reads it).
- refusals name the node and the reason (subgraph GQA, caches that are not the graph inputs).
- rewrite_file: nested output folders, inline vs external weights, stale external data, the input's data file,
  unsafe external data (first 3 problems), the validator's message (first 5 problems).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import pagedkit
from rewrite_helpers import rel_err, run_gqa, run_paged
from pagedkit.interface import names as N
from pagedkit.interface.genai_config import LayerSpec
from pagedkit.rewriters import rewrite as rw
from pagedkit.rewriters.gqa_to_paged import gqa_to_paged, paged_model_spec, remove_dead_nodes
from pagedkit.rewriters.paged_to_gqa import paged_to_gqa
from pagedkit.rewriters.report import RewriteRefused
from pagedkit.rewriters.rewrite import RewriteInvalid, rewrite_file
from pagedkit.validators.issues import Issue
from pagedkit.validators.model_loading import ModelLoadError

ort = pytest.importorskip("onnxruntime")

TOL = 5e-3
H, KV, D, E, V = 4, 2, 8, 16, 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23]]  # 7 tokens: past the window of 4
STEPS = 3


def decoder(windows=(-1, -1), *, dtype=np.float32, seed=0, omit_window=(), scale: float | None = None
            ) -> onnx.ModelProto:
    """A builder-layout GQA decoder with one layer per entry of `windows` (local_window_size; layers in
    omit_window have no such attribute)."""
    rng = np.random.default_rng(seed)
    et = TP.FLOAT if dtype == np.float32 else TP.FLOAT16
    inits = [nh.from_array(rng.standard_normal((V, E)).astype(dtype), "embed"),
             nh.from_array(np.array([1], np.int64), "one"), nh.from_array(np.array(1, np.int64), "one_scalar")]
    nodes = [oh.make_node("Gather", ["embed", N.INPUT_IDS], ["h0"], name="/embed/Gather"),
             oh.make_node("ReduceSum", [N.ATTENTION_MASK, "one"], ["mask_sum"], keepdims=0, name="/mask/ReduceSum"),
             oh.make_node("Sub", ["mask_sum", "one"], ["mask_sub"], name="/mask/Sub"),
             oh.make_node("Cast", ["mask_sub"], ["seqlens_k"], to=TP.INT32, name="/mask/seqlens_k"),
             oh.make_node("Shape", [N.ATTENTION_MASK], ["mask_shape"], name="/mask/Shape"),
             oh.make_node("Gather", ["mask_shape", "one_scalar"], ["total64"], axis=0, name="/mask/Gather"),
             oh.make_node("Cast", ["total64"], ["total_seq"], to=TP.INT32, name="/mask/total")]
    inputs = [oh.make_tensor_value_info(N.INPUT_IDS, TP.INT64, ["batch_size", "sequence_length"]),
              oh.make_tensor_value_info(N.ATTENTION_MASK, TP.INT64, ["batch_size", "total_sequence_length"])]
    outputs, value_info, x = [], [], "h0"
    for i, w in enumerate(windows):
        inits += [nh.from_array((rng.standard_normal((E, (H + 2 * KV) * D)) * 0.7).astype(dtype), f"wqkv{i}"),
                  nh.from_array((rng.standard_normal((H * D, E)) * 0.3).astype(dtype), f"wo{i}")]
        attrs = dict(num_heads=H, kv_num_heads=KV)
        if i not in omit_window:
            attrs["local_window_size"] = w
        if scale is not None:
            attrs["scale"] = scale
        nodes += [oh.make_node("MatMul", [x, f"wqkv{i}"], [f"qkv{i}"], name=f"/layers.{i}/qkv"),
                  oh.make_node("GroupQueryAttention", [f"qkv{i}", "", "", N.past_name("key", i),
                               N.past_name("value", i), "seqlens_k", "total_seq"],
                               [f"attn{i}", N.present_name("key", i), N.present_name("value", i)],
                               domain="com.microsoft", name=f"/layers.{i}/attn/GroupQueryAttention", **attrs),
                  oh.make_node("MatMul", [f"attn{i}", f"wo{i}"], [f"o{i}"], name=f"/layers.{i}/o"),
                  oh.make_node("Add", [x, f"o{i}"], [f"h{i + 1}"], name=f"/layers.{i}/residual")]
        x = f"h{i + 1}"
        for k in ("key", "value"):
            inputs.append(oh.make_tensor_value_info(N.past_name(k, i), et, ["batch_size", KV, "past_sequence_length", D]))
            outputs.append(oh.make_tensor_value_info(N.present_name(k, i), et,
                                                     ["batch_size", KV, "total_sequence_length", D]))
        # the builder writes every value's type; onnx's shape inference does not know com.microsoft ops
        value_info.append(oh.make_tensor_value_info(f"attn{i}", et, ["batch_size", "sequence_length", H * D]))
    inits.append(nh.from_array(rng.standard_normal((E, V)).astype(dtype), "lm_head"))
    nodes.append(oh.make_node("MatMul", [x, "lm_head"], [N.LOGITS], name="/lm_head/MatMul"))
    outputs.insert(0, oh.make_tensor_value_info(N.LOGITS, et, ["batch_size", "sequence_length", V]))
    g = oh.make_graph(nodes, "tiny", inputs, outputs, inits, value_info=value_info)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1)], ir_version=10)
    return onnx.shape_inference.infer_shapes(m)


def genai_config(num_layers: int, **decoder_fields) -> dict:
    dec = {"filename": "model.onnx", "head_size": D, "hidden_size": E, "num_attention_heads": H,
           "num_key_value_heads": KV, "num_hidden_layers": num_layers,
           "inputs": {"input_ids": N.INPUT_IDS, "attention_mask": N.ATTENTION_MASK,
                      "past_key_names": N.PAST_KEY, "past_value_names": N.PAST_VALUE},
           "outputs": {"logits": N.LOGITS, "present_key_names": N.PRESENT_KEY, "present_value_names": N.PRESENT_VALUE}}
    dec.update(decoder_fields)
    return {"model": {"type": "llama", "vocab_size": V, "context_length": 64, "bos_token_id": 1, "eos_token_id": 2,
                      "pad_token_id": 0, "decoder": {k: v for k, v in dec.items() if v is not None}},
            "search": {"max_length": 64}}


def _ort(model) -> "ort.InferenceSession":
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def _dims(v: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


def _io(model: onnx.ModelProto) -> tuple[dict, dict]:
    return ({v.name: _dims(v) for v in model.graph.input}, {v.name: _dims(v) for v in model.graph.output})


def _paged_errs(paged: onnx.ModelProto, ref_model: onnx.ModelProto, tmp: Path) -> list[float]:
    path = tmp / "paged.onnx"
    onnx.save(paged, str(path))
    got = run_paged(pagedkit.InferenceSession(str(path)), PROMPTS, STEPS, V)
    ref = _ort(ref_model)
    return [rel_err(o, run_gqa(ref, p, STEPS, V, head_size=D)) for p, o in zip(PROMPTS, got)]


def _gqa_errs(model: onnx.ModelProto, ref_model: onnx.ModelProto) -> list[float]:
    a, b = _ort(model), _ort(ref_model)
    return [rel_err(run_gqa(a, p, STEPS, V, head_size=D), run_gqa(b, p, STEPS, V, head_size=D)) for p in PROMPTS]


def _pagedkit_layers(cfg: dict) -> dict[int, dict]:
    """layer -> its entry of the config's pagedkit section (written as a JSON string)."""
    section = cfg["pagedkit"]
    section = json.loads(section) if isinstance(section, str) else section
    return {l["layer"]: l for l in section["layers"]}


def _paged_nodes(model: onnx.ModelProto) -> dict[int, onnx.NodeProto]:
    """layer -> its PagedAttention node (by the key cache it reads)."""
    return {N.layer_of(n.input[3], N.PAST_KEY): n for n in model.graph.node if n.op_type == "PagedAttention"}


# ------------------------------------------------------------------------------------------------
# numbers: GQA -> paged (pagedkit), round trip back to GQA (onnxruntime), against the original
# ------------------------------------------------------------------------------------------------

def test_gqa_to_paged_and_back_keep_the_logits(tmp_path):
    src = decoder((-1, 4))
    paged, report, layers = gqa_to_paged(src)
    assert isinstance(paged, onnx.ModelProto)
    assert report.changed == ["/layers.0/attn/GroupQueryAttention", "/layers.1/attn/GroupQueryAttention"]
    assert report.skipped == []
    errs = _paged_errs(paged, src, tmp_path)
    assert max(errs) <= TOL, errs

    back, back_report = paged_to_gqa(paged)
    assert isinstance(back, onnx.ModelProto)
    assert back_report.changed == ["/layers.0/attn/PagedAttention", "/layers.1/attn/PagedAttention"]
    errs = _gqa_errs(back, src)
    assert max(errs) <= TOL, errs
    # the GQA layout's I/O, head size included (it comes from the paged cache's last dimension)
    ins, outs = _io(back)
    assert ins == {N.INPUT_IDS: ["batch_size", "sequence_length"],
                   **{N.past_name(k, i): ["batch_size", KV, "past_sequence_length", D]
                      for i in (0, 1) for k in ("key", "value")},
                   N.ATTENTION_MASK: ["batch_size", "total_sequence_length"]}
    assert outs == {N.LOGITS: ["batch_size", "sequence_length", V],
                    **{N.present_name(k, i): ["batch_size", KV, "total_sequence_length", D]
                       for i in (0, 1) for k in ("key", "value")}}
    assert any("removed inputs: " + ", ".join([N.BLOCK_TABLE, N.BLOCK_TABLE_WINDOWED, N.CUMULATIVE_SEQUENCE_LENGTHS,
                                                N.PAST_SEQUENCE_LENGTHS, N.ATTENTION_METADATA]) == m
               for m in back_report.model), back_report.model


def test_teeth_wrong_scale_fails_the_comparison(tmp_path):
    good = decoder((-1, 4), scale=1 / np.sqrt(D))
    bad = decoder((-1, 4), scale=1.02 / np.sqrt(D))
    assert max(_gqa_errs(good, decoder((-1, 4)))) <= 1e-5  # explicit default scale: the same model
    paged, _, _ = gqa_to_paged(bad)
    assert max(_paged_errs(paged, good, tmp_path)) > TOL
    assert max(_gqa_errs(paged_to_gqa(paged)[0], good)) > TOL


def test_kept_shapes_are_the_computed_ones():
    """paged_to_gqa keeps the declared shapes of its Shape / Concat values: each must be what onnxruntime
    computes (a stale or wrong one misleads shape inference and other tools)."""
    back, _ = paged_to_gqa(gqa_to_paged(decoder((-1, -1)))[0])
    declared = {v.name: _dims(v) for v in back.graph.value_info if v.type.tensor_type.HasField("shape")}
    kept = [n.output[0] for n in back.graph.node if n.op_type in ("Shape", "Concat") and n.output[0] in declared]
    assert "/gqa_rewrite/logits_shape" in kept and "/gqa_rewrite/batch_seq" in kept
    probe = onnx.ModelProto()
    probe.CopyFrom(back)
    probe.graph.output.extend([oh.make_tensor_value_info(k, TP.INT64, None) for k in kept])
    ids = np.array([[3, 4, 5]], np.int64)
    feeds = {N.INPUT_IDS: ids, N.ATTENTION_MASK: np.ones((1, 3), np.int64),
             **{N.past_name(k, i): np.zeros((1, KV, 0, D), np.float16) for i in (0, 1) for k in ("key", "value")}}
    got = dict(zip(kept, _ort(probe).run(kept, feeds)))
    for name in kept:
        static = [d for d in declared[name] if isinstance(d, int)]
        assert len(static) == len(declared[name]), (name, declared[name])
        assert list(got[name].shape) == declared[name], (name, got[name].shape, declared[name])
    assert list(got["/gqa_rewrite/logits_shape"]) == [1, 3, V]


def test_ir_model_is_edited_in_place_and_returned():
    m = ir.serde.deserialize_model(decoder((-1,)))
    out, _, layers = gqa_to_paged(m)
    assert out is m and [l.layer for l in layers] == [0]
    back, report = paged_to_gqa(m)
    assert back is m and report.changed == ["/layers.0/attn/PagedAttention"]
    assert isinstance(paged_to_gqa(gqa_to_paged(decoder((-1,)))[0])[0], onnx.ModelProto)


def test_paged_to_gqa_options_are_keyword_only():
    params = inspect.signature(paged_to_gqa).parameters
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["cast_to"].kind is params["unfuse_qk_norm"].kind is inspect.Parameter.KEYWORD_ONLY
    paged = gqa_to_paged(decoder((-1,)))[0]
    with pytest.raises(TypeError):
        paged_to_gqa(paged, None)
    assert paged_to_gqa(model=paged)[1].changed == ["/layers.0/attn/PagedAttention"]


# ------------------------------------------------------------------------------------------------
# windows: which layers read block_table_windowed, LayerSpec and genai_config per layer
# ------------------------------------------------------------------------------------------------

def _layout(paged: onnx.ModelProto) -> dict[int, tuple[str, str]]:
    """layer -> (its block table input, the first dimension of its key cache)."""
    ins = {v.name: _dims(v) for v in paged.graph.input}
    return {i: (n.input[7], ins[n.input[3]][0]) for i, n in _paged_nodes(paged).items()}


@pytest.mark.parametrize("windows,omit", [((-1, 4), (0,)), ((-1, 4), ())])
def test_mixed_windows_windowed_layer_reads_its_own_table(windows, omit, tmp_path):
    """local_window_size absent or -1 is full attention: only the windowed layer reads block_table_windowed,
    with the num_blocks_windowed pool."""
    src = decoder(windows, omit_window=omit)
    paged, report, layers = gqa_to_paged(src)
    assert _layout(paged) == {0: (N.BLOCK_TABLE, "num_blocks"), 1: (N.BLOCK_TABLE_WINDOWED, "num_blocks_windowed")}
    assert [(l.layer, l.window, l.windowed_table) for l in layers] == \
        [(0, -1 if omit else windows[0], False), (1, 4, True)]
    assert f"new inputs: {N.BLOCK_TABLE}, {N.BLOCK_TABLE_WINDOWED}, {N.CUMULATIVE_SEQUENCE_LENGTHS}, " \
           f"{N.PAST_SEQUENCE_LENGTHS}, {N.ATTENTION_METADATA}" in report.model
    spec = paged_model_spec(genai_config(2), layers, 16, "float16")
    assert spec.windowed_layers == [1]
    errs = _paged_errs(paged, src, tmp_path)
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("windows,omit", [((-1, -1), ()), ((-1, -1), (0, 1)), ((-1, -1), (1,)), ((4, 4), ())])
def test_uniform_windows_need_no_windowed_table(windows, omit):
    paged, report, layers = gqa_to_paged(decoder(windows, omit_window=omit))
    assert N.BLOCK_TABLE_WINDOWED not in [v.name for v in paged.graph.input]
    assert not any(N.BLOCK_TABLE_WINDOWED in m for m in report.model), report.model
    assert set(_layout(paged).values()) == {(N.BLOCK_TABLE, "num_blocks")}
    want = [-1 if i in omit else w for i, w in enumerate(windows)]
    assert [l.window for l in layers] == want and not any(l.windowed_table for l in layers)


@pytest.mark.parametrize("windows", [(0, 4), (-1, 0), (-2, -1)])
def test_window_neither_off_nor_positive_is_refused(windows):
    """PagedAttention's local_window_size is -1 (off) or > 0: a GQA node with 0 or -2 is refused by name."""
    bad = next(i for i, w in enumerate(windows) if w not in (-1, 4))
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(decoder(windows))
    msg = str(exc.value)
    assert msg.startswith(f"/layers.{bad}/attn/GroupQueryAttention: the created PagedAttention node is invalid: ")
    assert f"got {windows[bad]}" in msg and msg.count("GroupQueryAttention:") == 1, msg


def test_absent_window_is_minus_one_in_the_written_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(decoder((-1, 4), omit_window=(0,)), str(src / "model.onnx"))
    (src / "genai_config.json").write_text(json.dumps(genai_config(2)))
    rewrite_file(src, tmp_path / "out" / "model.onnx", "paged", block_size=16)
    cfg = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    layers = _pagedkit_layers(cfg)
    assert (layers[0]["window"], layers[0]["block_table"]) == (-1, N.BLOCK_TABLE)
    assert (layers[1]["window"], layers[1]["block_table"]) == (4, N.BLOCK_TABLE_WINDOWED)
    assert cfg["model"]["decoder"]["sliding_window"]["layers"] == [1]


# ------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------

def test_gqa_inside_a_subgraph_is_refused_by_name():
    m = decoder((-1,))
    inner = oh.make_node("GroupQueryAttention", ["qkv0", "", "", N.past_name("key", 0), N.past_name("value", 0),
                                                 "seqlens_k", "total_seq"], ["sub_out", "sub_k", "sub_v"],
                         domain="com.microsoft", name="/branch/GroupQueryAttention", num_heads=H, kv_num_heads=KV)
    branch = oh.make_graph([inner], "then", [], [oh.make_tensor_value_info("sub_out", TP.FLOAT, None)])
    other = oh.make_graph([oh.make_node("Identity", ["qkv0"], ["else_out"])], "else", [],
                          [oh.make_tensor_value_info("else_out", TP.FLOAT, None)])
    m.graph.initializer.append(nh.from_array(np.array(True), "flag"))
    m.graph.node.append(oh.make_node("If", ["flag"], ["if_out"], name="/branch/If", then_branch=branch,
                                     else_branch=other))
    m.graph.output.append(oh.make_tensor_value_info("if_out", TP.FLOAT, None))
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(m)
    assert str(exc.value) == "/branch/GroupQueryAttention: inside a subgraph, not rewritten"


@pytest.mark.parametrize("kind", ["key", "value"])
def test_cache_that_is_not_a_graph_input_is_refused(kind):
    """past_key / past_value made by a node (even with the cache's name) cannot be replaced by a paged pool."""
    m = decoder((-1,))
    name = N.past_name(kind, 0)
    raw = next(v for v in m.graph.input if v.name == name)
    raw.name = f"{name}_raw"
    m.graph.node.insert(0, oh.make_node("Identity", [f"{name}_raw"], [name], name="/cache/Identity"))
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(m)
    assert str(exc.value) == (f"/layers.0/attn/GroupQueryAttention: past_key / past_value are not the graph inputs "
                              f"'{N.PAST_KEY}' / '{N.PAST_VALUE}'")


@pytest.mark.parametrize("value_layer", [0, 1])
def test_paged_node_reading_another_layers_value_cache_is_refused(value_layer):
    paged = gqa_to_paged(decoder((-1, -1)))[0]
    nodes = _paged_nodes(paged)
    key_layer = 1 - value_layer
    nodes[key_layer].input[3] = N.past_name("key", key_layer)
    nodes[key_layer].input[4] = N.past_name("value", value_layer)  # key of one layer, value of the other
    with pytest.raises(RewriteRefused) as exc:
        paged_to_gqa(paged)
    assert f"/layers.{key_layer}/attn/PagedAttention: key_cache / value_cache are not the graph inputs " \
           f"'{N.PAST_KEY}' / '{N.PAST_VALUE}'" in str(exc.value)


def test_remove_dead_nodes_counts_what_it_removes():
    g = ir.serde.deserialize_graph(oh.make_graph(
        [oh.make_node("Relu", ["x"], ["a"], name="dead1"), oh.make_node("Neg", ["a"], ["b"], name="dead2"),
         oh.make_node("Abs", ["b"], ["c"], name="dead3"), oh.make_node("Identity", ["x"], ["y"], name="live")],
        "g", [oh.make_tensor_value_info("x", TP.FLOAT, [2])], [oh.make_tensor_value_info("y", TP.FLOAT, [2])]))
    assert remove_dead_nodes(g) == 3
    assert [n.name for n in g] == ["live"]
    assert remove_dead_nodes(g) == 0


def test_paged_model_spec_falls_back_to_the_first_layer():
    layers = [LayerSpec(0, 4, 2, 8), LayerSpec(1, 4, 2, 8)]
    spec = paged_model_spec({"model": {"decoder": {}}}, layers, 16, "float16")
    assert (spec.num_heads, spec.kv_num_heads, spec.head_size) == (4, 2, 8)
    one = paged_model_spec(genai_config(1), layers[:1], 32, "bfloat16")
    assert (one.kv_num_heads, one.block_size, one.dtype) == (KV, 32, "bfloat16")


# ------------------------------------------------------------------------------------------------
# rewrite_file: folders, weights inline or external, the validator
# ------------------------------------------------------------------------------------------------

def _folder(tmp: Path, name: str, model: onnx.ModelProto, *, config: dict | None = None, external: bool = False,
            data_name: str | None = None, filename: str = "model.onnx") -> Path:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    model = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save moves the caller's weights out
    if external:
        onnx.save(model, str(d / filename), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data_name or filename + ".data", size_threshold=0)
    else:
        onnx.save(model, str(d / filename))
    if config is not None:
        (d / "genai_config.json").write_text(json.dumps(config))
    return d


def test_one_layer_fp16_rewrite_to_nested_folder_inline_weights(tmp_path):
    """A one-layer fp16 model with its genai_config: written into a folder that does not exist yet, weights
    inline (the source had no external data), the config's cache dtype float16, no Casts reported."""
    src_model = decoder((-1,), dtype=np.float16)
    src = _folder(tmp_path, "src", src_model, config=genai_config(1))
    dst = tmp_path / "deep" / "er" / "model.onnx"
    report = rewrite_file(src / "model.onnx", dst, "paged")
    assert report.changed == ["/layers.0/attn/GroupQueryAttention"]
    assert not any("float32 source" in m for m in report.model), report.model
    assert f"wrote {dst.parent / 'genai_config.json'}" in report.model
    assert sorted(p.name for p in dst.parent.iterdir()) == ["genai_config.json", "model.onnx"]
    m = onnx.load(str(dst), load_external_data=False)
    assert m.graph.initializer and not any(onnx.external_data_helper.uses_external_data(t) for t in m.graph.initializer)
    cfg = json.loads((dst.parent / "genai_config.json").read_text())
    assert cfg["engine"]["dynamic_batching"]["block_size"] == rw.DEFAULT_BLOCK_SIZE
    assert {l["k_cache"]["dtype"] for l in _pagedkit_layers(cfg).values()} == {"float16"}
    assert cfg["model"]["decoder"]["num_key_value_heads"] == KV


def test_float32_source_reports_its_casts():
    _, report, layers = gqa_to_paged(decoder((-1,)))
    assert any(m.startswith("float32 source: Casts to float16") for m in report.model), report.model
    assert layers[0].k_cache.dtype == "float16"


def test_external_data_rewrite_replaces_a_stale_data_file(tmp_path):
    src_model = decoder((-1, 4))
    src = _folder(tmp_path, "src", src_model, external=True)
    dst = tmp_path / "out" / "model.onnx"
    dst.parent.mkdir()
    (dst.parent / "model.onnx.data").write_bytes(b"stale" * 100000)  # a previous run's, larger than the new one
    rewrite_file(src / "model.onnx", dst, "paged")
    rewrite_file(src / "model.onnx", dst, "paged")  # again over its own output
    m = onnx.load(str(dst), load_external_data=False)
    sizes = {t.name: int(onnx.external_data_helper.ExternalDataInfo(t).length) for t in m.graph.initializer
             if onnx.external_data_helper.uses_external_data(t)}
    assert sizes and (dst.parent / "model.onnx.data").stat().st_size < 500000
    ref = {t.name: nh.to_array(t) for t in src_model.graph.initializer}
    loaded = onnx.load(str(dst))
    for t in loaded.graph.initializer:
        if t.name in ref:
            np.testing.assert_array_equal(nh.to_array(t), ref[t.name])


def test_output_data_file_that_is_the_inputs_is_refused(tmp_path):
    src = _folder(tmp_path, "m", decoder((-1,)), external=True, filename="a.onnx", data_name="b.onnx.data")
    before = (src / "b.onnx.data").read_bytes()
    with pytest.raises(ValueError) as exc:
        rewrite_file(src / "a.onnx", src / "b.onnx", "paged")
    assert str(exc.value) == f"the output's external data {src / 'b.onnx.data'} is the input's: write elsewhere"
    assert (src / "b.onnx.data").read_bytes() == before and not (src / "b.onnx").exists()


def test_unsafe_external_data_names_the_first_three(tmp_path):
    m = decoder((-1,))
    d = _folder(tmp_path, "evil", m, external=True)
    proto = onnx.load(str(d / "model.onnx"), load_external_data=False)
    bad = [t for t in proto.graph.initializer if onnx.external_data_helper.uses_external_data(t)][:4]
    assert len(bad) == 4
    for i, t in enumerate(bad):
        for e in t.external_data:
            if e.key == "location":
                e.value = f"../elsewhere{i}.data"
    onnx.save(proto, str(d / "model.onnx"))
    with pytest.raises(ModelLoadError) as exc:
        rewrite_file(d / "model.onnx", tmp_path / "o" / "model.onnx", "paged")
    msg = str(exc.value)
    assert msg.startswith(f"{d / 'model.onnx'}: unsafe external data: ")
    assert [f"'../elsewhere{i}.data'" in msg for i in range(4)] == [True, True, True, False], msg
    assert not (tmp_path / "o").exists()


def test_invalid_rewrite_lists_the_first_five_problems(tmp_path, monkeypatch):
    """The validator's verdict on the written model: RewriteInvalid with its first 5 problems."""
    issues = [Issue("model", f"tensor 't{i}'", "MODEL-test", "something", f"problem {i}") for i in range(7)]

    class Report:
        pass

    rep = Report()
    rep.issues = issues
    seen = []
    monkeypatch.setattr(rw, "check_model", lambda path, genai_config=None: seen.append((path, genai_config)) or rep)
    src = _folder(tmp_path, "src", decoder((-1,)), config=genai_config(1))
    dst = tmp_path / "out" / "model.onnx"
    with pytest.raises(RewriteInvalid) as exc:
        rewrite_file(src, dst, "paged", block_size=16)
    msg = str(exc.value)
    assert msg.startswith(f"the rewritten model {dst} is invalid: ")
    assert [f"tensor 't{i}'" in msg for i in range(7)] == [True] * 5 + [False] * 2, msg
    assert seen[0][0] == dst and seen[0][1]["engine"]["dynamic_batching"]["block_size"] == 16


# ------------------------------------------------------------------------------------------------
# near misses: model-level refusals, head size, argument checks, the decomposed target
# ------------------------------------------------------------------------------------------------

def test_gqa_to_paged_refuses_a_non_decoder_with_every_reason():
    g = oh.make_graph([oh.make_node("Relu", [N.POSITION_IDS], ["y"], name="relu")], "g",
                      [oh.make_tensor_value_info(N.POSITION_IDS, TP.INT64, [2])],
                      [oh.make_tensor_value_info("y", TP.INT64, [2])])
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(oh.make_model(g))
    assert str(exc.value) == "; ".join([
        "no com.microsoft::GroupQueryAttention node in the main graph",
        f"no graph input '{N.INPUT_IDS}' (not an onnxruntime-genai decoder)",
        f"graph input '{N.POSITION_IDS}': the paged layout takes positions from the sequence lengths (or the "
        f"pagedkit extension '{N.QUERY_POSITIONS}'); not converted",
        f"no graph output '{N.LOGITS}'"])


def test_paged_to_gqa_refuses_a_non_decoder_and_pagedkit_extensions():
    g = oh.make_graph([oh.make_node("Identity", [N.SLOT_MAPPING], ["y"], name="id")], "g",
                      [oh.make_tensor_value_info(n, TP.INT32, [2]) for n in (N.SLOT_MAPPING, N.QUERY_POSITIONS)],
                      [oh.make_tensor_value_info("y", TP.INT32, [2])])
    with pytest.raises(RewriteRefused) as exc:
        paged_to_gqa(oh.make_model(g))
    assert str(exc.value) == "; ".join([
        "no com.microsoft::PagedAttention node in the main graph",
        f"no graph input '{N.INPUT_IDS}' (not an onnxruntime-genai decoder)", f"no graph output '{N.LOGITS}'",
        f"graph input '{N.SLOT_MAPPING}' (a pagedkit extension) has no GQA-layout equivalent",
        f"graph input '{N.QUERY_POSITIONS}' (a pagedkit extension) has no GQA-layout equivalent"])


def test_attention_mask_used_elsewhere_is_refused():
    m = decoder((-1,))
    m.graph.node.append(oh.make_node("Identity", [N.ATTENTION_MASK], ["mask_copy"], name="/other/Identity"))
    m.graph.output.append(oh.make_tensor_value_info("mask_copy", TP.INT64, None))
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(m)
    assert str(exc.value) == (f"'{N.ATTENTION_MASK}' is still used after the rewrite (by ['/other/Identity']): "
                              "not a builder decoder")


def test_paged_input_used_elsewhere_is_refused():
    paged = gqa_to_paged(decoder((-1,)))[0]
    paged.graph.node.append(oh.make_node("Identity", [N.BLOCK_TABLE], ["table_copy"], name="/other/Identity"))
    paged.graph.output.append(oh.make_tensor_value_info("table_copy", TP.INT32, None))
    with pytest.raises(RewriteRefused) as exc:
        paged_to_gqa(paged)
    assert str(exc.value) == f"'{N.BLOCK_TABLE}' is still used after the rewrite (by ['/other/Identity']): not converted"


def _symbolic_head(m: onnx.ModelProto, query_width=True) -> onnx.ModelProto:
    for v in list(m.graph.input) + list(m.graph.output):
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.shape.dim[3].dim_param = "head_size"
    if not query_width:
        for v in m.graph.value_info:
            if v.name.startswith("qkv"):
                v.type.tensor_type.shape.dim[2].dim_param = "hidden"
    return m


def test_head_size_from_the_packed_query_when_the_cache_does_not_say(tmp_path):
    src = _symbolic_head(decoder((-1, 4)))
    paged, _, layers = gqa_to_paged(src)
    assert [l.head_size for l in layers] == [D, D]
    ins = {v.name: _dims(v) for v in paged.graph.input}
    assert ins[N.past_name("key", 0)] == ["num_blocks", "block_size", KV, D]
    assert max(_paged_errs(paged, decoder((-1, 4)), tmp_path)) <= TOL


def test_head_size_unknown_is_refused():
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(_symbolic_head(decoder((-1,)), query_width=False))
    assert str(exc.value) == "/layers.0/attn/GroupQueryAttention: head_size is not known statically"


def test_integer_caches_are_refused():
    m = decoder((-1,))
    for v in list(m.graph.input) + list(m.graph.output):
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.elem_type = TP.INT8
    with pytest.raises(RewriteRefused) as exc:
        gqa_to_paged(m)
    assert str(exc.value) == ("/layers.0/attn/GroupQueryAttention: quantized (INT8) GQA caches: the whole-model "
                              "rewrite keeps float caches only")


def _bf16(m: onnx.ModelProto) -> onnx.ModelProto:
    """The fp32 decoder with bfloat16 weights, activations and caches (not run: only its types matter)."""
    for t in m.graph.initializer:
        if t.data_type == TP.FLOAT:
            t.CopyFrom(oh.make_tensor(t.name, TP.BFLOAT16, t.dims, nh.to_array(t).ravel().tolist()))
    for v in list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info):
        if v.type.tensor_type.elem_type == TP.FLOAT:
            v.type.tensor_type.elem_type = TP.BFLOAT16
    return m


def test_bf16_source_keeps_bf16_caches_and_config(tmp_path):
    src = _folder(tmp_path, "src", _bf16(decoder((-1,))), config=genai_config(1))
    report = rewrite_file(src, tmp_path / "out" / "model.onnx", "paged", block_size=32)
    assert not any("float32 source" in m for m in report.model), report.model
    assert "block size 32 (genai_config engine.dynamic_batching.block_size)" in report.model
    m = onnx.load(str(tmp_path / "out" / "model.onnx"))
    caches = {v.name: v.type.tensor_type.elem_type for v in m.graph.input if v.name.startswith("past_key_values.")}
    assert set(caches.values()) == {TP.BFLOAT16}
    cfg = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert {l["k_cache"]["dtype"] for l in _pagedkit_layers(cfg).values()} == {"bfloat16"}
    assert json.loads(cfg["pagedkit"])["dtype"] == "bfloat16"


@pytest.mark.parametrize("to,kw,msg", [
    ("paged2", {}, "--to should be one of paged, gqa, decomposed, got 'paged2'"),
    ("gqa", {"block_size": 16}, "--block-size applies to --to paged only"),
    ("decomposed", {"block_size": 16}, "--block-size applies to --to paged only"),
    ("paged", {"block_size": 24}, "block_size must be a power of two >= 16, got 24"),
])
def test_rewrite_model_argument_errors(to, kw, msg):
    with pytest.raises(ValueError) as exc:
        rw.rewrite_model(ir.serde.deserialize_model(decoder((-1,))), to, **kw)
    assert msg in str(exc.value)


def test_rewrite_file_argument_errors(tmp_path):
    src = _folder(tmp_path, "src", decoder((-1,)))
    with pytest.raises(ValueError, match="--to should be one of paged, gqa, decomposed, got 'x'"):
        rewrite_file(src, tmp_path / "o" / "model.onnx", "x")
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16, got 8"):
        rewrite_file(src, tmp_path / "o" / "model.onnx", "paged", block_size=8)
    with pytest.raises(ValueError) as exc:
        rewrite_file(src, tmp_path / "o" / "model.bin", "paged")
    assert str(exc.value) == f"the output should be a .onnx file, got {tmp_path / 'o' / 'model.bin'}"
    with pytest.raises(ValueError) as exc:
        rewrite_file(src, src / "model.onnx", "paged")
    assert str(exc.value) == f"the output {src / 'model.onnx'} is the input model: write to another file"
    assert not (tmp_path / "o").exists()


def test_paged_to_gqa_file_writes_the_gqa_config(tmp_path):
    src = _folder(tmp_path, "src", decoder((-1,)), config=genai_config(1))
    rewrite_file(src, tmp_path / "paged" / "model.onnx", "paged", block_size=16)
    report = rewrite_file(tmp_path / "paged", tmp_path / "back" / "m.onnx", "gqa")
    assert report.changed == ["/layers.0/attn/PagedAttention"]
    cfg = json.loads((tmp_path / "back" / "genai_config.json").read_text())
    assert "engine" not in cfg and "pagedkit" not in cfg and "sliding_window" not in cfg["model"]["decoder"]
    assert cfg["model"]["decoder"]["filename"] == "m.onnx"
    assert cfg["model"]["decoder"]["inputs"] == genai_config(1)["model"]["decoder"]["inputs"]
    assert max(_gqa_errs(onnx.load(str(tmp_path / "back" / "m.onnx")), decoder((-1,)))) <= TOL


def test_decomposed_target_runs_in_onnxruntime(tmp_path):
    """to="decomposed": every PagedAttention node as standard ops (config copied); onnxruntime CPU runs the
    paged layout then, against the original GQA model."""
    src_model = decoder((-1, 4))
    src = _folder(tmp_path, "src", src_model, config=genai_config(2))
    rewrite_file(src, tmp_path / "paged" / "model.onnx", "paged", block_size=16)
    paged_cfg = (tmp_path / "paged" / "genai_config.json").read_text()
    report = rewrite_file(tmp_path / "paged", tmp_path / "dec" / "model.onnx", "decomposed")
    assert report.pass_name == "decompose" and len(report.changed) == 2 and report.skipped == []
    assert json.loads((tmp_path / "dec" / "genai_config.json").read_text()) == json.loads(paged_cfg)
    dec = onnx.load(str(tmp_path / "dec" / "model.onnx"))
    assert not any(n.op_type == "PagedAttention" for n in dec.graph.node)
    got = run_paged(_ort(tmp_path / "dec" / "model.onnx"), PROMPTS, STEPS, V)
    ref = _ort(src_model)
    errs = [rel_err(o, run_gqa(ref, p, STEPS, V, head_size=D)) for p, o in zip(PROMPTS, got)]
    assert max(errs) <= TOL, errs
    with pytest.raises(RewriteRefused, match="no com.microsoft::PagedAttention node to decompose"):
        rewrite_file(src, tmp_path / "dec2" / "model.onnx", "decomposed")
