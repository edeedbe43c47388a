"""paged-export, PhiMoE (Phi-3.5-MoE): sparsemixer top-2 routing computed in standard ops and fed to
com.microsoft::MoE, LayerNorm with bias, biased Q / K / V / O and LM head, LongRoPE (short / long tables with
short_mscale 1.1 / long_mscale 1.3), a sliding window of 16 on every layer (tests/family_harness.py: fp32 / fp16
parity, decomposed in onnxruntime, teeth, the built-in Phi-3.5-MoE configuration).

LongRoPE regimes as tests/test_export_phi3.py (Hugging Face switches tables by the longest sequence of *its*
forward, one sequence at a time here; the graph by the batch's): CASE (original_max_position_embeddings 32,
prompts 37 / 45) is long from the first step, SHORT (original 64, prompts 11 / 37, 6 steps) stays short.

Routing is a discrete decision (an expert crossing the mask threshold or a top-2 swap is a jump), so the
end-to-end models are built without near-decisions, as tests/test_export_deepseek.py: the MoE input's LayerNorm
bias is a / gain (so the bias direction is orthogonal to every normalized token: LayerNorm output is centred)
and the router maps that direction to fixed logits ROUTER (top expert 3.0, a second kept by the first pass's mask
at ratio 0.01, the rest masked at >= 0.05), plus a token-dependent part of 5e-4: every decision HF makes on the
test sequences is >= 5e-3 from a tie / the 2 eps threshold (`test_phimoe_routing_well_posed`), fp16 noise is
~1e-3. Token-dependent routing (masks keeping 1-8 experts) is checked exactly in float32 on 400 tokens against
HF's MoE block. The node's own use_sparse_mixer=1 (pagedkit's runtime has it: tests/test_moe_sparse_mixer.py)
gives the same model too."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from onnx import TensorProto

from family_harness import (FamilyCase, _parity, check_builtin, check_decomposed, check_export, check_teeth,
                            export_case, model_of)
from export_utils import TOL


def _rope(original: int) -> dict:
    return dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=original,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.5 + 0.4 * i for i in range(8)],
                short_mscale=1.1, long_mscale=1.3)


BASE = dict(num_local_experts=8, attention_bias=True, lm_head_bias=True, sliding_window=16)
CASE = FamilyCase("PhimoeConfig", seed=1, prompt_lens=(37, 45), overrides=BASE | dict(rope_parameters=_rope(32)))
SHORT = FamilyCase("PhimoeConfig", seed=2, prompt_lens=(11, 37), overrides=BASE | dict(rope_parameters=_rope(64)))
ROUTER = [0.3, 2.97, -0.5, 3.0, 1.0, 2.85, -2.0, 2.2]  # fixed router logits (permuted per layer)


def design_routing(hf, seed: int, router: list[float] = ROUTER):
    """The router design of the module docstring on every layer of `hf` (logits `router`, permuted per layer)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            ln, r = layer.post_attention_layernorm, layer.mlp.router
            beta = 0.5 / ln.weight  # beta * gain constant: orthogonal to the centred normalized token
            ln.bias.copy_(beta)
            c = torch.tensor(router)[torch.randperm(len(router), generator=g)]
            tok = 5e-4 * torch.randn(r.weight.shape, generator=g) / r.weight.shape[1] ** 0.5
            r.weight.copy_(torch.outer(c, beta) / beta.dot(beta) + tok)


def phimoe(case: FamilyCase = CASE):
    """The case's HF model with the router design (applied once, before any reference)."""
    hf = model_of(case)[0]
    if not getattr(hf, "_routing_designed", False):
        design_routing(hf, case.seed)
        hf._routing_designed = True
    return hf


def _family():
    from pagedkit.exporters.families.phimoe import PhimoeFamily

    return PhimoeFamily


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_phimoe_parity(tmp_path, dtype):
    phimoe()
    print("phimoe", check_export(CASE, tmp_path, dtype))


def test_phimoe_decomposed(tmp_path):
    phimoe()
    print("phimoe decomposed", check_decomposed(CASE, tmp_path))


def test_phimoe_short_regime_parity(tmp_path):
    phimoe(SHORT)
    print("phimoe short regime", check_export(SHORT, tmp_path, "fp16"))


def _swapped(m):
    """The LongRoPE switch inverted: the long table where the short one belongs and back."""
    from pagedkit.exporters.families import base

    real = base.select_tables
    m.setattr(base, "select_tables", lambda g, io, short, long, original, key: real(g, io, long, short, original, key))


