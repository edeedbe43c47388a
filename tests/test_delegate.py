"""The CPU session's onnxruntime backend (pagedkit/runtime/delegate.py; cpu_backend="onnxruntime"):
PagedAttention rewritten into standard ops with in-place cache writes (decompose(in_place=True)) and the
standard-op segments run by onnxruntime's CPU execution provider. These tests run the decomposition
(PAGEDKIT_CPU_ATTENTION=decompose); the case files also run through the CPU attention kernel
(pagedkit/kernels/cpu, whose own tests are tests/test_cpu_attention.py).

Oracles: Hugging Face eager (float32) through tests/export_utils.check_parity (prefill + teacher-forced
decode, ragged batches, shuffled blocks, poisoned caches), and a partition checked by hand. Teeth: a 2%
wrong attention scale fails the HF parity; without the in-place binding of the caches the fed cache tensors
stay untouched (run_torch's contract fails); a rewrite onnxruntime refuses falls back to pagedkit's kernels.
"""

from __future__ import annotations

import pytest
import torch
from onnx import TensorProto, helper

from export_utils import check_parity, export_tiny, mutated_export, tiny_model
from pagedkit.runtime import InferenceSession
from pagedkit.runtime import delegate as D

pytest.importorskip("onnxruntime")

FP32_TOL = 8e-3  # as tests/test_export_fp32.py: fp32 export (fp16 caches) vs HF eager float32


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    hf = tiny_model("LlamaConfig", seed=3)
    out = tmp_path_factory.mktemp("llama32")
    export_tiny(hf, out, dtype="fp32")
    return hf, out


def test_auto_keeps_bf16_weights_on_torch_and_widens_fp16(tmp_path, monkeypatch):
    """auto: bfloat16 weights stay on torch (numpy has no bfloat16 for onnxruntime's boundaries); float16 ones run
    in onnxruntime widened to float32 outside attention (tests/test_cpu_attention.py: the rule and its parity)."""
    monkeypatch.delenv("PAGEDKIT_CPU_BACKEND", raising=False)
    hf = tiny_model("LlamaConfig", seed=4, vocab_size=20000)  # a 20000 x 64 embedding: 1.28 M elements
    export_tiny(hf, tmp_path / "bf16", dtype="bf16")
    assert InferenceSession(str(tmp_path / "bf16" / "model.onnx"), cpu_backend="auto").cpu_backend == "torch"
    export_tiny(hf, tmp_path / "fp16")
    sess = InferenceSession(str(tmp_path / "fp16" / "model.onnx"), cpu_backend="auto")
    assert sess.cpu_backend == "onnxruntime" and sess.delegated["widened"] > 0, sess.delegated


@pytest.fixture(autouse=True)
def _keep_torch_threads(monkeypatch):
    n = torch.get_num_threads()  # a delegating session sets torch to one thread (process-wide)
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "decompose")
    yield
    torch.set_num_threads(n)


def _backend(monkeypatch, name: str) -> None:
    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", name)


