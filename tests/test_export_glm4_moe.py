"""paged-export, GLM-4-MoE (GLM-4.5 / 4.5-Air): DeepSeek-V3 routing (sigmoid scores, e_score_correction_bias for
the choice, group-limited top-k, norm_topk_prob, routed_scaling_factor) through moe.sigmoid_group_route and
com.microsoft::MoE, shared experts, first_k_dense_replace dense layers, partial rotate_half RoPE, QK-norm,
q / k / v biases (tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth, built-in).

Routing is a discrete decision, so the end-to-end model is built without near-ties, as tests/test_export_deepseek.py
(its V3_BIAS design): router gain 0.1 (sigmoid scores 0.5 +- ~0.15) and the correction bias below make the
decisions static with margins >= 0.3 (`test_glm4_moe_routing_well_posed`): groups of 2 experts with top-2 sums
A 0.5, B 3.5, C 1.5, D -0.5 keep B and C, so experts 2, 3, 4 are chosen; without the group limit expert 0 would
be, without the bias the scores alone decide. Token-dependent routing (bias std 0.5, gain 1) is checked exactly in
float32 on 400 tokens against HF's Glm4MoeMoE block, where the group limit changes >10% of the choices."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from onnx import TensorProto

from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, model_of

BIAS = [3.0, -2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
MOE = dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
           routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
CASE = FamilyCase("Glm4MoeConfig", seed=4, overrides=MOE | dict(num_hidden_layers=3, attention_bias=True,
                                                                use_qk_norm=True))


def glm4_moe(case: FamilyCase = CASE, gain: float = 0.1, bias=BIAS):
    """The case's HF model with router weights x gain and the correction bias set (once, before any reference)."""
    hf = model_of(case)[0]
    if not getattr(hf, "_routing_designed", False):
        gen = torch.Generator().manual_seed(case.seed + 100)
        with torch.no_grad():
            for layer in hf.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.mul_(gain)
                    b = layer.mlp.gate.e_score_correction_bias  # a buffer: tiny_model leaves it at 0
                    b.copy_(torch.tensor(bias) if isinstance(bias, list)
                            else bias * torch.randn(b.shape, generator=gen))
        hf._routing_designed = True
    return hf


def _family():
    from pagedkit.exporters.families.glm4_moe import Glm4MoeFamily

    return Glm4MoeFamily


def choice_margin(gate, x: torch.Tensor) -> float:
    """Smallest gap of HF's decisions on tokens x: topk_group-th vs next group score, k-th vs (k+1)-th choice
    among the kept groups (float64)."""
    s = (x.reshape(-1, gate.weight.shape[1]).double() @ gate.weight.double().t()).sigmoid()
    choice = s + gate.e_score_correction_bias.double()
    n, groups, kept, k = choice.shape[-1], gate.num_group, gate.topk_group, gate.top_k
    grouped = choice.view(-1, groups, n // groups)
    gs = grouped.topk(2, -1)[0].sum(-1)
    srt = gs.sort(-1, descending=True).values
    margin = srt[:, kept - 1] - srt[:, kept] if kept < groups else torch.full((len(gs),), math.inf)
    keep = torch.zeros_like(gs).scatter_(1, gs.topk(kept, -1)[1], 1.0).bool()
    srt = grouped.masked_fill(~keep[..., None], -math.inf).view(-1, n).sort(-1, descending=True).values
    return float(torch.minimum(margin, srt[:, k - 1] - srt[:, k]).min())


def test_glm4_moe_routing_well_posed():
    import numpy as np

    from export_utils import hf_greedy_sequence

    hf = glm4_moe()
    seen = []
    hooks = [l.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(choice_margin(m, a[0])))
             for l in hf.model.layers if hasattr(l.mlp, "gate")]
    rng = np.random.default_rng(0)
    try:
        for n in CASE.prompt_lens:
            hf_greedy_sequence(hf, [int(t) for t in rng.integers(3, hf.config.vocab_size, n)], CASE.steps)
    finally:
        for h in hooks:
            h.remove()
    print(f"glm4_moe routing margin {min(seen):.3g}")
    assert min(seen) > 0.3


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_glm4_moe_parity(tmp_path, dtype):
    glm4_moe()
    print("glm4_moe", check_export(CASE, tmp_path, dtype))