@pytest.mark.parametrize("case", [CASE, SHORT], ids=["long", "short"])
def test_phimoe_longrope_switch_has_teeth(tmp_path, monkeypatch, case):
    phimoe(case)
    check_teeth(case, tmp_path, monkeypatch, _swapped)


def routing_margin(hf, case: FamilyCase) -> tuple[float, float]:
    """(smallest top-1 / top-2 and top-2 / top-3 logit gap relative to max |s|, smallest distance of a mask ratio
    from 2 eps in either pass) over every router call HF makes on the parity sequences (prompts + greedy steps,
    as export_utils.check_parity draws them)."""
    from export_utils import hf_greedy_sequence

    seen = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: seen.append(out[0].detach().double()))
             for layer in hf.model.layers]
    rng = np.random.default_rng(0)
    try:
        for n in case.prompt_lens:
            hf_greedy_sequence(hf, [int(t) for t in rng.integers(3, hf.config.vocab_size, n)], case.steps)
    finally:
        for h in hooks:
            h.remove()
    s = torch.cat(seen)
    eps = hf.config.router_jitter_noise
    top = s.topk(min(3, s.shape[-1]), -1).values
    gap = ((top[:, :-1] - top[:, 1:]) / s.abs().amax(-1, keepdim=True)).min()
    thr = min(((m - s) / torch.maximum(s.abs(), m) - 2 * eps).abs().min() for m in (top[:, :1], top[:, 1:2]))
    return float(gap), float(thr)


@pytest.mark.parametrize("case", [CASE, SHORT], ids=["long", "short"])
def test_phimoe_routing_well_posed(case):
    gap, thr = routing_margin(phimoe(case), case)
    print(f"phimoe routing margins: top-2 gap {gap:.3g}, mask threshold distance {thr:.3g}")
    assert gap > 5e-3 and thr > 5e-3


