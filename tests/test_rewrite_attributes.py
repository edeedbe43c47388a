"""GQA <-> PagedAttention node rewrites (pagedkit/rewriters/node_rules/) carrying every attribute the numbers depend
on: QK-norm epsilons (GQA's q_norm_epsilon / k_norm_epsilon over qk_norm_epsilon, PagedAttention's one
qk_norm_epsilon), both non-default, on small Q / K rows (per-token RMS 1e-3 .. 1e-2: mean squares 1e-6 .. 1e-4,
where an epsilon of 3e-5 against the default 1e-6 moves the normed rows by tens of percent), and qk_output (the
scores output, output_qk) - on one sequence with a past and a 3-token step (output_qk converts for B = 1).

- GQA -> PagedAttention: the rewritten node's attributes (qk_norm_epsilon = the epsilon GQA applies to both, the
  same qk_output), its output and output_qk run in pagedkit.InferenceSession against the float64 GQA oracle
  (tests/paged_oracle.gqa_oracle) and against pagedkit's GQA on the source; GQA nodes whose effective Q and K
  epsilons differ (also when one comes from qk_norm_epsilon) are refused by reason.
- PagedAttention -> GQA: fused (the node keeps q/k_norm_weight and qk_norm_epsilon; pagedkit's GQA runs it) and
  unfused (the norm as standard ops before the node; onnxruntime CPU runs it), output and output_qk against the
  float64 PagedAttention oracle (tests/paged_oracle.oracle).
- the round trip GQA -> PagedAttention -> GQA keeps the numbers.
- teeth: rule sets that drop qk_norm_epsilon, drop qk_output or turn scores into probabilities fail."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from paged_gqa import gqa_from_paged
from paged_oracle import Spec, build, gqa_oracle, oracle
from pagedkit.interface import dtypes
from pagedkit.rewriters.node_rules import (
    GQA_TO_PAGED, PAGED_TO_GQA, GqaIO, PagedIO, Refused, Rule, gqa_node_to_paged, paged_node_to_gqa,
)
from pagedkit.rewriters.node_rules.base import SAME_ATTRS
from pagedkit.validators.contract import GROUP_QUERY_ATTENTION as GQA, PAGED_ATTENTION as PA

ort = pytest.importorskip("onnxruntime") if not os.environ.get("CI") else __import__("onnxruntime")

TOL = 5e-3  # fp16 attention (tests/test_rewrite_nodes.py's bound)
EPS = 3e-5  # non-default (contract default 1e-6)
ROW_SCALES = np.array([1e-3, 3e-3, 1e-2])
H, HKV, D, PAST, NQ = 4, 2, 16, 13, 3


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def small_step(qk_output: int = 1, seed: int = 0):
    """One sequence, past 13, 3 new tokens, RoPE, QK-norm (qk_norm_epsilon EPS), qk_output; new Q / K rows small.
    -> (the paged case (oracle-ready), its inputs, attrs)."""
    spec = Spec(q_lens=[NQ], past=[PAST], num_heads=H, kv_num_heads=HKV, head_size=D, block_size=16,
                rotary="half", qk_norm=True, attrs={"qk_norm_epsilon": EPS, "qk_output": qk_output}, seed=seed)
    case = build(spec)
    tok = torch.from_numpy(ROW_SCALES[np.arange(NQ) % 3])[:, None]
    for name in ("query", "key"):
        case.inputs[name] = (case.inputs[name].double() * tok).to(spec.dtype)
    return case


def one_node(contract, inputs: dict, attrs: dict, outputs: list[str]) -> onnx.ModelProto:
    names = [n if n in inputs else "" for n in contract.input_names]
    while names and not names[-1]:
        names.pop()
    outs = [n if n in outputs else "" for n in contract.output_names]
    while outs and not outs[-1]:
        outs.pop()
    node = onnx.helper.make_node(contract.name, names, outs, domain="com.microsoft", name=contract.name, **attrs)
    elem = lambda t: dtypes.elem_type(str(t.dtype).replace("torch.", ""))  # noqa: E731
    qk_t = onnx.TensorProto.FLOAT if contract is PA else elem(inputs["query"])  # GQA: output_qk in T
    g = onnx.helper.make_graph(
        [node], "one", [onnx.helper.make_tensor_value_info(n, elem(t), list(t.shape)) for n, t in inputs.items()],
        [onnx.helper.make_tensor_value_info(o, qk_t if o == "output_qk" else elem(inputs["query"]), None)
         for o in outs if o in ("output", "output_qk")])
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                    onnx.helper.make_opsetid("com.microsoft", 1)])


def rewrite(proto: onnx.ModelProto, fn, make_io, rules, extra: dict):
    """The model's one attention node rewritten by fn(node, io, rules) (`extra`: new graph inputs): (the model
    with graph outputs output (+ output_qk), the new attention node's attributes)."""
    m = ir.serde.deserialize_model(proto)
    g = m.graph
    node = next(iter(g))
    vals = {}
    for k, t in extra.items():
        elem = dtypes.elem_type(str(t.dtype).replace("torch.", "")) if isinstance(t, torch.Tensor) else int(
            onnx.helper.np_dtype_to_tensor_dtype(t.dtype))
        v = ir.Value(name=k, type=ir.TensorType(ir.DataType(elem)), shape=ir.Shape(list(t.shape)))
        g.inputs.append(v)
        vals[k] = v
    new_nodes, replaces, _ = fn(node, make_io(vals), rules)
    g.insert_before(node, new_nodes)
    attn = next(n for n in new_nodes if n.op_type in ("PagedAttention", "GroupQueryAttention"))
    attrs = {k: a.value for k, a in attn.attributes.items()}
    keep = []
    for old in list(g.outputs):
        new = replaces[old]
        name = old.name
        old.name = name + "/old"
        new.name = name
        keep.append(new)
    g.outputs.clear()
    g.outputs.extend(keep)
    for old, new in replaces.items():
        old.replace_all_uses_with(new)
    g.remove(node, safe=True)
    for n in reversed(list(g)):
        if all(not v.uses() and v not in g.outputs for v in n.outputs):
            g.remove(n, safe=True)
    for v in [v for v in g.inputs if not v.uses()]:
        g.inputs.remove(v)
    return ir.serde.serialize_model(m), attrs


