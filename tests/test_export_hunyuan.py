"""paged-export, HunYuan dense (hunyuan_v1_dense): per-head QK RMSNorm after RoPE, so RoPE runs in the graph
(rope.apply_rope at rope.token_positions) and the node with do_rotary=0; dynamic-alpha NTK RoPE; tied embeddings
(tests/family_harness.py: fp32 / fp16 parity, decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import pytest

from export_utils import attention_attrs
from family_harness import FamilyCase, check_builtin, check_decomposed, check_export, check_teeth, export_case, model_of

# HunYuan's "dynamic" + alpha: base 10000 * 1000 ** (16 / 14) for head_dim 16 (a fixed table, no per-length update)
ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
CASE = FamilyCase("HunYuanDenseV1Config", seed=6, overrides=dict(rope_parameters=ROPE, attention_bias=True,
                                                                tie_word_embeddings=True))
# The harness's fp32 check against HF with the node's fp16 boundary emulated rounds Q / K entering RoPE (it wraps
# the modeling module's apply_rotary_pos_emb), which this export does not: RoPE and the QK-norm run in the graph
# in float32 and only the normalized Q / K / V are rounded, at the node (with that emulation: 1.33e-3). The exact
# emulation of this export is test_hunyuan_fp32_node_boundary below.
CASE_FP32 = FamilyCase("HunYuanDenseV1Config", seed=6, boundary=False, overrides=CASE.overrides)


def test_hunyuan_rope_is_ntk_alpha():
    hf, _ = model_of(CASE)
    assert hf.model.rotary_emb.rope_type == "ntk_alpha"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_hunyuan_parity(tmp_path, dtype):
    hf, _ = model_of(CASE)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    print("hunyuan", check_export(CASE_FP32 if dtype == "fp32" else CASE, tmp_path, dtype))


def test_hunyuan_fp32_node_boundary(tmp_path):
    """fp32 export vs HF eager with this export's float16 rounding emulated, at 1e-3: cos / sin (the tables are
    T-typed initializers) and Q / K / V / the output at the node; Q / K enter RoPE and the QK-norm unrounded."""
    import importlib

    from export_utils import check_parity
    from family_harness import FP32_BOUNDARY_TOL, _r16, fp16_node_boundary, torch_session

    out = export_case(CASE, tmp_path / "fp32", "fp32")
    hf, _ = model_of(CASE)
    mod = importlib.import_module(type(hf).__module__)
    rope_fn = mod.apply_rotary_pos_emb
    with fp16_node_boundary(hf, out):  # restores mod.apply_rotary_pos_emb on exit
        mod.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: rope_fn(q, k, _r16(cos), _r16(sin), *a, **kw)
        rep = check_parity(hf, out, prompt_lens=CASE.prompt_lens, steps=CASE.steps, tol=FP32_BOUNDARY_TOL,
                           session=torch_session(out))
    assert mod.apply_rotary_pos_emb is rope_fn
    print("hunyuan fp32_boundary", rep.worst_ratio)


def test_hunyuan_decomposed(tmp_path):
    print("hunyuan decomposed", check_decomposed(CASE, tmp_path))


def test_hunyuan_node_does_not_rotate(tmp_path):
    out = export_case(CASE, tmp_path / "fp16")
    for a in attention_attrs(out / "model.onnx"):
        assert not a.get("do_rotary") and "cos_cache" not in a["inputs"] and "q_norm_weight" not in a["inputs"]


def test_hunyuan_query_positions(tmp_path):
    """With the optional query_positions input the graph's RoPE reads each token's position from it (the runner
    feeds the true positions); parity as without it."""
    from export_utils import check_parity, io_signature
    from family_harness import torch_session

    out = export_case(CASE, tmp_path / "qpos", "fp16", query_positions=True)
    assert "query_positions" in io_signature(out / "model.onnx")
    hf, memo = model_of(CASE)
    rep = check_parity(hf, out, prompt_lens=CASE.prompt_lens, steps=CASE.steps, reference=memo,
                       session=torch_session(out))
    print("hunyuan query_positions", rep.worst_ratio)


def _norm_before_rope(m):
    """The QK-norm fused before RoPE (the node's order) instead of after (Hugging Face's)."""
    from pagedkit.exporters.families.hunyuan import HunYuanDenseFamily

    m.setattr(HunYuanDenseFamily, "rope_norm", lambda self, ctx, i, x, heads, norm, name: self.rope(
        ctx, i, self.head_norm(ctx, i, x, heads, norm, name), heads, name))


def _interleaved(m):
    """rope.apply_rope with interleaved pairs (2c, 2c + 1) instead of half-split (c, c + D / 2)."""
    from pagedkit.exporters.families import hunyuan

    real = hunyuan.apply_rope
    m.setattr(hunyuan, "apply_rope", lambda *a, interleaved, **kw: real(*a, interleaved=True, **kw))


def _positions_off_by_one(m):
    """Every token's RoPE position one too far."""
    from onnx import TensorProto

    from pagedkit.exporters.families import hunyuan

    real = hunyuan.token_positions

    def shifted(g, io):
        name = "/teeth/positions/Add/output_0"
        if name not in g.vi:
            p = real(g, io)
            g.node("Add", [p, g.const(1, TensorProto.INT64)], "/teeth/positions/Add", out_type=TensorProto.INT64,
                   out_shape=g.vi[p][1])
        return name
    m.setattr(hunyuan, "token_positions", shifted)


def _unscaled_rope(m):
    """The plain rope_theta table instead of the alpha-scaled one."""
    import copy

    from pagedkit.exporters.families.hunyuan import HunYuanDenseFamily
    from pagedkit.exporters.graph import rotary_tables

    def tables(self, model, n):
        rot = model.model.rotary_emb
        cfg = copy.deepcopy(rot.config)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
        return {"cos_cache": rotary_tables(type(rot)(config=cfg), n)}
    m.setattr(HunYuanDenseFamily, "rope_tables", tables)


@pytest.mark.parametrize("patch", [_norm_before_rope, _interleaved, _positions_off_by_one, _unscaled_rope],
                         ids=["norm_after_rope", "half_pairing", "positions", "alpha_scaling"])
def test_hunyuan_features_have_teeth(tmp_path, monkeypatch, patch):
    check_teeth(CASE, tmp_path, monkeypatch, patch)


@pytest.mark.slow
def test_hunyuan_builtin(tmp_path):
    print("hunyuan-0.5b", check_builtin("hunyuan-0.5b", tmp_path, num_layers=4))
