"""The onnxruntime CPU delegate's pieces on small hand-built graphs (pagedkit/runtime/delegate.py, segment.py):
the barrier rules and partition's levels, what the report says for each segment kept on pagedkit's kernels, the
typed boundaries, the sessions' options (threads, spinning, logging), the attention rewrite's fallbacks, and
Segment's runs (aliased caches in place, DLPack or numpy outputs, `run(..., keep=True)`'s buffers per input
shape).

Oracles: numpy (ScatterND as an indexed assignment, elementwise ops, nonzero), the case files' expected outputs
for the one-node PagedAttention models, and the rules' own text (a report's reason is matched whole).
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

from pagedkit.runtime import delegate as D
from pagedkit.runtime import segment as S
from pagedkit.runtime.ops.registry import ORT_DOMAIN

pytest.importorskip("onnxruntime")

n = helper.make_node
F = TP.FLOAT


@pytest.fixture(autouse=True)
def _decompose(monkeypatch):
    monkeypatch.setenv("PAGEDKIT_CPU_ATTENTION", "decompose")


def _vi(name, elem=F, shape=(2, 3)):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _model(nodes, inputs, outputs, inits=(), opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def _options(seg):
    so = seg.session.get_session_options()
    return so.intra_op_num_threads, so.get_session_config_entry("session.intra_op.allow_spinning")


# ---------------------------------------------------------------- barriers and levels


def test_barrier_rules():
    """PagedAttention, com.microsoft collectives, MoE / QMoE with use_sparse_mixer=1, unknown domains (whatever
    their spelling sorts like) and subgraph holders are barriers; standard, ai.onnx, com.microsoft, pagedkit.cpu
    nodes and GroupQueryAttention are not."""
    branch = helper.make_graph([n("Identity", ["x"], ["t"])], "b", [], [_vi("t")])
    barriers = [n("PagedAttention", ["q"], ["o"], domain="com.microsoft"),
                n("PagedAttention", ["q"], ["o"], domain="ai.onnx.contrib"),  # unknown domain too
                n("AllReduce", ["x"], ["y"], domain="com.microsoft"),
                n("AllGather", ["x"], ["y"], domain="com.microsoft"),
                n("MoE", ["x"], ["y"], domain="com.microsoft", use_sparse_mixer=1),
                n("QMoE", ["x"], ["y"], domain="com.microsoft", use_sparse_mixer=1),
                n("Relu", ["x"], ["y"], domain="acme"),  # sorts before "ai.onnx"
                n("Relu", ["x"], ["y"], domain="Custom"),  # upper case: sorts before every known domain
                n("Relu", ["x"], ["y"], domain="zz.custom"),
                n("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    others = [n("Relu", ["x"], ["y"]), n("Relu", ["x"], ["y"], domain="ai.onnx"),
              n("Gelu", ["x"], ["y"], domain="com.microsoft"),
              n("GroupQueryAttention", ["q"], ["o"], domain="com.microsoft"),
              n("MoE", ["x"], ["y"], domain="com.microsoft", use_sparse_mixer=0),
              n("MoE", ["x"], ["y"], domain="com.microsoft"),
              n("AllReduce", ["x"], ["y"]),  # the default domain's (no such op): onnxruntime's to refuse
              n("PagedAttention_f32_f16_f16", ["q"], ["o"], domain="pagedkit.cpu")]
    assert [D._barrier(b) for b in barriers] == [True] * len(barriers)
    assert [D._barrier(o) for o in others] == [False] * len(others)


def test_partition_numbering_and_the_empty_graph():
    """Segment L runs before the barriers of level L; a barrier's outputs are one level up; a graph of no nodes
    is one empty level."""
    nodes = [n("Relu", ["x"], ["a"]),  # 0: level 0
             n("AllReduce", ["a"], ["r"], domain="com.microsoft"),  # 1: barrier of level 0 -> r at 1
             n("Relu", ["x"], ["b"], domain="acme"),  # 2: barrier of level 0 -> b at 1
             n("Add", ["r", "b"], ["c"]),  # 3: level 1
             n("Neg", ["a"], ["d"]),  # 4: level 0
             n("Relu", ["c"], ["e"], domain="Custom"),  # 5: barrier of level 1 -> e at 2
             n("Mul", ["e", "d"], ["f"])]  # 6: level 2
    g = helper.make_graph(nodes, "g", [_vi("x")], [_vi("f")])
    assert D.partition(g) == ([[0, 4], [3], [6]], [[1, 2], [5], []])
    empty = helper.make_graph([], "g", [_vi("x")], [_vi("x")])
    assert D.partition(empty) == ([[]], [[]])


# ---------------------------------------------------------------- delegate() on plain graphs


def test_no_attention_never_asks_for_the_attention_library(monkeypatch):
    """A model without PagedAttention (com.microsoft ops of names on either side of it) is delegated as it is:
    no CPU attention library, no widening; the report says nothing of attention. Outputs vs numpy."""
    def asked():
        raise AssertionError("the CPU attention library was asked for")

    monkeypatch.setattr(D, "cpu_attention_library", asked)
    nodes = [n("Gelu", ["x"], ["g"], domain="com.microsoft"),  # "Gelu" < "PagedAttention"
             n("QuickGelu", ["g"], ["y"], domain="com.microsoft", alpha=1.0)]  # "QuickGelu" > "PagedAttention"
    out, live, rep = D.delegate(_model(nodes, [_vi("x")], [_vi("y")]), None, 1)
    assert rep.delegated == {"segment_0": 2} and rep.kept == {} and rep.barriers == 0
    assert rep.decomposed == [] and rep.lowered == [] and rep.fused is False and rep.widened == 0
    assert rep.cpu_kernel == ""
    assert [(x.op_type, x.domain) for x in out.graph.node] == [(D.SEGMENT_OP, ORT_DOMAIN)]
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    (y,) = live[0].run([torch.from_numpy(x)])
    from math import erf

    g = np.array([v * 0.5 * (1 + erf(v / np.sqrt(2))) for v in x.ravel().astype(np.float64)]).reshape(2, 3)
    want = g / (1 + np.exp(-g))  # QuickGelu, alpha 1: x * sigmoid(x)
    assert np.abs(y.numpy() - want).max() <= 1e-5 * np.abs(want).max()
    D._forget(live)


def test_session_options_threads_spinning_and_logging():
    """One segment holding the whole model: its own pool of `threads` (at least 1), spinning workers on, one
    inter-op thread, warnings off (level 3: errors only). Several segments (a barrier between): no spinning."""
    whole = _model([n("Relu", ["x"], ["a"]), n("Neg", ["a"], ["y"])], [_vi("x")], [_vi("y")])
    for threads, want in ((0, 1), (1, 1), (3, 3)):
        _, live, rep = D.delegate(whole, None, threads)
        (seg,) = live
        so = seg.session.get_session_options()
        assert _options(seg) == (want, "1") and so.inter_op_num_threads == 1 and so.log_severity_level == 3
        D._forget(live)
    split = _model([n("Relu", ["x"], ["a"]), n("Relu", ["a"], ["b"], domain="acme"), n("Neg", ["b"], ["y"])],
                   [_vi("x")], [_vi("y")])
    split.opset_import.append(helper.make_opsetid("acme", 1))
    split.graph.value_info.append(_vi("b"))  # the barrier's output typed: segment 1 can be delegated too
    _, live, rep = D.delegate(split, None, 2)
    assert rep.delegated == {"segment_0": 1, "segment_1": 1} and rep.barriers == 1 and rep.kept == {}
    assert [_options(s) for s in live] == [(2, "0"), (2, "0")]
    D._forget(live)


def test_typed_boundaries_and_what_onnxruntime_infers():
    """A value ONNX shape inference cannot type (a com.microsoft op's output) is typed by what onnxruntime infers
    for the segment producing it: a later segment (across a barrier) can read it, and the returned model types
    every Segment output (value_info), not the outputs of nodes pagedkit still runs."""
    branch = lambda op: helper.make_graph([n(op, ["x"], ["t"])], op, [], [_vi("t")])  # noqa: E731
    nodes = [n("Gelu", ["x"], ["g"], domain="com.microsoft"),
             n("If", ["c"], ["i"], then_branch=branch("Identity"), else_branch=branch("Neg")),  # a barrier
             n("Add", ["g", "i"], ["y"])]
    model = _model(nodes, [_vi("x"), _vi("c", TP.BOOL, ())], [_vi("y", F, None)])
    out, live, rep = D.delegate(model, None, 1)
    assert rep.kept == {} and rep.delegated == {"segment_0": 1, "segment_1": 1} and rep.barriers == 1
    assert [x.op_type for x in out.graph.node] == [D.SEGMENT_OP, "If", D.SEGMENT_OP]
    tt = {vi.name: vi.type.tensor_type for vi in out.graph.value_info}
    typed = {k: (t.elem_type, [d.dim_value for d in t.shape.dim] if t.HasField("shape") else None)
             for k, t in tt.items()}
    # g: onnxruntime's type and shape; y: ONNX's (float, shape unknown); i, the If's output, is no Segment's
    assert typed == {"g": (F, [2, 3]), "y": (F, None)}, typed
    assert {o.domain for o in out.opset_import} >= {ORT_DOMAIN}
    D._forget(live)


def _kept(nodes, inputs, outputs, inits=()):
    out, live, rep = D.delegate(_model(nodes, inputs, outputs, inits), None, 1)
    D._forget(live)
    return out, live, rep


def test_untyped_boundary_names_the_first_three():
    """bfloat16 boundary inputs (numpy has none): the segment stays with pagedkit, the reason names three."""
    names = ["a", "b", "c", "d"]
    nodes = [n("Cast", [x], [x + "f"], to=F) for x in names] + [n("Sum", [x + "f" for x in names], ["y"])]
    out, live, rep = _kept(nodes, [_vi(x, TP.BFLOAT16) for x in names], [_vi("y")])
    assert live == [] and rep.delegated == {}
    assert rep.kept == {"segment_0": "boundary value(s) of unknown or non-numpy type: ['a', 'b', 'c']"}
    assert [x.op_type for x in out.graph.node] == ["Cast"] * 4 + ["Sum"]


def test_no_outputs_anyone_reads():
    nodes = [n("Relu", ["x"], ["dead"]), n("Relu", ["x"], ["y"], domain="acme")]
    _, live, rep = _kept(nodes, [_vi("x")], [_vi("y", F, None)])
    assert rep.kept == {"segment_0": "no outputs anyone reads"} and rep.barriers == 1


def test_weight_limit_per_segment(monkeypatch):
    """Over _MAX_BYTES of inline weights in one segment: kept, said so, the weight stays in the model; exactly
    _MAX_BYTES is delegated (the weight moves into the segment)."""
    w = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    size = w.ByteSize()
    nodes, ins, outs = [n("Add", ["x", "w"], ["y"])], [_vi("x")], [_vi("y")]
    monkeypatch.setattr(D, "_MAX_BYTES", size - 1)
    out, live, rep = _kept(nodes, ins, outs, [w])
    assert rep.kept == {"segment_0": "over 2 GB of inline weights in one segment"} and rep.delegated == {}
    assert [t.name for t in out.graph.initializer] == ["w"] and out.graph.node[0].op_type == "Add"
    monkeypatch.setattr(D, "_MAX_BYTES", size)
    out, live, rep = D.delegate(_model(nodes, ins, outs, [w]), None, 1)
    assert rep.kept == {} and rep.delegated == {"segment_0": 1} and list(out.graph.initializer) == []
    x = torch.ones(2, 3)
    (y,) = live[0].run([x])
    assert torch.equal(y, x + torch.arange(6.0).reshape(2, 3))
    D._forget(live)


def test_onnxruntime_refusal_reason(monkeypatch):
    """A segment onnxruntime refuses stays as it is; the reason is the first line of onnxruntime's message, at
    most 200 characters of it."""
    long_name = "n" * 300
    out, live, rep = _kept([n("NoSuchOp", ["x"], ["y"], name=long_name)], [_vi("x")], [_vi("y")])
    why = rep.kept["segment_0"]
    assert why.startswith("onnxruntime refused it: ") and long_name[:40] in why and "\n" not in why
    assert len(why) == len("onnxruntime refused it: ") + 200
    assert out.graph.node[0].op_type == "NoSuchOp" and rep.delegated == {}

    def refuse(*args, **kwargs):
        raise RuntimeError("E" * 150 + "F" * 100 + "\nsecond line")

    monkeypatch.setattr(D, "_ort_session", refuse)
    _, _, rep = _kept([n("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")])
    assert rep.kept == {"segment_0": "onnxruntime refused it: " + "E" * 150 + "F" * 50}


# ---------------------------------------------------------------- the attention rewrite's fallbacks


def _paged_case(opset):
    from cases import load_cases
    from test_session_cases import single_node_model

    (case,) = load_cases(["paged_llama_fp16_rotary"])
    model = single_node_model(case)
    model.opset_import[0].version = opset
    return case, model


def _run_delegated(case, out):
    from cases import compare_case

    from pagedkit.runtime import InferenceSession

    sess = InferenceSession(out, cpu_backend="torch")  # the Segment nodes run through ops/control.py
    feeds = {k: (v.clone() if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in case.inputs.items()}
    compare_case(case, {k: v.clone() for k, v in sess.run_torch(feeds).items()})


def test_rewrite_report_on_a_float32_path():
    """A one-node model (no weights: nothing to widen) rewritten op by op at opset 21: widened 0, not fused."""
    case, model = _paged_case(21)
    out, live, rep = D.delegate(model, None, 1)
    assert rep.decomposed == [case.name] and rep.kept == {} and rep.widened == 0 and rep.fused is False
    assert rep.lowered == [] and rep.cpu_kernel.startswith("PAGEDKIT_CPU_ATTENTION=decompose"), rep
    _run_delegated(case, out)
    D._forget(live)



def _refuse_sessions_with(monkeypatch, op_type: str, message: str) -> None:
    """onnxruntime made to refuse every segment that holds an `op_type` node (RuntimeError(message))."""
    real = D._ort_session

    def picky(m, *args, **kwargs):
        if any(x.op_type == op_type for x in m.graph.node):
            raise RuntimeError(message)
        return real(m, *args, **kwargs)

    monkeypatch.setattr(D, "_ort_session", picky)

def test_refused_fused_attention_falls_back_to_the_op_by_op_rewrite(monkeypatch):
    """At opset 23 the rewrite first tries one ONNX Attention node; a session onnxruntime refuses with it is
    rewritten op by op instead (still decomposed, not kept); the outputs match the case."""
    case, model = _paged_case(23)
    out, live, rep = D.delegate(model, None, 1)
    assert rep.fused is True and rep.decomposed == [case.name] and rep.kept == {}, rep
    D._forget(live)
    _refuse_sessions_with(monkeypatch, "Attention", "refused for the test")
    out, live, rep = D.delegate(model, None, 1)
    assert rep.fused is False and rep.decomposed == [case.name] and rep.kept == {}, rep
    assert not any(x.op_type == "PagedAttention" for x in out.graph.node)
    _run_delegated(case, out)
    D._forget(live)


def test_refused_rewrite_says_which_segment_and_why(monkeypatch):
    _refuse_sessions_with(monkeypatch, "ScatterND", "refused for the test\nmore")
    case, model = _paged_case(23)
    out, live, rep = D.delegate(model, None, 1)
    assert rep.kept == {"(attention rewrite)": "not used: segment_0: onnxruntime refused it: refused for the test"}
    assert rep.decomposed == [] and rep.barriers == 1 and live == []
    assert [(x.op_type, x.domain) for x in out.graph.node] == [("PagedAttention", "com.microsoft")]


# ---------------------------------------------------------------- Segment


def _segment(extra, outs, name="s"):
    """cache [4, 3] updated by ScatterND (cache_out aliases it) + `extra` nodes over x [n]."""
    nodes = [n("ScatterND", ["cache", "idx", "upd"], ["cache_out"]),
             n("Constant", [], ["two"], value=onnx.numpy_helper.from_array(np.float32(2.0)))] + extra
    ins = ["cache", "idx", "upd", "x"]
    vis = [_vi("cache", F, (4, 3)), _vi("idx", TP.INT64, ("k", 1)), _vi("upd", F, ("k", 3)), _vi("x", F, ("n",))]
    m = _model(nodes, vis, [onnx.ValueInfoProto(name=o) for o in ["cache_out"] + outs])
    session = D._ort_session(m, 1, False)
    return S.Segment(name, ins, ["cache_out"] + outs, len(nodes), session, aliases={"cache_out": "cache"})


def _feeds(rng, k, size, cache):
    idx = torch.from_numpy(rng.choice(4, size=(k, 1), replace=False).astype(np.int64))
    upd = torch.from_numpy(rng.standard_normal((k, 3)).astype(np.float32))
    x = torch.from_numpy((rng.standard_normal(size) + 3).astype(np.float32))  # no zeros
    return [cache, idx, upd, x]


def _check(ins, got, before):
    cache, idx, upd, x = ins
    want = before.numpy().copy()
    want[idx.numpy()[:, 0]] = upd.numpy()
    assert got[0] is cache and np.array_equal(cache.numpy(), want)  # in place, only the step's rows
    assert np.array_equal(got[1].numpy(), 2 * x.numpy())


@pytest.mark.parametrize("dlpack", [True, False])
def test_segment_runs_caches_in_place_and_fresh_outputs(dlpack, monkeypatch):
    """Plain runs: the cache output is the cache input (written in place), the others are new tensors each
    run (a later run does not overwrite what an earlier one returned), DLPack or numpy alike."""
    monkeypatch.setattr(S, "_DLPACK", dlpack)
    rng = np.random.default_rng(0)
    seg = _segment([n("Mul", ["x", "two"], ["y"])], ["y"])
    cache = torch.zeros(4, 3)
    kept = []
    for k, size in ((2, 5), (1, 5), (3, 7)):
        ins = _feeds(rng, k, size, cache)
        before = cache.clone()
        got = seg.run(ins)
        _check(ins, got, before)
        kept.append((got[1], got[1].clone()))
    assert all(torch.equal(a, b) for a, b in kept)


class _NoDLPackValue:  # an OrtValue of an onnxruntime without to_dlpack
    def __init__(self, v):
        self._v = v

    def data_type(self):
        return self._v.data_type()

    def numpy(self):
        return self._v.numpy()


class _NoDLPackBinding:
    def __init__(self, real):
        self.real, self._iobinding = real, self

    def get_outputs(self):
        return [_NoDLPackValue(v) for v in self.real._iobinding.get_outputs()]

    def __getattr__(self, name):
        return getattr(self.real, name)


class _NoDLPackSession:
    def __init__(self, real):
        self.real = real

    def io_binding(self):
        return _NoDLPackBinding(self.real.io_binding())

    def run_with_iobinding(self, binding):
        self.real.run_with_iobinding(binding.real)


def test_segment_without_dlpack_reads_outputs_through_numpy(monkeypatch):
    """_DLPACK off (an onnxruntime without OrtValue.to_dlpack): every output comes through numpy."""
    monkeypatch.setattr(S, "_DLPACK", False)
    rng = np.random.default_rng(1)
    seg = _segment([n("Mul", ["x", "two"], ["y"])], ["y"])
    seg.session = _NoDLPackSession(seg.session)
    cache = torch.zeros(4, 3)
    ins = _feeds(rng, 2, 4, cache)
    before = cache.clone()
    _check(ins, seg.run(ins), before)


def test_has_dlpack(monkeypatch):
    assert S._has_dlpack() is True  # onnxruntime 1.32 and torch 2 both have it
    monkeypatch.delattr(torch, "from_dlpack")
    assert S._has_dlpack() is False
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "onnxruntime.capi.onnxruntime_pybind11_state", None)  # import fails
    assert S._has_dlpack() is False


def test_keep_mode_buffers_per_input_shape():
    """keep=True: the first run of an input shape copies; later runs of that shape write the same tensors (bound
    once, re-bound when the shape changes back); a run with the very same input objects sees their new contents.
    Every run's values are checked before the next."""
    rng = np.random.default_rng(2)
    seg = _segment([n("Mul", ["x", "two"], ["y"])], ["y"])
    cache = torch.zeros(4, 3)
    first = {}
    for k, size in ((2, 5), (2, 5), (2, 5), (1, 3), (1, 3), (2, 5), (1, 3)):
        ins = _feeds(rng, k, size, cache)
        before = cache.clone()
        got = seg.run(ins, keep=True)
        _check(ins, got, before)
        if (k, size) in first and first[(k, size)] is not None:
            assert got[1] is first[(k, size)], (k, size)  # the shape's buffer, bound again
        first[(k, size)] = None if (k, size) not in first else got[1]
    ins[3].mul_(-1.5)  # the same objects, new contents (a KV manager's persistent step buffers)
    before = cache.clone()
    again = seg.run(ins, keep=True)
    assert again[1] is got[1]
    _check(ins, again, before)
    plain = seg.run(_feeds(rng, 1, 3, cache))  # a plain run after keep ones: fresh outputs again
    assert plain[1] is not got[1]


def test_keep_mode_output_shape_from_values_falls_back():
    """An output whose shape depends on the input values (NonZero): the bound buffer no longer fits, onnxruntime
    refuses the run, and keep mode falls back to onnxruntime's allocation (then copies) with the right values."""
    seg = _segment([n("NonZero", ["x"], ["nz"])], ["nz"])
    cache = torch.zeros(4, 3)
    idx, upd = torch.tensor([[1]]), torch.ones(1, 3)
    for x in ([0.0, 1.0, 0.0, 2.0], [3.0, 1.0, 0.0, 2.0], [3.0, 1.0, 5.0, 2.0], [0.0, 0.0, 0.0, 7.0]):
        xs = torch.tensor(x)
        got = seg.run([cache, idx, upd, xs], keep=True)
        assert got[1].tolist() == [list(np.nonzero(np.array(x))[0])], (x, got[1])