def test_phimoe_moe_block_fp32_exact():
    """The exported MoE block (float32 router, sparsemixer in standard ops, experts node) == HF's
    PhimoeSparseMoeBlock on 400 tokens with token-dependent routing: router rows close to a shared row, so the
    first pass keeps 1 to 8 experts and the second pass's mask matters."""
    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.runtime.session import InferenceSession

    hf = model_of(FamilyCase("PhimoeConfig", seed=4, overrides=BASE))[0]
    mlp = hf.model.layers[0].mlp
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        w = mlp.router.weight
        w.copy_(torch.randn(1, w.shape[1], generator=gen) + 0.02 * torch.randn(w.shape, generator=gen))
    g = GraphBuilder(TensorProto.FLOAT)
    x = g.input("x", TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    y = _family()().mlp(SimpleNamespace(g=g, config=hf.config), 0, mlp, x)
    g.output(y, TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    xs = torch.randn(400, hf.config.hidden_size, generator=gen)
    with torch.no_grad():
        ref = mlp(xs[None])[0]
        s = mlp.router(xs)[0].double()
    m1 = s.amax(-1, keepdim=True)
    ratio = (m1 - s) / torch.maximum(s.abs(), m1)
    kept = (ratio <= 0.02).sum(-1)
    assert kept.min() == 1 and kept.max() >= 4 and (kept > 1).float().mean() > 0.3, kept.bincount()
    margin = float((ratio - 0.02).abs().min())
    model = g.model("moe", "test")
    ks = [a.i for n in model.graph.node if n.op_type == "MoE" for a in n.attribute if a.name == "k"]
    assert ks == [2], ks  # the two sparsemixer passes: two experts per token, no zero-weight third
    got = InferenceSession(model, cpu_backend="torch").run_torch({"x": xs})[y]
    err = float((got - ref).abs().max() / ref.abs().max())
    print(f"phimoe MoE block: max|diff|/max|ref| = {err:.3g}, experts kept by the first mask "
          f"{kept.bincount().tolist()}, threshold margin {margin:.3g}")
    assert margin > 1e-5 and err <= 1e-5


def test_phimoe_native_sparse_mixer(tmp_path, monkeypatch):
    """The same export with the node's own routing (use_sparse_mixer=1 on float32 router logits: pagedkit's
    kernel, jitter 0.01 == router_jitter_noise) instead of the standard-ops route also matches HF."""
    from pagedkit.exporters import moe

    def native(self, ctx, i, mlp, x):
        p, ip = f"/model/layers.{i}/mlp", f"model.layers.{i}.mlp"
        ex = moe.Experts.fused(mlp.experts.gate_up_proj, mlp.experts.down_proj, ctx.config.hidden_act)
        logits = moe.router_logits(ctx.g, x, mlp.router.weight, None, p, ip)
        return moe.softmax_moe(ctx.g, x, logits, ex, 2, p, ip, normalize=False, sparse_mixer=True)

    assert phimoe().config.router_jitter_noise == 0.01
    with monkeypatch.context() as m:
        m.setattr(_family(), "mlp", native)
        out = export_case(CASE, tmp_path / "native", "fp16")
    print("phimoe native use_sparse_mixer", _parity(CASE, out, TOL).worst_ratio)


def _softmax_top2(g, s, eps, p):
    from pagedkit.exporters import moe

    probs = g.node("Softmax", [s], f"{p}/Softmax", axis=-1, out_type=TensorProto.FLOAT, out_shape=g.shape_of(s))
    w, idx = moe.top_k(g, probs, 2, p)
    return idx, w


def _no_norm_bias(m):
    Fam = _family()
    norm = Fam.norm
    m.setattr(Fam, "norm", lambda self, n: dataclasses.replace(norm(self, n), bias=None))


def _no_qkv_bias(m):
    Fam = _family()
    qkv = Fam.qkv_weights
    m.setattr(Fam, "qkv_weights", lambda self, attn: (qkv(self, attn)[0], None))


def _no_bias(which):
    def patch(m):
        hf = phimoe()
        mods = [l.self_attn.o_proj for l in hf.model.layers] if which == "o_proj" else [hf.lm_head]
        for mod in mods:
            m.setattr(mod, "bias", None)
    return patch


TEETH = {
    "sparse_mixer_off": lambda m: m.setattr(_family(), "route", staticmethod(_softmax_top2)),  # softmax top-2
    "layernorm_bias": _no_norm_bias,
    "qkv_bias": _no_qkv_bias,
    "o_proj_bias": _no_bias("o_proj"),
    "lm_head_bias": _no_bias("lm_head"),
    "sliding_window": lambda m: m.setattr(_family(), "layer_window", lambda self, c, i, a: -1),
}


@pytest.mark.parametrize("feature", list(TEETH))
def test_phimoe_feature_has_teeth(tmp_path, monkeypatch, feature):
    phimoe()
    check_teeth(CASE, tmp_path, monkeypatch, TEETH[feature])


def test_phimoe_refuses_one_expert():
    with pytest.raises(NotImplementedError, match="num_local_experts"):
        _family()().check(SimpleNamespace(num_local_experts=1))


@pytest.mark.slow
def test_phimoe_builtin(tmp_path, monkeypatch):
    """Phi-3.5-MoE-instruct (pagedkit/exporters/builtin/phi-3.5-moe-instruct.json: hidden 4096, 32 heads / 8 KV
    heads, LayerNorm, biases, LongRoPE 128k with its published factors and mscale 1.243, sparsemixer) at 4 layers
    and 4 of its 16 experts, random weights, fp16 vs HF eager float32 (family_harness.check_builtin; measured worst
    0.0033, routing margins 9.1e-3 / 9.4e-3, peak 8.0 GiB, ~3 minutes on CPU). The config is the published
    config.json less its auto_map; its 64 + 64 LongRoPE factors agree, value for value, between two copies
    (sgl-project/ome pkg/hfutil/modelconfig/testdata/phimoe.json and Ascend/MindSpeed-LLM
    examples/mcore/phi35/pretrain_phi35_moe_ptd.sh).

    HF's init routes near-decisions on the parity sequences (4 experts: top-2 gap 1.3e-4 of max |s|, a mask 3.3e-3
    from 2 eps; 2 / 3 / 8 experts alike), and one flipped decision put the prefill 0.26 x max|ref| off, so the
    loaded model gets the module doc's router design (logits 3.0 / 2.97 kept by the first mask, 0.3 / -0.5 masked,
    permuted per layer) before check_builtin takes its reference; the margins are asserted >= 5e-3 first."""
    from pagedkit.exporters import weights

    real, margins = weights.load_model, []

    def designed(*args, **kwargs):
        loaded = real(*args, **kwargs)
        design_routing(loaded.model, 0, router=[0.3, 2.97, -0.5, 3.0])
        margins.append(routing_margin(loaded.model, FamilyCase("PhimoeConfig", prompt_lens=(11, 20))))
        assert min(margins[-1]) > 5e-3, margins[-1]
        return loaded

    monkeypatch.setattr(weights, "load_model", designed)
    worst = check_builtin("phi-3.5-moe-instruct", tmp_path, num_layers=4, num_experts=4)
    gap, thr = margins[0]
    print(f"phi-3.5-moe-instruct (4 layers, 4 experts): worst {worst:.4g}, routing margins {gap:.3g} / {thr:.3g}")
