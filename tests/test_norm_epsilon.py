"""Normalizations on small activations, where the epsilon decides the result: rows with mean squares from 1e-6 to
1e-4 (a hidden state after a small residual branch, a K head of a cold projection), epsilons 1e-6 / 2e-5 (and
the attribute's default where the op has one), against float64 oracles written here (numpy, no pagedkit import):

    rms(x)  = x / sqrt(mean(x^2) + eps) * gamma
    ln(x)   = (x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta

- the runtime's ops (runtime/ops/norms.py): LayerNormalization, RMSNormalization, SimplifiedLayerNormalization,
  SkipLayerNormalization, SkipSimplifiedLayerNormalization, both routes (torch's fused norms when no statistics
  are asked for, the composition otherwise), the statistics outputs too; onnxruntime CPU on the same one-node
  models against the same oracle (the oracle's reading of each op's epsilon and default is onnxruntime's);
- the Triton norm (kernels/triton/norm.py rms_norm) in the interpreter;
- QK-norm: PagedAttention's qk_norm_epsilon in the loop reference, torch_sdpa, torch_planned, the Triton write
  (side_rows) and the standard-ONNX decomposition (onnxruntime CPU); GroupQueryAttention's q_norm_epsilon /
  k_norm_epsilon (distinct) in the reference and the Triton GQA; oracles tests/paged_oracle.py `oracle` and
  `gqa_oracle` on inputs whose Q and K rows are scaled down (mean squares 1e-6 .. 1e-4);
- teeth (tests/mutants.py: a copy of the module with the bug): the epsilon dropped, added outside the square
  root, the wrong default, Q's epsilon used for K (and the reverse) each fail."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from mutants import mutant
from paged_oracle import Spec, build, clone_inputs, gqa_oracle, oracle, rel_err
from pagedkit.runtime.ops import OPS, OpContext, registry
from pagedkit.runtime.ops import norms

ort = pytest.importorskip("onnxruntime") if not os.environ.get("CI") else __import__("onnxruntime")
triton = pytest.importorskip("triton") if not os.environ.get("CI") else __import__("triton")  # CI: never skip

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
H = 64
ROW_SCALES = np.array([1e-3, 2e-3, 4e-3, 1e-2])  # rows' RMS: mean squares 1e-6 .. 1e-4


# --- oracles (float64 numpy) ------------------------------------------------------------------------------------

def rms64(x, gamma, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma


def ln64(x, gamma, beta, eps):
    xc = x - x.mean(-1, keepdims=True)
    return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps) * gamma + beta


def _f64(t) -> np.ndarray:
    return t.double().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)


def _rel(got, want) -> float:
    got, want = _f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all(), (got.shape, want.shape)
    scale = np.abs(want).max()
    return float(np.abs(got - want).max() / scale) if scale else float(np.abs(got).max())  # zeros: exactly


def small_rows(seed: int, rows: int = 4, width: int = H, dtype=torch.float32, offset: float = 0.0) -> torch.Tensor:
    """[rows, width]: row r ~ N(offset, 1) * ROW_SCALES[r % 4] (LayerNorm rows get an offset: the mean removed)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g, dtype=torch.float64) + offset)
    return (x * torch.from_numpy(ROW_SCALES[np.arange(rows) % 4])[:, None]).to(dtype)


def _gamma(seed, width=H, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.3 * torch.randn(width, generator=g, dtype=torch.float64)).to(dtype)


# --- the runtime's norm ops ---------------------------------------------------------------------------------------

MS = "com.microsoft"
DEFAULT_EPS = {"LayerNormalization": 1e-5, "RMSNormalization": 1e-5, "SimplifiedLayerNormalization": 1e-5,
               "SkipLayerNormalization": 1e-12, "SkipSimplifiedLayerNormalization": 1e-12}