def run(proto, feeds: dict, engine: str) -> dict:
    names = {i.name for i in proto.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}
    outs = [o.name for o in proto.graph.output]
    if engine == "ort":
        s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip(outs, s.run(outs, feeds)))
    import pagedkit

    return dict(zip(outs, pagedkit.InferenceSession(proto).run(outs, feeds)))


def rel(got, want, mask=None) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if mask is not None:
        got, want = got[mask], want[mask]
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


# --- GQA -> PagedAttention -------------------------------------------------------------------------------------

GQA_EPS = {"qk_norm_epsilon": 1e-4, "q_norm_epsilon": EPS, "k_norm_epsilon": EPS}  # the overrides decide


def gqa_source(qk_output: int = 1, eps_attrs=GQA_EPS, seed: int = 0):
    """The GQA twin of small_step (B = 1, no padding): (case, gqa inputs, gqa attrs)."""
    case = small_step(qk_output, seed)
    gx, ga, _ = gqa_from_paged(case.inputs, case.attrs)
    gx = {n: gx[n] for n in GQA.input_names if n in gx and n != "query_seqlens"}
    ga = {k: v for k, v in ga.items() if k != "qk_norm_epsilon"} | eps_attrs
    return case, gx, ga


def gqa_to_paged(case, gx, ga, rules=GQA_TO_PAGED):
    """-> (outputs of the rewrite in pagedkit {output [1, S, W], output_qk [1, H, S, total]}, its node attrs)."""
    outs = ["output", "present_key", "present_value"] + (["output_qk"] if ga.get("qk_output") else [])
    proto = one_node(GQA, gx, ga, outs)
    paged_in = {k: case.inputs[k].clone() for k in ("key_cache", "value_cache", "cumulative_sequence_length",
                                                    "past_seqlens", "block_table")}

    def io(v):
        return PagedIO(v["key_cache"], v["value_cache"], v["cumulative_sequence_length"], v["past_seqlens"],
                       v["block_table"], "key_cache_out", "value_cache_out")
    conv, attrs = rewrite(proto, gqa_node_to_paged, io, rules, paged_in)
    feeds = {k: _np(v) for k, v in gx.items()} | {k: _np(v) for k, v in paged_in.items()}
    return run(conv, feeds, "pagedkit"), attrs


def _gqa_checks(got: dict, gx, ga):
    """The rewrite's output and output_qk against the float64 GQA oracle, and against pagedkit's GQA on the
    source (raises AssertionError)."""
    import pagedkit

    want = gqa_oracle(gx, ga)
    assert rel(got["output"], want["output"]) <= TOL, rel(got["output"], want["output"])
    qk_ok = ~np.isnan(want["output_qk"])
    assert rel(got["output_qk"], want["output_qk"], qk_ok) <= TOL, rel(got["output_qk"], want["output_qk"], qk_ok)
    src = one_node(GQA, gx, ga, ["output", "present_key", "present_value", "output_qk"])
    ref = pagedkit.InferenceSession(src).run(["output", "output_qk"], {k: _np(v) for k, v in gx.items()})
    assert rel(got["output"], ref[0]) <= TOL and rel(got["output_qk"], ref[1], qk_ok) <= TOL


