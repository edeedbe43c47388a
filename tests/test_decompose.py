"""pagedkit.rewriters.decompose: PagedAttention -> standard ONNX ops, run by stock onnxruntime (CPU).

- every PagedAttention case file (tests/cases) is wrapped as a single-node model, decomposed, run in
  onnxruntime and compared with its expected outputs (output, cache outputs, scale caches, output_qk);
- fresh random inputs (tests/paged_oracle.build: shuffled block tables, ragged sequences, poisoned caches)
  against pagedkit.kernels.paged_attention, through a model with symbolic token / batch / block dims that
  one decomposed session runs at two different shapes;
- teeth: a decomposition with a 2% wrong scale, or without the window mask, fails the comparison;
- invalid nodes are refused with the validator's reason;
- examples/tiny-paged decomposed matches pagedkit.InferenceSession over prefill + decode, caches fed back.
"""

from __future__ import annotations

import copy
import importlib
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cases import Case, Expected, compare_case, load_cases, load_index, to_numpy
from paged_oracle import Spec, build
from test_session_cases import single_node_model
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.rewriters.decompose import decompose
from pagedkit.validators.nodeview import onnx_dtype_of

decompose_mod = importlib.import_module("pagedkit.kernels.onnx_ops.paged")  # the implementation module
PAGED = [e["name"] for e in load_index() if e["op"] == "PagedAttention"]
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def ort_run(model: onnx.ModelProto, feeds: dict, outputs: dict) -> dict:
    """Run `model` in onnxruntime CPU with torch feeds (bf16 / fp8 included, through OrtValues) and
    preallocated outputs {name: (shape, torch dtype)}; returns torch tensors."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    for i in sess.get_inputs():
        t = feeds[i.name]
        io.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(to_numpy(t.contiguous())), onnx_dtype_of(t)))
    result = {}
    for name, (shape, dtype) in outputs.items():
        buf = torch.zeros(shape, dtype=dtype)
        arr = to_numpy(buf)  # shares memory with buf
        io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, onnx_dtype_of(buf)))
        result[name] = (buf, arr)
    sess.run_with_iobinding(io)
    return {n: b for n, (b, _) in result.items()}


def run_case_decomposed(case: Case) -> tuple[dict, object]:
    model, report = decompose(single_node_model(case))
    if report.skipped:
        return None, report
    assert not [n for n in model.graph.node if n.domain == "com.microsoft"]
    onnx.checker.check_model(model, full_check=True)  # a valid standard-ONNX graph, strict shape inference
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in case.expected.items()}
    return ort_run(model, case.inputs, shapes), report


# ------------------------------------------------------------------------------------------------
# the case files
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PAGED)
def test_case_file_decomposed_in_onnxruntime(name):
    (case,) = load_cases([name])
    got, report = run_case_decomposed(case)
    assert got is not None, f"refused: {report.skipped}"  # every case file is decomposed (test_case_file_coverage)
    compare_case(case, got)


def test_case_file_coverage():
    """How many PagedAttention case files the decomposition claims; the rest are refused by reason."""
    reasons = Counter()
    covered = 0
    for case in load_cases(op="PagedAttention"):
        _, report = decompose(single_node_model(case))
        if report.skipped:
            reasons[report.skipped[0][1]] += 1
        else:
            covered += 1
    print(f"\ndecompose covers {covered} of {len(PAGED)} PagedAttention case files; refused: {dict(reasons)}")
    assert covered == len(PAGED), reasons


# ------------------------------------------------------------------------------------------------
# fresh random inputs vs the reference kernel, symbolic dims
# ------------------------------------------------------------------------------------------------

SYMBOLIC = {"query": ["T", None], "key": ["T", None], "value": ["T", None], "slot_mapping": ["T"],
            "query_positions": ["T"], "cumulative_sequence_length": ["B1"], "past_seqlens": ["B"],
            "block_table": ["B", "MB"], "key_cache": ["NB"], "value_cache": ["NB"], "k_scale_cache": ["NB"],
            "v_scale_cache": ["NB"], "output": ["T", None], "key_cache_out": ["NB"], "value_cache_out": ["NB"],
            "k_scale_cache_out": ["NB"], "v_scale_cache_out": ["NB"], "output_qk": [None, "T", "C"],
            "attention_bias": ["BB", None, "QC", "KC"], "cos_cache": ["P"], "sin_cache": ["P"]}


def symbolic(model: onnx.ModelProto) -> onnx.ModelProto:
    """token_count, batch_size, num_blocks, max blocks and capacities as named (symbolic) dims."""
    m = copy.deepcopy(model)
    for vi in list(m.graph.input) + list(m.graph.output):
        for d, sym in zip(vi.type.tensor_type.shape.dim, SYMBOLIC.get(vi.name, [])):
            if sym:
                d.Clear()
                d.dim_param = sym
    return m


def _with_slots(inputs: dict, block_size: int, skip: tuple = ()) -> None:
    """slot_mapping derived from past_seqlens + block_table, with the tokens in `skip` set to -1."""
    csl, past, table = inputs["cumulative_sequence_length"], inputs["past_seqlens"], inputs["block_table"]
    slots = []
    for b in range(len(past)):
        for j in range(int(csl[b + 1] - csl[b])):
            p = int(past[b]) + j
            slots.append(int(table[b, p // block_size]) * block_size + p % block_size)
    for t in skip:
        slots[t] = -1
    inputs["slot_mapping"] = torch.tensor(slots, dtype=torch.int32)


RANDOM = {
    "fp16_half_rope_window_sink_softcap": dict(rotary="half", sink=True, attrs=dict(local_window_size=5, softcap=3.0)),
    "bf16_interleaved_qknorm_bias_scores": dict(dtype=torch.bfloat16, rotary="interleaved", qk_norm=True,
                                                 bias=(True, True), attrs=dict(qk_output=1)),
    "fp16_packed_mqa_probs": dict(packed=True, kv_num_heads=1, rotary="half", attrs=dict(qk_output=2)),
    "fp16_bidirectional_scale_positions": dict(attrs=dict(is_causal=0, scale=0.3, local_window_size=4)),
    "fp16_int8_per_channel": dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", rotary="half"),
    "bf16_fp8_per_tensor": dict(dtype=torch.bfloat16, cache="float8e4m3fn", k_quant="PER_TENSOR",
                                v_quant="PER_TENSOR"),
    "fp16_int4_per_token_rotation": dict(cache="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN", rotary="half",
                                         attrs=dict(qk_rotation=1, v_rotation=1)),
    "fp16_latent_offset_rope": dict(latent=True, kv_num_heads=1, head_size=40, v_head_size=32, rotary="half",
                                    rotary_offset=32, attrs=dict(scale=0.15)),
}


def _random_case(kind: str, q_lens, past, seed: int, slots: tuple | None = None, unmapped=(), oob=()) -> Case:
    kw = dict(RANDOM[kind])
    if kind == "fp16_bidirectional_scale_positions":
        kw["query_positions"] = [p + j + 2 for p, n in zip(past, q_lens) for j in range(n)]
    rc = build(Spec(q_lens=q_lens, past=past, seed=seed, unmapped=unmapped, **kw))
    if slots is not None:
        _with_slots(rc.inputs, 16, slots)
    table, nb = rc.inputs["block_table"], rc.inputs["key_cache"].shape[0]
    for b, i in oob:  # out-of-range block ids (>= num_blocks) are unmapped too
        table[b, i] = nb + 3
    inputs = {k: v.clone() for k, v in rc.inputs.items()}
    names = ["output", "key_cache_out"] + ([] if kw.get("latent") else ["value_cache_out"])
    if kw.get("k_quant") == "PER_TOKEN":
        names += ["k_scale_cache_out", "v_scale_cache_out"]
    if rc.attrs.get("qk_output"):
        names.append("output_qk")
    ref = paged_attention({k: v.clone() for k, v in inputs.items()}, outputs=names, **rc.attrs)
    return Case(f"random_{kind}", "PagedAttention", rc.attrs, inputs, Expected(ref, {}))


def _compare(case: Case, got: dict, tol: float) -> None:
    for name, want in case.expected.items():
        have = got[name]
        assert have.shape == want.shape and have.dtype == want.dtype, name
        if want.dtype in (torch.int8, torch.uint8):  # quantized cache codes: at most one step apart
            from cases import _codes
            assert int((_codes(have) - _codes(want)).abs().max()) <= 1, name
            continue
        h, w = have.double(), want.double()
        err = float((h - w).abs().max() / w.abs().max().clamp_min(1e-30))
        assert err <= tol, f"{case.name}: {name} max|diff| / max|ref| = {err:.3g} > {tol}"


@pytest.mark.parametrize("kind", sorted(RANDOM))
def test_random_ragged_batches_match_the_reference(kind):
    """Ragged batches through models with symbolic dims: a prefill with a zero-token sequence and explicit
    slots (one -1), then a decode step with unmapped past blocks (-1 and >= num_blocks, which also sits in
    a column beyond every extent)."""
    first = _random_case(kind, [5, 0, 3], [0, 7, 20], seed=1, slots=(2,))
    second = _random_case(kind, [1, 1, 1, 1], [33, 3, 17, 40], seed=2, unmapped=((0, 0),), oob=((3, 1), (1, 3)))
    model, report = decompose(symbolic(single_node_model(first)))
    assert report.changed and not report.skipped, report
    tol = TOL[first.inputs["query"].dtype]
    got = ort_run(model, first.inputs, {n: (tuple(t.shape), t.dtype) for n, t in first.expected.items()})
    _compare(first, got, tol)
    model2, _ = decompose(symbolic(single_node_model(second)))
    got2 = ort_run(model2, second.inputs, {n: (tuple(t.shape), t.dtype) for n, t in second.expected.items()})
    _compare(second, got2, tol)


def test_one_symbolic_model_serves_several_shapes():
    """The same decomposed graph (built once) runs batches of different token / batch / block counts."""
    a = _random_case("fp16_half_rope_window_sink_softcap", [4, 2], [3, 30], seed=3)
    b = _random_case("fp16_half_rope_window_sink_softcap", [1, 6, 0, 2], [17, 0, 9, 50], seed=4)
    model, _ = decompose(symbolic(single_node_model(a)))
    for c in (a, b):
        got = ort_run(model, c.inputs, {n: (tuple(t.shape), t.dtype) for n, t in c.expected.items()})
        _compare(c, got, TOL[torch.float16])


# ------------------------------------------------------------------------------------------------
# teeth, refusals
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mutation", ["scale_2pct", "no_window"])
def test_a_wrong_decomposition_fails_the_comparison(monkeypatch, mutation):
    (case,) = load_cases(["paged_sink_window_softcap"])
    real = decompose_mod.Masking

    def broken(causal, window, softcap, scale, qk_mode):
        if mutation == "scale_2pct":
            scale *= 1.02
        else:
            window = -1
        return real(causal, window, softcap, scale, qk_mode)

    monkeypatch.setattr(decompose_mod, "Masking", broken)
    got, _ = run_case_decomposed(case)
    with pytest.raises(AssertionError, match="output"):
        compare_case(case, got)


def test_invalid_node_is_refused_with_the_reason():
    (case,) = load_cases(["paged_llama_fp16_rotary"])
    model = single_node_model(case)
    node = model.graph.node[0]
    for a in node.attribute:
        if a.name == "num_heads":
            a.i = 3  # not a multiple of kv_num_heads = 2
    out, report = decompose(model)
    assert not report.changed and len(report.skipped) == 1
    assert "invalid node" in report.skipped[0][1] and "num_heads" in report.skipped[0][1]
    assert [n.op_type for n in out.graph.node] == ["PagedAttention"]  # left alone


def test_low_opset_is_refused():
    (case,) = load_cases(["paged_llama_fp16_rotary"])
    model = single_node_model(case)
    model.opset_import[0].version = 17
    _, report = decompose(model)
    assert "opset is 17" in report.skipped[0][1]


def test_ir_model_in_ir_model_out():
    import onnx_ir as ir

    (case,) = load_cases(["paged_packed_qkv"])
    irm = ir.serde.deserialize_model(single_node_model(case))
    out, report = decompose(irm)
    assert out is irm and report.changed == ["paged_packed_qkv"]
    assert not [n for n in irm.graph if n.domain == "com.microsoft"]
    got = ort_run(ir.serde.serialize_model(irm), case.inputs,
                  {n: (tuple(t.shape), t.dtype) for n, t in case.expected.items()})
    compare_case(case, got)


# ------------------------------------------------------------------------------------------------
# a whole model
# ------------------------------------------------------------------------------------------------

def _prefill_decode_parity(path, layers: int, tol: float = 5e-3) -> None:
    """The model at `path` decomposed, in onnxruntime CPU, vs pagedkit.InferenceSession on the original: a
    prefill of two sequences (6 and 3 tokens) over shuffled blocks of a poisoned float16 cache, then one
    decode token each; each side's present caches are fed back as the next step's past (onnxruntime
    returns them as new tensors). Logits and caches within tol * max|ref|."""
    from pagedkit import InferenceSession

    model, report = decompose(onnx.load(path))
    assert len(report.changed) == layers and not report.skipped, report
    assert not [n for n in model.graph.node if n.op_type == "PagedAttention"]
    ours = InferenceSession(path)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in ours.get_outputs()]
    assert names == [o.name for o in theirs.get_outputs()]
    inputs = {i.name: i for i in ours.get_inputs()}

    g = torch.Generator().manual_seed(11)
    nb, bs = 8, 16
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    caches = {n: (torch.randn(nb, bs, *i.shape[2:], generator=g) * 3).half().numpy()
              for n, i in inputs.items() if n.startswith("past_key_values.")}
    table = torch.stack([perm[:3], perm[3:6]]).numpy()
    steps = [(torch.randint(3, 100, (9,), generator=g).numpy(), [0, 6, 9], [0, 0]),
             (torch.randint(3, 100, (2,), generator=g).numpy(), [0, 1, 2], [6, 3])]
    past_a, past_b = dict(caches), dict(caches)
    for ids, csl, past in steps:
        common = {"input_ids": ids, "cumulative_sequence_lengths": np.array(csl, np.int32),
                  "past_sequence_lengths": np.array(past, np.int32), "block_table": table,
                  "block_table_windowed": table, "attention_metadata": np.array([max(np.diff(csl)), 16, 0], np.int32)}
        common = {k: v for k, v in common.items() if k in inputs}
        a = dict(zip(names, ours.run(None, {**common, **past_a})))
        b = dict(zip(names, theirs.run(None, {**common, **past_b})))
        for n in names:
            ref = a[n].astype(np.float64)
            err = np.abs(b[n].astype(np.float64) - ref).max() / np.abs(ref).max()
            assert err <= tol, f"{n} at step {csl}: {err:.3g}"
        past_a = {k: a[k.replace("past_key_values", "present")] for k in caches}
        past_b = {k: b[k.replace("past_key_values", "present")] for k in caches}


def test_tiny_paged_model_prefill_and_decode_match_pagedkit():
    from pathlib import Path

    _prefill_decode_parity(Path(__file__).resolve().parents[1] / "examples" / "tiny-paged" / "model.onnx", 2)


EXPORTED = {  # tiny random HF models exported by paged-export (tests/export_utils)
    "gemma2_window_softcap": ("Gemma2Config", dict(seed=6, num_hidden_layers=3, sliding_window=8,
                                                   query_pre_attn_scalar=24), 3),
    "qwen3_qk_norm": ("Qwen3Config", dict(seed=4, rms_norm_eps=1e-5), 2),
}


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_exported_model_prefill_and_decode_match_pagedkit(name, tmp_path):
    """Whole exported decoders (Gemma 2: sliding-window layers on block_table_windowed, softcap, an explicit
    scale; Qwen3: fused QK-norm) decomposed run in onnxruntime and match pagedkit over prefill + decode."""
    from export_utils import attention_attrs, export_tiny, tiny_model

    cls, kw, layers = EXPORTED[name]
    export_tiny(tiny_model(cls, **kw), tmp_path)
    attrs = attention_attrs(tmp_path / "model.onnx")
    if name.startswith("gemma2"):  # the features this model is here for
        assert any(a.get("local_window_size", -1) > 0 for a in attrs) and all(a.get("softcap", 0) > 0 for a in attrs)
        assert any(a["inputs"]["block_table"] == "block_table_windowed" for a in attrs)
    else:
        assert all("q_norm_weight" in a["inputs"] for a in attrs)
    _prefill_decode_parity(tmp_path / "model.onnx", layers)


def test_node_inside_a_subgraph_is_reported_not_rewritten():
    from onnx import helper

    (case,) = load_cases(["paged_no_rotary_decode"])
    model = single_node_model(case)
    g = model.graph
    node = copy.deepcopy(g.node[0])
    node.output[:] = [f"{o}_in" for o in node.output]
    branch = lambda tag: helper.make_graph(  # noqa: E731 (uses the outer graph's inputs)
        [copy.deepcopy(node), helper.make_node("Identity", [node.output[0]], [f"o_{tag}"])], tag, [],
        [helper.make_tensor_value_info(f"o_{tag}", onnx.TensorProto.FLOAT16, None)])
    del g.node[:]
    g.node.append(helper.make_node("If", ["cond"], ["output"], then_branch=branch("then"), else_branch=branch("else")))
    g.input.append(helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []))
    del g.output[1:]
    out, report = decompose(model)
    assert not report.changed and len(report.skipped) == 2
    assert all("subgraph" in reason for _, reason in report.skipped)


def test_docs_example_runs(monkeypatch, capsys):
    """The example in docs/decompose.md runs as written (from the repository root)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "decompose.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(root)
    exec(compile(code, "docs/decompose.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "2 PagedAttention node(s) rewritten, 0 skipped" in printed and "(2, 128)" in printed


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("cache", ["fp16", "bf16", "int8", "float8e4m3fn", "int4"])
def test_duplicate_and_skipped_slots_leave_the_rest_of_the_cache_bit_identical(cache):
    """slot_mapping with a -1 and two tokens sharing a slot (the later one wins, as the reference):
    every cache entry the step does not write comes back bit-identical (fp8 through the float16 copy)."""
    kw = {"fp16": {}, "bf16": dict(dtype=torch.bfloat16), "int8": dict(cache="int8", k_quant="PER_TENSOR",
          v_quant="PER_TENSOR"), "float8e4m3fn": dict(cache="float8e4m3fn", k_quant="PER_CHANNEL",
          v_quant="PER_CHANNEL"), "int4": dict(cache="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN")}[cache]
    rc = build(Spec(q_lens=[3, 2], past=[4, 9], seed=5, rotary="half", **kw))
    _with_slots(rc.inputs, 16, skip=(1,))
    rc.inputs["slot_mapping"][4] = rc.inputs["slot_mapping"][3]  # tokens 3 and 4 share a slot: 4 wins
    before = {k: v.clone() for k, v in rc.inputs.items()}
    names = ["output", "key_cache_out", "value_cache_out"] + (
        ["k_scale_cache_out", "v_scale_cache_out"] if "k_scale_cache" in rc.inputs else [])
    ref = paged_attention({k: v.clone() for k, v in rc.inputs.items()}, outputs=names, **rc.attrs)
    case = Case("random_slots", "PagedAttention", rc.attrs, before, Expected(ref, {}))
    model, _ = decompose(single_node_model(case))
    got = ort_run(model, before, {n: (tuple(t.shape), t.dtype) for n, t in ref.items()})
    _compare(case, got, TOL[rc.inputs["query"].dtype])
    for out_name, in_name in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache"),
                              ("k_scale_cache_out", "k_scale_cache"), ("v_scale_cache_out", "v_scale_cache")):
        if out_name not in ref:
            continue
        untouched = (_bits(ref[out_name]) == _bits(before[in_name]))
        assert torch.equal(_bits(got[out_name])[untouched], _bits(before[in_name])[untouched]), out_name
        assert (~untouched).any(), out_name  # the step did write


def test_a_feature_the_rewrite_does_not_know_is_refused_by_name(monkeypatch):
    """If the contract grows, a node using the new attribute is refused by name, never decomposed without it
    (simulated: the rewrite 'forgets' softcap)."""
    monkeypatch.setattr(decompose_mod, "KNOWN_ATTRIBUTES", decompose_mod.KNOWN_ATTRIBUTES - {"softcap"})
    (case,) = load_cases(["paged_sink_window_softcap"])
    _, report = decompose(single_node_model(case))
    assert report.skipped == [("paged_sink_window_softcap", "attribute 'softcap' is not decomposed")]


def test_nan_garbage_in_unwritten_cache_rows_never_reaches_the_output():
    """Cache rows no sequence may read (beyond each extent, in unmapped / unused blocks) hold NaN: the output
    stays finite and equal to the reference; those rows come back bit-identical."""
    rc = build(Spec(q_lens=[3, 1], past=[5, 17], seed=9, rotary="half", sink=True, unmapped=((1, 0),)))
    x = rc.inputs
    readable = torch.zeros(x["key_cache"].shape[:2], dtype=torch.bool)
    for b, (past, n) in enumerate(zip([5, 17], [3, 1])):
        for p in range(past + n):
            blk = int(x["block_table"][b, p // 16])
            if blk >= 0:
                readable[blk, p % 16] = True
    for name in ("key_cache", "value_cache"):
        x[name][~readable] = float("nan")
    before = {k: v.clone() for k, v in x.items()}
    ref = paged_attention({k: v.clone() for k, v in x.items()}, **rc.attrs)
    case = Case("nan_garbage", "PagedAttention", rc.attrs, before, Expected({"output": ref["output"]}, {}))
    model, _ = decompose(single_node_model(case))
    got = ort_run(model, before, {"output": (tuple(ref["output"].shape), torch.float16)})
    assert torch.isfinite(got["output"]).all()
    _compare(case, got, TOL[torch.float16])