def test_glm4_moe_decomposed(tmp_path):
    glm4_moe()
    print("glm4_moe decomposed", check_decomposed(CASE, tmp_path))


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
def test_glm4_moe_block_fp32_exact(norm):
    """The exported MoE block (router, sigmoid_group_route, experts node, shared experts) in float32 == HF's
    Glm4MoeMoE on 400 tokens with token-dependent routing."""
    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.runtime.session import InferenceSession

    case = FamilyCase("Glm4MoeConfig", seed=7, overrides=MOE | dict(norm_topk_prob=norm))
    hf = glm4_moe(case, gain=1.0, bias=0.5)
    mlp = hf.model.layers[1].mlp
    g = GraphBuilder(TensorProto.FLOAT)
    x = g.input("x", TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    y = _family()().mlp(SimpleNamespace(g=g, config=hf.config), 1, mlp, x)
    g.output(y, TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    xs = torch.randn(400, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    gate = mlp.gate
    with torch.no_grad():
        ref = mlp(xs[None])[0]
        _, _, idx = gate(xs)
        plain = ((xs @ gate.weight.t()).sigmoid() + gate.e_score_correction_bias).topk(gate.top_k, -1)[1]
        changed = float((idx.sort(-1).values != plain.sort(-1).values).any(-1).float().mean())
        margin = choice_margin(gate, xs)
    got = InferenceSession(g.model("moe", "test"), cpu_backend="torch").run_torch({"x": xs})[y]
    err = float((got - ref).abs().max() / ref.abs().max())
    print(f"glm4_moe block ({'norm' if norm else 'no norm'}): max|diff|/max|ref| = {err:.3g}, group limit changes "
          f"{changed:.0%} of the choices, margin {margin:.3g}")
    assert changed > 0.1 and margin > 1e-5 and err <= 1e-5


def _route_patch(**change):
    """sigmoid_group_route as the family calls it, with some of its arguments replaced."""
    def patch(m):
        from pagedkit.exporters import moe
        from pagedkit.exporters.families import glm4_moe as mod

        real = moe.sigmoid_group_route

        def route(g, logits, bias, k, n_group, topk_group, **kw):
            args = dict(bias=bias, n_group=n_group, topk_group=topk_group) | kw
            args.update({key: (v(args[key]) if callable(v) else v) for key, v in change.items()})
            return real(g, logits, args.pop("bias"), k, args.pop("n_group"), args.pop("topk_group"), **args)
        m.setattr(mod, "sigmoid_group_route", route)
    return patch


def _no_qkv_bias(m):
    Fam = _family()
    qkv = Fam.qkv_weights
    m.setattr(Fam, "qkv_weights", lambda self, attn: (qkv(self, attn)[0], None))


TEETH = {
    "correction_bias_dropped": _route_patch(bias=torch.zeros_like),
    "group_limit_dropped": _route_patch(n_group=1, topk_group=1),
    "routed_scaling_factor_dropped": _route_patch(scale=1.0),
    "qk_norm_dropped": lambda m: m.setattr(_family(), "qk_norm", lambda self, attn: None),
    "qkv_bias_dropped": _no_qkv_bias,
    "rotary_pairing": lambda m: m.setattr(_family(), "rotary_interleaved", lambda self, c: 1),
}


@pytest.mark.parametrize("feature", list(TEETH))
def test_glm4_moe_feature_has_teeth(tmp_path, monkeypatch, feature):
    glm4_moe()
    check_teeth(CASE, tmp_path, monkeypatch, TEETH[feature])


@pytest.mark.slow
def test_glm4_moe_builtin(tmp_path):
    """zai-org/GLM-4.5-Air at 4 layers (layer 0 dense, then MoE: first_k_dense_replace 1) and 8 of its 128 routed
    experts (top-8 of 8), random weights, vs HF eager (measured: worst 0.0021, peak 16.3 GB)."""
    print("glm-4.5-air", check_builtin("glm-4.5-air", tmp_path, num_layers=4, num_experts=8))