@pytest.mark.parametrize("eps_attrs", [GQA_EPS, {"q_norm_epsilon": EPS, "k_norm_epsilon": EPS},
                                       {"qk_norm_epsilon": EPS}],
                         ids=["overrides-over-shared", "overrides", "shared"])
def test_gqa_to_paged_carries_epsilon_and_qk_output(eps_attrs):
    case, gx, ga = gqa_source(1, eps_attrs)
    got, attrs = gqa_to_paged(case, gx, ga)
    assert attrs["qk_norm_epsilon"] == pytest.approx(EPS, rel=1e-6) and attrs["qk_output"] == 1
    _gqa_checks(got, gx, ga)


@pytest.mark.parametrize("eps_attrs", [
    {"q_norm_epsilon": 1e-6, "k_norm_epsilon": EPS},  # distinct, both written
    {"q_norm_epsilon": EPS},  # K keeps qk_norm_epsilon's default 1e-6
    {"qk_norm_epsilon": EPS, "k_norm_epsilon": 1e-6},  # Q keeps qk_norm_epsilon
], ids=["both-written", "q-only", "k-over-shared"])
def test_gqa_to_paged_refuses_distinct_effective_epsilons(eps_attrs):
    """PagedAttention normalizes Q and K with one epsilon: a GQA node that applies two is refused (with the shared
    qk_norm_epsilon filling the one not written), never converted with one of them."""
    case, gx, ga = gqa_source(1, eps_attrs)
    with pytest.raises(Refused, match="one qk_norm_epsilon"):
        gqa_to_paged(case, gx, ga)
    # the point of refusing: on these rows the two epsilons give other numbers
    want = gqa_oracle(gx, ga)["output"]
    one = gqa_oracle(gx, {k: v for k, v in ga.items() if k not in ("q_norm_epsilon", "k_norm_epsilon")}
                     | {"qk_norm_epsilon": EPS})["output"]
    assert rel(one, want) > 10 * TOL


# --- PagedAttention -> GQA -------------------------------------------------------------------------------------

def paged_to_gqa(case, unfuse: bool, rules=PAGED_TO_GQA):
    """-> (outputs of the rewrite {output [T, W], output_qk [H, T, capacity]}, its GQA node's attributes); GQA runs
    in onnxruntime CPU when the norm is unfused (it rejects a fused one), else in pagedkit."""
    x, a = case.inputs, case.attrs
    px = {n: x[n] for n in PA.input_names if n in x}
    outs = ["output", "key_cache_out", "value_cache_out"] + (["output_qk"] if a.get("qk_output") else [])
    proto = one_node(PA, px, a, outs)
    gx, _, _ = gqa_from_paged(x, a)
    extra = {"past_key": gx["past_key"], "past_value": gx["past_value"], "seqlens_k": gx["seqlens_k"],
             "total_sequence_length": gx["total_sequence_length"], "batch_seq": np.array([1, NQ], np.int64)}

    def io(v):
        return GqaIO(v["past_key"], v["past_value"], "present_key", "present_value", v["seqlens_k"],
                     v["total_sequence_length"], v["batch_seq"], unfuse_qk_norm=unfuse)
    conv, attrs = rewrite(proto, paged_node_to_gqa, io, rules, extra)
    feeds = {k: _np(v) for k, v in px.items()} | {k: v if isinstance(v, np.ndarray) else _np(v)
                                                   for k, v in extra.items()}
    return run(conv, feeds, "ort" if unfuse else "pagedkit"), attrs


def _paged_checks(got: dict, case):
    want = oracle(case)
    assert rel(got["output"], want["output"]) <= TOL, rel(got["output"], want["output"])
    pos = PAST + np.arange(NQ)
    allowed = np.arange(want["output_qk"].shape[-1])[None, :] <= pos[:, None]  # [T, C]: causal, one sequence
    mask = np.broadcast_to(allowed, want["output_qk"].shape)
    assert rel(got["output_qk"], want["output_qk"].numpy(), mask) <= TOL, rel(got["output_qk"], want["output_qk"], mask)