class NormCase:
    """One norm call: op, its inputs, which outputs are asked for, and the float64 expectation of each."""

    def __init__(self, op: str, dtype, eps: float | None, stats: bool, seed: int = 0, scale_2d: bool = False):
        self.op, self.dtype, self.eps, self.stats = op, dtype, eps, stats
        self.domain = MS if op.startswith("Skip") else ""
        center = op in ("LayerNormalization", "SkipLayerNormalization")
        skip = op.startswith("Skip")
        e = DEFAULT_EPS[op] if eps is None else eps
        x = small_rows(seed, dtype=dtype, offset=0.5 if center else 0.0)
        gamma = _gamma(seed + 1, dtype=dtype)
        beta = (0.1 * _gamma(seed + 2, dtype=torch.float64) - 0.1).to(dtype)
        if skip:  # x + skip + bias: each small, the sum too
            sk = small_rows(seed + 3, dtype=dtype)
            bias = (small_rows(seed + 4, rows=1, dtype=dtype)[0] * 0.5)
            self.inputs = [x, sk, gamma] + ([beta] if center else []) + [bias]
            s = _f64(x) + _f64(sk) + _f64(bias)
        else:
            self.inputs = [x, gamma.reshape(1, H) if scale_2d else gamma] + ([beta] if center else [])
            s = _f64(x)
        y = ln64(s, _f64(gamma), _f64(beta), e) if center else rms64(s, _f64(gamma), e)
        xc = s - s.mean(-1, keepdims=True) if center else s
        inv = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + e)
        self.attrs = {} if eps is None else {"epsilon": eps}
        # outputs by index: the ones compared (statistics asked for or not)
        if op == "LayerNormalization":
            self.want = {0: y, 1: s.mean(-1, keepdims=True), 2: inv}
            self.n_out = 3
        elif op == "RMSNormalization":
            self.want, self.n_out = {0: y}, 1
        elif op == "SimplifiedLayerNormalization":
            self.want, self.n_out = ({0: y, 1: inv} if stats else {0: y}), 2
        else:
            self.want = {0: y, 1: (s.mean(-1, keepdims=True) if center else np.zeros_like(inv)), 2: inv, 3: s} \
                if stats else {0: y, 3: s}
            self.n_out = 4
        self.requested = tuple(i in self.want for i in range(self.n_out))

    def tol(self, i: int) -> float:
        return TOL[self.dtype] if i in (0, 3) else 1e-5  # statistics are float32

    def run(self, fn=None) -> dict:
        fn = fn or OPS[(self.domain, self.op)]
        out = fn([t.clone() for t in self.inputs], dict(self.attrs), OpContext(requested=self.requested))
        return {i: out[i] for i in self.want}

    def check(self, got: dict) -> dict:
        errs = {i: _rel(got[i], self.want[i]) for i in self.want}
        for i, e in errs.items():
            assert e <= self.tol(i), f"{self.op} output {i}: {e:.3g} > {self.tol(i)}"
        return errs

    def model(self) -> onnx.ModelProto:
        names = ["x", "skip", "gamma", "beta", "bias"] if self.domain else ["x", "scale", "bias"]
        if self.op == "SkipSimplifiedLayerNormalization":
            names = ["x", "skip", "gamma", "bias"]
        elif self.op in ("RMSNormalization", "SimplifiedLayerNormalization"):
            names = ["x", "scale"]
        names = names[:len(self.inputs)]
        et = TensorProto.FLOAT if self.dtype == torch.float32 else TensorProto.FLOAT16
        outs = [f"o{i}" if i in self.want else "" for i in range(self.n_out)]
        while not outs[-1]:
            outs.pop()
        node = helper.make_node(self.op, names, outs, domain=self.domain, **self.attrs)
        ins = [helper.make_tensor_value_info(n, et, list(t.shape)) for n, t in zip(names, self.inputs)]
        stat_t = lambda i: TensorProto.FLOAT if i in (1, 2) else et  # noqa: E731
        g = helper.make_graph([node], "norm", ins, [helper.make_tensor_value_info(o, stat_t(i), None)
                                                    for i, o in enumerate(outs) if o])
        opset = 23 if self.op == "RMSNormalization" else 17
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                                 ir_version=10)

    def run_ort(self) -> dict:
        m = self.model()
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [i.name for i in m.graph.input]
        res = sess.run([o.name for o in m.graph.output], {n: t.numpy() for n, t in zip(names, self.inputs)})
        return dict(zip([int(o.name[1:]) for o in m.graph.output], res))


