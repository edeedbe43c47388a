"""paged-export --weights int4 on a mixture-of-experts model (tiny Mixtral): every com.microsoft MoE node becomes
a com.microsoft QMoE node (4-bit experts: uint8 [E, N, K / 2], element 2j in the low nibble, scales
[E, N, K / 32] in the node's type, no zero points: w = (code - 8) * scale; exporters/quantize_moe.py).

Checks:
- the graph: QMoE nodes only (no MoE left), onnxruntime's schema attributes, validated;
- per layer, the QMoE node alone (pagedkit's session and stock onnxruntime CPU) against the float export's MoE
  node on the same tokens and router logits. The weights decoded here from the nibbles are the float weights
  within the int4 grid's error (|W_q - W| <= |scale| per element: the block's largest weight maps exactly to
  code 0, rounding moves any other by <= scale / 2, and only the clip of +8 to code 15 by up to one scale).
  Propagated through the expert (silu is 1.1-Lipschitz) that gives an elementwise envelope on |y_int4 - y_float|
  (`envelope`), asserted. The tight bound: y_int4 - y_float must be exactly what the quantization error does,
  y_dec - y_float with y_dec the float64 MoE over the decoded weights, up to the node's arithmetic (fp32: 1e-4,
  fp16: 4e-3 of max|y|). Its teeth: every scale 2% off fails it;
- the whole int4 export teacher-forced in pagedkit's session and, decomposed (PagedAttention in standard ops),
  in stock onnxruntime CPU, against Hugging Face eager float32 whose weights are the export's int4 weights
  decoded (MatMulNBits: the attention and router products, the LM head; QMoE: the experts), at the fp16 bound.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from export_quant_utils import decode_int4
from export_utils import TOL, assert_valid_export, check_parity
from family_harness import FamilyCase, OrtSession, model_of, torch_session

# seed 17: the decoded model's routing decisions on the parity run's tokens are well separated (the smallest
# gap between the 2nd and 3rd expert probability, asserted > 1e-3 below), so fp16 rounding cannot flip one
CASE = FamilyCase("MixtralConfig", seed=17, overrides=dict(num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=8))
NODE_TOL = {"fp32": 1e-4, "fp16": 4e-3}  # the node's own arithmetic, x max|y|
SILU_LIPSCHITZ = 1.0998  # max |d silu / dx|


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(weights, dtype): export dir}: float and int4 (accuracy_level 0: exact MatMulNBits) in fp16 / fp32."""
    hf, _ = model_of(CASE)
    out = {}
    for dtype in ("fp16", "fp32"):
        for weights in ("float", "int4"):
            d = tmp_path_factory.mktemp(f"mixtral-{weights}-{dtype}")
            kw = dict(weight_format="int4", int4_accuracy_level=0) if weights == "int4" else {}
            _export(hf, d, dtype, **kw)
            out[weights, dtype] = d
    return out