@pytest.mark.parametrize("unfuse", [False, True], ids=["fused-pagedkit", "unfused-onnxruntime"])
def test_paged_to_gqa_carries_epsilon_and_qk_output(unfuse):
    case = small_step(1)
    got, attrs = paged_to_gqa(case, unfuse)
    assert attrs["qk_output"] == 1
    if unfuse:
        assert "qk_norm_epsilon" not in attrs or attrs["qk_norm_epsilon"] == pytest.approx(EPS)  # (not read)
    else:
        assert attrs["qk_norm_epsilon"] == pytest.approx(EPS, rel=1e-6)
    _paged_checks(got, case)


def test_round_trip_keeps_the_numbers():
    """GQA -> PagedAttention -> GQA: the second rewrite's node reads the first's attributes."""
    case, gx, ga = gqa_source(1)
    _, attrs = gqa_to_paged(case, gx, ga)
    back = {k: v for k, v in case.attrs.items() if k not in ("qk_norm_epsilon", "qk_output")} | {
        k: attrs[k] for k in ("qk_norm_epsilon", "qk_output")}
    case2 = type(case)(case.spec, case.inputs, back, case.ctx_k, case.ctx_v)
    got, attrs2 = paged_to_gqa(case2, unfuse=False)
    assert attrs2["qk_norm_epsilon"] == pytest.approx(EPS, rel=1e-6) and attrs2["qk_output"] == 1
    _paged_checks(got, case)


# --- teeth -----------------------------------------------------------------------------------------------------

def _without(rules, name: str, *, also=None):
    """`rules` with the shared-attributes rule copying every attribute but `name` (and a rule `also` after)."""
    def copy_but(f, t, io):
        for k in SAME_ATTRS:
            if k in f.given and k != name:
                t.attrs[k] = f.attrs[k]
    out = tuple(Rule(r.name, r.pattern, r.check, copy_but) if r.name.startswith("shared attributes") else r
                for r in rules)
    assert out != rules
    return out + ((also,) if also else ())


def _drop_after(name):
    return Rule(f"teeth: {name} dropped", lambda f: True, lambda f, io: None, lambda f, t, io: t.attrs.pop(name, None))


def _probs(f, t, io):
    if t.attrs.get("qk_output") == 1:
        t.attrs["qk_output"] = 2


TEETH_G2P = {
    "qk_norm_epsilon dropped": (_without(GQA_TO_PAGED, "qk_norm_epsilon", also=_drop_after("qk_norm_epsilon")),
                                {"qk_norm_epsilon": EPS}),
    "override epsilons dropped": (tuple(r for r in GQA_TO_PAGED if r.name != "q/k_norm_epsilon"), GQA_EPS),
    "qk_output dropped": (_without(GQA_TO_PAGED, "qk_output"), GQA_EPS),
    "qk_output scores -> probabilities": (GQA_TO_PAGED + (Rule("teeth", lambda f: True, lambda f, io: None, _probs),),
                                          GQA_EPS),
}


@pytest.mark.parametrize("teeth", list(TEETH_G2P))
def test_teeth_gqa_to_paged(teeth):
    rules, eps_attrs = TEETH_G2P[teeth]
    assert rules != GQA_TO_PAGED
    case, gx, ga = gqa_source(1, eps_attrs)
    with pytest.raises((AssertionError, Refused)) as exc:
        got, _ = gqa_to_paged(case, gx, ga, rules)
        _gqa_checks(got, gx, ga)
    print(teeth, "->", exc.type.__name__, str(exc.value).splitlines()[0][:160])


TEETH_P2G = {
    "qk_norm_epsilon dropped": _without(PAGED_TO_GQA, "qk_norm_epsilon"),
    "qk_output dropped": _without(PAGED_TO_GQA, "qk_output"),
    "qk_output scores -> probabilities": PAGED_TO_GQA + (Rule("teeth", lambda f: True, lambda f, io: None, _probs),),
}


@pytest.mark.parametrize("teeth", list(TEETH_P2G))
def test_teeth_paged_to_gqa(teeth):
    case = small_step(1)
    with pytest.raises((AssertionError, Refused)) as exc:
        got, _ = paged_to_gqa(case, False, TEETH_P2G[teeth])
        _paged_checks(got, case)
    print(teeth, "->", exc.type.__name__, str(exc.value).splitlines()[0][:160])


def test_teeth_unfused_norm_without_its_epsilon(monkeypatch):
    """The unfused QK-norm (standard ops) built with the default epsilon instead of the node's fails."""
    from pagedkit.rewriters.node_rules import to_gqa

    real = to_gqa._rms
    monkeypatch.setattr(to_gqa, "_rms", lambda b, x, w, eps, dt: real(b, x, w, 1e-6, dt))
    case = small_step(1)
    got, _ = paged_to_gqa(case, True)
    with pytest.raises(AssertionError):
        _paged_checks(got, case)