NORM_CASES = {  # id: (op, stats, scale_2d) - stats: the statistics outputs asked for (the composed route)
    "layer_norm": ("LayerNormalization", True, False),
    "rms_fused": ("RMSNormalization", False, False),
    "rms_composed": ("RMSNormalization", False, True),
    "simplified_fused": ("SimplifiedLayerNormalization", False, False),
    "simplified_stats": ("SimplifiedLayerNormalization", True, False),
    "skip_ln_fused": ("SkipLayerNormalization", False, False),
    "skip_ln_stats": ("SkipLayerNormalization", True, False),
    "skip_simplified_fused": ("SkipSimplifiedLayerNormalization", False, False),
    "skip_simplified_stats": ("SkipSimplifiedLayerNormalization", True, False),
}
EPSILONS = [1e-6, 2e-5, None]  # None: the attribute absent (the op's default)


def _case(name, dtype, eps, seed=0):
    op, stats, scale_2d = NORM_CASES[name]
    return NormCase(op, dtype, eps, stats, seed=seed, scale_2d=scale_2d)


@pytest.mark.parametrize("eps", EPSILONS, ids=["1e-6", "2e-5", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_runtime_norm_ops_on_small_rows(name, dtype, eps):
    case = _case(name, dtype, eps)
    case.check(case.run())


@pytest.mark.parametrize("eps", EPSILONS, ids=["1e-6", "2e-5", "default"])
@pytest.mark.parametrize("name", [n for n in NORM_CASES if n != "rms_composed"])  # (its scale [1, H]: the same op)
def test_onnxruntime_agrees_with_the_oracle(name, eps):
    """The oracle's reading of each op (epsilon inside the root, the defaults) is onnxruntime CPU's."""
    case = _case(name, torch.float32, eps)
    case.check(case.run_ort())


def test_small_rows_make_the_epsilon_matter():
    """The inputs' point: with the epsilon dropped the oracle itself moves by far more than any bound."""
    x, gamma = _f64(small_rows(0)), _f64(_gamma(1))
    assert _rel(rms64(x, gamma, 0.0), rms64(x, gamma, 1e-6)) > 0.1
    assert _rel(rms64(x, gamma, 1e-6), rms64(x, gamma, 2e-5)) > 0.5


def _norms_mutant(edits, tmp_path, monkeypatch):
    """norms.py with `edits`: its registrations go to a scratch op table (the real one is untouched); returns
    {(domain, op): mutated implementation}."""
    scratch: dict = {}
    monkeypatch.setattr(registry, "OPS", scratch)
    mutant(norms, edits, tmp_path, monkeypatch)
    return scratch


_NORMALIZE = "inv = torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)"
NORM_MUTANTS = {  # name: (edits, the cases that must fail)
    "composed: eps dropped": ([(_NORMALIZE, "inv = torch.rsqrt(xc.square().mean(dims, keepdim=True))")],
                              ["layer_norm", "rms_composed", "simplified_stats", "skip_ln_stats",
                               "skip_simplified_stats"]),
    "composed: eps outside the root": (
        [(_NORMALIZE, "inv = 1.0 / (xc.square().mean(dims, keepdim=True).sqrt() + eps)")],
        ["layer_norm", "rms_composed", "simplified_stats", "skip_ln_stats", "skip_simplified_stats"]),
    "RMSNormalization fused: eps dropped": (
        [('scale.to(dtype), attrs.get("epsilon", 1e-5))', "scale.to(dtype))", 0)], ["rms_fused"]),
    "Simplified fused: eps dropped": (
        [('scale.to(dtype), attrs.get("epsilon", 1e-5))', "scale.to(dtype))", 1)], ["simplified_fused"]),
    "Simplified: default 1e-6": ([('y, _, inv = _normalize(x, axis, attrs.get("epsilon", 1e-5)',
                                   'y, _, inv = _normalize(x, axis, attrs.get("epsilon", 1e-6)')],
                                 ["simplified_stats"]),
    "RMSNormalization: default 1e-6": ([('attrs.get("epsilon", 1e-5), dtype, center=False)',
                                         'attrs.get("epsilon", 1e-6), dtype, center=False)', 0)], ["rms_composed"]),
    "skip fused: LayerNorm eps dropped": ([("F.layer_norm(s, shape, g, b, eps)", "F.layer_norm(s, shape, g, b)")],
                                          ["skip_ln_fused"]),
    "skip fused: RMS eps dropped": ([("F.rms_norm(s, shape, g, eps)", "F.rms_norm(s, shape, g)")],
                                    ["skip_simplified_fused"]),
    "skip: default 1e-5": ([('eps, shape = attrs.get("epsilon", 1e-12)', 'eps, shape = attrs.get("epsilon", 1e-5)')],
                           ["skip_ln_fused", "skip_simplified_fused"]),
}


@pytest.mark.parametrize("mutation", list(NORM_MUTANTS))
def test_teeth_runtime_norms(mutation, tmp_path, monkeypatch):
    edits, victims = NORM_MUTANTS[mutation]
    bad = _norms_mutant(edits, tmp_path, monkeypatch)
    for name in victims:
        for eps in EPSILONS:
            case = _case(name, torch.float32, eps)
            try:
                case.check(case.run(bad[(case.domain, case.op)]))
            except AssertionError:
                break
        else:
            pytest.fail(f"{mutation}: {name} passed at every epsilon")


# --- the Triton norm (interpreter) ----------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [1e-6, 2e-5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_rms_norm_on_small_rows(dtype, eps):
    from pagedkit.kernels.triton import norm

    case = NormCase("SkipSimplifiedLayerNormalization", dtype, eps, stats=False)
    x, sk, gamma, bias = case.inputs
    y, s = norm.rms_norm(x, gamma, eps, skip=sk, bias=bias, want_sum=True)
    assert _rel(y, case.want[0]) <= TOL[dtype] and _rel(s, case.want[3]) <= TOL[dtype]
    y2, _ = norm.rms_norm(x, gamma, eps)  # no skip
    assert _rel(y2, rms64(_f64(x), _f64(gamma), eps)) <= TOL[dtype]


_TRITON_INV = "inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)"
TRITON_NORM_MUTANTS = {
    "eps dropped": (_TRITON_INV, _TRITON_INV.replace(" + eps", "")),
    "eps outside the root": (_TRITON_INV, "inv = 1.0 / (tl.sqrt(tl.sum(s * s, axis=0) / H) + eps)"),
}


@pytest.mark.parametrize("mutation", list(TRITON_NORM_MUTANTS))
def test_teeth_triton_norm(mutation, tmp_path, monkeypatch):
    from pagedkit.kernels.triton import norm

    bad = mutant(norm, [TRITON_NORM_MUTANTS[mutation]], tmp_path, monkeypatch)
    case = NormCase("SkipSimplifiedLayerNormalization", torch.float16, 1e-6, stats=False)
    x, sk, gamma, bias = case.inputs
    y, _ = bad.rms_norm(x, gamma, 1e-6, skip=sk, bias=bias)
    assert _rel(y, case.want[0]) > 10 * TOL[torch.float16]


# --- QK-norm: PagedAttention ------------------------------------------------------------------------------------

QK_TOL = 2e-3  # fp16 outputs (tests/test_reference_paged.py's bound)


def qk_small_case(eps: float | None, seed: int = 3, packed: bool = False):
    """A ragged PagedAttention step with QK-norm whose new Q / K rows are scaled to RMS 1e-3 .. 1e-2 per token
    (the cached past is already normed: it stays); eps None: qk_norm_epsilon absent (default 1e-6)."""
    spec = Spec(q_lens=[3, 1, 2], past=[5, 17, 0], num_heads=4, kv_num_heads=2, head_size=32, block_size=16,
                rotary="half", qk_norm=True, packed=packed,
                attrs={} if eps is None else {"qk_norm_epsilon": eps}, seed=seed)
    case = build(spec)
    n = case.inputs["query"].shape[0]
    tok = torch.from_numpy(ROW_SCALES[np.arange(n) % 4])[:, None]
    h, hkv, d = spec.num_heads, spec.kv_num_heads, spec.head_size
    if packed:  # Q and K columns scaled, V left as it is
        qkv = case.inputs["query"].double()
        qkv[:, :(h + hkv) * d] *= tok
        case.inputs["query"] = qkv.to(spec.dtype)
    else:
        for name in ("query", "key"):
            case.inputs[name] = (case.inputs[name].double() * tok).to(spec.dtype)
    return case


def _paged_variants():
    from pagedkit.kernels.paged import reference, torch_planned, torch_sdpa
    from pagedkit.kernels.triton import paged as triton_paged

    return {"reference": reference.paged_attention, "torch_sdpa": torch_sdpa.paged_attention,
            "torch_planned": torch_planned.paged_attention,
            "triton": lambda x, **kw: triton_paged.paged_attention(x, validate=False, **kw)}


def _decomposed(x, outputs, **attrs):
    """The standard-ONNX decomposition (pagedkit.rewriters.decompose) run by onnxruntime CPU."""
    from cases import Case, Expected
    from pagedkit.rewriters.decompose import decompose
    from test_decompose import ort_run
    from test_session_cases import single_node_model

    shape = (x["query"].shape[0], attrs["num_heads"] * 32)
    case = Case("qk_small", "PagedAttention", dict(attrs), x,
                Expected({"output": torch.zeros(shape, dtype=torch.float16)}, {}))
    model, report = decompose(single_node_model(case))
    assert not report.skipped, report.skipped
    return ort_run(model, x, {"output": (shape, torch.float16)})


@pytest.mark.parametrize("eps", [1e-5, None], ids=["1e-5", "default"])
@pytest.mark.parametrize("variant", ["reference", "torch_sdpa", "torch_planned", "triton", "decomposed"])
def test_paged_qk_norm_on_small_rows(variant, eps):
    case = qk_small_case(eps, packed=variant == "torch_planned")
    fn = _decomposed if variant == "decomposed" else _paged_variants()[variant]
    got = fn(clone_inputs(case.inputs), outputs=["output"], **case.attrs)
    assert rel_err(got["output"], oracle(case)["output"]) <= QK_TOL


def test_paged_small_rows_make_the_epsilon_matter():
    case = qk_small_case(1e-5)
    moved = dict(case.attrs, qk_norm_epsilon=1e-6)
    assert rel_err(oracle(case)["output"], oracle(type(case)(case.spec, case.inputs, moved, case.ctx_k,
                                                             case.ctx_v))["output"]) > 20 * QK_TOL


def _patched_triton_write(edits_rope, edits_write, tmp_path, monkeypatch):
    """cache_write.py (with `edits_write`) over _rope_quant.py (with `edits_rope`), put where the write_kv op
    imports it from."""
    import sys

    from pagedkit.kernels.triton import _rope_quant, cache_write

    imports = []
    if edits_rope:
        mutant(_rope_quant, edits_rope, tmp_path, monkeypatch)
        imports = [("from ._rope_quant import bf16_bits", "from ._rope_quant_mutant import bf16_bits")]
    bad = mutant(cache_write, imports + edits_write, tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, cache_write.__name__, bad)


_RMS_HEADS = "inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)"
_SIDE_ROWS = "inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)"
PAGED_QK_MUTANTS = {  # name: (the variants that must fail, how the bug is put in place)
    "rms_norm_heads: eps dropped": (["reference", "torch_sdpa", "torch_planned"],
                                    ("attention_math", [(_RMS_HEADS, _RMS_HEADS.replace(" + eps", ""))])),
    "rms_norm_heads: eps outside the root": (
        ["reference", "torch_sdpa", "torch_planned"],
        ("attention_math", [(_RMS_HEADS, "inv = 1.0 / (x.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)")])),
    "triton side_rows: eps dropped": (["triton"], ("rope", [(_SIDE_ROWS, _SIDE_ROWS.replace(" + eps", ""))])),
    "triton side_rows: eps outside the root": (
        ["triton"], ("rope", [(_SIDE_ROWS, "inv = 1.0 / (tl.sqrt(tl.sum(x * x, axis=1) / D) + eps)")])),
    "decomposition: eps outside the root": (
        ["decomposed"], ("onnx_ops", [('b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, b.f32(eps))))',
                                       'b.op("Reciprocal", b.op("Add", b.op("Sqrt", ms), b.f32(eps)))')])),
    "decomposition: eps dropped": (
        ["decomposed"], ("onnx_ops", [('b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, b.f32(eps))))',
                                       'b.op("Reciprocal", b.op("Sqrt", ms))')])),
}


@pytest.mark.parametrize("mutation", list(PAGED_QK_MUTANTS))
def test_teeth_paged_qk_norm(mutation, tmp_path, monkeypatch):
    from pagedkit.kernels import attention_math
    from pagedkit.kernels.onnx_ops import paged as onnx_paged, paged_attention as onnx_pa, paged_inplace
    from pagedkit.kernels.paged import prologue, torch_planned

    victims, (where, edits) = PAGED_QK_MUTANTS[mutation]
    if where == "attention_math":
        bad = mutant(attention_math, edits, tmp_path, monkeypatch)
        for mod in (prologue, torch_planned):
            monkeypatch.setattr(mod, "rms_norm_heads", bad.rms_norm_heads)
    elif where == "rope":
        _patched_triton_write(edits, [], tmp_path, monkeypatch)
    else:
        bad = mutant(onnx_pa, edits, tmp_path, monkeypatch)
        for mod in (onnx_paged, paged_inplace):
            monkeypatch.setattr(mod, "rms_norm", bad.rms_norm)
    for variant in victims:
        case = qk_small_case(None, packed=variant == "torch_planned")  # the default epsilon (1e-6)
        fn = _decomposed if variant == "decomposed" else _paged_variants()[variant]
        got = fn(clone_inputs(case.inputs), outputs=["output"], **case.attrs)
        assert rel_err(got["output"], oracle(case)["output"]) > 10 * QK_TOL, variant


# --- QK-norm: GroupQueryAttention (q_norm_epsilon != k_norm_epsilon) --------------------------------------------

GQA_EPS = {"q_norm_epsilon": 1e-6, "k_norm_epsilon": 2e-5}


def gqa_small(dtype, attrs=GQA_EPS, seed=5):
    """A GQA step (ragged right-padded chunks, past, RoPE, QK-norm) whose Q / K rows are scaled to RMS 1e-3 ..
    1e-2 per token."""
    from paged_gqa import GqaSpec, make_gqa_inputs

    spec = GqaSpec(past=(3, 6), seq=3, q=(3, 1), capacity=9, query_seqlens=True, qk_norm=True, rotary="half",
                   dtype=dtype, attrs=dict(attrs))
    x, a, _ = make_gqa_inputs(spec, seed)
    b, s = x["query"].shape[:2]
    tok = torch.from_numpy(ROW_SCALES[np.arange(b * s) % 4].reshape(b, s, 1))
    for name in ("query", "key"):
        x[name] = (x[name].double() * tok).to(dtype)
    return x, a


def _gqa_run(variant, x, a):
    from pagedkit.kernels.gqa.reference import group_query_attention as reference
    from pagedkit.kernels.triton import gqa

    x = {k: v.clone() for k, v in x.items()}
    return reference(x, **a) if variant == "reference" else gqa.group_query_attention(x, validate=False, **a)


GQA_TOL = {"reference": {torch.float32: 1e-5, torch.float16: 2e-3}, "triton": {torch.float16: 5e-3}}


@pytest.mark.parametrize("attrs", [GQA_EPS, {"qk_norm_epsilon": 2e-5, "q_norm_epsilon": 1e-6},
                                   {"qk_norm_epsilon": 1e-6, "k_norm_epsilon": 2e-5}],
                         ids=["q-and-k", "q-over-shared", "k-over-shared"])
@pytest.mark.parametrize("variant,dtype", [("reference", torch.float32), ("reference", torch.float16),
                                           ("triton", torch.float16)], ids=["reference-fp32", "reference-fp16",
                                                                           "triton-fp16"])
def test_gqa_qk_norm_epsilons_on_small_rows(variant, dtype, attrs):
    from test_gqa_oracle import compare_with_oracle

    x, a = gqa_small(dtype, attrs)
    compare_with_oracle(_gqa_run(variant, x, a), x, a, GQA_TOL[variant][dtype])


def test_gqa_small_rows_make_each_epsilon_matter():
    """Swapping the two epsilons moves the oracle's output and present_key far past the bounds."""
    x, a = gqa_small(torch.float32)
    want, swapped = gqa_oracle(x, a), gqa_oracle(x, dict(a, q_norm_epsilon=2e-5, k_norm_epsilon=1e-6))
    for name in ("output", "present_key"):
        ok = ~np.isnan(want[name])
        d = np.abs(want[name][ok] - swapped[name][ok]).max() / np.abs(want[name][ok]).max()
        assert d > 0.1, (name, d)


_EQ = 'q = rms_norm_heads(q, x["q_norm_weight"].to(cd), float(eq))'
_EK = 'k_new = rms_norm_heads(k_new, x["k_norm_weight"].to(cd), float(ek))'
_K_ROWS = "k = side_rows(k_ptr + t * k_rs, rows, HKV, D, eps_k,"
_Q_ROWS = "qx = side_rows(q_ptr + t * q_rs, qrows, H, D, eps,"
GQA_MUTANTS = {  # name: (variant, where, edits)
    "reference: K takes q_norm_epsilon": ("reference", "reference", [(_EK, _EK.replace("(ek)", "(eq)"))]),
    "reference: Q takes k_norm_epsilon": ("reference", "reference", [(_EQ, _EQ.replace("(eq)", "(ek)"))]),
    "reference: shared epsilon only": ("reference", "reference",
                                       [(_EQ, _EQ.replace("float(eq)", 'a["qk_norm_epsilon"]')),
                                        (_EK, _EK.replace("float(ek)", 'a["qk_norm_epsilon"]'))]),
    "triton: K rows take Q's epsilon": ("triton", "cache_write", [(_K_ROWS, _K_ROWS.replace("eps_k,", "eps,"))]),
    "triton: Q rows take K's epsilon": ("triton", "cache_write", [(_Q_ROWS, _Q_ROWS.replace("eps,", "eps_k,"))]),
    "triton: epsilons swapped on the host": (
        "triton", "gqa_common", [("qk_norm_epsilon=float(eps_q)", "qk_norm_epsilon=float(eps_k)"),
                                 ("k_norm_epsilon=float(eps_k))", "k_norm_epsilon=float(eps_q))")]),
}


@pytest.mark.parametrize("mutation", list(GQA_MUTANTS))
def test_teeth_gqa_qk_norm_epsilons(mutation, tmp_path, monkeypatch):
    from test_gqa_oracle import compare_with_oracle

    from pagedkit.kernels.gqa import reference
    from pagedkit.kernels.triton import gqa, gqa_common

    variant, where, edits = GQA_MUTANTS[mutation]
    dtype = torch.float32 if variant == "reference" else torch.float16
    x, a = gqa_small(dtype)
    if where == "reference":
        bad = mutant(reference, edits, tmp_path, monkeypatch)
        got = bad.group_query_attention({k: v.clone() for k, v in x.items()}, **a)
    else:
        if where == "cache_write":
            _patched_triton_write([], edits, tmp_path, monkeypatch)
        else:
            monkeypatch.setattr(gqa, "write", mutant(gqa_common, edits, tmp_path, monkeypatch).write)
        got = _gqa_run("triton", x, a)
    with pytest.raises(AssertionError, match=r"max\|diff\| / max\|ref\|"):
        compare_with_oracle(got, x, a, 10 * GQA_TOL[variant][dtype])