def _export(hf, out, dtype, **kw):
    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions

    return export_hf_model(hf, out, ExportOptions(dtype=dtype, progress=False), **kw)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _arrays(m) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def decode_experts(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """QMoE 4-bit experts, decoded here from the nibbles: codes uint8 [E, N, K / 2], scales [E, N, K / block]
    -> float64 [E, N, K] = (code - 8) * scale."""
    e, n, _ = codes.shape
    q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(e, n, scales.shape[-1], -1).astype(np.float64) - 8
    return (q * scales.astype(np.float64)[..., None]).reshape(e, n, -1)


def _scale_per_element(scales: np.ndarray, k: int) -> np.ndarray:
    return np.repeat(np.abs(scales.astype(np.float64)), k // scales.shape[-1], axis=-1)


# ---- the graph ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_int4_moe_graph(exports, dtype):
    """QMoE nodes replace the MoE nodes (same activation / routing attributes, 4 bits, block 32, raw layout), the
    float expert tensors are gone, the export validates (pagedkit's validator, onnx.checker, genai's config)."""
    out = exports["int4", dtype]
    assert_valid_export(out)
    m, f = onnx.load(str(out / "model.onnx")), onnx.load(str(exports["float", dtype] / "model.onnx"))
    assert not [n for n in m.graph.node if n.op_type == "MoE"]
    qmoe, moe = [n for n in m.graph.node if n.op_type == "QMoE"], [n for n in f.graph.node if n.op_type == "MoE"]
    assert len(qmoe) == len(moe) == 2
    inits = {t.name: t for t in m.graph.initializer}
    elem = onnx.TensorProto.FLOAT16 if dtype == "fp16" else onnx.TensorProto.FLOAT
    for q, fl in zip(qmoe, moe):
        a = _attrs(q)
        assert q.domain == "com.microsoft" and a.pop("expert_weight_bits") == 4 and a.pop("block_size") == 32
        assert a.pop("weights_prepacked") == 0 and a == _attrs(fl)
        i = q.name.split("/")[2]  # layers.i
        assert list(q.input[2:]) == [f"model.{i}.mlp.experts.fc1.weight_Q4", f"model.{i}.mlp.experts.fc1.weight_scales",
                                     "", f"model.{i}.mlp.experts.fc2.weight_Q4",
                                     f"model.{i}.mlp.experts.fc2.weight_scales"]
        e, h, inter = 4, 64, 96
        assert [list(inits[q.input[j]].dims) for j in (2, 3, 5, 6)] == [[e, 2 * inter, h // 2], [e, 2 * inter, h // 32],
                                                                        [e, h, inter // 2], [e, h, inter // 32]]
        assert inits[q.input[3]].data_type == inits[q.input[6]].data_type == elem
        assert f"model.{i}.mlp.experts.fc1.weight" not in inits


def test_int4_moe_sizes_not_whole_blocks(tmp_path):
    """QMoE needs the hidden and the expert inner size both multiples of the block: an inner size of 48 keeps the
    experts float (the MoE node), said in the export's notes; the MatMuls are still int4."""
    from export_utils import tiny_model

    hf = tiny_model("MixtralConfig", seed=3, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    res = _export(hf, tmp_path, "fp16", weight_format="int4")
    assert_valid_export(tmp_path)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node]
    assert ops.count("MoE") == 2 and "QMoE" not in ops and "MatMulNBits" in ops
    assert "int4 experts: 0 MoE nodes -> QMoE (block 32), 2 left float (sizes not whole blocks)" in res.notes


# ---- one node against the float export's ----------------------------------------------------------------------

def _node_model(m: onnx.ModelProto, node: onnx.NodeProto, elem: int, hidden: int, experts: int) -> onnx.ModelProto:
    """The node alone: inputs x [T, H] and router logits [T, E] of type elem, its initializers, output y."""
    inits = [t for t in m.graph.initializer if t.name in node.input]
    n = copy.deepcopy(node)
    n.input[0], n.input[1], n.output[0] = "x", "router", "y"
    g = helper.make_graph([n], "node", [helper.make_tensor_value_info("x", elem, ["T", hidden]),
                                        helper.make_tensor_value_info("router", elem, ["T", experts])],
                          [helper.make_tensor_value_info("y", elem, ["T", hidden])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto, x: np.ndarray, r: np.ndarray) -> dict[str, np.ndarray]:
    """y from pagedkit's session and from stock onnxruntime CPU, float64."""
    import onnxruntime as ort

    from pagedkit.runtime.session import InferenceSession

    ours = InferenceSession(model).run_torch({"x": torch.from_numpy(x), "router": torch.from_numpy(r)})["y"]
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "router": r})[0]
    return {"pagedkit": ours.double().numpy(), "onnxruntime": theirs.astype(np.float64)}


def moe_reference(x, r, w1, w2, k, normalize, dw1=None, dw2=None):
    """float64 com.microsoft MoE (softmax, top-k, renormalized when `normalize`, SwiGLU over fc1's interleaved
    rows, alpha 1, beta 0) of x [T, H] with router logits r [T, E], fc1 w1 [E, 2I, H], fc2 w2 [E, H, I].
    With dw1 / dw2 (elementwise bounds on the error of w1 / w2): also the elementwise envelope of the output's
    error, propagated through each chosen expert (see the module doc)."""
    x, r = x.astype(np.float64), r.astype(np.float64)
    p = np.exp(r - r.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    y, env = np.zeros_like(x), np.zeros_like(x)
    for t in range(x.shape[0]):
        w = p[t, top[t]]
        w = w / w.sum() if normalize else w
        for e, wt in zip(top[t], w):
            hh = w1[e] @ x[t]
            g, u = hh[0::2], hh[1::2]
            act = g / (1 + np.exp(-g))
            y[t] += wt * (w2[e] @ (act * u))
            if dw1 is not None:
                ex = dw1[e] @ np.abs(x[t])  # |delta (W1 x)| bound
                eg, eu = ex[0::2], ex[1::2]
                eh = SILU_LIPSCHITZ * eg * (np.abs(u) + eu) + np.abs(act) * eu
                env[t] += wt * (dw2[e] @ (np.abs(act * u) + eh) + np.abs(w2[e]) @ eh)
    return y, env


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_qmoe_node_vs_float_moe(exports, dtype):
    """Per layer, 96 tokens of random hidden states and router logits through the QMoE node (pagedkit and stock
    onnxruntime CPU) and through the float export's MoE node: decoded weights within the int4 grid error, the
    int4 output within its propagated envelope of the float output, and equal to the float output plus exactly
    the quantization error's effect (the float64 MoE over the decoded weights) up to the node's arithmetic."""
    worst = _node_check(exports, dtype)
    print(f"QMoE {dtype}: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))


def _node_check(exports, dtype, scale_factor: float = 1.0) -> dict[str, float]:
    m, f = onnx.load(str(exports["int4", dtype] / "model.onnx")), onnx.load(str(exports["float", dtype] / "model.onnx"))
    qa, fa = _arrays(m), _arrays(f)
    np_t = np.float16 if dtype == "fp16" else np.float32
    elem = onnx.TensorProto.FLOAT16 if dtype == "fp16" else onnx.TensorProto.FLOAT
    rng = np.random.default_rng(3)
    worst = {"weights/scale": 0.0, "vs float/envelope": 0.0, "pagedkit": 0.0, "onnxruntime": 0.0, "int4 vs float": 0.0}
    for q, fl in zip([n for n in m.graph.node if n.op_type == "QMoE"], [n for n in f.graph.node if n.op_type == "MoE"]):
        a = _attrs(q)
        if scale_factor != 1.0:  # the teeth: every scale of the node off by scale_factor
            for j in (3, 6):
                t = next(t for t in m.graph.initializer if t.name == q.input[j])
                t.CopyFrom(numpy_helper.from_array((qa[q.input[j]] * scale_factor).astype(np_t), t.name))
        w1, w2 = fa[fl.input[2]].astype(np.float64), fa[fl.input[4]].astype(np.float64)
        d1, d2 = decode_experts(qa[q.input[2]], qa[q.input[3]]), decode_experts(qa[q.input[5]], qa[q.input[6]])
        s1, s2 = _scale_per_element(qa[q.input[3]], w1.shape[-1]), _scale_per_element(qa[q.input[6]], w2.shape[-1])
        for d, w, s in ((d1, w1, s1), (d2, w2, s2)):  # the int4 grid: |W_q - W| <= |scale| (1 + fp16 slack)
            worst["weights/scale"] = max(worst["weights/scale"], float((np.abs(d - w) / s).max()))
            assert (np.abs(d - w) <= s * 1.002).all()
            assert (np.abs(d - w) <= s * 0.5 * 1.002).mean() > 0.99  # only the clipped +8 codes exceed scale / 2
        hidden, experts = w2.shape[1], w1.shape[0]
        x = rng.standard_normal((96, hidden)).astype(np_t)
        r = (2 * rng.standard_normal((96, experts))).astype(np_t)
        k, norm = a["k"], bool(a["normalize_routing_weights"])
        y_float, env = moe_reference(x, r, w1, w2, k, norm, dw1=np.abs(d1 - w1), dw2=np.abs(d2 - w2))
        if scale_factor == 1.0:  # the float export's own node computes y_float
            got_f = _run(_node_model(f, fl, elem, hidden, experts), x, r)
            for name, y in got_f.items():
                assert np.abs(y - y_float).max() <= NODE_TOL[dtype] * np.abs(y_float).max(), f"float MoE, {name}"
        y_dec, _ = moe_reference(x, r, d1, d2, k, norm)
        scale = np.abs(y_dec).max()
        for name, y in _run(_node_model(m, q, elem, hidden, experts), x, r).items():
            slack = NODE_TOL[dtype] * scale
            over = float((np.abs(y - y_float) / (env + slack)).max())
            worst["vs float/envelope"] = max(worst["vs float/envelope"], over)
            assert over <= 1.0, f"{q.name} ({name}): |int4 - float| exceeds the int4 envelope {over:.3g}x"
            err = float(np.abs(y - y_dec).max() / scale)
            worst[name] = max(worst[name], err)
            worst["int4 vs float"] = max(worst["int4 vs float"], float(np.abs(y - y_float).max() / scale))
            assert err <= NODE_TOL[dtype], \
                f"{q.name} ({name}): max|y - y_decoded| = {err:.3g} x max|y| > {NODE_TOL[dtype]}"
    return worst


@pytest.mark.parametrize("factor", [1.02, 0.98], ids=["scales+2%", "scales-2%"])
def test_qmoe_node_check_has_teeth(exports, factor):
    """Every QMoE scale 2% off (the weights then 2% off their decoded values) fails the node check."""
    with pytest.raises(AssertionError, match="y_decoded") as exc:
        _node_check(exports, "fp16", factor)
    print(f"teeth x{factor}: {str(exc.value).splitlines()[0]}")


# ---- the whole model -------------------------------------------------------------------------------------------

def int4_decoded_mixtral(hf, model_dir: Path):
    """A copy of the HF Mixtral whose weights are the int4 export's, decoded here: MatMulNBits (packed QKV split
    back into q / k / v, o_proj, the router, the LM head) and QMoE (fc1's interleaved gate / up rows back to
    gate_up_proj [E, 2I, H] = [gate | up], fc2 = down_proj [E, H, I])."""
    m = onnx.load(str(Path(model_dir) / "model.onnx"))
    arr = _arrays(m)
    ref = copy.deepcopy(hf).float()
    with torch.no_grad():
        for node in m.graph.node:
            if node.op_type == "MatMulNBits":
                w = torch.from_numpy(decode_int4(arr[node.input[1]], arr[node.input[2]], _attrs(node)["K"]))
                path = node.input[1].removesuffix(".MatMul.weight_Q4")
                if path == "lm_head":
                    ref.lm_head.weight.copy_(w)
                    continue
                _, _, i, block, name = path.split(".")  # model.layers.{i}.attn|mlp.{qkv_proj|o_proj|router}
                layer = ref.model.layers[int(i)]
                if name == "router":
                    layer.mlp.gate.weight.copy_(w)
                elif name == "o_proj":
                    layer.self_attn.o_proj.weight.copy_(w)
                else:
                    at = layer.self_attn
                    rows = [at.q_proj.weight.shape[0], at.k_proj.weight.shape[0], at.v_proj.weight.shape[0]]
                    for lin, part in zip((at.q_proj, at.k_proj, at.v_proj), w.split(rows)):
                        lin.weight.copy_(part)
            elif node.op_type == "QMoE":
                ex = ref.model.layers[int(node.name.split("/")[2].split(".")[1])].mlp.experts
                fc1 = torch.from_numpy(decode_experts(arr[node.input[2]], arr[node.input[3]])).float()
                ex.gate_up_proj.copy_(torch.cat([fc1[:, 0::2], fc1[:, 1::2]], dim=1))
                ex.down_proj.copy_(torch.from_numpy(decode_experts(arr[node.input[5]], arr[node.input[6]])).float())
    return ref


@torch.no_grad()
def routing_margin(hf, sequences: list[list[int]]) -> float:
    """The smallest gap between the k-th and (k+1)-th routing probability of HF over these token sequences."""
    gaps = []

    def hook(module, args, out):
        top = out[0].float().softmax(-1).topk(module.top_k + 1, -1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in hf.model.layers]
    try:
        for ids in sequences:
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return min(gaps)


def test_int4_mixtral_parity(exports):
    """The fp16 int4 export in pagedkit's session and (decomposed) in stock onnxruntime CPU, teacher-forced, against
    HF eager over the decoded int4 weights at the fp16 bound; the same export against plain (float) HF fails it
    (the quantization is really in the graph and the check sees it)."""
    from pagedkit.rewriters.decompose import decompose

    hf, _ = model_of(CASE)
    out = exports["int4", "fp16"]
    ref = int4_decoded_mixtral(hf, out)
    memo: dict = {}  # the decoded reference's sequences and logits, shared by both runs
    rep = check_parity(ref, out, steps=6, session=torch_session(out), reference=memo)
    margin = routing_margin(ref, [ids for ids, _ in memo.values()])
    assert margin > 1e-3, f"routing near-tie in the reference ({margin:.3g}): pick another seed"
    model, report = decompose(onnx.load(str(out / "model.onnx")))
    assert report.changed and not report.skipped, report
    ort_rep = check_parity(ref, out, steps=6, session=OrtSession(model), reference=memo)
    plain = check_parity(hf, out, steps=2, tol=np.inf, greedy=False, session=torch_session(out))
    print(f"int4 Mixtral vs decoded HF: pagedkit {rep.worst_ratio:.3g}, onnxruntime {ort_rep.worst_ratio:.3g}; "
          f"vs float HF {plain.worst_ratio:.3g}; routing margin {margin:.3g}")
    assert plain.worst_ratio > 2 * TOL