def test_partition_levels():
    """Barriers (attention nodes) split the graph; a node's level is the largest level of its inputs, a
    barrier's outputs one above it."""
    n = helper.make_node
    nodes = [n("Relu", ["x"], ["a"]), n("PagedAttention", ["a"], ["p"], domain="com.microsoft"),
             n("Neg", ["x"], ["b"]), n("Add", ["p", "b"], ["c"]),
             n("PagedAttention", ["c"], ["q"], domain="com.microsoft"), n("Abs", ["q"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    segs, bars = D.partition(g)
    assert segs == [[0, 2], [3], [5]] and bars == [[1], [4], []]


def test_generation_matches_hf_and_runs_in_one_onnxruntime_session(llama32, monkeypatch):
    hf, out = llama32
    _backend(monkeypatch, "onnxruntime")
    rep = check_parity(hf, out, tol=FP32_TOL, prompt_lens=(11, 37, 3), steps=12)
    assert rep.worst_ratio <= FP32_TOL and not rep.mismatches
    sess = InferenceSession(str(out / "model.onnx"))
    d = sess.delegated
    assert sess.cpu_backend == "onnxruntime" and d["decomposed"] and d["attention_nodes"] == 0
    assert len(d["onnxruntime"]) == 1 and not d["torch"], d


def test_chunked_prefill_and_block_size_32(llama32, monkeypatch):
    hf, out = llama32
    _backend(monkeypatch, "onnxruntime")
    check_parity(hf, out, tol=FP32_TOL, prompt_lens=(40, 9), chunk=16, steps=6, block_size=32, seed=4)


def _one_step(out):
    """One prefill step through run_torch -> (fed key cache 0 before, the same tensor after, its present)."""
    from export_utils import PagedRunner, _Seq

    runner = PagedRunner(out, seed=5)
    before = runner.caches["past_key_values.0.key"].clone()
    fed = runner.caches["past_key_values.0.key"]
    seqs = [_Seq(list(range(3, 20)))]
    runner.step(seqs, [17])
    return before, fed, runner.caches["past_key_values.0.key"]


def test_caches_updated_in_place_and_teeth(llama32, monkeypatch):
    """run_torch's contract: the cache inputs are updated in place and returned as the present outputs. The
    binding of each cache output to its input's buffer does it; without it (teeth) the fed tensor is
    untouched and the present output is another tensor."""
    _, out = llama32
    _backend(monkeypatch, "onnxruntime")
    before, fed, present = _one_step(out)
    assert present is fed and not torch.equal(fed, before)
    real = D.Segment.__init__

    def no_alias(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.aliases = {}

    monkeypatch.setattr(D.Segment, "__init__", no_alias)
    before, fed, present = _one_step(out)
    assert present is not fed and torch.equal(fed, before)


def test_teeth_wrong_scale(llama32, monkeypatch, tmp_path):
    hf, out = llama32
    _backend(monkeypatch, "onnxruntime")
    head_dim = hf.config.head_dim
    bad = mutated_export(out, tmp_path / "bad", scale=1.02 / head_dim ** 0.5)
    with pytest.raises(AssertionError, match="max.diff"):
        check_parity(hf, bad, tol=FP32_TOL, prompt_lens=(11, 37), steps=4)


def test_refused_rewrite_falls_back_to_pagedkit_kernels(llama32, monkeypatch):
    """A session whose rewritten segment onnxruntime refuses (here: made to refuse) keeps the attention
    nodes on pagedkit's kernels, says so, and still matches HF."""
    hf, out = llama32
    _backend(monkeypatch, "onnxruntime")
    real = D._ort_session

    def picky(model, *args, **kwargs):
        if any(n.op_type == "ScatterND" for n in model.graph.node):
            raise RuntimeError("refused for the test")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(D, "_ort_session", picky)
    sess = InferenceSession(str(out / "model.onnx"))
    d = sess.delegated
    assert d["attention_nodes"] > 0 and not d["decomposed"] and "(attention rewrite)" in d["torch"], d
    assert len(d["onnxruntime"]) >= 2  # the segments between the attention nodes
    check_parity(hf, out, tol=FP32_TOL, prompt_lens=(11, 5), steps=4)


def test_backend_choice_and_errors(llama32, monkeypatch):
    _, out = llama32
    monkeypatch.delenv("PAGEDKIT_CPU_BACKEND", raising=False)
    assert InferenceSession(str(out / "model.onnx")).cpu_backend == "torch"  # the session's default
    assert InferenceSession(str(out / "model.onnx")).delegated == {}
    with pytest.raises(ValueError, match="cpu_backend: expected one of"):
        InferenceSession(str(out / "model.onnx"), cpu_backend="mlas")
    from pagedkit.runtime.generate import Generator

    gen = Generator(out)  # the Generator's default, auto: onnxruntime for float32 weights
    assert gen.session.cpu_backend == "onnxruntime"
    assert torch.get_num_threads() == 1  # the cores are onnxruntime's pool's


def _paged_cases():
    from cases import load_index

    return [e["name"] for e in load_index() if e["op"] == "PagedAttention"]


# the case files the CPU attention kernel serves (the others: quantized caches, LATENT, bias / output_qk,
# rotations, and bfloat16 activations, which stay off onnxruntime: numpy has no bfloat16 boundary type)
KERNEL_CASES = {"paged_llama_fp16_rotary", "paged_packed_qkv", "paged_partial_rotary", "paged_no_rotary_decode",
                "paged_slot_mapping_explicit", "paged_slot_mapping_skips", "paged_unmapped_block",
                "paged_zero_token_sequence", "paged_token_count_zero", "paged_sink_window_softcap", "paged_qk_norm",
                "paged_bidirectional_window", "paged_query_positions_shifted", "paged_metadata_custom_scale"}


@pytest.mark.parametrize("attention", ["decompose", "kernel"])
@pytest.mark.parametrize("name", _paged_cases())
def test_case_files_through_the_onnxruntime_backend(name, attention, monkeypatch):
    """Every PagedAttention case file as a one-node model in a session with cpu_backend="onnxruntime": the
    in-place rewrite or the CPU attention kernel (where they serve the node; else pagedkit's kernels between
    onnxruntime segments) gives the case's expected outputs and caches."""
    from cases import compare_case, load_cases
    from test_session_cases import single_node_model

    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "auto" if attention == "kernel" else "decompose")
    (case,) = load_cases([name])
    sess = InferenceSession(single_node_model(case), cpu_backend="onnxruntime")
    assert bool(sess.delegated["lowered"]) == (attention == "kernel" and name in KERNEL_CASES), sess.delegated
    feeds = {k: (v.clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in case.inputs.items()}
    got = sess.run_torch(feeds)
    compare_case(case, {k: v.clone() for k, v in got.items()})


@pytest.mark.parametrize("name", _paged_cases())
def test_case_files_through_onnx_attention(name):
    """The same case files at default opset 23: each node's attention is one ONNX Attention node (onnxruntime's
    CPU kernel) wherever its semantics allow, the op-by-op form elsewhere; both give the case's outputs."""
    from cases import compare_case, load_cases
    from test_session_cases import single_node_model

    (case,) = load_cases([name])
    model = single_node_model(case)
    model.opset_import[0].version = 23
    sess = InferenceSession(model, cpu_backend="onnxruntime")
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    excluded = attrs.get("softcap", 0.0) > 0 or "head_sink" in case.inputs or attrs.get("qk_output", 0)
    if sess.delegated["decomposed"]:  # (bfloat16 cases stay with pagedkit's kernels)
        assert sess.delegated["onnx_attention"] == (not excluded), (name, sess.delegated)
    feeds = {k: (v.clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in case.inputs.items()}
    got = sess.run_torch(feeds)
    compare_case(case, {k: v.clone() for k, v in got.items()})


def _run_case(case, model):
    sess = InferenceSession(model, cpu_backend="onnxruntime")
    feeds = {k: (v.clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in case.inputs.items()}
    return sess.delegated["decomposed"], {k: v.clone() for k, v in sess.run_torch(feeds).items()}


def test_half_prologue_is_bit_exact(monkeypatch):
    """The in-place rewrite keeps q / k / v float16 through RoPE and the cache writes where that is exact
    (paged_inplace._half_prologue): every case file it serves gives outputs and caches bit-identical to the
    float32 prologue (RoPE in float32, Q rounded to T, K / V rounded by the cache store). Teeth: a 0.1% change of
    the half path's RoPE input is seen."""
    from cases import load_cases
    from test_session_cases import single_node_model

    from pagedkit.kernels.onnx_ops import paged_inplace as P

    real_half, real_rope = P._half_prologue, P.ort_rope
    served, teeth = 0, False
    for name in _paged_cases():
        (case,) = load_cases([name])
        model = single_node_model(case)
        model.opset_import[0].version = 23
        taken = []
        monkeypatch.setattr(P, "_half_prologue", lambda s: taken.append(real_half(s)) or taken[-1])
        done, half = _run_case(case, model)
        if not done or not any(taken):
            continue
        served += 1
        monkeypatch.setattr(P, "_half_prologue", lambda s: False)
        _, full = _run_case(case, model)
        assert half.keys() == full.keys()
        for k in half:
            assert torch.equal(half[k], full[k]), (name, k)
        if not teeth and case.attrs.get("do_rotary", 0):  # teeth, on the first rotary case served
            teeth = True
            def off_rope(b, x, *rest):
                return real_rope(b, b.cast(b.op("Mul", b.f(x), b.f32(1.001)), P.FP16), *rest)
            monkeypatch.setattr(P, "_half_prologue", real_half)
            monkeypatch.setattr(P, "ort_rope", off_rope)
            _, bad = _run_case(case, model)
            assert not torch.equal(bad["output"], full["output"]), name
            monkeypatch.setattr(P, "ort_rope", real_rope)
    assert served >= 3 and teeth, (served, teeth)


def test_external_weights_stay_external(llama32, tmp_path, monkeypatch):
    """A model whose weights are in external data hands them to onnxruntime by reference (it maps them from
    the model's folder: no inlined copy in the segment's proto or its serialized bytes), and still matches HF."""
    import shutil

    import onnx
    from onnx.external_data_helper import uses_external_data

    hf, out = llama32
    _backend(monkeypatch, "onnxruntime")
    for f in out.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy(f, tmp_path / f.name)
    onnx.save(onnx.load(str(out / "model.onnx")), str(tmp_path / "model.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    seen, real = [], D._ort_session

    def record(m, threads, spin=True, external_dir=None, library=None):
        seen.append((sum(uses_external_data(t) for t in m.graph.initializer), m.ByteSize(), external_dir))
        return real(m, threads, spin, external_dir, library)

    monkeypatch.setattr(D, "_ort_session", record)
    sess = InferenceSession(str(tmp_path / "model.onnx"))
    assert sess.delegated["decomposed"] and not sess.delegated["torch"], sess.delegated
    assert seen and all(n > 0 and d == str(tmp_path) for n, _, d in seen), seen
    assert sum(size for _, size, _ in seen) < (tmp_path / "weights.bin").stat().st_size / 4
    check_parity(hf, tmp_path, tol=FP32_TOL, prompt_lens=(11, 5), steps=3)
